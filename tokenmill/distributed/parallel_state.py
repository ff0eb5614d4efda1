"""Tensor-parallel group membership and the collectives the layers call.

One process is rank 0 of a group of one until `init_distributed` joins it to a torch.distributed
group (gloo on the CPU, NCCL on CUDA; the executor starts one process per rank). The layers read
the rank and size when they are built, so the group must exist before the model is.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    backend: str | None = None
    """gloo | nccl; None for a group of one (no torch.distributed)."""


_TP_GROUP = TensorParallelGroup()


def get_tp_rank() -> int:
    return _TP_GROUP.rank


def get_tp_size() -> int:
    return _TP_GROUP.world_size


def get_tp_group() -> TensorParallelGroup:
    return _TP_GROUP


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device,
                     timeout_s: float = 600.0) -> None:
    """Join this process to the tensor-parallel group as `rank` (every rank of the group calls it).

    The whole world is the TP group for now; pipeline stages will split it."""
    global _TP_GROUP
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    _TP_GROUP = TensorParallelGroup(rank, world_size, backend)
    # NCCL makes its communicator at the first collective, which must not happen inside a CUDA graph
    # capture: one small all-reduce now, so every captured all-reduce finds it ready.
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != world_size:
        raise RuntimeError(f"tensor-parallel group check failed: all-reduce of ones gave {probe.item()}")


def destroy_distributed() -> None:
    global _TP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = TensorParallelGroup()


def abort_distributed() -> None:
    """Unblock collectives waiting for a rank that died (NCCL waits forever; gloo notices by itself)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if dist.is_initialized() and abort is not None:
        abort()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (captured by CUDA graphs under NCCL)."""
    if _TP_GROUP.world_size > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` [n, m] along the last dimension, in rank order -> [n, world_size * m]."""
    world_size = _TP_GROUP.world_size
    if world_size == 1:
        return x
    # One output tensor (not a list): a single NCCL call, which CUDA graphs capture.
    out = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous())
    return out.view(world_size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], world_size * x.shape[-1])


# all_gather_into_tensor was renamed all_gather_single (torch 2.13), the old name warning on every call.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
