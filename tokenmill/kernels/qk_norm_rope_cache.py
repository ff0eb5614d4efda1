"""q/k norms, rotary embedding and the KV write of an attention layer in one launch.

Unfused, each layer launches up to four kernels after its QKV projection (q RMSNorm, k RMSNorm, rotary,
reshape_and_cache), each re-reading what the previous one wrote. Here a program takes a head row of one token
(with many tokens, a prefill's, several heads of it: a warp a head): the optional per-head RMSNorm (Qwen3's
q_norm/k_norm), then the rotate-half rotary, then the store: q into a new contiguous tensor, k (with v,
untouched) into the paged pool at the token's slot.

A row is normed as kernels.rms_norm norms it (the normed row rounded to the activation dtype, as that
kernel's store rounds it), then rotated with each product and sum rounded as torch rounds them: the kernel
is compiled without fused multiply-adds, so the rotary matches the torch reference bit for bit (the norm's
float32 sum of squares is reduced in another order than torch's). Each element's rotary partner (its
element in the other half) is loaded and normed again rather than moved across the tile. Pool layout and
negative (padding) slots as in kernels.reshape_and_cache; a padding token's q is still produced. An fp8 or int8
pool stores k and v quantized as reshape_and_cache stores them (store_kv, store_kv_int8).
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.kv_fp8 import kv_scales
from tokenmill.kernels.pdl import pdl_launch, pdl_start
from tokenmill.kernels.reshape_and_cache import reshape_and_cache_ref, store_kv, store_kv_int8
from tokenmill.kernels.rms_norm import rms_norm_ref
from tokenmill.kernels.rotary import rotary_embedding_ref


class HeadNorm(Protocol):
    """A per-head RMSNorm's parameters (layers.norm.RMSNorm has them)."""

    weight: torch.Tensor  # [head_dim]
    eps: float
    offset: float  # 1.0: Gemma's (1 + weight) scaling


@triton.jit
def _rms_scaled(x, rstd, w, offset, HAS_OFFSET: tl.constexpr, dtype: tl.constexpr):
    """x normed by its row's rstd and weighted, rounded to dtype: kernels.rms_norm's output."""
    if HAS_OFFSET:
        y = x * rstd * (offset + w)
    else:
        y = (x * rstd).to(dtype).to(tl.float32) * w
    return y.to(dtype).to(tl.float32)


@triton.jit
def _normed_rotated_heads(
    x_ptr, heads, stride_h, head_mask, weight_ptr, eps, offset, cos, sin, head_dim, half,
    HAS_NORM: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Head rows [HEADS, BLOCK_D] (row `h` at x_ptr + heads[h] * stride_h, unit stride) normed then rotated:
    float32 holding activation-dtype values; cos and sin [BLOCK_D] are the token's."""
    dtype = x_ptr.dtype.element_ty
    dims = tl.arange(0, BLOCK_D)
    in_first_half = (dims < half)[None, :]
    rotated = (dims < 2 * half)[None, :]
    partner = tl.where(dims < half, dims + half, dims - half)
    rows = x_ptr + heads[:, None] * stride_h
    x = tl.load(rows + dims[None, :], mask=head_mask[:, None] & (dims < head_dim)[None, :], other=0.0)
    x = x.to(tl.float32)
    x_partner = tl.load(rows + partner[None, :], mask=head_mask[:, None] & rotated, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, 1) / head_dim + eps))[:, None]
        w = tl.load(weight_ptr + dims, mask=dims < head_dim, other=0.0).to(tl.float32)[None, :]
        w_partner = tl.load(weight_ptr + partner, mask=dims < 2 * half, other=0.0).to(tl.float32)[None, :]
        x = _rms_scaled(x, rstd, w, offset, HAS_OFFSET, dtype)
        x_partner = _rms_scaled(x_partner, rstd, w_partner, offset, HAS_OFFSET, dtype)
    # First half: x1 * cos - x2 * sin; second half: x2 * cos + x1 * sin; each product rounded.
    a = (x * cos[None, :]).to(dtype).to(tl.float32)
    b = (x_partner * sin[None, :]).to(dtype).to(tl.float32)
    return tl.where(rotated, tl.where(in_first_half, a - b, a + b), x)


