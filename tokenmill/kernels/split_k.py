"""Split-K for the decode GEMVs (kernels.skinny_gemm, kernels.w4a16_gemm): K walked by several programs per tile of
output columns, their partial sums added in the same launch.

A skinny weight (a few thousand columns) gives too few programs, or too long a walk over K each, for the SMs to
keep enough weight bytes in flight: the DRAM latency is paid on every step. With `SPLITS` programs per column tile
(the grid's second axis), each stores its float32 partial sums and counts itself in on its tile's arrival counter
(kernels.arrivals); the last to arrive adds the partials in split order, so the sum does not depend on which
program came last, and writes the output. No second launch, no zero-filled buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.arrivals import arrival_counters


@triton.jit
def split_range(k, k_per_split, SPLITS: tl.constexpr):
    """[start, end) of K for this program: whole BLOCK_K steps (k_per_split), the last split what is left. One split
    keeps the bounds constant (0, k), as the kernels had them before splits (the AOT compile: a few instructions
    fewer in their main loops)."""
    if SPLITS == 1:
        return 0, k
    start = tl.program_id(1) * k_per_split
    return start, tl.minimum(k, start + k_per_split)


@triton.jit
def finish_split(acc, out_ptrs, part_ptrs, split_stride, mask, arrival_ptr, SPLITS: tl.constexpr):
    """acc: this program's partial sums (float32) of the output elements out_ptrs (mask); part_ptrs: where split 0
    keeps them in the partials buffer, split s at s * split_stride further."""
    tl.store(part_ptrs + tl.program_id(1) * split_stride, acc, mask=mask)
    # The barrier puts every warp's stores before the atomic, whose release (acq_rel, gpu scope) publishes them;
    # the last arrival's acquire makes them all visible to it (its loads are .cg: from L2, not a stale L1).
    tl.debug_barrier()
    if tl.atomic_add(arrival_ptr, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        total = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        for split in tl.static_range(1, SPLITS):
            total += tl.load(part_ptrs + split * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
        tl.store(arrival_ptr, 0)  # every split has arrived: the counter is ready for the next launch


def split_buffers(out: torch.Tensor, splits: int, rows: int, n: int,
                  counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials [splits, rows, n] float32, `counters` arrival counters) on `out`'s device; with one split, `out`
    twice, which the kernel does not read (no allocation on the unsplit path's every call)."""
    if splits == 1:
        return out, out
    device = out.device
    return (torch.empty((splits, rows, n), dtype=torch.float32, device=device), arrival_counters(device, counters))


def k_per_split(k: int, splits: int, block_k: int) -> int:
    """Each split's share of K in whole BLOCK_K steps (the last split takes what is left). Plain integer division:
    triton.cdiv costs ~1.5 us a call, on every eager decode GEMV."""
    steps = -(-k // block_k)
    return -(-steps // splits) * block_k


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
