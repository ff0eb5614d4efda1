"""What a step's small host-to-device copies cost the host (GPU): the pieces of pack_to_device, each timed
over many calls, with the GPU idle and with the GPU busy (as under async scheduling, where the copies of
step N+1 queue behind step N).

    PYTHONPATH=. python3 benchmarks/host_copy.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from tokenmill.device_copy import pack_to_device
from tokenmill.sample.metadata import build_sampling_metadata, with_fresh_seeds
from tokenmill.sampling_params import SamplingParams


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    device = torch.device("cuda")
    small = np.arange(256, dtype=np.int64)
    pinned = torch.empty(2048, dtype=torch.uint8, pin_memory=True)
    params = [SamplingParams(temperature=0.8, top_p=0.95)] * 256
    columns_only = dict(generators={}, vocab_size=151936, device=device, use_kernel=True)
    metadata = build_sampling_metadata(params, **columns_only)
    cases = {
        "torch.randint(256) on the host": lambda: torch.randint(0, 2**62, (256,)),
        "torch.empty(2 KiB, pin_memory=True)": lambda: torch.empty(2048, dtype=torch.uint8, pin_memory=True),
        "from_numpy(2 KiB).pin_memory()": lambda: torch.from_numpy(small).pin_memory(),
        "pinned 2 KiB .to(cuda, non_blocking)": lambda: pinned.to(device, non_blocking=True),
        "torch.randint(256, device=cuda)": lambda: torch.randint(0, 2**62, (256,), device=device),
        "pack_to_device(1 array)": lambda: pack_to_device([small], device),
        "pack_to_device(8 arrays)": lambda: pack_to_device([small] * 8, device),
        "build_sampling_metadata(256 rows, top_p)": lambda: build_sampling_metadata(params, **columns_only),
        "with_fresh_seeds (the same batch again)": lambda: with_fresh_seeds(metadata),
    }
    print(f"{'host µs per call':>18}  idle GPU / busy GPU  case")
    for name, fn in cases.items():
        idle = per_call_us(fn)
        torch.cuda._sleep(2_000_000_000)  # keeps the GPU busy for about a second while the host runs the calls
        busy = per_call_us(fn, 500)
        torch.cuda.synchronize()
        print(f"{idle:18.1f}  {busy:10.1f}  {name}", flush=True)


if __name__ == "__main__":
    main()
