"""Tensor-parallel group and pipeline-stage membership, and the collectives the layers call.

One process is rank 0 of a group of one until `init_distributed` joins it to a torch.distributed
world (gloo on the CPU, NCCL on CUDA; the executor starts one process per rank). The layers read
the rank and size, and the models their stage's layer range, when they are built, so the groups
must exist before the model is.

Rank layout for tp x pp ranks: global rank r is tensor-parallel rank r % tp of pipeline stage
pp - 1 - r // tp. Rank 0, the driver in the engine core's process, is thus on the last stage: it
samples and holds each step's whole output (logprobs, prompt logprobs) without a copy between processes.

Data-parallel replicas that share out a model's experts (config.ReplicaWorld) make one world instead:
replica d's rank r (the layout above within it) is global rank d * tp * pp + r (`init_replica_world`). Each
replica's stages keep their tensor-parallel groups and pass the residual stream and the sampled tokens
among the replica's own ranks (its driver is global rank d * tp * pp), and each stage's MoE layers send tokens
to the rank holding their experts among that stage's ranks of every replica, and back (layers.moe_all_to_all).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    backend: str | None = None
    """gloo | nccl; None without torch.distributed."""
    group: Any = None
    """The stage's torch.distributed group; None: the whole world (one stage), or no group at all."""


@dataclass(frozen=True)
class PipelineStage:
    stage: int = 0
    num_stages: int = 1
    rank: int = 0
    """This process's global rank."""
    tp_size: int = 1
    driver: int = 0
    """Global rank of the driver of this process's engine (its replica's first rank, when replicas share a world)."""
    group: Any = None
    """The torch.distributed group of this engine's ranks (None: the world), in which the driver broadcasts."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def peer(self, stage: int) -> int:
        """Global rank of this tensor-parallel rank's counterpart on `stage`."""
        return self.driver + (self.num_stages - 1 - stage) * self.tp_size + self.rank % self.tp_size


@dataclass(frozen=True)
class ReplicaExperts:
    """The ranks of data-parallel replicas whose MoE layers share out the routed experts: rank `rank` of the `size`
    ranks of this pipeline stage in every replica holds a contiguous range of them. size 1: no such world."""
    rank: int = 0
    size: int = 1
    group: Any = None
    """Those ranks' torch.distributed group (None: the world, with one pipeline stage)."""
    host_group: Any = None
    """A gloo group over the replicas' drivers (rank 0 of each) for the engine cores' per-step agreement."""


_TP_GROUP = TensorParallelGroup()
_PP_STAGE = PipelineStage()
_REPLICA_EXPERTS = ReplicaExperts()


_EXPERT_PARALLEL = False
"""Whether MoE layers built from now on spread whole experts over the TP ranks instead of slicing each one."""


def set_expert_parallel(enabled: bool) -> None:
    """The worker sets it from ParallelConfig.enable_expert_parallel before building the model."""
    global _EXPERT_PARALLEL
    _EXPERT_PARALLEL = bool(enabled)


def expert_parallel_enabled() -> bool:
    return _EXPERT_PARALLEL


def get_replica_experts() -> ReplicaExperts:
    return _REPLICA_EXPERTS


@contextlib.contextmanager
def experts_within_replica() -> Iterator[None]:
    """MoE layers built inside keep their experts within this replica's ranks, as without replicas sharing them out:
    a drafter's, whose forward passes run when its replica's step drafts, not in step with the other replicas."""
    global _REPLICA_EXPERTS
    shared = _REPLICA_EXPERTS
    _REPLICA_EXPERTS = ReplicaExperts()
    try:
        yield
    finally:
        _REPLICA_EXPERTS = shared


