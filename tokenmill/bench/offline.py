"""What the offline benchmarks (throughput, latency) share: engine flags, the engine, random prompts."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import logging
import os
import platform
import pstats
import tempfile
import time

import numpy as np


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.cli.args import add_engine_args as add_all_engine_args

    add_all_engine_args(parser, model_positional=False)


def at_least(minimum: int):
    """An argparse type: a whole number of at least `minimum`, refused before the model loads (0 prompts or 0
    timed runs would load it, then print rates of nothing or fail taking percentiles of no timings)."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return whole_number


def make_llm(args: argparse.Namespace):
    """An LLM from the engine flags, with no tokenizer (prompts are token ids); logs the start-up time."""
    from tokenmill import LLM
    from tokenmill.cli.args import engine_kwargs_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model, kwargs = engine_kwargs_from_args(args)
    kwargs.setdefault("skip_tokenizer_init", True)
    start = time.perf_counter()
    llm = LLM(model, **kwargs)
    print(f"engine start-up: {time.perf_counter() - start:.1f} s ({model}, {describe_device()})")
    return llm


def describe_device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}"


def random_prompts(rng: np.random.Generator, lengths: np.ndarray, vocab_size: int) -> list[dict]:
    """One prompt of random token ids per length (ids from 3 up: no pad/bos/eos)."""
    return [{"prompt_token_ids": rng.integers(3, vocab_size, int(n)).tolist()} for n in lengths]


def draw_lengths(rng: np.random.Generator, fixed: int, bounds: list[int] | None, count: int) -> np.ndarray:
    """`count` lengths: all `fixed`, or uniform over the inclusive range `bounds`."""
    if bounds is None:
        return np.full(count, fixed, dtype=np.int64)
    low, high = bounds
    return rng.integers(low, high + 1, count)


def with_num_layers(model_dir: str, num_layers: int | None) -> str:
    """A model folder whose config.json is `model_dir`'s with `num_layers` layers (for dummy weights: a
    quick CPU dry run of a benchmark); `model_dir` itself when num_layers is None."""
    if num_layers is None:
        return model_dir
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def vocab_size_of(llm) -> int:
    return llm.engine.hf_config.vocab_size


@contextlib.contextmanager
def host_profile(enabled: bool, top: int = 30):
    """cProfile the block and print its `top` functions by own time (where the host's time goes)."""
    if not enabled:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
        print(text.getvalue())
