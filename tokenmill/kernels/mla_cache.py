"""write_latent_cache: store each new token's MLA latent row [c_kv | k_pe] into the latent KV cache at its slot.

Cache layout per layer: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], slot = block * block_size
+ offset; a negative slot marks a padding token (CUDA-graph batches), not stored. c_kv (normed) and k_pe
(rotated) come in as the separate tensors the model has, so no concatenated copy is made. An fp8 cache stores
x / k_scale as reshape_and_cache does (its store_kv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.kv_fp8 import is_fp8, quantize_kv
from tokenmill.kernels.reshape_and_cache import store_kv


@triton.jit
def _write_latent_cache_kernel(
    c_kv_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr,
    stride_ct, stride_pt, stride_cb, stride_cs,
    latent_dim, rope_dim,
    BLOCK_SIZE: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, IS_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    offs_c = tl.arange(0, LATENT_PAD)
    c_mask = offs_c < latent_dim
    store_kv(row + offs_c, tl.load(c_kv_ptr + token * stride_ct + offs_c, mask=c_mask), k_scale_ptr, c_mask, IS_FP8)
    offs_p = tl.arange(0, ROPE_PAD)
    p_mask = offs_p < rope_dim
    store_kv(row + latent_dim + offs_p, tl.load(k_pe_ptr + token * stride_pt + offs_p, mask=p_mask), k_scale_ptr,
             p_mask, IS_FP8)


def write_latent_cache(
    c_kv: torch.Tensor,  # [num_tokens, kv_lora_rank], normed
    k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rotated
    cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; < 0 skips the token
    k_scale: torch.Tensor | None = None,  # [] float32: an fp8 cache's scale, unused otherwise
) -> None:
    num_tokens, latent_dim = c_kv.shape
    rope_dim = k_pe.shape[1]
    assert cache.shape[2] == latent_dim + rope_dim and cache.stride(2) == 1, (c_kv.shape, k_pe.shape, cache.shape)
    if num_tokens == 0:
        return
    if c_kv.stride(1) != 1:
        c_kv = c_kv.contiguous()
    if k_pe.stride(1) != 1:
        k_pe = k_pe.contiguous()
    fp8 = is_fp8(cache.dtype)
    if fp8 and k_scale is None:
        raise ValueError("an fp8 latent cache needs its k_scale")
    _write_latent_cache_kernel[(num_tokens,)](
        c_kv, k_pe, cache, slot_mapping, k_scale if fp8 else cache,
        c_kv.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        latent_dim, rope_dim,
        BLOCK_SIZE=cache.shape[1], LATENT_PAD=triton.next_power_of_2(latent_dim),
        ROPE_PAD=triton.next_power_of_2(rope_dim), IS_FP8=fp8, num_warps=2,
    )


def write_latent_cache_ref(c_kv: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                           k_scale: torch.Tensor | None = None) -> None:
    keep = slot_mapping >= 0
    latent = torch.cat([c_kv[keep], k_pe[keep]], dim=-1)
    cache.view(-1, cache.shape[2])[slot_mapping[keep].long()] = quantize_kv(latent, k_scale, cache.dtype)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
