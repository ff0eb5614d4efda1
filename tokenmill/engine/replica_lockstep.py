"""The engine cores of data-parallel replicas whose MoE layers share out the experts step together.

Each MoE layer exchanges its tokens with every replica (layers.moe_all_to_all), so every core must run the
same number of forward passes: at each turn of its loop, every core says whether it has requests (an
all-reduce over the replicas); if any has, each core steps, and a core that had nothing to run (or whose
step launched no forward pass) exchanges each layer without tokens of its own, its experts still serving the
others'. While none has work the cores take turns every IDLE_POLL_S, waiting on their inputs in between, so a
request arriving at an idle engine waits at most that long for the others to join.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import get_replica_experts, init_replica_experts
from tokenmill.layers.moe_all_to_all import ExpertExchange
from tokenmill.layers.moe_routing import expert_range, routed_experts_of
from tokenmill.protocol import EngineCoreOutputs

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.01
"""How long an idle core waits on its inputs between turns (the others' new requests wait up to this)."""


def replicas_share_experts(config: EngineConfig, hf_config) -> bool:
    """Whether the data-parallel replicas share out the routed experts (and so step in lockstep):
    enable_expert_parallel over several replicas of one rank each, on a mixture-of-experts model. Refuses at
    start-up what cannot go with it yet."""
    parallel = config.parallel_config
    num_experts = routed_experts_of(hf_config)
    if not (parallel.enable_expert_parallel and parallel.data_parallel_size > 1 and num_experts):
        return False
    if parallel.world_size > 1:
        logger.info("expert parallelism within each replica's %d ranks; sharing the experts out over the replicas "
                    "takes one rank per replica (tensor and pipeline parallel size 1) for now", parallel.world_size)
        return False
    speculative = config.speculative_config
    if speculative is not None and speculative.method != "ngram":
        raise ValueError(f"speculative method {speculative.method!r} cannot go with enable_expert_parallel over "
                         f"{parallel.data_parallel_size} data-parallel replicas yet (its drafter's forward passes "
                         f"would not run in step across the replicas): use 'ngram', or one of the two alone")
    expert_range(num_experts, 0, parallel.data_parallel_size)  # raises if a replica would hold no expert
    return True


@dataclass(frozen=True)
class ReplicaRendezvous:
    """Where a replica's engine-core process joins the others (the frontend gives each its rank)."""
    rank: int
    size: int
    init_method: str
    """torch.distributed's init_method: a file of the frontend's private folder."""

    def join(self, config: EngineConfig) -> None:
        from tokenmill.worker.worker import resolve_device

        device = resolve_device(config.device_config.device)
        if device.type == "cuda":  # the replica's one GPU (its process sees only its own)
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        init_replica_experts(self.rank, self.size, self.init_method, device)


class ReplicaLockstep:
    def __init__(self, core) -> None:
        """`core`: this replica's EngineCore; from now on its MoE layers exchange tokens with the other replicas."""
        self.core = core
        self.group = get_replica_experts().host_group
        self._flag = torch.zeros(1, dtype=torch.int32)
        ExpertExchange.live = True

    def anyone_busy(self) -> bool:
        """Whether any replica has requests (every core calls it once a turn, together)."""
        self._flag.fill_(int(self.core.has_requests()))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._flag.item())

    def step(self) -> EngineCoreOutputs | None:
        """This core's step if it has requests, and one pass of the layers' exchanges in any case."""
        before = ExpertExchange.num_passes
        outputs = self.core.step() if self.core.has_requests() else None
        if ExpertExchange.num_passes == before:
            self.core.executor.exchange_experts_without_tokens()
        return outputs
