"""Compile the sampler's Triton kernels at start-up, so that no step pays a compile mid-run.

Each case below is one sampler call whose batch takes a different set of kernel variants: plain (logits in
the model's dtype), penalised with a top_k (the penalty pass hands the draw float32 logits) and penalised
without (the draw kernels penalise the logits as they load them); then structured outputs' token bitmask.
The worker starts their compile in a background process before it loads the model
(`compile_sampler_in_background`), so that it overlaps loading, the memory profile and graph capture; the
warm-up then waits for it, loads the variants (any it missed compile in threads here: kernels/precompile.py)
and runs each case once. A warm start finds them all in Triton's disk cache.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from tokenmill.kernels.precompile import BackgroundCompile, compile_in_background, precompile
from tokenmill.sample.metadata import SamplingMetadata, build_sampling_metadata
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MIXED = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
         SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
         SamplingParams(temperature=0.8, min_p=0.1)]
SMALL_TOP_K = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)]
"""Every row with a small top_k: drawn among its candidates only, overflowing rows one program each."""
NO_TOP_K = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, min_p=0.1)]
"""Penalised without a top_k: the draw kernels apply the penalties as they load the logits."""


@torch.inference_mode()
def compile_sampler_in_background(vocab_size: int, dtype: torch.dtype,
                                  device: torch.device) -> BackgroundCompile | None:
    """Start compiling the sampler's kernel variants in another process; None if nothing needs compiling."""
    cases = _make_cases(vocab_size, dtype, device)
    sampler = Sampler()
    return compile_in_background(lambda: _run_cases(sampler, cases), device, "sampler kernels")


@torch.inference_mode()
def warm_up_sampler(sampler: Sampler, vocab_size: int, dtype: torch.dtype, device: torch.device,
                    background: BackgroundCompile | None = None) -> None:
    start = time.perf_counter()
    if background is not None:
        background.wait()
    cases = _make_cases(vocab_size, dtype, device)
    num_kernels = precompile(lambda: _run_cases(sampler, cases), device)
    _run_cases(sampler, cases)
    torch.cuda.synchronize(device)
    logger.info("sampler warm-up: %d kernel variants loaded or compiled, then run, in %.1f s", num_kernels,
                time.perf_counter() - start)


def _make_cases(vocab_size: int, dtype: torch.dtype, device: torch.device) -> list:
    return [_make_case(params, penalised, vocab_size, dtype, device)
            for params, penalised in ((MIXED, False), (MIXED, True), (SMALL_TOP_K, False), (SMALL_TOP_K, True),
                                      (NO_TOP_K, True))]


def _run_cases(sampler: Sampler, cases: list) -> None:
    for logits, metadata in cases:
        sampler(logits, metadata)
    _run_token_bitmask(cases[0][0])


def _run_token_bitmask(logits: torch.Tensor) -> None:
    """Structured outputs' mask kernel, in the variant structured/matchers.py launches (int32 logits rows, flag
    bytes and masks, one buffer, the masks 64-byte aligned); every bit set, so it writes no logit."""
    from tokenmill.kernels import use_triton

    if not use_triton(logits):
        return
    from tokenmill.kernels.token_bitmask import apply_token_bitmask

    rows, vocab_size = logits.shape
    words = -(-vocab_size // 32)
    capacity = 64
    masks_at = capacity + capacity // 4
    buffer = torch.full((masks_at + capacity * words,), -1, dtype=torch.int32, device=logits.device)
    buffer[:rows] = torch.arange(rows, dtype=torch.int32, device=logits.device)
    apply_token_bitmask(logits, buffer[masks_at : masks_at + rows * words].view(rows, words), buffer[:rows],
                        vocab_size, buffer[capacity:masks_at].view(torch.uint8)[:rows])


def _make_case(params: list[SamplingParams], penalised: bool, vocab_size: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, SamplingMetadata]:
    num_rows = len(params)
    logits = torch.randn(num_rows, vocab_size, device=device).to(dtype)
    penalty_state = None
    if penalised:
        counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
        penalty_state = (counts, counts.bool(), np.arange(num_rows))
        params = [dataclasses.replace(p, repetition_penalty=1.1) for p in params]
    return logits, build_sampling_metadata(params, {}, vocab_size, device, penalty_tensors=penalty_state)
