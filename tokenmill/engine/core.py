"""EngineCore: the busy loop's body. step() = schedule -> execute -> update_from_output.

With async scheduling one step stays in flight: step() schedules and queues step N+1, then waits
for step N's tokens and updates the requests with them, so the host's work overlaps the device's.
The scheduler counts the tokens in flight (`num_output_placeholders`) and the worker feeds them to
step N+1 on the device; a request that stops at step N wastes one token of step N+1.

Under pipeline parallelism up to one step per stage is in flight (micro-batches): step() queues step
N+1 while steps N-k+1..N run on the stages downstream, then updates from step N-k+1. The scheduler keeps
a request out of a step while an earlier one in flight computes its next token.

This file must only contain what every model and request needs: no tokenizer, no HTTP, no
model code. It runs in the caller's process (offline LLM) or in its own (server).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

from tokenmill.config import EngineConfig, SchedulerConfig
from tokenmill.engine.tokenizer import load_tokenizer
from tokenmill.executor.base import make_executor
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.protocol import EngineCoreOutput, EngineCoreOutputs, EngineRequest
from tokenmill.request import GRAMMAR_FAILED, FinishReason, Request, RequestStatus
from tokenmill.scheduler.draft_budget import DraftBudget
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.scheduler.token_budget import token_budget_for_step_time
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.grammar_process import GrammarProcessError
from tokenmill.structured.waiting import AwaitingGrammar
from tokenmill.worker.pending_output import PendingOutput, ReadyOutput

if TYPE_CHECKING:
    from tokenmill.engine.core_profiler import CoreProfiler

logger = logging.getLogger(__name__)


def grammar_failed(request_id: str, error: BaseException) -> EngineCoreOutput:
    """The output that ends a request whose grammar did not compile: finish_reason "error", the reason its stop_reason
    (the server answers a 400 with it); "abort" where the grammar process is gone (the engine's failure, not the
    request's: the frontend fails the whole request)."""
    if isinstance(error, GrammarProcessError):
        return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT)
    return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, stop_reason=f"{GRAMMAR_FAILED}: {error}")


