"""The `tokenmill` command: serve, generate, chat, bench. Each subcommand is a module with
`register(subparsers)`; heavy imports happen in its handler, so `tokenmill --help` stays quick."""

from __future__ import annotations

import argparse
import signal
import sys

from tokenmill.cli import bench, chat, generate, serve
from tokenmill.cli.args import CommandParser, refuse_unknown
from tokenmill.cli.errors import user_message


def make_parser() -> argparse.ArgumentParser:
    from tokenmill import __version__

    parser = CommandParser(prog="tokenmill", description="tokenmill: LLM inference and serving")
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in (serve, generate, chat, bench):
        command.register(subparsers)
    for command_parser in subparsers.choices.values():  # whose --help an unknown flag's error points to
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra_args", False):
        refuse_unknown(args.command_parser, extra)
    args.extra_args = extra
    from tokenmill.server.startup import exit_on_signal  # light: no server dependency

    # SIGTERM unwinds like Ctrl-C (SystemExit), so that what a command started is stopped on the way out: an
    # offline engine's ranks and their socket folder, a server's engine core (until uvicorn takes it over).
    signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        # The one place that turns failures a user can fix into a line or two; bugs keep their traceback.
        message = user_message(error, args)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 1
