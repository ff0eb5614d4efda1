"""EngineCore: the busy loop's body. step() = schedule -> execute -> update_from_output.

With async scheduling one step stays in flight: step() schedules and queues step N+1, then waits
for step N's tokens and updates the requests with them, so the host's work overlaps the device's.
The scheduler counts the tokens in flight (`num_output_placeholders`) and the worker feeds them to
step N+1 on the device; a request that stops at step N wastes one token of step N+1.

This file must only contain what every model and request needs: no tokenizer, no HTTP, no
model code. It runs in the caller's process (offline LLM) or in its own (server).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.tokenizer import load_tokenizer
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.protocol import EngineCoreOutput, EngineCoreOutputs, EngineRequest
from tokenmill.request import FinishReason, Request, RequestStatus
from tokenmill.scheduler.draft_budget import DraftBudget
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.worker.pending_output import PendingOutput, ReadyOutput
from tokenmill.worker.worker import Worker

logger = logging.getLogger(__name__)


class StepRunner(Protocol):
    """What the core needs of whatever runs its steps (the worker, or a fake in scheduler tests)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingOutput | ReadyOutput: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, worker: StepRunner, async_scheduling: bool,
                 grammars: GrammarCompiler | None = None) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.async_scheduling = async_scheduling
        self.grammars = grammars
        """Compiles structured outputs' grammars; None when the engine has no tokenizer."""
        self._awaiting_grammar: dict[str, tuple[Request, Future]] = {}
        """Requests whose grammar is compiling: the scheduler sees them once it is compiled."""
        self._in_flight: tuple[SchedulerOutput, PendingOutput | ReadyOutput] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, hf_config, max_model_len: int) -> EngineCore:
        """Load the model on its device, size and allocate the KV pool, and build the scheduler over it."""
        start = time.perf_counter()
        worker = Worker(config, hf_config, max_model_len)
        kv_cache_spec = worker.determine_kv_cache_spec()
        worker.initialize_cache(kv_cache_spec)
        kv_cache_manager = KVCacheManager(
            kv_cache_spec.num_blocks,
            config.cache_config.block_size,
            enable_caching=config.cache_config.enable_prefix_caching,
        )
        draft_budget = None
        if config.speculative_config is not None:
            spec = config.speculative_config
            draft_budget = DraftBudget(spec.num_speculative_tokens, worker.measure_step_cost(),
                                       spec.disable_by_batch_size, worker.max_verify_tokens)
        scheduler = Scheduler(config.scheduler_config, kv_cache_manager, max_model_len, draft_budget)
        async_scheduling = config.scheduler_config.async_scheduling
        if async_scheduling is None:
            async_scheduling = worker.device.type == "cuda"
        grammars = None
        if not config.model_config.skip_tokenizer_init:
            grammars = GrammarCompiler(lambda: load_tokenizer(config.model_config, hf_config), hf_config.vocab_size)
            worker.enable_structured_outputs(grammars)
        core = cls(scheduler, worker, async_scheduling, grammars)
        logger.info("engine ready in %.1f s", time.perf_counter() - start)
        return core

    def add_request(self, request: EngineRequest) -> None:
        structured = request.sampling_params.structured_outputs
        if structured is not None and self.grammars is None:
            raise ValueError("structured outputs need a tokenizer, and this engine has none")
        if request.request_id in self._awaiting_grammar:
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
            self._awaiting_grammar[request.request_id] = (core_request, self.grammars.submit(structured))
        else:
            self.scheduler.add_request(core_request)

    def abort_requests(self, request_ids: list[str], status=RequestStatus.FINISHED_ABORTED) -> None:
        for request_id in request_ids:
            self._awaiting_grammar.pop(request_id, None)
        self.scheduler.finish_requests(request_ids, status)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests() or self._in_flight is not None or bool(self._awaiting_grammar)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Hand the requests whose grammar is compiled to the scheduler; a failed compilation aborts its
        request (its output says so in the log; the frontend validated the spec, so this is rare)."""
        if not self.scheduler.has_requests() and self._in_flight is None:
            # Nothing else to do: wait for a compilation rather than spin.
            wait([future for _, future in self._awaiting_grammar.values()], timeout=0.05,
                 return_when=FIRST_COMPLETED)
        failed = []
        for request_id, (request, future) in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[request_id]
            if future.exception() is not None:
                logger.error("request %s: its grammar failed to compile: %s", request_id, future.exception())
                failed.append(EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT))
            else:
                self.scheduler.add_request(request)
        return failed

    def step(self) -> EngineCoreOutputs:
        failed = self._admit_compiled() if self._awaiting_grammar else []
        outputs = self._step()
        if failed:
            outputs.outputs = failed + outputs.outputs
        return outputs

    def _step(self) -> EngineCoreOutputs:
        launched = None
        if self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            launched = scheduler_output, self.worker.execute_model(scheduler_output)
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
