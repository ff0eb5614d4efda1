"""What a step's small host-to-device copies and the sampler's launches cost the host (GPU): the pieces of
pack_to_device and of Sampler.forward, each timed over many calls, with the GPU idle and with the GPU busy
(as under async scheduling, where the work of step N+1 queues behind step N).

    PYTHONPATH=. python3 benchmarks/host_copy.py
"""

from __future__ import annotations

import time

import numpy as np
import torch
import triton

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


def sampler_cases(device: torch.device) -> dict:
    """The sampler's host work at batch 256 over Qwen3's vocabulary: its allocations, one bare Triton launch,
    and whole calls."""
    from tokenmill.kernels import sampling
    from tokenmill.sample.sampler import Sampler

    rows, vocab = 256, 151936
    logits = torch.randn(rows, vocab, device=device).to(torch.bfloat16)
    temperature = torch.full((rows,), 0.8, device=device)
    top_p = torch.full((rows,), 0.95, device=device)
    seeds = torch.randint(0, 2**62, (rows,), device=device)
    out = torch.empty(rows, dtype=torch.int64, device=device)
    num_tiles, tiles_per_split, num_splits = layout = sampling.draw_layout(vocab, sampling.TILE)
    stats = torch.empty(rows, num_splits, 4, device=device)
    values = torch.empty(rows, num_splits, device=device)
    indices = torch.empty(rows, num_splits, dtype=torch.int32, device=device)
    arrivals = torch.zeros(rows, dtype=torch.int32, device=device)
    no_penalties = sampling.no_penalties_args(temperature)
    sampler = Sampler()
    top_p_metadata = build_sampling_metadata([SamplingParams(temperature=0.8, top_p=0.95)] * rows, {}, vocab, device,
                                             use_kernel=True)

    def bare_launch():
        sampling._draw_kernel[(rows, num_splits)](
            logits, logits.stride(0), temperature, seeds, temperature, stats, values, indices, arrivals, out, vocab,
            num_tiles, tiles_per_split, num_splits, 0, *no_penalties, BLOCK=triton.next_power_of_2(num_tiles),
            TILE=sampling.TILE, PENALTIES=False)

    return {
        "sampler: torch.zeros(256, device=cuda)": lambda: torch.zeros(rows, device=device),
        "sampler: torch.empty(256, 30, 4, device=cuda)": lambda: torch.empty(rows, num_splits, 4, device=device),
        "sampler: _draw_kernel launch alone": bare_launch,
        "sampler: sampling._draw (allocations + launch)": lambda: sampling._draw(
            logits, temperature, seeds, None, layout, sampling.TILE, out, None),
        "sampler: greedy_argmax": lambda: sampling.greedy_argmax(logits),
        "sampler: categorical_draw": lambda: sampling.categorical_draw(logits, temperature, seeds),
        "sampler: top_p_draw": lambda: sampling.top_p_draw(logits, temperature, top_p, seeds),
        "sampler: Sampler.forward, 256 top-p rows": lambda: sampler(logits, top_p_metadata),
    }


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
        **sampler_cases(device),
    }
    print(f"{'host µs per call':>18}  idle GPU / busy GPU  case")
    for name, fn in cases.items():
        calls = 100 if name.startswith("sampler:") else 500  # fewer than the launch queue holds
        idle = per_call_us(fn, calls)
        torch.cuda._sleep(2_000_000_000)  # keeps the GPU busy for about a second while the host runs the calls
        busy = per_call_us(fn, calls)
        torch.cuda.synchronize()
        print(f"{idle:18.1f}  {busy:10.1f}  {name}", flush=True)


if __name__ == "__main__":
    main()
