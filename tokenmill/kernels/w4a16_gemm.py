"""Integer-weight GEMMs (W4A16, W8A16): y = x @ dequant(W).T with the weight dequantized in registers.

The weight is in layers.quant.w4a16's layout, the one every checkpoint format (GPTQ, AWQ,
compressed-tensors pack-quantized) is repacked into at load: `weight_packed` int32 [n, k / pack] packed
along k (lowest bits first), `weight_scale` [n, groups], `weight_zero` [n, groups] or none (the midpoint
2^(bits-1)), and an optional input permutation (act-order) applied to x as it is loaded. A program reads
its weight tile as int32 words, shifts each feature's bits out, and scales by its group: the weight crosses
memory at 4 (or 8) bits, and no 16-bit copy is ever written.

Three kernels:
- `gemv_int`, decode of up to 4 rows: on the CUDA cores, each program owning BLOCK_N output columns, every word
  unpacked once for all the rows, the zero point and the scale applied per group to the sums rather than per
  weight (scale * (sum q * x - zero * sum x)). The skinny kernel's 16-row tensor-core tile at one row ran at
  a tenth of the weights' read rate on the H200 (BENCHMARKS.md): the unpacking, not the memory, set the pace.
- `skinny_int_gemm`, decode (<= 16 rows): each program owns BLOCK_N output columns and walks all of K, as
  kernels.skinny_gemm does for 16-bit weights; a decode step only streams weights, and these are a quarter
  of the bytes.
- `tiled_int_gemm`, prefill: BLOCK_M x BLOCK_N tiles in grouped order (programs running together share
  weight tiles in L2).
When a group spans a whole number of BLOCK_K steps (group sizes 64, 128, per-channel) each step meets one
scale per column; otherwise (group 32 under wider steps) the scales are gathered per feature.
The references are layers.quant.w4a16.dequantize_int / int_linear_torch (the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys

SKINNY_MAX_ROWS = 16  # the tensor-core tile's minimum height: up to this many rows cost the same weight read


@triton.jit
def _load_x(x_ptr, perm_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, HAS_PERM: tl.constexpr):
    if HAS_PERM:  # act-order: the weight's feature j is the input's feature perm[j]
        cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    else:
        cols = offs_k
    return tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + cols[None, :],
                   mask=m_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _dequant_tile(w_ptr, s_ptr, z_ptr, offs_n, offs_k, n_mask, k_mask, start, k_end, stride_wn, stride_sn,
                  BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  HAS_ZERO: tl.constexpr):
    """The float32 weight tile [BLOCK_N, BLOCK_K] of features start + offs_k. GROUP 0: per-channel."""
    PACK: tl.constexpr = 32 // BITS
    mask = n_mask[:, None] & k_mask[None, :]
    row = offs_n[:, None].to(tl.int64)
    # Each word once (a contiguous [BLOCK_N, BLOCK_K / PACK] tile, vectorized loads), then its PACK values
    # shifted out along a new last axis and folded back into K: feature k is slot k % PACK of word k // PACK.
    offs_w = start // PACK + tl.arange(0, BLOCK_K // PACK)
    words = tl.load(w_ptr + row * stride_wn + offs_w[None, :],
                    mask=n_mask[:, None] & (offs_w * PACK < k_end)[None, :],
                    other=0)
    shifts = tl.arange(0, PACK) * BITS
    # The arithmetic shift of a negative word copies its sign bit in from the top: the mask removes it.
    q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    q = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(tl.float32)
    if GROUP == 0 or GROUP % BLOCK_K == 0:  # one group per column in this step
        if GROUP == 0:
            group = 0
        else:
            group = start // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_ZERO:
            z = tl.load(z_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    else:
        index = row * stride_sn + (offs_k // GROUP)[None, :]
        s = tl.load(s_ptr + index, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + index, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        return (q - z) * s
    return (q - (1 << (BITS - 1))) * s  # symmetric: the midpoint


# The row count changes with the batch: one compiled variant for all of them.
@triton.jit(do_not_specialize=["num_rows"])
def _skinny_int_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, num_rows, n, k, stride_xm, stride_wn, stride_sn, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < num_rows, offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        x = _load_x(x_ptr, perm_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, HAS_PERM)
        w = _dequant_tile(w_ptr, s_ptr, z_ptr, offs_n, offs_k, n_mask, k_mask, start, k, stride_wn, stride_sn,
                          BITS, GROUP, BLOCK_N, BLOCK_K, HAS_ZERO)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["m"])
def _tiled_int_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, m, n, k, stride_xm, stride_wn, stride_sn, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < m, offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        x = _load_x(x_ptr, perm_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, HAS_PERM)
        w = _dequant_tile(w_ptr, s_ptr, z_ptr, offs_n, offs_k, n_mask, k_mask, start, k, stride_wn, stride_sn,
                          BITS, GROUP, BLOCK_N, BLOCK_K, HAS_ZERO)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemv_row(q, x_ptr, perm_ptr, s, z, offs_k, k_mask, GROUP_STEP: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, HAS_PERM: tl.constexpr):
    """One row's part of a step: sum over the step's groups of scale * (sum q * x - zero * sum x), [BLOCK_N].
    The zero point leaves the inner product (one multiply-add per weight, not three)."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    else:
        cols = offs_k
    x = tl.load(x_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
    dots = tl.sum(tl.reshape(q * x[None, :], (BLOCK_N, BLOCK_K // GROUP_STEP, GROUP_STEP)), axis=2)
    sums = tl.sum(tl.reshape(x, (BLOCK_K // GROUP_STEP, GROUP_STEP)), axis=1)
    return tl.sum(s * (dots - z * sums[None, :]), axis=1)


@triton.jit
def _gemv_int_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, n, k, stride_xm, stride_wn, stride_sn, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # A row or a few on the CUDA cores: a 16-row tensor-core tile would be 15 rows of padding, and there the
    # unpacking, not the weight read, set the pace. Each word is loaded and unpacked once for every row.
    PACK: tl.constexpr = 32 // BITS
    # The step's groups: a step inside one group (or per-channel) meets one scale per column.
    GROUP_STEP: tl.constexpr = BLOCK_K if GROUP == 0 or GROUP >= BLOCK_K else GROUP
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    row = offs_n[:, None].to(tl.int64)
    shifts = tl.arange(0, PACK) * BITS
    offs_g = tl.arange(0, BLOCK_K // GROUP_STEP)
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        offs_w = start // PACK + tl.arange(0, BLOCK_K // PACK)
        words = tl.load(w_ptr + row * stride_wn + offs_w[None, :],
                        mask=n_mask[:, None] & (offs_w * PACK < k)[None, :], other=0)
        q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1), (BLOCK_N, BLOCK_K))
        q = q.to(tl.float32)
        if GROUP == 0:
            group = tl.zeros_like(offs_g)
        else:
            group = (start + offs_g * GROUP_STEP) // GROUP
        sz_mask = n_mask[:, None] & (start + offs_g * GROUP_STEP < k)[None, :]
        s = tl.load(s_ptr + row * stride_sn + group[None, :], mask=sz_mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + row * stride_sn + group[None, :], mask=sz_mask, other=0.0).to(tl.float32)
        else:
            z = tl.full([BLOCK_N, BLOCK_K // GROUP_STEP], 1 << (BITS - 1), tl.float32)  # symmetric: the midpoint
        acc0 += _gemv_row(q, x_ptr, perm_ptr, s, z, offs_k, k_mask, GROUP_STEP, BLOCK_N, BLOCK_K, HAS_PERM)
        if ROWS > 1:
            acc1 += _gemv_row(q, x_ptr + stride_xm, perm_ptr, s, z, offs_k, k_mask, GROUP_STEP, BLOCK_N, BLOCK_K,
                              HAS_PERM)
        if ROWS > 2:
            acc2 += _gemv_row(q, x_ptr + 2 * stride_xm, perm_ptr, s, z, offs_k, k_mask, GROUP_STEP, BLOCK_N,
                              BLOCK_K, HAS_PERM)
        if ROWS > 3:
            acc3 += _gemv_row(q, x_ptr + 3 * stride_xm, perm_ptr, s, z, offs_k, k_mask, GROUP_STEP, BLOCK_N,
                              BLOCK_K, HAS_PERM)
    tl.store(out_ptr + offs_n, acc0.to(out_ptr.dtype.element_ty), mask=n_mask)
    if ROWS > 1:
        tl.store(out_ptr + stride_om + offs_n, acc1.to(out_ptr.dtype.element_ty), mask=n_mask)
    if ROWS > 2:
        tl.store(out_ptr + 2 * stride_om + offs_n, acc2.to(out_ptr.dtype.element_ty), mask=n_mask)
    if ROWS > 3:
        tl.store(out_ptr + 3 * stride_om + offs_n, acc3.to(out_ptr.dtype.element_ty), mask=n_mask)


def _block_k(group: int, widest: int, narrowest: int) -> int:
    """The widest step in [narrowest, widest] (powers of 2) that a group spans whole, else `widest` with the
    scales gathered per feature (narrower steps would starve the loads more than the gather costs)."""
    if group == 0:
        return widest
    step = widest
    while step >= narrowest:
        if group % step == 0:
            return step
        step //= 2
    return widest


def _group_of(k: int, scale: torch.Tensor) -> int:
    groups = scale.shape[1]
    return 0 if groups == 1 else k // groups


def _check(x, weight_packed, scale, zero, perm, bits) -> tuple[int, int, int]:
    rows, k = x.shape
    n = weight_packed.shape[0]
    assert bits in (4, 8) and weight_packed.shape[1] * (32 // bits) == k, (weight_packed.shape, k, bits)
    assert x.stride(-1) == 1 and weight_packed.is_contiguous() and scale.is_contiguous() and scale.shape[0] == n
    assert k % scale.shape[1] == 0 and (zero is None or zero.shape == scale.shape)
    assert perm is None or perm.shape == (k,)
    return rows, n, k


def skinny_int_gemm(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    perm: torch.Tensor | None, bits: int,
                    config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [rows <= 16, k] (bf16/fp16) @ dequant(weight).T; config = (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    rows, n, k = _check(x, weight_packed, scale, zero, perm, bits)
    assert rows <= SKINNY_MAX_ROWS
    group = _group_of(k, scale)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    # As many weight bytes per step as the 16-bit skinny GEMM's 256-wide steps: 4x (int4) the features,
    # capped where the unpacked tile would spill registers.
    block_n, block_k, num_warps, num_stages = config or (32, _block_k(group, 256, 128), 4, 4)
    _skinny_int_kernel[(triton.cdiv(n, block_n),)](
        x, weight_packed, scale, zero if zero is not None else scale, perm if perm is not None else weight_packed,
        out, rows, n, k, x.stride(0), weight_packed.stride(0), scale.stride(0), out.stride(0),
        BITS=bits, GROUP=group, HAS_ZERO=zero is not None, HAS_PERM=perm is not None,
        BLOCK_M=SKINNY_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return out


GEMV_MAX_ROWS = 4


def gemv_int(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
             perm: torch.Tensor | None, bits: int, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [rows <= 4, k] (bf16/fp16) @ dequant(weight).T on the CUDA cores; config = (BLOCK_N, BLOCK_K, num_warps,
    num_stages). BLOCK_K must be a multiple of the group size or divide it."""
    rows, n, k = _check(x, weight_packed, scale, zero, perm, bits)
    assert rows <= GEMV_MAX_ROWS
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    group = _group_of(k, scale)
    # ~512 weight bytes per column per step (as the fp8 GEMV's 512-1,024): many loads in flight per program.
    block_n, block_k, num_warps, num_stages = config or (16, 4096 // bits if group == 0 or group <= 4096 // bits
                                                         else group, 4, 3)
    assert group == 0 or block_k % group == 0 or group % block_k == 0, (group, block_k)
    _gemv_int_kernel[(triton.cdiv(n, block_n),)](
        x, weight_packed, scale, zero if zero is not None else scale, perm if perm is not None else weight_packed,
        out, n, k, x.stride(0), weight_packed.stride(0), scale.stride(0), out.stride(0),
        BITS=bits, GROUP=group, HAS_ZERO=zero is not None, HAS_PERM=perm is not None, ROWS=rows,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def tiled_int_gemm(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                   perm: torch.Tensor | None, bits: int,
                   config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [m, k] (bf16/fp16) @ dequant(weight).T; config = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    m, n, k = _check(x, weight_packed, scale, zero, perm, bits)
    group = _group_of(k, scale)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 64 if m <= 64 else 128
    block_m, block_n, block_k, num_warps, num_stages = config or (block_m, 128, _block_k(group, 64, 32),
                                                                   4 if block_m == 64 else 8, 3)
    _tiled_int_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)](
        x, weight_packed, scale, zero if zero is not None else scale, perm if perm is not None else weight_packed,
        out, m, n, k, x.stride(0), weight_packed.stride(0), scale.stride(0), out.stride(0),
        BITS=bits, GROUP=group, HAS_ZERO=zero is not None, HAS_PERM=perm is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def int_weight_gemm(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    perm: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The layer's entry: the GEMV up to 4 rows, the skinny kernel up to 16, the tiled one above (a choice by
    shape only, so CUDA graphs capture it)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gemv_int(x, weight_packed, scale, zero, perm, bits)
    if x.shape[0] <= SKINNY_MAX_ROWS:
        return skinny_int_gemm(x, weight_packed, scale, zero, perm, bits)
    return tiled_int_gemm(x, weight_packed, scale, zero, perm, bits)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
