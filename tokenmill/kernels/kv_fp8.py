"""FP8 KV pool arithmetic in torch: what a float8_e4m3fn pool stores and reads back. The torch attention path
runs it, and it is the reference of the Triton kernels' in-register quantize / dequantize. Torch only (no
triton import): the CPU path imports it too.

A stored element is (x / scale) saturated to e4m3's ±448 (past it a cast may give NaN, which would poison
every score it touches); a read element is fp8 * scale. The scales are float32 0-d tensors, one K and one V
per attention layer.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x as the pool stores it: x / scale saturated to e4m3 for an fp8 pool, else x in the pool's dtype."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.to(torch.float32) / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored K or V read back in `dtype`: fp8 * scale for an fp8 pool, else a plain cast."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.to(torch.float32) * scale).to(dtype)


def kv_scales(
    kv_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The scale pointers a kernel takes (the pool itself as an unread placeholder unless it is fp8), and
    whether it is fp8."""
    if not is_fp8(kv_cache.dtype):
        return kv_cache, kv_cache, False
    if k_scale is None or v_scale is None:
        raise ValueError("an fp8 KV pool needs its k_scale and v_scale tensors")
    return k_scale, v_scale, True


def as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """A one-byte pool seen as uint8, for the copies torch has no float8 kernel for on the CPU (index_copy_)."""
    return pool.view(torch.uint8) if pool.element_size() == 1 else pool
