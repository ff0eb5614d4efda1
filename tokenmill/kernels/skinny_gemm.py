"""Skinny GEMM for decode: y = x @ W.T with few rows in x (a batch of 1-16 tokens), no split-K.

At a few rows a linear layer only streams its weight: cuBLAS does that at the copy ceiling, but for many
shapes it splits K and adds a reduction kernel per GEMM. Here each program owns BLOCK_N output columns
and walks all of K, its weight tiles software-pipelined, so one launch writes the result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MAX_ROWS = 16  # the tensor-core tile's minimum height: up to this many rows cost the same weight read


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr, num_rows, n, k, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_rows
    n_mask = offs_n < n
    if PDL:
        # Launched early (programmatic dependent launch): the weights do not depend on the kernel before, so
        # the first of them start coming into L2 while it finishes; x does, so read it only after the wait.
        if PREFETCH_K > 0:
            lines = tl.arange(0, PREFETCH_K // 64) * 64  # one 128-byte line of bf16 per prefetch
            _prefetch_l2(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + lines[None, :])
        gdc_launch_dependents()
        gdc_wait()
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        k_mask = offs_k < k - start
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def skinny_gemm(
    x: torch.Tensor,  # [num_rows <= MAX_ROWS, k], bf16/fp16, last stride 1
    weight: torch.Tensor,  # [n, k], contiguous
    config: tuple[int, int, int, int] = (32, 256, 4, 4),
    pdl: bool = False,
    prefetch_k: int = 0,
) -> torch.Tensor:
    """x @ weight.T; config = (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= MAX_ROWS and weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, num_rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, PREFETCH_K=prefetch_k,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )
    return out
