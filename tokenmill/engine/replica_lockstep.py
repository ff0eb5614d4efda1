"""The engine cores of data-parallel replicas whose MoE layers share out the experts step together.

Each MoE layer exchanges its tokens with every rank of every replica (layers.moe_all_to_all), so every core
must run the same number of forward passes: at each turn of its loop, every core says whether it has requests
(an all-reduce over the replicas' drivers); if any has, each core steps, and a core that had nothing to run (or
whose step launched no forward pass) has its ranks exchange each layer without tokens of their own, their
experts still serving the others'. With pipeline stages, each stage's ranks exchange with the same stage's of
the other replicas: a turn's pass (with tokens or without) reaches every stage in launch order, so each stage's
k-th exchange is every replica's k-th pass. While none has work the cores take turns every IDLE_POLL_S, waiting on
their inputs in between; the frontend wakes the other replicas' cores when it sends one a request, so that they
join its first turn at once (the periodic turn remains, so that no core waits for a wake that raced its turn).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig, ReplicaWorld
from tokenmill.distributed.parallel_state import get_replica_experts
from tokenmill.executor.base import choose_backend, ray_executor_module
from tokenmill.layers.moe_routing import expert_range, routed_experts_of
from tokenmill.protocol import EngineCoreOutputs

IDLE_POLL_S = 0.01
"""How long an idle core waits on its inputs between turns (the others' new requests wait up to this)."""


def replicas_share_experts(config: EngineConfig, hf_config) -> bool:
    """Whether the data-parallel replicas share out the routed experts (and so step in lockstep):
    enable_expert_parallel over several replicas, on a mixture-of-experts model. Refuses at start-up a rank left
    without an expert."""
    parallel = config.parallel_config
    num_experts = routed_experts_of(hf_config)
    if not (parallel.enable_expert_parallel and parallel.data_parallel_size > 1 and num_experts):
        return False
    expert_range(num_experts, 0, parallel.data_parallel_size * parallel.tensor_parallel_size)  # a rank without any
    return True


def replica_configs(config: EngineConfig, folder: str, start: int) -> list[EngineConfig]:
    """Each data-parallel replica's config when they share out the experts, for their `start`-th start (0: the
    first): its place in their world, which meets somewhere new at each start; the backend of its ranks, chosen
    here once for all the replicas; and no CUDA graphs (an exchange's sizes change every step and are read on the
    host). The ranks meet in a file of the server's private `folder` when they all run on this host, and at a TCP
    store on this node (replica 0's driver serves it) when some are Ray actors, which may be on other nodes."""
    parallel, device = config.parallel_config, config.device_config
    backend = choose_backend(config)
    if backend == "ray":
        init_method = ray_executor_module().tcp_rendezvous()
    else:
        init_method = f"file://{os.path.join(folder, f'world-{start}')}"
    return [config.with_parts(
        device_config=dataclasses.replace(device, enforce_eager=True),
        parallel_config=dataclasses.replace(
            parallel, distributed_executor_backend=backend,
            replica_world=ReplicaWorld(replica, parallel.data_parallel_size, init_method)))
        for replica in range(parallel.data_parallel_size)]


class ReplicaLockstep:
    def __init__(self, core) -> None:
        """`core`: this replica's EngineCore; from now on its MoE layers exchange tokens with the other replicas."""
        self.core = core
        self.group = get_replica_experts().host_group
        self._flag = torch.zeros(1, dtype=torch.int32)
        core.executor.start_expert_exchanges()

    def anyone_busy(self) -> bool:
        """Whether any replica has requests (every core calls it once a turn, together)."""
        self._flag.fill_(int(self.core.has_requests()))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._flag.item())

    def step(self) -> EngineCoreOutputs | None:
        """This core's step if it has requests, and one pass of the layers' exchanges in any case."""
        before = self.core.num_forward_passes
        outputs = self.core.step() if self.core.has_requests() else None
        if self.core.num_forward_passes == before:
            self.core.executor.exchange_experts_without_tokens()
        return outputs
