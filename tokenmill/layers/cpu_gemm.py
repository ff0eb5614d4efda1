"""Linear layers on the CPU through prepacked weights: oneDNN's blocked layout, each weight reordered once (bfloat16
weights on CPUs with AMX: into layers.cpu_amx_gemm's tiles instead, which read faster at a decode step's rows and
match oneDNN up to the CPU's 512-token budget; float32 weights on CPUs with AVX-512, and bfloat16 ones on CPUs with
AVX512_BF16 but no AMX: into layers.cpu_panel_gemm's panels, 1.1-1.5x oneDNN at a decode step's rows and level at
a prefill's).

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

from tokenmill.layers.cpu_amx_gemm import AMXWeight, amx_applies, amx_linear, pack_amx
from tokenmill.layers.cpu_panel_gemm import PanelWeight, pack_panels, panel_applies, panel_linear

_PACKED_ATTR = "_tokenmill_packed_weight"  # pack_weight's copy, kept on the weight tensor


@functools.cache
def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def prepacked_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == x.dtype
            and weight.dim() == 2 and x.shape[0] > 0 and not torch.is_grad_enabled() and _onednn_available())


def pack_weight(weight: torch.Tensor) -> torch.Tensor | AMXWeight | PanelWeight | None:
    """A float32 or bfloat16 weight [n, k] reordered for packed_linear (needs no other copy): for bfloat16 on CPUs
    with AMX the AMX kernel's tiles (layers.cpu_amx_gemm), else on CPUs with AVX-512 (bfloat16: and AVX512_BF16)
    the panel kernel's panels (layers.cpu_panel_gemm), else oneDNN's opaque tensor; None where none takes it."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if amx_applies(weight):
        return pack_amx(weight)
    if panel_applies(weight):
        return pack_panels(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach()) if _onednn_available() else None


def packed_linear(x: torch.Tensor, packed: torch.Tensor | AMXWeight | PanelWeight, bias: torch.Tensor | None,
                  out_float32: bool = False) -> torch.Tensor:
    """x [m, k] (m > 0, the packed weight's dtype) @ weight.T + bias, from pack_weight's copy; in float32 where
    `out_float32` (written so by the AMX kernel, converted after oneDNN's)."""
    if isinstance(packed, AMXWeight):
        y = amx_linear(x, packed, torch.float32 if out_float32 else x.dtype)
        return y if bias is None else y + bias
    if isinstance(packed, PanelWeight):
        return panel_linear(x, packed, bias, out_float32)
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y.float() if out_float32 else y


def _packed(weight: torch.Tensor) -> torch.Tensor | AMXWeight | PanelWeight:
    cached = getattr(weight, _PACKED_ATTR, None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    packed = pack_weight(weight)
    setattr(weight, _PACKED_ATTR, (weight._version, packed))
    return packed


def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     out_float32: bool = False) -> torch.Tensor:
    """x @ weight.T + bias, as F.linear (in float32 where `out_float32`); check prepacked_linear_applies() first."""
    if x.dim() != 2:
        y = prepacked_linear(x.reshape(-1, x.shape[-1]), weight, bias, out_float32)
        return y.reshape(*x.shape[:-1], -1)
    return packed_linear(x, _packed(weight), bias, out_float32)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               out_float32: bool = False) -> torch.Tensor:
    """F.linear, through prepacked weights where that applies; in float32 where `out_float32`."""
    if prepacked_linear_applies(x, weight):
        return prepacked_linear(x, weight, bias, out_float32)
    y = F.linear(x, weight, bias)
    return y.float() if out_float32 else y