@triton.jit
def _qk_norm_rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, slot_ptr, cos_sin_ptr,
    q_weight_ptr, k_weight_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch, stride_cs, stride_sb, stride_st,
    num_q_heads, num_kv_heads, head_dim, half, q_eps, k_eps, q_offset, k_offset,
    HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, HAS_Q_OFFSET: tl.constexpr, HAS_K_OFFSET: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, HEADS: tl.constexpr, IS_FP8: tl.constexpr,
    IS_INT8: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # kernels.pdl
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)  # HEADS q heads at a time, then HEADS kv heads at a time
    q_groups = tl.cdiv(num_q_heads, HEADS)
    dtype = q_out_ptr.dtype.element_ty
    dims = tl.arange(0, BLOCK_D)
    # Element d rotates with frequency d mod half: cos and sin spread over both halves of the row.
    freq = tl.where(dims < half, dims, dims - half)
    rotated = dims < 2 * half
    table_row = cos_sin_ptr + tl.load(positions_ptr + token).to(tl.int64) * stride_cs
    cos = tl.load(table_row + freq, mask=rotated, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(table_row + half + freq, mask=rotated, other=0.0).to(dtype).to(tl.float32)
    if group < q_groups:
        heads = group * HEADS + tl.arange(0, HEADS)
        head_mask = heads < num_q_heads
        q = _normed_rotated_heads(q_ptr + token * stride_qt, heads, stride_qh, head_mask, q_weight_ptr, q_eps,
                                  q_offset, cos, sin, head_dim, half, HAS_Q_NORM, HAS_Q_OFFSET, BLOCK_D)
        dst = q_out_ptr + (token * num_q_heads + heads[:, None]) * head_dim + dims[None, :]
        tl.store(dst, q.to(dtype), mask=head_mask[:, None] & (dims < head_dim)[None, :])
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:  # a padding token stores nothing
            heads = (group - q_groups) * HEADS + tl.arange(0, HEADS)
            head_mask = heads < num_kv_heads
            k = _normed_rotated_heads(k_ptr + token * stride_kt, heads, stride_kh, head_mask, k_weight_ptr, k_eps,
                                      k_offset, cos, sin, head_dim, half, HAS_K_NORM, HAS_K_OFFSET, BLOCK_D)
            mask = head_mask[:, None] & (dims < head_dim)[None, :]
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + heads[:, None] * stride_ch \
                + dims[None, :]
            # Rounded to the activation dtype first, as the unfused rotary output is, then to the pool's.
            k = k.to(dtype)
            v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
            if IS_INT8:  # each head's row with its scale at its slot and head
                scale_dst = (slot // BLOCK_SIZE) * stride_sb + (slot % BLOCK_SIZE) * stride_st + heads
                store_kv_int8(k_cache_ptr + dst, k, k_scale_ptr + scale_dst, mask)
                store_kv_int8(v_cache_ptr + dst, v, v_scale_ptr + scale_dst, mask)
            else:
                store_kv(k_cache_ptr + dst, k, k_scale_ptr, mask, IS_FP8)
                store_kv(v_cache_ptr + dst, v, v_scale_ptr, mask, IS_FP8)


MANY_TOKENS = 16
"""From this many tokens a program takes several heads of its token (HEADS_PER_PROGRAM): one-head programs each
moved 512 bytes and reloaded the token's cos/sin. Measured on the H200 (Llama-3.1-8B heads, in CUDA graphs): 8
heads a program 2.7x faster at 8,192 tokens (75 against 199 us), 2.1x at 256, level at 16; one head a program
stays faster for a single token (2.0 against 2.3 us), which it spreads over more of the GPU."""
HEADS_PER_PROGRAM = 8


def qk_norm_rope_cache(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]; last stride 1
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]; last stride 1
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]; last stride 1
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; < 0 skips the token's K/V
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] float32: cos | sin
    q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None,
    k_scale: torch.Tensor | None = None,  # an fp8 pool's scales ([] float32) or an int8 pool's (kernels.kv_int8)
    v_scale: torch.Tensor | None = None,
    heads_per_program: int | None = None,  # None: by the token count (MANY_TOKENS); a power of 2
) -> torch.Tensor:
    """The normed, rotated query (new, contiguous); the normed, rotated key and the value go to the pool."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return q_out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    scales = kv_scales(kv_cache, k_scale, v_scale)
    block = triton.next_power_of_2(head_dim)
    if heads_per_program is None:
        heads_per_program = HEADS_PER_PROGRAM if num_tokens >= MANY_TOKENS else 1
    heads = min(heads_per_program, triton.next_power_of_2(num_q_heads))
    groups = triton.cdiv(num_q_heads, heads) + triton.cdiv(num_kv_heads, heads)
    _qk_norm_rope_cache_kernel[(num_tokens, groups)](
        query, key, value, q_out, k_cache, v_cache, positions, slot_mapping, cos_sin_cache,
        query if q_norm is None else q_norm.weight, key if k_norm is None else k_norm.weight, scales.k, scales.v,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos_sin_cache.stride(0),
        scales.stride_b, scales.stride_t,
        num_q_heads, num_kv_heads, head_dim, cos_sin_cache.shape[1] // 2,
        0.0 if q_norm is None else q_norm.eps, 0.0 if k_norm is None else k_norm.eps,
        0.0 if q_norm is None else q_norm.offset, 0.0 if k_norm is None else k_norm.offset,
        HAS_Q_NORM=q_norm is not None, HAS_K_NORM=k_norm is not None,
        HAS_Q_OFFSET=q_norm is not None and q_norm.offset != 0.0,
        HAS_K_OFFSET=k_norm is not None and k_norm.offset != 0.0,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_D=block, HEADS=heads, IS_FP8=scales.is_fp8, IS_INT8=scales.is_int8,
        num_warps=min(16, max(heads, block // 256)),
        enable_fp_fusion=False,  # a * cos - b * sin as two rounded products, as the reference computes it
        **pdl_launch(query.device),
    )
    return q_out


def qk_norm_rope_cache_ref(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, cos_sin_cache: torch.Tensor, q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    if q_norm is not None:
        query = rms_norm_ref(query, q_norm.weight, q_norm.eps, q_norm.offset)
    if k_norm is not None:
        key = rms_norm_ref(key, k_norm.weight, k_norm.eps, k_norm.offset)
    query, key = rotary_embedding_ref(positions, query, key, cos_sin_cache)
    reshape_and_cache_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    return query


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
