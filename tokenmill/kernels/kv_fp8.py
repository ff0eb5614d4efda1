"""FP8 KV pool arithmetic in torch: what a float8_e4m3fn pool stores and reads back. The torch attention path
runs it, and it is the reference of the Triton kernels' in-register quantize / dequantize. Torch only (no
triton import): the CPU path imports it too.

A stored element is (x / scale) saturated to e4m3's ±448 (past it a cast may give NaN, which would poison
every score it touches); a read element is fp8 * scale. The scales are float32 0-d tensors, one K and one V
per attention layer. kv_scales also hands the Triton kernels an int8 pool's per-row scales (kernels.kv_int8).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenmill.kernels.kv_int8 import is_int8, scale_shape

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x as the pool stores it: x / scale saturated to e4m3 for an fp8 pool, else x in the pool's dtype."""
    assert not is_int8(dtype), "an int8 pool stores rows with scales of their own: kernels.kv_int8"
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.to(torch.float32) / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored K or V read back in `dtype`: fp8 * scale for an fp8 pool, else a plain cast."""
    assert not is_int8(x.dtype), "an int8 pool's rows read back with their own scales: kernels.kv_int8"
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.to(torch.float32) * scale).to(dtype)


class KVScaleArgs(NamedTuple):
    """What a kernel takes for a pool's scales: pointers (the pool itself, an unread placeholder, when it has
    none), its kind, and an int8 pool's scale strides per block and per slot (a KV head's is 1)."""

    k: torch.Tensor
    v: torch.Tensor
    is_fp8: bool
    is_int8: bool
    stride_b: int = 0
    stride_t: int = 0


def kv_scales(kv_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> KVScaleArgs:
    """The scale arguments of a kernel on `kv_cache`: an fp8 pool's per-layer scales (0-d), an int8 pool's
    per-row ones ([num_blocks, block_size, num_kv_heads], kernels.kv_int8), none for a model-dtype pool."""
    if is_int8(kv_cache.dtype):
        expected = scale_shape(*kv_cache.shape[1:4])
        for scale in (k_scale, v_scale):
            if scale is None or tuple(scale.shape) != expected or scale.stride(-1) != 1:
                raise ValueError(f"an int8 KV pool needs k_scale and v_scale of shape {expected} (last stride 1)")
        if k_scale.stride() != v_scale.stride():
            raise ValueError("an int8 KV pool's k_scale and v_scale must share their strides")
        return KVScaleArgs(k_scale, v_scale, False, True, k_scale.stride(0), k_scale.stride(1))
    if not is_fp8(kv_cache.dtype):
        return KVScaleArgs(kv_cache, kv_cache, False, False)
    if k_scale is None or v_scale is None:
        raise ValueError("an fp8 KV pool needs its k_scale and v_scale tensors")
    return KVScaleArgs(k_scale, v_scale, True, False)


def as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """A one-byte pool seen as uint8, for the copies torch has no float8 kernel for on the CPU (index_copy_)."""
    return pool.view(torch.uint8) if pool.element_size() == 1 else pool
