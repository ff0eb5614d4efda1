"""Linear layers on the CPU through oneDNN, with each weight reordered once into oneDNN's blocked layout.

F.linear on the CPU calls MKL's sgemm, which on AMD CPUs takes a generic code path: on the 2-core EPYC
development machine it reaches ~80 GFLOP/s in float32 where oneDNN's prepacked kernels reach ~190
(BENCHMARKS.md, CPU section), and bfloat16 gains too. The reordered copy is made on a weight's first
use and kept on the weight tensor, so it costs as much memory again as the linear weights. It is made
anew when the weight's version counter moves (an in-place write through the parameter); writes through
`param.data`, as the weight loaders do, are not seen, which is fine since loading ends before the
first forward pass.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_PACKED_ATTR = "_tokenmill_onednn_weight"


@functools.cache
def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def prepacked_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == x.dtype
            and weight.dim() == 2 and x.shape[0] > 0 and not torch.is_grad_enabled() and _onednn_available())


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 or bfloat16 weight [n, k] reordered for packed_linear (an opaque oneDNN tensor that needs no
    other copy), or None where oneDNN cannot take it."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not _onednn_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] (m > 0, the packed weight's dtype) @ weight.T + bias, from pack_weight's copy."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed(weight: torch.Tensor) -> torch.Tensor:
    cached = getattr(weight, _PACKED_ATTR, None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    packed = pack_weight(weight)
    setattr(weight, _PACKED_ATTR, (weight._version, packed))
    return packed


def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias, as F.linear; check prepacked_linear_applies() first."""
    if x.dim() != 2:
        return prepacked_linear(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], -1)
    return packed_linear(x, _packed(weight), bias)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, through prepacked oneDNN weights where that applies."""
    if prepacked_linear_applies(x, weight):
        return prepacked_linear(x, weight, bias)
    return F.linear(x, weight, bias)
