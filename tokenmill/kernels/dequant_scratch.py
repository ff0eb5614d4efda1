"""One 16-bit scratch buffer per device, shared by every integer-weight layer, for its weight dequantized before a
dense GEMM (kernels.w4a16_gemm.dequant_int_gemm, large row counts).

Layers run one after another on one stream, and each layer's GEMM has read the buffer before the next layer's
dequantization writes it: one buffer the size of the largest layer's weight serves all of them. Each layer
reserves its size when its weights are repacked (layers.quant.w4a16), and the buffer is allocated at its first
use at the largest size reserved on that device: the profiled step (worker.profiling) counts it, and the CUDA
graphs, captured later, replay its address. As with kernels.arrivals' counters, it grows only outside a
capture and a replaced buffer stays allocated: a graph captured before the growth still writes into it.
"""

from __future__ import annotations

import torch

_reserved: dict[torch.device, int] = {}  # device -> the most elements a layer on it has asked for
# device -> its buffers (int16, viewed as the 16-bit dtype each call asks for), the current (largest) one last
_buffers: dict[torch.device, list[torch.Tensor]] = {}


def reserve_dequant_scratch(device: torch.device, numel: int) -> None:
    """A layer on `device` will dequantize `numel` weights at once: the buffer, when allocated, holds them."""
    _reserved[device] = max(_reserved.get(device, 0), numel)


def dequant_scratch(device: torch.device, dtype: torch.dtype, n: int, k: int) -> torch.Tensor:
    """A contiguous [n, k] tensor of `dtype` (16 bits) on `device`: the same memory call after call."""
    assert dtype.itemsize == 2, dtype
    buffers = _buffers.setdefault(device, [])
    if not buffers or buffers[-1].numel() < n * k:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"dequantizing a [{n}, {k}] weight needs a larger scratch buffer during a CUDA graph capture: "
                "reserve it when the layer loads (reserve_dequant_scratch) or run the shape eagerly first")
        buffers.append(torch.empty(max(n * k, _reserved.get(device, 0)), dtype=torch.int16, device=device))
    return buffers[-1][: n * k].view(dtype).view(n, k)
