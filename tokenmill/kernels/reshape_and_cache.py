"""reshape_and_cache: write each new token's K and V into the paged pool at its slot.

Pool layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size
+ offset. A negative slot marks a padding token (CUDA-graph batches) whose K/V is not stored.

An fp8 (float8_e4m3fn) pool stores x / scale saturated to ±448, the per-layer scale read through a pointer
(kernels.kv_fp8); an int8 pool stores each (token, KV head) row over its own absmax / 127 and that scale beside
the pool (kernels.kv_int8); any other pool stores x cast to its dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.kv_fp8 import kv_scales, quantize_kv
from tokenmill.kernels.kv_int8 import is_int8, quantize_rows


@triton.jit
def _round_to_e4m3(y):
    """float32 y (|y| <= 448) rounded to the nearest e4m3 value, ties to even, still as float32: y over its
    e4m3 spacing (2^(exponent - 3), 2^-9 below the normal range) rounded to an integer by the 1.5 * 2^23 trick."""
    bits = y.to(tl.int32, bitcast=True)
    step = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3  # log2 of the spacing
    spacing = ((step + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - step) << 23).to(tl.float32, bitcast=True)
    r = tl.abs(((y * inverse + 12582912.0) - 12582912.0) * spacing)  # powers of two: both products are exact
    # y's sign bit put back (a negation would be 0 - r, +0 for a value that rounds to zero): torch keeps -0.
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def store_kv(ptr, x, scale_ptr, mask, IS_FP8: tl.constexpr):
    """x into the pool at ptr: for an fp8 pool x / scale (div_rn: the rounded quotient torch computes),
    saturated to ±448 and rounded to e4m3 before the cast, so that the cast is exact: the same bits on the GPU
    (whose conversion rounds to nearest even too) and under Triton's interpreter (whose conversion drops the
    carry of a mantissa that rounds up); else x cast to the pool's dtype."""
    if IS_FP8:
        x = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
        x = _round_to_e4m3(tl.minimum(tl.maximum(x, -448.0), 448.0))
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_kv_int8(ptr, x, scale_ptr, mask):
    """Rows x [rows, BLOCK_D] into an int8 pool at ptr, each as round(x / scale) (ties to even), its scale
    absmax / 127 to scale_ptr [rows]: torch's kernels.kv_int8.quantize_rows bit for bit (div_rn: IEEE quotients;
    the 1.5 * 2^23 trick rounds to the nearest integer, ties to even). A row of zeros stores scale 0."""
    x = x.to(tl.float32)
    absmax = tl.max(tl.where(mask, tl.abs(x), 0.0), 1)
    scale = tl.math.div_rn(absmax, 127.0)
    y = tl.math.div_rn(x, tl.where(scale > 0.0, scale, 1.0)[:, None])
    y = (y + 12582912.0) - 12582912.0
    tl.store(ptr, tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8), mask=mask)
    tl.store(scale_ptr, scale, mask=tl.max(mask.to(tl.int32), 1) > 0)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
    IS_INT8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    dst = block * stride_cb + offset * stride_ct + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if IS_INT8:
        scale_dst = block * stride_sb + offset * stride_st + heads
        store_kv_int8(k_cache_ptr + dst, k, k_scale_ptr + scale_dst, mask)
        store_kv_int8(v_cache_ptr + dst, v, v_scale_ptr + scale_dst, mask)
    else:
        store_kv(k_cache_ptr + dst, k, k_scale_ptr, mask, IS_FP8)
        store_kv(v_cache_ptr + dst, v, v_scale_ptr, mask, IS_FP8)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; < 0 skips the token
    k_scale: torch.Tensor | None = None,  # an fp8 pool's scales ([] float32) or an int8 pool's (kernels.kv_int8)
    v_scale: torch.Tensor | None = None,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    scales = kv_scales(kv_cache, k_scale, v_scale)
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, scales.k, scales.v,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scales.stride_b, scales.stride_t,
        num_kv_heads, head_dim,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=block_h, BLOCK_D=block_d, IS_FP8=scales.is_fp8,
        IS_INT8=scales.is_int8,
        num_warps=4 if block_h * block_d >= 2048 else 2,
    )


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    for pool, x, scale in ((kv_cache[0], key, k_scale), (kv_cache[1], value, v_scale)):
        if is_int8(kv_cache.dtype):
            pool.view(-1, num_kv_heads, head_dim)[slots], scale.view(-1, num_kv_heads)[slots] = quantize_rows(x[keep])
        else:
            pool.view(-1, num_kv_heads, head_dim)[slots] = quantize_kv(x[keep], scale, kv_cache.dtype)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