class StepRunner(Protocol):
    """What the core needs of whatever runs its steps (the executor, or a fake in scheduler tests)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingOutput | ReadyOutput: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: StepRunner, async_scheduling: bool,
                 grammars: GrammarCompiler | None = None, num_batches_in_flight: int = 1) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = async_scheduling
        self.awaiting_grammar = AwaitingGrammar(grammars) if grammars is not None else None
        """Structured-output requests whose grammar is compiling: the scheduler sees them once it is compiled
        (None when the engine has no tokenizer, hence no grammars)."""
        self.max_steps_in_flight = max(num_batches_in_flight - 1, int(async_scheduling))
        """Steps left in flight when step() returns: 0 (synchronous), 1 (async scheduling) or one less than the
        pipeline's micro-batches."""
        self._in_flight: deque[tuple[SchedulerOutput, PendingOutput | ReadyOutput]] = deque()
        self.num_forward_passes = 0
        """Steps launched with tokens to compute, each one pass of the model's layers on every rank (the replica
        lockstep's count: engine.replica_lockstep)."""
        self.profiler: CoreProfiler | None = None
        """Set while a torch profiler trace is recorded (core_profiler.py): each step is then a named range."""

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
            long_prompt_len=kv_cache_spec.long_prompt_len,
        )
        draft_budget = None
        if config.speculative_config is not None:
            spec = config.speculative_config
            draft_budget = DraftBudget(spec.num_speculative_tokens, executor.measure_step_cost(),
                                       spec.disable_by_batch_size, executor.max_verify_tokens, spec.tree_level_sizes,
                                       spec.num_speculative_tokens - 1 if spec.drafts_after_verify else 0)
        num_batches = config.parallel_config.num_batches_in_flight
        # A prompt is computed while its grammar compiles where the compile has cores the forward pass leaves free.
        scheduler = Scheduler(_scheduler_config(config, executor), kv_cache_manager, max_model_len, draft_budget,
                              num_batches, compute_before_sampling=executor.device.type == "cuda")
        async_scheduling = config.scheduler_config.async_scheduling
        if async_scheduling is None:
            async_scheduling = executor.device.type == "cuda"
        grammars = None
        if not config.model_config.skip_tokenizer_init:
            # A partial, not a lambda: other ranks get the compiler pickled (as its recipe).
            grammars = GrammarCompiler(functools.partial(load_tokenizer, config.model_config, hf_config),
                                       hf_config.vocab_size)
            executor.enable_structured_outputs(grammars)
        core = cls(scheduler, executor, async_scheduling, grammars, num_batches)
        logger.info("engine ready in %.1f s", time.perf_counter() - start)
        return core

    def add_request(self, request: EngineRequest) -> None:
        structured = request.sampling_params.structured_outputs
        if structured is not None and self.awaiting_grammar is None:
            raise ValueError("structured outputs need a tokenizer, and this engine has none")
        core_request = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_ids=request.eos_token_ids,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            fork_of=request.fork_of,
            can_sample=structured is None,  # a structured request samples once its grammar is compiled
        )
        self.scheduler.add_request(core_request)
        if structured is not None:
            self.awaiting_grammar.add(core_request)

    def abort_requests(self, request_ids: list[str], status=RequestStatus.FINISHED_ABORTED) -> None:
        if self.awaiting_grammar is not None:
            self.awaiting_grammar.abort(request_ids)
        self.scheduler.finish_requests(request_ids, status)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests() or bool(self._in_flight)

    def step(self) -> EngineCoreOutputs:
        failed = {}
        if self.awaiting_grammar:
            ready, failed = self.awaiting_grammar.take_ready(idle=not self.scheduler.has_work()
                                                             and not self._in_flight)
            for request in ready:
                self.scheduler.allow_sampling(request.request_id)
            self.scheduler.finish_requests(list(failed), RequestStatus.FINISHED_ABORTED)
        try:
            outputs = self._step()
        except BaseException:  # KeyboardInterrupt too: Ctrl-C in a notebook, then the next generate()
            self._abandon_steps_in_flight()
            raise
        if failed:
            outputs.outputs = [grammar_failed(rid, error) for rid, error in failed.items()] + outputs.outputs
        return outputs

    def _abandon_steps_in_flight(self) -> None:
        """A step raised: the steps not updated never will be, and their requests were left half-stepped (tokens
        counted computed, a sample awaited). They end aborted, so that the scheduler does not match the next step's
        tokens to an abandoned step, or wait for their samples forever."""
        steps, requests = self.scheduler.steps_in_flight, self.scheduler.requests
        ids = [rid for step in steps for rid, (request, _) in step.items() if requests.get(rid) is request]
        steps.clear()
        self._in_flight.clear()
        self.abort_requests(ids)

    def _step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule() if self.scheduler.has_work() else None
        if self.profiler is None or scheduler_output is None:
            return self._run(scheduler_output)
        with self.profiler.step_region(scheduler_output):
            return self._run(scheduler_output)

    def _run(self, scheduler_output: SchedulerOutput | None) -> EngineCoreOutputs:
        """Launch the scheduled step (if any) and update the requests with the tokens of the finished one."""
        launched = None
        if scheduler_output is not None:
            launched = scheduler_output, self.executor.execute_model(scheduler_output)
            self.num_forward_passes += not scheduler_output.is_empty
        if launched is not None:
            self._in_flight.append(launched)
            if len(self._in_flight) <= self.max_steps_in_flight:
                return EngineCoreOutputs()  # the pipeline fills first
        outputs = self._update(self._in_flight.popleft() if self._in_flight else None)
        if not self.scheduler.has_requests():
            # Every request ended in the step just updated: those in flight only hold their extra tokens.
            while self._in_flight:
                self._update(self._in_flight.popleft())
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


def _scheduler_config(config: EngineConfig, executor) -> SchedulerConfig:
    """The scheduler's config, its token budget set from target_step_ms where that applies: on a GPU, one pipeline
    stage, chunked prefill (else a prompt must fit one step)."""
    sched = config.scheduler_config
    if sched.target_step_ms is None or executor.device.type != "cuda":
        return sched
    if not sched.enable_chunked_prefill or config.parallel_config.pipeline_parallel_size > 1:
        logger.info("token budget %d a step, fixed: target_step_ms needs chunked prefill and one pipeline stage",
                    sched.max_num_batched_tokens)
        return sched
    budget = token_budget_for_step_time(executor.measure_prefill_cost(), sched.target_step_ms / 1e3,
                                        sched.max_num_batched_tokens)
    logger.info("token budget %d a step: the prompt tokens this GPU computes in ~%g ms (target_step_ms; "
                "--max-num-batched-tokens sets a budget instead)", budget, sched.target_step_ms)
    return dataclasses.replace(sched, max_num_batched_tokens=budget)
