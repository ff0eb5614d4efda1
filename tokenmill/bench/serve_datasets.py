"""The prompts of `tokenmill bench serve`, by vLLM's `--dataset-name` and its flags:

- `random`: --random-input-len random tokens per prompt, behind --random-prefix-len tokens of one prefix that
  every prompt shares; with --random-range-ratio R each request's input and output lengths are drawn
  uniformly from [floor(len * (1 - R)), ceil(len * (1 + R))] (an output at least 1 token), as vLLM draws them.
- `prefix_repetition`: --prefix-repetition-num-prefixes prefixes of --prefix-repetition-prefix-len tokens,
  each followed by --num-prompts / num-prefixes random suffixes of --prefix-repetition-suffix-len tokens
  (many requests sharing a few long system prompts), in a shuffled order; as vLLM's, --num-prompts is
  rounded down to a multiple of the number of prefixes.

Tokens are drawn from a vocabulary (the server's tokens of a built-in text) and sent as token-id prompts, so
every prompt has exactly the length drawn and every shared prefix is the same tokens on the server. One
seeded random.Random draws everything: a seed gives the same requests on every run.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

DATASETS = ("random", "prefix_repetition")


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    """max_tokens (all of them generated with --ignore-eos)."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", default="random", choices=DATASETS,
                        help="where prompts come from: random token ids, with an optional shared prefix (random), "
                             "or a few long prefixes each shared by many requests (prefix_repetition)")
    parser.add_argument("--random-input-len", type=int, default=128,
                        help="random: prompt tokens per request, after the shared prefix")
    parser.add_argument("--random-output-len", type=int, default=64,
                        help="random: generated tokens per request (max_tokens)")
    parser.add_argument("--random-prefix-len", type=int, default=0,
                        help="random: tokens of one prefix that every prompt starts with")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="random: input and output lengths drawn uniformly from len * [1 - R, 1 + R], 0 <= R < 1")
    parser.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                        help="prefix_repetition: tokens of each shared prefix")
    parser.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                        help="prefix_repetition: tokens of each request's own suffix")
    parser.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                        help="prefix_repetition: distinct prefixes, each shared by --num-prompts / this many requests")
    parser.add_argument("--prefix-repetition-output-len", type=int, default=128,
                        help="prefix_repetition: generated tokens per request (max_tokens)")


def dataset_params(args: argparse.Namespace) -> dict:
    """The chosen dataset's parameters (its flags' names without the dataset's prefix): for the result file
    and the printed summary."""
    if args.dataset_name == "random":
        return {"input_len": args.random_input_len, "output_len": args.random_output_len,
                "prefix_len": args.random_prefix_len, "range_ratio": args.random_range_ratio}
    return {"prefix_len": args.prefix_repetition_prefix_len, "suffix_len": args.prefix_repetition_suffix_len,
            "num_prefixes": args.prefix_repetition_num_prefixes, "output_len": args.prefix_repetition_output_len}


def describe(args: argparse.Namespace) -> str:
    """'prefix_repetition (prefix_len=256, suffix_len=256, ...)'."""
    params = ", ".join(f"{key}={value:g}" for key, value in dataset_params(args).items())
    return f"{args.dataset_name} ({params})"


