"""reshape_and_cache: write each new token's K and V into the paged pool at its slot.

Pool layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size
+ offset. A negative slot marks a padding token (CUDA-graph batches) whose K/V is not stored.

An fp8 (float8_e4m3fn) pool stores x / scale saturated to ±448, the per-layer scale read through a pointer
(kernels.kv_fp8); any other pool stores x cast to its dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.kv_fp8 import kv_scales, quantize_kv


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
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
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
    store_kv(k_cache_ptr + dst, k, k_scale_ptr, mask, IS_FP8)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    store_kv(v_cache_ptr + dst, v, v_scale_ptr, mask, IS_FP8)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; < 0 skips the token
    k_scale: torch.Tensor | None = None,  # [] float32; an fp8 pool's scales, unused otherwise
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
    k_scale, v_scale, is_fp8 = kv_scales(kv_cache, k_scale, v_scale)
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=block_h, BLOCK_D=block_d, IS_FP8=is_fp8,
        num_warps=4 if block_h * block_d >= 2048 else 2,
    )


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = quantize_kv(key[keep], k_scale, kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = quantize_kv(value[keep], v_scale, kv_cache.dtype)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
