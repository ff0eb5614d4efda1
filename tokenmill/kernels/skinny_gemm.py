"""Skinny GEMM for decode: y = x @ W.T with few rows in x (a batch of 1-16 tokens), no split-K.

At a few rows a linear layer only streams its weight. cuBLAS splits K for many of these shapes and adds a
reduction kernel per GEMM; here each program owns BLOCK_N output columns and walks all of K, its weight
tiles software-pipelined, so one launch writes the result. On the H200, the four projections of 32
Llama-3.1-8B layers run in 3.67 ms against cuBLAS's 3.82 at one row (benchmarks/skinny_gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys

MAX_ROWS = 16  # the tensor-core tile's minimum height: up to this many rows cost the same weight read


# The row count changes with the batch: one compiled variant for all of them.
@triton.jit(do_not_specialize=["num_rows"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr, num_rows, n, k, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_rows
    n_mask = offs_n < n
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


def skinny_gemm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_gemm should replace torch's matmul: few 16-bit rows and a weight large enough for its
    tiles to fill the GPU (the shapes it was measured faster on; smaller ones stay with cuBLAS)."""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.is_contiguous()
            and weight.shape[0] >= 4096 and weight.shape[1] >= 4096)


def _config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), from the sweep of benchmarks/skinny_gemm.py on the H200."""
    if k >= 8192:
        return 32, 512, 4, 5
    if n >= 16384:
        return 64, 256, 4, 3
    return 32, 256, 4, 5


def skinny_gemm(
    x: torch.Tensor,  # [num_rows <= MAX_ROWS, k], bf16/fp16, last stride 1
    weight: torch.Tensor,  # [n, k], contiguous
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x @ weight.T; config = (BLOCK_N, BLOCK_K, num_warps, num_stages) overrides the tuned choice."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= MAX_ROWS and weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config or _config(n, k)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, num_rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().T).to(x.dtype)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
