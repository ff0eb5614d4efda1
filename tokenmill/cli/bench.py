"""`tokenmill bench serve|throughput|latency`: each benchmark lives in tokenmill/bench/<name>.py with
`add_cli_args(parser)` and `main(args)`, and is imported only when asked for."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from tokenmill.cli.args import CommandParser

BENCHMARKS = {
    "serve": "load an OpenAI-compatible server with concurrent requests (TTFT, TPOT, ITL, throughput)",
    "throughput": "offline throughput of the engine on a batch of prompts",
    "latency": "offline latency of one batch, end to end",
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    names = parser.add_subparsers(dest="benchmark", required=True, metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, help_text in BENCHMARKS.items():
        # The benchmark's own flags (--help included) are left for its module to parse.
        sub = names.add_parser(name, help=help_text, add_help=False)
        sub.set_defaults(handler=run, takes_extra_args=True, url_flag="--base-url", model_flag="--model")


def run(args: argparse.Namespace) -> int:
    module_name = f"tokenmill.bench.{args.benchmark}"
    if importlib.util.find_spec(module_name) is None:
        print(f"error: tokenmill bench {args.benchmark} is not available in this version", file=sys.stderr)
        return 2
    module = importlib.import_module(module_name)
    parser = CommandParser(prog=f"tokenmill bench {args.benchmark}", description=BENCHMARKS[args.benchmark])
    module.add_cli_args(parser)
    return module.main(parser.parse_args(args.extra_args)) or 0
