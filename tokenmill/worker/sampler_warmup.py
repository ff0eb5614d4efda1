"""Compile the sampler's Triton kernels at start-up, so that no step pays a compile mid-run.

Each case below is one sampler call whose batch takes a different set of kernel variants. The cases run
in threads: Triton compiles (LLVM, ptxas) mostly without the GIL, and a cold machine otherwise pays them one
after another (tens of seconds on a slow host). A warm start finds them all in Triton's disk cache.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tokenmill.sample.metadata import build_sampling_metadata
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MIXED = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
         SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
         SamplingParams(temperature=0.8, min_p=0.1)]
SMALL_TOP_K = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)]
"""Every row with a small top_k: drawn among its candidates only, overflowing rows one program each."""


def warm_up_sampler(sampler: Sampler, vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Run the sampler on each case, plain (logits in the model's dtype) and penalised (float32)."""
    cases = [(params, penalised) for params in (MIXED, SMALL_TOP_K) for penalised in (False, True)]
    if device.type == "cuda" and device.index is None:
        # the CUDA device is per thread, and a new thread starts on device 0: name this thread's
        device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    with ThreadPoolExecutor(len(cases), thread_name_prefix="sampler-warmup") as pool:
        futures = [pool.submit(_run_case, sampler, params, penalised, vocab_size, dtype, device)
                   for params, penalised in cases]
        for future in futures:
            future.result()  # re-raises a compile error
    logger.info("sampler warm-up: %d batches in %.1f s", len(cases), time.perf_counter() - start)


def _run_case(sampler: Sampler, params: list[SamplingParams], penalised: bool, vocab_size: int,
              dtype: torch.dtype, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with torch.inference_mode():  # so is inference mode
        num_rows = len(params)
        logits = torch.randn(num_rows, vocab_size, device=device).to(dtype)
        penalty_state = None
        if penalised:
            counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
            penalty_state = (counts, counts.bool(), np.arange(num_rows))
            params = [dataclasses.replace(p, repetition_penalty=1.1) for p in params]
        sampler(logits, build_sampling_metadata(params, {}, vocab_size, device, penalty_tensors=penalty_state))
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
