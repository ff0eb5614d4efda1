"""INT8 KV pool arithmetic in torch (kv_cache_dtype int8): what an int8 pool stores and reads back. The torch
attention path runs it, and it is the reference of the Triton kernels' in-register quantize / dequantize.
Torch only (no triton import): the CPU path imports it too.

Each (token, KV head) row of K and of V is quantized on its own, symmetrically: scale = absmax / 127 (float32,
kept beside the pool at the row's slot and head), stored = round(x / scale), ties to even. No calibration: the
scale follows each row. A row of zeros gets scale 0 and stores zeros. A read element is int8 * scale.
"""

from __future__ import annotations

import torch

INT8_DTYPE = torch.int8
INT8_MAX = 127.0
SCALE_DTYPE = torch.float32


def is_int8(dtype: torch.dtype) -> bool:
    return dtype == INT8_DTYPE


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 [..., head_dim], float32 scales [...]): each row over its own absmax."""
    x = x.to(torch.float32)
    absmax = x.abs().amax(dim=-1)
    # A tensor divisor: CUDA torch divides by a Python scalar as a multiply by its reciprocal, which is not the
    # IEEE quotient the Triton writers (and torch on the CPU) compute.
    scale = absmax / torch.full_like(absmax, INT8_MAX)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / divisor.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(INT8_DTYPE), scale


def dequantize_rows(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows x [..., head_dim] with their scales [...] read back in `dtype`."""
    return (x.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def scale_shape(num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
    """One layer's K (or V) scales: one per slot and KV head, laid out as the pool's rows are, so that a block's
    scales go wherever its K/V go (block ids index both)."""
    return (num_blocks, block_size, num_kv_heads)
