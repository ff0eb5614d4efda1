"""Several small host arrays in one host-to-device copy: a step's attention metadata or sampling
parameters travel in a single pinned, non-blocking transfer instead of one per array.

Every array starts 16-byte aligned in the packed buffer. Triton specialises kernels on pointer
alignment, so parts at offsets that moved with the batch size would compile new variants mid-run
(~1 s each); 16 bytes also suits every dtype's view.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGN_BYTES = 16


def pack_to_device(
    arrays: Sequence[np.ndarray], device: torch.device
) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """Returns the packed uint8 buffer on the device, each array's byte offset in it, and each
    array's view of it (its own dtype and shape)."""
    starts, size = [], 0
    for array in arrays:
        starts.append(size)
        size += -(-array.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    buffer = host.numpy()
    for array, start in zip(arrays, starts):
        buffer[start : start + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    packed = host.to(device, non_blocking=True)  # the caching host allocator keeps `host` until it is done
    views = [
        packed[start : start + array.nbytes].view(torch.from_numpy(array[:0]).dtype).view(array.shape)
        for array, start in zip(arrays, starts)
    ]
    return packed, starts, views


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host array on the device: through pinned memory and without blocking on a GPU, as is on the CPU."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
