"""Executor: what the engine core drives its steps through, however many ranks run them.

The core never builds a worker: it asks the executor to size and allocate the KV pool, then hands
it one SchedulerOutput per step and gets back that step's output with the `result()` contract
async scheduling relies on (result() waits for the tokens; execute_model returns before that).
Every rank runs every call; only the driver rank's (rank 0's: the last pipeline stage's) results come back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from transformers import PretrainedConfig

from tokenmill.config import EngineConfig
from tokenmill.kv_cache.sizing import KVCacheSpec
from tokenmill.layers.moe import check_expert_parallel
from tokenmill.scheduler.draft_budget import StepCost
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.worker.pending_output import PendingOutput, ReadyOutput
from tokenmill.worker.worker import Worker, num_local_devices, resolve_device


class Executor(ABC):
    driver_worker: Worker
    """Rank 0, in the engine core's process: its outputs are the engine's."""

    @property
    def device(self) -> torch.device:
        return self.driver_worker.device

    @property
    def max_verify_tokens(self) -> int:
        return self.driver_worker.max_verify_tokens

    @abstractmethod
    def determine_kv_cache_spec(self) -> KVCacheSpec:
        """The KV pool every rank can hold: the fewest blocks over the ranks (each rank's shape is the same)."""

    @abstractmethod
    def initialize_cache(self, spec: KVCacheSpec) -> None: ...

    @abstractmethod
    def measure_step_cost(self) -> StepCost: ...

    @abstractmethod
    def measure_prefill_cost(self) -> StepCost: ...

    @abstractmethod
    def enable_structured_outputs(self, compiler: GrammarCompiler) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingOutput | ReadyOutput:
        """Launch the step on every rank; result() on the return value waits for rank 0's output."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the other ranks' processes (if any); idempotent."""

    # Replicas that share out the experts (engine.replica_lockstep), on every rank:
    @abstractmethod
    def start_expert_exchanges(self) -> None:
        """From now on the MoE layers exchange tokens with the other replicas' ranks (the cores step together)."""

    @abstractmethod
    def exchange_experts_without_tokens(self) -> None:
        """A lockstep step without tokens of this replica's."""


class RankGroupExecutor(Executor):
    """An executor of several ranks: every set-up call runs on all of them (collective_rpc), rank 0's answer first."""

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """`method` of every rank's Worker with `args`; their results, rank 0's first."""

    def determine_kv_cache_spec(self) -> KVCacheSpec:
        return min(self.collective_rpc("determine_kv_cache_spec"), key=lambda spec: spec.num_blocks)

    def initialize_cache(self, spec: KVCacheSpec) -> None:
        self.collective_rpc("initialize_cache", spec)

    def measure_step_cost(self) -> StepCost:
        return self.collective_rpc("measure_step_cost")[0]

    def measure_prefill_cost(self) -> StepCost:
        return self.collective_rpc("measure_prefill_cost")[0]

    def start_expert_exchanges(self) -> None:
        self.collective_rpc("start_expert_exchanges")

    def exchange_experts_without_tokens(self) -> None:
        self.collective_rpc("exchange_experts_without_tokens")

    def enable_structured_outputs(self, compiler: GrammarCompiler) -> None:
        # Every rank must mask alike, since every rank samples (and must sample the same tokens): the others
        # get a compiler of their own (GrammarCompiler pickles as its recipe).
        self.collective_rpc("enable_structured_outputs", compiler)


def check_tensor_parallel(hf_config: PretrainedConfig, tp_size: int) -> None:
    """Refuse, at start-up, a model whose heads or features the ranks cannot split evenly."""
    if tp_size == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {heads} attention heads")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"tensor_parallel_size {tp_size} and the model's {kv_heads} key-value heads must divide "
                         f"one another (kv heads are split, or replicated when fewer than the ranks)")
    if hf_config.intermediate_size % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the MLP's intermediate size "
                         f"{hf_config.intermediate_size}")
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # MoE experts' MLPs
        size = getattr(hf_config, field, None)
        if size and size % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {field} {size}")


def check_pipeline_parallel(hf_config: PretrainedConfig, pp_size: int) -> None:
    """Refuse, at start-up, more pipeline stages than decoder layers (every stage holds at least one)."""
    if pp_size > hf_config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {hf_config.num_hidden_layers} "
                         "decoder layers: every stage needs at least one")


def make_executor(config: EngineConfig, hf_config: PretrainedConfig, max_model_len: int) -> Executor:
    parallel = config.parallel_config
    check_tensor_parallel(hf_config, parallel.tensor_parallel_size)
    check_pipeline_parallel(hf_config, parallel.pipeline_parallel_size)
    check_expert_parallel(hf_config, parallel)
    backend = choose_backend(config)
    if backend == "mp":
        from tokenmill.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, hf_config, max_model_len)
    if backend == "ray":
        return ray_executor_module().RayExecutor(config, hf_config, max_model_len)
    from tokenmill.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config, hf_config, max_model_len)


def ray_executor_module():
    """tokenmill.executor.ray_executor, or a ValueError saying how to install Ray."""
    try:
        from tokenmill.executor import ray_executor
    except ImportError as e:
        if (e.name or "").split(".")[0] != "ray":
            raise
        raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'tokenmill[ray]'") from None
    return ray_executor


def choose_backend(config: EngineConfig) -> str:
    """The configured backend, else vLLM's choice: mp when the ranks fit this node's devices, ray when they do
    not and a Ray cluster is running (the ranks then go to its nodes)."""
    parallel = config.parallel_config
    if parallel.distributed_executor_backend is not None:
        return parallel.distributed_executor_backend
    num_devices = num_local_devices(resolve_device(config.device_config.device))
    if num_devices is None or num_devices >= parallel.world_size:
        return "mp"
    try:
        from tokenmill.executor.ray_executor import ray_cluster_running
    except ImportError:
        ray_cluster_running = None
    if ray_cluster_running is not None and ray_cluster_running():
        return "ray"
    raise ValueError(f"{parallel.world_size} ranks (tensor_parallel_size x pipeline_parallel_size) need as many "
                     f"GPUs and this node has {num_devices}: start a Ray cluster over several nodes (`ray start "
                     f"--head`, then `ray start --address HEAD:6379` on the others; `pip install tokenmill[ray]`) "
                     f"or spread the ranks with --nnodes/--node-rank/--master-addr")
