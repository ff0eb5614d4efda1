"""UniProcExecutor: one rank, in the engine core's own process; each call goes straight to the worker."""

from __future__ import annotations

from transformers import PretrainedConfig

from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import is_distributed
from tokenmill.executor.base import Executor
from tokenmill.kv_cache.sizing import KVCacheSpec
from tokenmill.scheduler.draft_budget import StepCost
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, max_model_len: int) -> None:
        if is_distributed():
            # The layers read the process-wide groups when built: this model would be sharded or staged.
            raise RuntimeError("a tensor- or pipeline-parallel engine is running in this process: shut it down "
                               "first")
        self.driver_worker = Worker(config, hf_config, max_model_len)
        # No wrapper on the hot path: the core calls the worker's own method.
        self.execute_model = self.driver_worker.execute_model

    def determine_kv_cache_spec(self) -> KVCacheSpec:
        return self.driver_worker.determine_kv_cache_spec()

    def initialize_cache(self, spec: KVCacheSpec) -> None:
        self.driver_worker.initialize_cache(spec)

    def measure_step_cost(self) -> StepCost:
        return self.driver_worker.measure_step_cost()

    def measure_prefill_cost(self) -> StepCost:
        return self.driver_worker.measure_prefill_cost()

    def enable_structured_outputs(self, compiler: GrammarCompiler) -> None:
        self.driver_worker.enable_structured_outputs(compiler)

    def execute_model(self, scheduler_output):  # replaced per instance by the worker's bound method
        return self.driver_worker.execute_model(scheduler_output)

    def start_expert_exchanges(self) -> None:
        self.driver_worker.start_expert_exchanges()

    def exchange_experts_without_tokens(self) -> None:
        self.driver_worker.exchange_experts_without_tokens()

    def shutdown(self) -> None:
        pass  # nothing runs outside this process