def init_replica_world(replica: int, num_replicas: int, init_method: str, local_rank: int, tp_size: int,
                       pp_size: int, device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the world of every rank of `num_replicas` data-parallel replicas of tp_size x pp_size ranks each, as
    rank `local_rank` (the layout of one engine's ranks) of replica `replica` (every rank of every replica calls
    it), before the model is built: its layers read the groups then."""
    global _TP_GROUP, _PP_STAGE, _REPLICA_EXPERTS
    engine_size = tp_size * pp_size
    world_size, driver = num_replicas * engine_size, replica * engine_size
    rank = driver + local_rank
    _TP_GROUP = _join_world(rank, world_size, init_method, device, timeout_s, tp_size)
    stage = pp_size - 1 - local_rank // tp_size
    # Every rank makes every group, in the same order (torch.distributed's rule).
    drivers = dist.new_group(list(range(0, world_size, engine_size)), backend="gloo")
    engine_group = experts_group = None
    if pp_size > 1:
        firsts = range(0, world_size, engine_size)
        engine_group = [dist.new_group(list(range(first, first + engine_size))) for first in firsts][replica]
        experts_group = [dist.new_group([first + (pp_size - 1 - s) * tp_size + t for first in firsts
                                         for t in range(tp_size)]) for s in range(pp_size)][stage]
    _PP_STAGE = PipelineStage(stage, pp_size, rank, tp_size, driver, engine_group)
    _REPLICA_EXPERTS = ReplicaExperts(replica * tp_size + local_rank % tp_size, num_replicas * tp_size,
                                      experts_group, drivers)


def get_tp_rank() -> int:
    return _TP_GROUP.rank


def get_tp_size() -> int:
    return _TP_GROUP.world_size


def get_tp_group() -> TensorParallelGroup:
    return _TP_GROUP


def get_pp_stage() -> PipelineStage:
    return _PP_STAGE


def get_pp_size() -> int:
    return _PP_STAGE.num_stages


def is_distributed() -> bool:
    """Whether this process is a rank of a running multi-rank engine."""
    return dist.is_initialized()


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device,
                     timeout_s: float = 600.0, tp_size: int | None = None) -> None:
    """Join this process to the world as global `rank` (every rank calls it): tensor-parallel groups of
    `tp_size` ranks (default: the whole world), one per pipeline stage."""
    global _TP_GROUP, _PP_STAGE
    tp_size = world_size if tp_size is None else tp_size
    if world_size % tp_size:
        raise ValueError(f"world size {world_size} is not a multiple of tensor_parallel_size {tp_size}")
    num_stages = world_size // tp_size
    _TP_GROUP = _join_world(rank, world_size, init_method, device, timeout_s, tp_size)
    _PP_STAGE = PipelineStage(num_stages - 1 - rank // tp_size, num_stages, rank, tp_size)


def _join_world(rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float,
                tp_size: int) -> TensorParallelGroup:
    """torch.distributed's world, and this rank's tensor-parallel group: its block of tp_size consecutive ranks
    (a pipeline stage, or a data-parallel replica; the world itself when it is one block)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    group = None
    if world_size > tp_size > 1:
        for first in range(0, world_size, tp_size):  # every rank makes every group, in the same order
            block_group = dist.new_group(list(range(first, first + tp_size)))
            if first <= rank < first + tp_size:
                group = block_group
    # NCCL makes its communicator at the first collective, which must not happen inside a CUDA graph
    # capture: one small all-reduce now (and one in the block's group), so every captured all-reduce finds
    # it ready.
    _check_group(world_size, None, device)
    if group is not None:
        _check_group(tp_size, group, device)
    return TensorParallelGroup(rank % tp_size, tp_size, backend, group)


def _check_group(size: int, group: Any, device: torch.device) -> None:
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe, group=group)
    if int(probe.item()) != size:
        raise RuntimeError(f"distributed group check failed: all-reduce of ones gave {probe.item()}, not {size}")


def destroy_distributed() -> None:
    global _TP_GROUP, _PP_STAGE, _REPLICA_EXPERTS
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = TensorParallelGroup()
    _PP_STAGE = PipelineStage()
    _REPLICA_EXPERTS = ReplicaExperts()


def abort_distributed() -> None:
    """Unblock collectives waiting for a rank that died (NCCL waits forever; gloo notices by itself)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if dist.is_initialized() and abort is not None:
        abort()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (captured by CUDA graphs under NCCL)."""
    if _TP_GROUP.world_size > 1:
        dist.all_reduce(x, group=_TP_GROUP.group)
    return x


def tp_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` [n, ...] stacked in rank order -> [world_size * n, ...]."""
    world_size = _TP_GROUP.world_size
    if world_size == 1:
        return x
    # One output tensor (not a list): a single NCCL call, which CUDA graphs capture.
    out = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=_TP_GROUP.group)
    return out


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` [n, m] along the last dimension, in rank order -> [n, world_size * m]."""
    world_size = _TP_GROUP.world_size
    if world_size == 1:
        return x
    out = tp_gather_rows(x)
    return out.view(world_size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], world_size * x.shape[-1])


# all_gather_into_tensor was renamed all_gather_single (torch 2.13), the old name warning on every call.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
