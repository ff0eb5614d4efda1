"""`tokenmill bench latency`: end-to-end latency of one batch of fixed-length random prompts.

Runs the batch --num-iters times after --num-iters-warmup untimed runs and prints the mean, median
and p99 end-to-end latency. The decode time per token comes from a second, one-token run of the same
batch (its latency is the prefill): (end to end - prefill) / (output_len - 1).

    python -m tokenmill.bench.latency --model benchmarks/models/llama-3.1-8b --load-format dummy \\
        --batch-size 1 --input-len 128 --output-len 512
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from tokenmill.bench import spec_decode
from tokenmill.bench.offline import add_engine_args, at_least, make_llm, random_prompts, vocab_size_of


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--batch-size", type=at_least(1), default=8, help="prompts in the batch")
    group.add_argument("--input-len", type=at_least(1), default=32, help="prompt tokens per request")
    group.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    group.add_argument("--num-iters", type=at_least(1), default=10, help="timed runs")
    group.add_argument("--num-iters-warmup", type=at_least(0), default=2, help="untimed runs first")
    group.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    group.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompts")
    group.add_argument("--output-json", default=None, help="also write the results to this file")
    add_engine_args(parser)


def _time_batch(llm, prompts: list[dict], params) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> int:
    from tokenmill import SamplingParams

    if args.output_len < 2:
        raise SystemExit("--output-len must be at least 2 to separate decode from prefill")
    llm = make_llm(args)
    rng = np.random.default_rng(args.prompt_seed)
    vocab_size = vocab_size_of(llm)
    prompts = random_prompts(rng, np.full(args.batch_size, args.input_len), vocab_size)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    prefill_params = SamplingParams(temperature=args.temperature, max_tokens=1, ignore_eos=True)

    # Prefix caching would turn every repeat of the same prompts into a cache hit: vary the first token.
    def time_fresh_batch(sampling) -> float:
        return _time_batch(llm, _fresh(prompts, rng, vocab_size), sampling)

    for _ in range(args.num_iters_warmup):
        time_fresh_batch(params)
    spec_before = spec_decode.stats_of(llm)
    latencies = np.array([time_fresh_batch(params) for _ in range(args.num_iters)])
    spec_run = spec_decode.difference(spec_before, spec_decode.stats_of(llm))  # of the timed runs
    prefills = np.array([time_fresh_batch(prefill_params) for _ in range(args.num_iters)])
    prefill = float(np.median(prefills))
    results = {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "mean_s": float(latencies.mean()),
        "median_s": float(np.median(latencies)),
        "p99_s": float(np.percentile(latencies, 99)),
        "prefill_median_s": prefill,
        "decode_ms_per_token": (float(np.median(latencies)) - prefill) / (args.output_len - 1) * 1e3,
        "e2e_ms_per_output_token": float(np.median(latencies)) / args.output_len * 1e3,
        "latencies_s": latencies.tolist(),
        **spec_decode.summary(spec_run),
    }
    print(f"Latency (batch {args.batch_size}, {args.input_len} in, {args.output_len} out, {args.num_iters} runs): "
          f"mean {results['mean_s'] * 1e3:.1f} ms, median {results['median_s'] * 1e3:.1f} ms, "
          f"p99 {results['p99_s'] * 1e3:.1f} ms")
    print(f"Prefill (1 output token) median {prefill * 1e3:.1f} ms; decode {results['decode_ms_per_token']:.3f} ms "
          f"per token; end to end {results['e2e_ms_per_output_token']:.3f} ms per output token")
    if (line := spec_decode.describe(results)) is not None:
        print(line)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _fresh(prompts: list[dict], rng: np.random.Generator, vocab_size: int) -> list[dict]:
    """The same prompts with a new first token each, so no run hits the prefix cache of an earlier one."""
    return [{"prompt_token_ids": [int(rng.integers(3, min(1000, vocab_size)))] + p["prompt_token_ids"][1:]}
            for p in prompts]


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tokenmill.bench.latency", description=__doc__.split("\n")[0])
    add_cli_args(_parser)
    raise SystemExit(main(_parser.parse_args()))