def check_args(args: argparse.Namespace) -> None:
    """ValueError, in one line, for flags no dataset can be made from (before the server is asked anything)."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.dataset_name == "random":
        ratio = args.random_range_ratio
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
        for flag in ("random_input_len", "random_output_len", "random_prefix_len"):
            if getattr(args, flag) < 0:
                raise ValueError(f"--{flag.replace('_', '-')} must not be negative, got {getattr(args, flag)}")
        if args.random_prefix_len + length_bounds(args.random_input_len, ratio)[0] < 1:
            raise ValueError("a prompt could be empty: raise --random-input-len or --random-prefix-len, "
                             "or lower --random-range-ratio")
        return
    num_prefixes = args.prefix_repetition_num_prefixes
    if num_prefixes < 1 or args.num_prompts < num_prefixes:
        raise ValueError(f"--prefix-repetition-num-prefixes must be between 1 and --num-prompts "
                         f"({args.num_prompts}), got {num_prefixes}")
    for flag in ("prefix_repetition_prefix_len", "prefix_repetition_suffix_len"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must not be negative, got {getattr(args, flag)}")
    if args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len < 1:
        raise ValueError("--prefix-repetition-prefix-len plus --prefix-repetition-suffix-len must be at least 1")
    if args.prefix_repetition_output_len < 1:
        raise ValueError(f"--prefix-repetition-output-len must be at least 1, got {args.prefix_repetition_output_len}")


def rounding_note(args: argparse.Namespace) -> str | None:
    """A line saying how many requests prefix_repetition sends, when that is fewer than --num-prompts."""
    if args.dataset_name != "prefix_repetition" or args.num_prompts % args.prefix_repetition_num_prefixes == 0:
        return None
    num_requests = args.num_prompts // args.prefix_repetition_num_prefixes * args.prefix_repetition_num_prefixes
    return (f"note: prefix_repetition sends {num_requests} requests, --num-prompts rounded down to a multiple of "
            f"--prefix-repetition-num-prefixes, as vLLM's does")


def make_requests(args: argparse.Namespace, vocab: list[int], rng: random.Random) -> list[BenchRequest]:
    """The run's requests, from the flags checked by check_args()."""
    if args.dataset_name == "random":
        return random_requests(vocab, rng, args.num_prompts, args.random_input_len, args.random_output_len,
                               prefix_len=args.random_prefix_len, range_ratio=args.random_range_ratio)
    return prefix_repetition_requests(vocab, rng, args.num_prompts, args.prefix_repetition_prefix_len,
                                      args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                      args.prefix_repetition_output_len)


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's inclusive interval [floor(length * (1 - R)), ceil(length * (1 + R))]."""
    # NOTE: rounded to 9 digits first, so that float noise (100 * 1.1 = 110.00000000000001) cannot widen it.
    return math.floor(round(length * (1 - range_ratio), 9)), math.ceil(round(length * (1 + range_ratio), 9))


def draw_lengths(num: int, length: int, range_ratio: float, rng: random.Random, minimum: int = 0) -> list[int]:
    """`num` lengths uniform over length_bounds(), none below `minimum`. With range_ratio 0 nothing is drawn,
    so the default random dataset's prompts are the ones earlier versions drew from the same seed."""
    low, high = (max(minimum, bound) for bound in length_bounds(length, range_ratio))
    if low == high:
        return [low] * num
    return [rng.randint(low, high) for _ in range(num)]


def random_tokens(vocab: list[int], num: int, rng: random.Random) -> list[int]:
    return [rng.choice(vocab) for _ in range(num)]


def random_requests(vocab: list[int], rng: random.Random, num_prompts: int, input_len: int, output_len: int,
                    prefix_len: int = 0, range_ratio: float = 0.0) -> list[BenchRequest]:
    prefix = random_tokens(vocab, prefix_len, rng)
    input_lens = draw_lengths(num_prompts, input_len, range_ratio, rng)
    output_lens = draw_lengths(num_prompts, output_len, range_ratio, rng, minimum=1)
    return [BenchRequest(prefix + random_tokens(vocab, n, rng), out) for n, out in zip(input_lens, output_lens)]


def prefix_repetition_requests(vocab: list[int], rng: random.Random, num_prompts: int, prefix_len: int,
                               suffix_len: int, num_prefixes: int, output_len: int) -> list[BenchRequest]:
    requests = []
    for _ in range(num_prefixes):
        prefix = random_tokens(vocab, prefix_len, rng)
        requests += [BenchRequest(prefix + random_tokens(vocab, suffix_len, rng), output_len)
                     for _ in range(num_prompts // num_prefixes)]
    rng.shuffle(requests)  # the prefixes' requests interleaved, not one prefix's burst after another's
    return requests
