"""reshape_and_cache: write each new token's K and V into the paged pool at its slot.

Pool layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size
+ offset. A negative slot marks a padding token (CUDA-graph batches) whose K/V is not stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; < 0 skips the token
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 2048 else 2,
    )


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(kv_cache.dtype)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
