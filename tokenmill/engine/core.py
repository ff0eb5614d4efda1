"""EngineCore: the busy loop's body. step() = schedule -> execute -> update_from_output.

With async scheduling one step stays in flight: step() schedules and queues step N+1, then waits
for step N's tokens and updates the requests with them, so the host's work overlaps the device's.
The scheduler counts the tokens in flight (`num_output_placeholders`) and the worker feeds them to
step N+1 on the device; a request that stops at step N wastes one token of step N+1.

This file must only contain what every model and request needs: no tokenizer, no HTTP, no
model code. It runs in the caller's process (offline LLM) or in its own (server).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.tokenizer import load_tokenizer
from tokenmill.executor.base import make_executor
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.protocol import EngineCoreOutput, EngineCoreOutputs, EngineRequest
from tokenmill.request import FinishReason, Request, RequestStatus
from tokenmill.scheduler.draft_budget import DraftBudget
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.waiting import AwaitingGrammar
from tokenmill.worker.pending_output import PendingOutput, ReadyOutput

logger = logging.getLogger(__name__)


class StepRunner(Protocol):
    """What the core needs of whatever runs its steps (the executor, or a fake in scheduler tests)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingOutput | ReadyOutput: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: StepRunner, async_scheduling: bool,
                 grammars: GrammarCompiler | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = async_scheduling
        self.awaiting_grammar = AwaitingGrammar(grammars) if grammars is not None else None
        """Structured-output requests whose grammar is compiling: the scheduler sees them once it is compiled
        (None when the engine has no tokenizer, hence no grammars)."""
        self._in_flight: tuple[SchedulerOutput, PendingOutput | ReadyOutput] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, hf_config, max_model_len: int) -> EngineCore:
        """Load the model on its device, size and allocate the KV pool, and build the scheduler over it."""
        start = time.perf_counter()
        executor = make_executor(config, hf_config, max_model_len)
        try:
            return cls._build(config, hf_config, max_model_len, executor, start)
        except BaseException:
            executor.shutdown()
            raise

    @classmethod
    def _build(cls, config: EngineConfig, hf_config, max_model_len: int, executor, start: float) -> EngineCore:
        kv_cache_spec = executor.determine_kv_cache_spec()
        executor.initialize_cache(kv_cache_spec)
        kv_cache_manager = KVCacheManager(
            kv_cache_spec.num_blocks,
            config.cache_config.block_size,
            enable_caching=config.cache_config.enable_prefix_caching,
        )
        draft_budget = None
        if config.speculative_config is not None:
            spec = config.speculative_config
            draft_budget = DraftBudget(spec.num_speculative_tokens, executor.measure_step_cost(),
                                       spec.disable_by_batch_size, executor.max_verify_tokens)
        scheduler = Scheduler(config.scheduler_config, kv_cache_manager, max_model_len, draft_budget)
        async_scheduling = config.scheduler_config.async_scheduling
        if async_scheduling is None:
            async_scheduling = executor.device.type == "cuda"
        grammars = None
        if not config.model_config.skip_tokenizer_init:
            # A partial, not a lambda: other ranks get the compiler pickled (as its recipe).
            grammars = GrammarCompiler(functools.partial(load_tokenizer, config.model_config, hf_config),
                                       hf_config.vocab_size)
            executor.enable_structured_outputs(grammars)
        core = cls(scheduler, executor, async_scheduling, grammars)
        logger.info("engine ready in %.1f s", time.perf_counter() - start)
        return core

    def add_request(self, request: EngineRequest) -> None:
        structured = request.sampling_params.structured_outputs
        if structured is not None and self.awaiting_grammar is None:
            raise ValueError("structured outputs need a tokenizer, and this engine has none")
        if self.awaiting_grammar is not None and request.request_id in self.awaiting_grammar:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        core_request = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_ids=request.eos_token_ids,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            fork_of=request.fork_of,
        )
        if structured is not None:
            self.awaiting_grammar.add(core_request)
        else:
            self.scheduler.add_request(core_request)

    def abort_requests(self, request_ids: list[str], status=RequestStatus.FINISHED_ABORTED) -> None:
        if self.awaiting_grammar is not None:
            self.awaiting_grammar.abort(request_ids)
        self.scheduler.finish_requests(request_ids, status)

    def has_requests(self) -> bool:
        return (self.scheduler.has_requests() or self._in_flight is not None
                or bool(self.awaiting_grammar))

    def step(self) -> EngineCoreOutputs:
        failed = []
        if self.awaiting_grammar:
            ready, failed = self.awaiting_grammar.take_ready(idle=not self.scheduler.has_requests()
                                                             and self._in_flight is None)
            for request in ready:
                self.scheduler.add_request(request)
        outputs = self._step()
        if failed:  # the frontend fails the whole request (all its samples)
            outputs.outputs = [EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT) for rid in failed] + \
                outputs.outputs
        return outputs

    def _step(self) -> EngineCoreOutputs:
        launched = None
        if self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            launched = scheduler_output, self.executor.execute_model(scheduler_output)
        if not self.async_scheduling:
            return self._update(launched)
        finished, self._in_flight = self._in_flight, launched
        outputs = self._update(finished)
        if not self.scheduler.has_requests():
            # Every request ended in the step just updated: the one in flight only holds their extra tokens.
            self._update(self._in_flight)
            self._in_flight = None
        return outputs

    def _update(self, step: tuple[SchedulerOutput, PendingOutput | ReadyOutput] | None) -> EngineCoreOutputs:
        """Wait for a launched step's tokens and hand them to the scheduler."""
        if step is None:
            return EngineCoreOutputs()
        scheduler_output, pending = step
        return self.scheduler.update_from_output(scheduler_output, pending.result())

    def shutdown(self) -> None:
        """Stop the executor's other processes (tensor-parallel ranks), if it has any."""
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()
