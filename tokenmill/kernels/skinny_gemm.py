"""Skinny GEMM for decode: y = x @ W.T with few rows in x (a batch of 1-16 tokens), in one launch.

At a few rows a linear layer only streams its weight. cuBLAS splits K for many of these shapes and adds a
reduction kernel per GEMM; here each program owns BLOCK_N output columns and walks its part of K, its weight
tiles software-pipelined, so one launch writes the result. On the H200, the four projections of 32
Llama-3.1-8B layers run in 3.67 ms against cuBLAS's 3.82 at one row (benchmarks/skinny_gemm.py).

A weight with few column tiles (o_proj: 128 programs of 32 columns for 132 SMs) leaves each SM one program and
few bytes in flight; K may then be split over programs, added in the same launch (kernels.split_k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.pdl import let_next_launch, pdl_launch, wait_for_previous
from tokenmill.kernels.split_k import finish_split, k_per_split, split_buffers, split_range
from tokenmill.kernels.tile_tables import swept_tiles

MAX_ROWS = 16  # the tensor-core tile's minimum height: up to this many rows cost the same weight read


# The row count changes with the batch: one compiled variant for all of them.
@triton.jit(do_not_specialize=["num_rows"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr, num_rows, n, k, stride_xm, stride_wn, stride_om, part_ptr, arrivals_ptr, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)  # kernels.pdl: x is the kernel before's output
    tile = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_rows
    n_mask = offs_n < n
    k_start, k_end = split_range(k, k_per_split, SPLITS)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(k_start, k_end, BLOCK_K):
        k_mask = offs_k < k_end - start
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # The next kernel launches only once this one's K loop is done: let in at the start, its programs waiting on the
    # SMs made W1 15% slower (kernels.pdl).
    let_next_launch(PDL)
    mask = m_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLITS == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        finish_split(acc, out_ptrs, part_ptr + offs_m[:, None] * n + offs_n[None, :], num_rows * n, mask,
                     arrivals_ptr + tile, SPLITS)


def skinny_gemm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_gemm should replace torch's matmul: few 16-bit rows and a weight large enough for its
    tiles to fill the GPU (the shapes it was measured faster on; smaller ones stay with cuBLAS)."""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.is_contiguous()
            and weight.shape[0] >= 4096 and weight.shape[1] >= 4096)


SkinnyConfig = tuple[int, int, int, int, int]
"""(BLOCK_N, BLOCK_K, num_warps, num_stages, splits of K)."""


def tuned_key(n: int, k: int, rows: int) -> str:
    """The tiles table's key: the shape and a row count of TUNED_ROWS."""
    return f"{n}x{k},rows={rows}"


TUNED_ROWS = (1, 8, 16)
"""The row counts benchmarks/skinny_gemm.py tunes; a batch takes the tiles of the first count at or above it."""


def _config(n: int, k: int, rows: int, device: torch.device) -> SkinnyConfig:
    """The device's swept tiles for the shape (kernels/configs/skinny_gemm_<device>.json, from
    `benchmarks/skinny_gemm.py --out`), else the first sweep's choice by shape (one split)."""
    tuned = swept_tiles("skinny_gemm", device, tuned_key(n, k, next(r for r in TUNED_ROWS if r >= rows)))
    if tuned is not None:
        return tuned
    if k >= 8192 or n >= 65536:  # (an LM head: Llama-3's 128,256 x 4,096 took these at 1-16 rows on an H100)
        return 32, 512, 4, 5, 1
    if n >= 16384:
        return 64, 256, 4, 3, 1
    return 32, 256, 4, 5, 1


def skinny_gemm(
    x: torch.Tensor,  # [num_rows <= MAX_ROWS, k], bf16/fp16, last stride 1
    weight: torch.Tensor,  # [n, k], contiguous
    config: tuple[int, int, int, int] | SkinnyConfig | None = None,
) -> torch.Tensor:
    """x @ weight.T; config = (BLOCK_N, BLOCK_K, num_warps, num_stages[, splits]) overrides the tuned choice."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= MAX_ROWS and weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages, *rest = config or _config(n, k, num_rows, x.device)
    splits = min(rest[0] if rest else 1, -(-k // block_k))  # (integer ceilings: triton.cdiv is ~1.5 us a call)
    tiles = -(-n // block_n)
    partials, arrivals = split_buffers(out, splits, num_rows, n, tiles)
    _skinny_gemm_kernel[(tiles, splits)](
        x, weight, out, num_rows, n, k, x.stride(0), weight.stride(0), out.stride(0), partials, arrivals,
        k_per_split(k, splits, block_k),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits, num_warps=num_warps,
        num_stages=num_stages, **pdl_launch(x.device),
    )
    return out


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().T).to(x.dtype)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
