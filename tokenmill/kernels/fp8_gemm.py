"""FP8 (e4m3) linear layers on the GPU: activation quantization, the decode GEMM, the block-scaled GEMM.

Weights are e4m3 with float32 scales, either one per output channel ("channel") or one per 128 x 128 tile
("block", as the DeepSeek-V3 and Qwen3 FP8 checkpoints ship them). Three kernels:
- `quantize_fp8`: activations to e4m3 with one scale per token, or per token and 128-wide group;
- `skinny_fp8_gemm`: decode batches (up to 16 rows) read the fp8 weight, widen it to the activations'
  16-bit type in registers and keep the activations unquantized (W8A16): a decode step only streams its
  weights, so half the bytes is the whole gain, and the activations lose nothing;
- `block_fp8_gemm`: W8A8 with per-token-group activation scales, for block-scaled weights at prefill sizes.
Channel-scaled prefill GEMMs go through cuBLASLt (torch._scaled_mm, row-wise scales): layers.quant.fp8,
which also holds the pure-torch references (the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.fp8_quant import fp8_quantize
from tokenmill.kernels.tile_tables import swept_tiles

FP8 = torch.float8_e4m3fn
SKINNY_MAX_ROWS = 16


@triton.jit(do_not_specialize=["num_rows"])
def _quantize_fp8_kernel(x_ptr, q_ptr, s_ptr, num_rows, k, stride_xm, stride_qm, stride_sm,
                         GROUP: tl.constexpr, BLOCK: tl.constexpr):
    # One program per (row, group); GROUP == BLOCK covers the group in one load.
    row, group = tl.program_id(0), tl.program_id(1)
    offs = group * GROUP + tl.arange(0, BLOCK)
    mask = (offs < k) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    q, scale = fp8_quantize(x)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group, scale)


def quantize_fp8(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (e4m3 [m, k], float32 scales [m, k / group_size]); group_size None: one scale per row."""
    m, k = x.shape
    group = k if group_size is None else group_size
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scales = torch.empty((m, triton.cdiv(k, group)), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(group)
        _quantize_fp8_kernel[(m, triton.cdiv(k, group))](
            x, q, scales, m, k, x.stride(0), q.stride(0), scales.stride(0), GROUP=group, BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
        )
    return q, scales


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_fp8_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, num_rows, n, k, stride_xm, stride_wn, stride_om, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    # SCALE_BLOCK 0: one scale per output channel; else the weight's scale tiles are SCALE_BLOCK wide, and
    # BLOCK_K == SCALE_BLOCK so each step of K meets one scale per column.
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
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(x.dtype)
        if SCALE_BLOCK == 0:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            s = tl.load(s_ptr + (offs_n // SCALE_BLOCK) * stride_sn + start // SCALE_BLOCK, mask=n_mask, other=0.0)
            acc += tl.dot(x, tl.trans(w)) * s[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALE_BLOCK == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _skinny_config(n: int, k: int, scale_block: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the bf16 skinny GEMM's tiles (kernels.skinny_gemm) with
    as many weight bytes per step, so twice the elements where the scale layout allows."""
    if scale_block:
        return 32, scale_block, 4, 5
    if k >= 8192:
        return 32, 1024, 4, 4
    if n >= 16384:
        return 64, 512, 4, 3
    return 32, 512, 4, 4


def skinny_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_block: int = 0,
                    config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [rows <= 16, k] (bf16/fp16) @ dequant(weight [n, k] e4m3).T; scale [n] (scale_block 0) or
    [n / scale_block, k / scale_block]."""
    rows, k = x.shape
    n = weight.shape[0]
    assert rows <= SKINNY_MAX_ROWS and weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config or _skinny_config(n, k, scale_block)
    _skinny_fp8_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        scale.stride(0) if scale_block else 0,
        BLOCK_M=SKINNY_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SCALE_BLOCK=scale_block,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


@triton.jit
def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, n, k, stride_xm, stride_wn, stride_om,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # A row or a few, per-channel scales: multiply-adds on the CUDA cores instead of a 16-row tensor-core tile
    # of which 15 rows would be padding; the weight tile is widened once and used by every row.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < n
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        k_mask = offs_k < k - start
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + start + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        acc0 += tl.sum(w * x[None, :], axis=1)
        if ROWS > 1:
            x = tl.load(x_ptr + stride_xm + start + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            acc1 += tl.sum(w * x[None, :], axis=1)
        if ROWS > 2:
            x = tl.load(x_ptr + 2 * stride_xm + start + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            acc2 += tl.sum(w * x[None, :], axis=1)
        if ROWS > 3:
            x = tl.load(x_ptr + 3 * stride_xm + start + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            acc3 += tl.sum(w * x[None, :], axis=1)
        w_ptrs += BLOCK_K
    s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    tl.store(out_ptr + offs_n, (acc0 * s).to(out_ptr.dtype.element_ty), mask=n_mask)
    if ROWS > 1:
        tl.store(out_ptr + stride_om + offs_n, (acc1 * s).to(out_ptr.dtype.element_ty), mask=n_mask)
    if ROWS > 2:
        tl.store(out_ptr + 2 * stride_om + offs_n, (acc2 * s).to(out_ptr.dtype.element_ty), mask=n_mask)
    if ROWS > 3:
        tl.store(out_ptr + 3 * stride_om + offs_n, (acc3 * s).to(out_ptr.dtype.element_ty), mask=n_mask)


GEMV_MAX_ROWS = 2
"""Rows the layers give the GEMV: from 3 rows the skinny kernel's tensor-core tile is faster (H200, Llama-8B's
projections: 3.22 against 3.65 ms over 32 layers at 3 rows, 2.71 against 3.22 at 2). The kernel takes up to 4."""
GEMV_KERNEL_ROWS = 4


def gemv_key(n: int, k: int, rows: int) -> str:
    """The tiles table's key: the shape and the row count (each row more is an accumulator more per column)."""
    return f"{n}x{k},rows={rows}"


def _gemv_config(n: int, k: int, rows: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the device's swept tiles for the shape
    (kernels/configs/fp8_gemv_<device>.json, from `benchmarks/fp8_gemm.py --gemv-only --out`), else the first sweep's
    choice by n alone (2026-12-02: 1.46x the skinny kernel over Llama-3.1-8B's four projections at one row)."""
    tuned = swept_tiles("fp8_gemv", device, gemv_key(n, k, rows))
    if tuned is not None:
        return tuned
    return (32, 512, 8, 3) if n >= 16384 else (16, 1024, 8, 3)


def gemv_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [rows <= 4, k] @ dequant(weight [n, k] e4m3, scale [n]).T on the CUDA cores."""
    rows, k = x.shape
    n = weight.shape[0]
    assert rows <= GEMV_KERNEL_ROWS and weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config or _gemv_config(n, k, rows, x.device)
    _gemv_fp8_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return out


@triton.jit(do_not_specialize=["m"])
def _block_fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, m, n, k, stride_am, stride_asm, stride_bn, stride_bsn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # BLOCK_K is the scale block: each step of K multiplies one fp8 tile pair and scales it once.
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
    # Grouped order: programs that run together share B tiles in L2.
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < m, offs_n < n
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + (offs_n // BLOCK_K) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(0, tl.cdiv(k, BLOCK_K)):
        k_mask = offs_k < k - step * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        a_s = tl.load(as_ptrs + step, mask=m_mask, other=0.0)
        b_s = tl.load(bs_ptrs + step, mask=n_mask, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   block: int, out_dtype: torch.dtype) -> torch.Tensor:
    """dequant(a [m, k] e4m3, a_scale [m, k / block]) @ dequant(b [n, k] e4m3, b_scale [n / block, k / block]).T"""
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_m = 64 if m <= 64 else 128
    _block_fp8_gemm_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, 128),)](
        a, a_scale, b, b_scale, out, m, n, k, a.stride(0), a_scale.stride(0), b.stride(0), b_scale.stride(0),
        out.stride(0), BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=block, GROUP_M=8, num_warps=4 if block_m == 64 else 8,
        num_stages=3,
    )
    return out


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
