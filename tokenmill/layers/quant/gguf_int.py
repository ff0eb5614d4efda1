"""GGUF blocks as the integer-weight layout (layers.quant.w4a16): what the GPU serves a GGUF from without a
16-bit copy.

Four GGML types are an integer times a per-32-weight scale, plus an offset, which is the (q - zero) * scale of
the integer kernels (kernels.w4a16_gemm) with group 32:
- Q4_0: 4-bit q, w = (q - 8) * d: the layout's symmetric midpoint.
- Q4_1: 4-bit q, w = q * d + m: zero = -m / d.
- Q8_0: signed 8-bit q, w = q * d: stored as q + 128, the 8-bit midpoint.
- Q4_K: 256-weight super-blocks of eight 32-weight sub-blocks, each with 6-bit scale and min multiplied by
  the super-block's d and dmin: w = (d * sc) * q - dmin * m, so scale = d * sc and zero = dmin * m / scale.
A fused layer's parts go in runs of one type, as on the CPU (layers.quant.gguf): each run of these types is one
integer GEMM writing its slice of the output, any other run (Q5_K, Q6_K, a float tensor) a dense GEMM on its
weights dequantized at load. Scales and zero points are kept in float32 (a Q4_1 / Q4_K zero point is a
ratio, not a small integer); such a block whose scale is 0 holds one value, kept as q = 0, scale 1 and
zero = -value. Q4_0 and Q8_0 have no zero point (the kernels' cheaper symmetric variant). The weights then
equal gguf's own dequantization up to float32 rounding. Q5_K and Q6_K (5 and 6 bits) have no 4-bit form and stay
dequantized at load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import use_triton
from tokenmill.kernels.dequant_scratch import reserve_dequant_scratch
from tokenmill.layers.quant.w4a16 import IntWeights, int_linear_torch, pack_int32

if TYPE_CHECKING:
    from tokenmill.layers.linear import LinearBase

INT_GGML_TYPES = {2: 4, 3: 4, 8: 8, 12: 4}
"""GGML type -> the integer layout's bits: Q4_0, Q4_1, Q8_0, Q4_K."""

GROUP = 32


def gguf_int_weights(raw: torch.Tensor, ggml_type: int, k: int) -> IntWeights:
    """A tensor's GGUF rows [n, row_bytes] uint8 -> q [n, k] unsigned, scale and zero [n, k / 32] float32."""
    blocks = raw.cpu().numpy()
    n = blocks.shape[0]
    if ggml_type == 12:
        q, scale, offset = _q4_k(blocks.reshape(n, k // 256, 144))
    else:
        size = {2: 18, 3: 20, 8: 34}[ggml_type]
        cells = blocks.reshape(n, k // GROUP, size)
        d = cells[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        if ggml_type == 8:
            q = cells[..., 2:].copy().view(np.int8).astype(np.int32) + 128
        else:
            body = cells[..., 4 if ggml_type == 3 else 2:]
            q = np.concatenate([body & 0x0F, body >> 4], axis=-1).astype(np.int32)  # low nibbles, then high
        if ggml_type != 3:  # symmetric about the layout's midpoint, 8 or 128
            return IntWeights(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d), None)
        scale, offset = d, cells[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return _as_int_weights(q.reshape(n, k), scale.reshape(n, -1), offset.reshape(n, -1))


def _q4_k(cells: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [n, blocks, 144] -> q [n, blocks, 256], scale and offset [n, blocks, 8]."""
    d = cells[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
    dmin = cells[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
    packed = cells[..., 4:16].astype(np.int32)  # eight 6-bit scales and eight 6-bit mins in 12 bytes
    sc = np.concatenate([packed[..., 0:4] & 63, (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], -1)
    qs = cells[..., 16:].reshape(*cells.shape[:-1], 4, 32)  # four chunks of 64 weights: low nibbles, then high
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*cells.shape[:-1], 256).astype(np.int32)
    return q, d * sc, -dmin * mn


def _as_int_weights(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> IntWeights:
    """w = q * scale + offset per 32-weight group -> (q - zero) * scale."""
    empty = scale == 0
    scale = np.where(empty, 1.0, scale).astype(np.float32)
    zero = (-offset / scale).astype(np.float32)
    q = np.where(np.repeat(empty, GROUP, axis=1), 0, q)
    return IntWeights(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero))


def runs_by_type(parts: list[tuple[int, torch.Tensor]]) -> list[tuple[int, list[torch.Tensor]]]:
    """A fused layer's parts [(GGML type, rows)] in order -> runs of consecutive parts of one type."""
    runs: list[tuple[int, list[torch.Tensor]]] = []
    for ggml_type, raw in parts:
        if runs and runs[-1][0] == ggml_type:
            runs[-1][1].append(raw)
        else:
            runs.append((ggml_type, [raw]))
    return runs


def hold_int_runs(layer: LinearBase, runs: list[tuple[int, list[torch.Tensor]]], dense) -> None:
    """Keep a layer's runs [(GGML type, its parts' rows)] on the default device: as the integer layout where the
    type has one, else dense (`dense(type, rows)` -> [n, k] in the layer's dtype). Sets layer.gguf_int_runs:
    per run (first output feature, features, bits or 0 for dense) and its tensors as the layer's parameters."""
    held = []
    offset = 0
    device = torch.get_default_device()
    for i, (ggml_type, pieces) in enumerate(runs):
        raw = torch.cat(pieces)
        bits = INT_GGML_TYPES.get(ggml_type, 0)
        if bits:
            w = gguf_int_weights(raw, ggml_type, layer.input_size)
            tensors = (pack_int32(w.q, bits, dim=1), w.scale, w.zero)
        else:
            tensors = (dense(ggml_type, raw),)
        for name, t in zip(("weight", "scale", "zero"), tensors):
            if t is not None:
                setattr(layer, f"gguf_{name}{i}", nn.Parameter(t.to(device).contiguous(), requires_grad=False))
        held.append((offset, raw.shape[0], bits, tuple(None if t is None else getattr(layer, f"gguf_{name}{i}")
                                                         for name, t in zip(("weight", "scale", "zero"), tensors))))
        if bits and getattr(layer, f"gguf_weight{i}").is_cuda:  # see layers.quant.w4a16: large row counts
            reserve_dequant_scratch(getattr(layer, f"gguf_weight{i}").device, raw.shape[0] * layer.input_size)
        offset += raw.shape[0]
    layer.gguf_int_runs = tuple(held)


def apply_int_runs(layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] through the layer's runs: the integer kernels on CUDA (the torch path elsewhere), dense GEMMs
    for the dense runs; no host syncs (CUDA graphs capture it)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    ys = []
    for _, _, bits, tensors in layer.gguf_int_runs:
        if not bits:
            ys.append(F.linear(x2, tensors[0]))
        elif use_triton(x2) and x2.dtype in (torch.bfloat16, torch.float16):
            from tokenmill.kernels.w4a16_gemm import int_weight_gemm

            ys.append(int_weight_gemm(x2, *tensors, None, bits))
        else:
            ys.append(int_linear_torch(x2, *tensors, None, bits, None))
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], y.shape[-1])
