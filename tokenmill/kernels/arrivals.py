"""Arrival counters for kernels whose last program to arrive finishes the work of its group (split-KV decode
attention's combine, the sampler's draws and top-p verdicts).

One persistent, zeroed int32 buffer per device that every launch shares: each launch resets the counters it
used (the last arrival stores 0), so a launch needs no zero-fill of its own, and launches must not overlap on
different streams. The buffer only grows outside a CUDA graph capture: the eager run that precedes each
capture (worker/cuda_graph.py) grows it.
"""

from __future__ import annotations

import torch

# device -> its buffers, the current (largest) one last. A replaced buffer stays allocated: a CUDA graph
# captured before the growth still uses it.
_arrival_buffers: dict[torch.device, list[torch.Tensor]] = {}
_MIN_ARRIVALS = 4096  # 16 KiB: more than the automatic split choice ever needs (num_decodes * num_kv_heads < 2 * SMs)


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed int32 arrival counters on `device`: the same buffer launch after launch."""
    buffers = _arrival_buffers.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"a kernel needs {count} arrival counters during a CUDA graph capture but there are "
                f"{buffers[-1].numel() if buffers else 0}: run the same batch shape eagerly before capturing it")
        buffers.append(torch.zeros(max(count, _MIN_ARRIVALS), dtype=torch.int32, device=device))
    return buffers[-1]
