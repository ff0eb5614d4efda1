"""Rotary embedding (rotate-half / NeoX layout) of q and k in one launch, one program per token.

cos and sin come from the layer's float32 [max_position, rotary_dim] table (cos | sin halves); they
are rounded to the activation dtype and each product and sum is rounded as the torch layer does (compiled
without fused multiply-adds, so the result equals the torch reference bit for bit, as
kernels.qk_norm_rope_cache's does).
Dimensions past rotary_dim are copied unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_t, stride_h, num_heads, cos, sin, half, head_dim,
                  BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (offs[None, :] < half)
    src = x_ptr + token * stride_t + heads[:, None] * stride_h + offs[None, :]
    dst = out_ptr + (token * num_heads + heads[:, None]) * head_dim + offs[None, :]
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    a = (x1 * cos[None, :]).to(dtype).to(tl.float32)
    b = (x2 * sin[None, :]).to(dtype).to(tl.float32)
    c = (x2 * cos[None, :]).to(dtype).to(tl.float32)
    d = (x1 * sin[None, :]).to(dtype).to(tl.float32)
    tl.store(dst, (a - b).to(dtype), mask=mask)
    tl.store(dst + half, (c + d).to(dtype), mask=mask)
    if REST_PAD > 0:
        rest = tl.arange(0, REST_PAD)
        rest_mask = (heads[:, None] < num_heads) & (rest[None, :] < head_dim - 2 * half)
        src_rest = x_ptr + token * stride_t + heads[:, None] * stride_h + 2 * half + rest[None, :]
        dst_rest = out_ptr + (token * num_heads + heads[:, None]) * head_dim + 2 * half + rest[None, :]
        tl.store(dst_rest, tl.load(src_rest, mask=rest_mask), mask=rest_mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_k_heads, half, head_dim,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=offs < half, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + offs, mask=offs < half, other=0.0)
    sin = sin.to(dtype).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, half, head_dim,
                  BLOCK_HQ, HALF_PAD, REST_PAD)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, num_k_heads, cos, sin, half, head_dim,
                  BLOCK_HK, HALF_PAD, REST_PAD)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]; last stride 1
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]; last stride 1
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] float32: cos | sin
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of query and key (contiguous)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    half = cos_sin_cache.shape[1] // 2
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    rest = head_dim - 2 * half
    _rotary_kernel[(num_tokens,)](
        query, key, q_out, k_out, positions, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        num_q_heads, num_k_heads, half, head_dim,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_k_heads),
        HALF_PAD=triton.next_power_of_2(half), REST_PAD=triton.next_power_of_2(rest) if rest else 0,
        num_warps=4, enable_fp_fusion=False,
    )
    return q_out, k_out


def rotary_embedding_ref(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rotary_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].to(query.dtype).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    return rotate(query), rotate(key)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
