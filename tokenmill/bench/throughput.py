"""`tokenmill bench throughput`: offline throughput of the engine on a batch of random prompts.

Every prompt is submitted at once and generation ignores EOS, so each request produces exactly its
output length; prints requests/s and input, output and total tokens/s. With --load-format dummy a
model folder needs only its config.json.

    python -m tokenmill.bench.throughput --model benchmarks/models/qwen3-0.6b --load-format dummy \\
        --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from tokenmill.bench import spec_decode
from tokenmill.bench.offline import (
    add_engine_args,
    at_least,
    draw_lengths,
    host_profile,
    make_llm,
    random_prompts,
    vocab_size_of,
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=at_least(1), default=1000, help="requests to run")
    group.add_argument("--input-len", type=at_least(1), default=1024, help="prompt tokens per request")
    group.add_argument("--output-len", type=at_least(1), default=128, help="generated tokens per request")
    group.add_argument("--input-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                       help="draw prompt lengths uniformly from [LO, HI] instead")
    group.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                       help="draw output lengths uniformly from [LO, HI] instead")
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                       help="generate the full output length whatever the tokens")
    group.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    group.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompts and lengths")
    group.add_argument("--output-json", default=None, help="also write the results to this file")
    group.add_argument("--cprofile", action="store_true", help="print where the host's time goes (cProfile)")
    add_engine_args(parser)


def main(args: argparse.Namespace) -> int:
    from tokenmill import SamplingParams

    llm = make_llm(args)
    rng = np.random.default_rng(args.prompt_seed)
    input_lens = draw_lengths(rng, args.input_len, args.input_len_range, args.num_prompts)
    output_lens = draw_lengths(rng, args.output_len, args.output_len_range, args.num_prompts)
    prompts = random_prompts(rng, input_lens, vocab_size_of(llm))
    params = [SamplingParams(temperature=args.temperature, max_tokens=int(n), ignore_eos=args.ignore_eos)
              for n in output_lens]

    with host_profile(args.cprofile):
        spec_before = spec_decode.stats_of(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        spec_run = spec_decode.difference(spec_before, spec_decode.stats_of(llm))

    num_input = int(input_lens.sum())
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    results = {
        "elapsed_s": elapsed,
        "num_requests": len(outputs),
        "num_input_tokens": num_input,
        "num_output_tokens": num_output,
        "requests_per_s": len(outputs) / elapsed,
        "input_tokens_per_s": num_input / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_input + num_output) / elapsed,
        **spec_decode.summary(spec_run),
    }
    print(f"Throughput: {results['requests_per_s']:.2f} requests/s, {results['total_tokens_per_s']:.1f} total tokens/s "
          f"({results['input_tokens_per_s']:.1f} input, {results['output_tokens_per_s']:.1f} output tokens/s); "
          f"{len(outputs)} requests, {num_input} input + {num_output} output tokens in {elapsed:.2f} s")
    if (line := spec_decode.describe(results)) is not None:
        print(line)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tokenmill.bench.throughput", description=__doc__.split("\n")[0])
    add_cli_args(_parser)
    raise SystemExit(main(_parser.parse_args()))
