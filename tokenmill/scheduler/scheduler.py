"""Token-budget scheduler: continuous batching with chunked prefill and recompute preemption.

There are no prefill or decode phases. Every request has `num_computed_tokens` and `num_tokens`;
each step the scheduler hands out a token budget to close that gap, running requests first
(decodes and unfinished prefill chunks), then waiting ones in queue order. When the KV cache is
full, the lowest-priority running request is preempted: its blocks are freed and it is recomputed
later from its prompt and the tokens it had already generated.

A step that reaches the end of a request's tokens may also give it lookahead: room (budget and KV
slots) for up to k draft tokens that the worker's proposer fills and one forward pass verifies
(speculative decoding). Such a step emits 1 to k + 1 tokens; plain decoding is k = 0. While a step is
in flight its request's counters assume every draft is accepted (`num_computed_tokens` and
`num_output_placeholders` are upper bounds); the update takes back what was not.

Pipeline micro-batches (`num_batches_in_flight` > 1): several steps are in flight, one per stage, and a
request whose next token one of them computes sits out the next ones (its prompt chunks need no token: they
may follow each other); the requests are spread evenly over the batches so that every stage has work.

This file must only contain what every request and model needs; rarer features live behind their
own modules and touch it in a few lines at most.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache.manager import NO_HIT, ComputedBlocks, KVCacheManager
from tokenmill.protocol import EngineCoreOutput, EngineCoreOutputs, SchedulerStats, SpecDecodingStats
from tokenmill.request import Request, RequestStatus, finish_reason_of
from tokenmill.scheduler.draft_budget import DraftBudget, can_draft
from tokenmill.scheduler.forks import PendingForks
from tokenmill.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenmill.scheduler.request_queue import make_request_queue
from tokenmill.scheduler.sampling_gate import SamplingGate
from tokenmill.scheduler.stop import check_stop, reaches_length


class SchedulerStalledError(RuntimeError):
    """A step scheduled nothing while requests wait and no step is in flight: nothing can ever change,
    so the engine would spin forever. Always a bug; raised rather than hidden."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 draft_budget: DraftBudget | None = None, num_batches_in_flight: int = 1,
                 compute_before_sampling: bool = True) -> None:
        """`compute_before_sampling`: a request that may not sample yet has its prompt computed meanwhile
        (scheduler/sampling_gate.py); False: it waits whole."""
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            # A prompt longer than one step's budget could then never be scheduled.
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must be at "
                f"least max_model_len ({max_model_len}): raise it, lower max_model_len or enable chunked prefill"
            )
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.max_chunk_tokens = config.long_prefill_token_threshold or config.max_num_batched_tokens
        """Most tokens a request computes in one step, its drafts aside (long_prefill_token_threshold)."""
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.waiting = make_request_queue(config.policy)
        self.running: list[Request] = []
        self.finished_request_ids: set[str] = set()
        """Requests that left since the last schedule(); the worker must drop their state."""
        self.forks = PendingForks()
        self.gate = SamplingGate(kv_cache_manager.block_size, compute_before_sampling)
        self.draft_budget = draft_budget
        """None: no speculative decoding, no lookahead."""
        self.num_batches_in_flight = num_batches_in_flight
        self.spec_stats = SpecDecodingStats()
        self.steps_in_flight: deque[dict[str, tuple[Request, int]]] = deque()
        """The requests of each scheduled step not yet updated, with the lookahead each was given, oldest
        first: every schedule() gets its update_from_output(), in order. Outputs go to these objects,
        since an id aborted while its step ran may already name a new request."""
        self.num_preemptions = 0
        self.queue_times: list[float] = []
        """Arrival-to-first-scheduling seconds not yet reported in stats."""

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.arrival_order = next(self._arrivals)
        self.gate.added(request)
        leader = self.requests.get(request.fork_of) if request.fork_of is not None else None
        if not self.forks.hold(request, leader):
            self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif not self.forks.is_held(request) and request.request_id not in self.gate.parked:
                self.waiting.remove(request)
            self._finish(request, status)

    def allow_sampling(self, request_id: str) -> None:
        """A request's next token may be sampled from now on (its grammar compiled); unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is not None and (parked := self.gate.open(request)) is not None:
            self.waiting.add(parked)

    def has_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.gate.parked)

    def has_work(self) -> bool:
        """Whether a step now would compute anything: not when every request waits to be allowed to sample."""
        return self.has_requests() and not self.gate.all_waiting(self.running, len(self.waiting))

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_requests: list[NewRequestData] = []
        cached_requests: list[CachedRequestData] = []
        lookahead: dict[str, int] = {}
        num_preemptions_before = self.num_preemptions
        drafts_per_request = self.draft_budget.drafts_per_request(len(self.running)) if self.draft_budget else 0

        max_num_reqs = self._max_reqs_per_batch()
        for request in list(self.running):
            if budget == 0 or len(num_scheduled) == max_num_reqs:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room
            if request.num_output_placeholders and (self.num_batches_in_flight > 1 or reaches_length(
                request, self.max_model_len, request.num_output_placeholders
            )):
                continue  # a micro-batch in flight computes its next token, or the step in flight its last one
            num_left = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            num_new = min(num_left, budget, self.max_chunk_tokens)
            if (room := self.gate.room(request, request.num_computed_tokens)) is not None:
                if room <= 0:
                    continue  # its prompt's tail waits until it may sample
                num_new = min(num_new, room)
            num_drafts = (self._lookahead(request, num_new == num_left, budget - num_new, drafts_per_request)
                          if drafts_per_request else 0)
            num_slots = num_new + num_drafts + self._slots_ahead(request, num_new + num_drafts, num_drafts)
            new_block_ids = self._allocate_or_preempt(request, num_slots, num_scheduled, cached_requests, lookahead)
            if new_block_ids is None:
                continue
            cached_requests.append(CachedRequestData(request.request_id, new_block_ids))
            num_scheduled[request.request_id] = num_new + num_drafts
            if num_drafts:
                lookahead[request.request_id] = num_drafts
            budget -= num_new + num_drafts
        # Their new full blocks enter the prefix cache only now that no preemption can unschedule them.
        for request_id, num_new in num_scheduled.items():
            request = self.requests[request_id]
            # Known tokens only (cache_blocks stops at num_tokens): drafts may still be rejected.
            self.kv.cache_blocks(request, request.num_computed_tokens + num_new)
        # Preemption may have handed back budget; recount from what is actually scheduled.
        budget = self.config.max_num_batched_tokens - sum(num_scheduled.values())
        # After a preemption the cache is full: admitting more would only thrash it.
        if self.num_preemptions > num_preemptions_before:
            budget = 0

        while (len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(num_scheduled) < max_num_reqs):
            request = self.waiting.peek()
            if request.num_output_placeholders:
                # Preempted with a token in flight: it gets it back in update_from_output, after which it may
                # start again (admission is closed in the step that preempted it; more micro-batches may follow).
                break
            # Waiting requests hold no blocks: what running requests free is always enough to admit one.
            assert request.num_computed_tokens == 0
            computed = self._get_computed_blocks(request)
            num_left = request.num_tokens - computed.num_tokens
            num_new = min(num_left, self.max_chunk_tokens)  # the cap counts the tokens after the cached prefix
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            reaches_end = num_new == num_left and num_new <= budget
            if (room := self.gate.room(request, computed.num_tokens)) is not None:
                # (Without chunked prefill its prompt waits whole, as one step's.)
                if room <= 0 or not self.config.enable_chunked_prefill:
                    self.gate.park(self.waiting.pop())  # nothing to compute until it may sample
                    continue
                reaches_end = False
                num_new = min(num_new, room)
            num_drafts = (self._lookahead(request, reaches_end, budget - num_new, drafts_per_request)
                          if drafts_per_request else 0)
            num_new = min(num_new, budget)
            slots_ahead = self._slots_ahead(request, computed.num_tokens + num_new + num_drafts, num_drafts)
            if self.kv.allocate_slots(request, num_new + num_drafts + slots_ahead, computed) is None:
                break
            self.waiting.pop()
            self.forks.admitted(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens += computed.num_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = request.num_computed_tokens  # prefix-cache hit or forked prompt
                self.queue_times.append(time.time() - request.arrival_time)
            self.running.append(request)
            # No preemption follows in this step: later admissions may share these blocks at once.
            self.kv.cache_blocks(request, request.num_computed_tokens + num_new)
            new_requests.append(
                NewRequestData(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids,
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv.get_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    eos_token_ids=request.eos_token_ids,
                )
            )
            num_scheduled[request.request_id] = num_new + num_drafts
            if num_drafts:
                lookahead[request.request_id] = num_drafts
            budget -= num_new + num_drafts

        # Decodes first in the batch: running requests were scheduled before waiting ones.
        output = SchedulerOutput(
            new_requests=new_requests,
            cached_requests=cached_requests,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_request_ids=self.finished_request_ids,
            block_copies=self.kv.take_block_copies(),
            num_lookahead_tokens=lookahead,
        )
        self.finished_request_ids = set()
        if not num_scheduled and not any(self.steps_in_flight) and self.has_requests() and not self.gate.num_closed:
            raise SchedulerStalledError(self._describe_stall())
        self.steps_in_flight.append(
            {request_id: (self.requests[request_id], lookahead.get(request_id, 0)) for request_id in num_scheduled})
        for request_id, num_new in num_scheduled.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_new
            num_drafts = lookahead.get(request_id, 0)
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders + num_drafts:
                # This step samples the request's next token, and up to one more per draft.
                request.num_output_placeholders += 1 + num_drafts
            for follower in self.forks.release_followers(request):
                self.waiting.add_preempted(follower)  # to the front: each has one token to compute
        return output

    def _max_reqs_per_batch(self) -> int:
        """One micro-batch's share of the requests (all of them without micro-batches)."""
        num_reqs = len(self.running) + len(self.waiting)
        return -(-num_reqs // self.num_batches_in_flight)

    def _lookahead(self, request: Request, reaches_end: bool, budget_left: int, drafts_per_request: int) -> int:
        """Draft tokens a request may have verified in this step: only when the step reaches the end of its
        tokens, within the budget, and never past max_tokens or max_model_len (drafts there are wasted)."""
        if not reaches_end or not can_draft(request.sampling_params):
            return 0
        params = request.sampling_params
        max_tokens = self.max_model_len if params.max_tokens is None else params.max_tokens
        in_flight = request.num_output_placeholders
        room_slots = self.max_model_len - request.num_tokens - in_flight - 1
        room = min(max_tokens - request.num_output_tokens - in_flight - 1, room_slots)
        # A tree's nodes need slots beyond the tokens its deepest path can emit (any first nodes form a tree).
        return max(0, min(self.draft_budget.num_slots(min(drafts_per_request, room)), budget_left, room_slots))

    def _slots_ahead(self, request: Request, num_new: int, num_drafts: int) -> int:
        """KV slots past a verifying step's `num_new` tokens where its proposer drafts the next step's chain right
        away (DraftBudget.slots_ahead), within max_model_len."""
        if not num_drafts or not self.draft_budget.slots_ahead:
            return 0
        room = self.max_model_len - request.num_computed_tokens - num_new
        return max(0, min(self.draft_budget.slots_ahead, room))

    def _describe_stall(self) -> str:
        head = self.waiting.peek() if len(self.waiting) else None
        return (
            f"the scheduler made no progress: {len(self.running)} running, {len(self.waiting)} waiting "
            f"(first: {head.request_id if head else None!r}, {head.num_tokens if head else 0} tokens), "
            f"KV cache {self.kv.usage:.0%} used; this is a bug in tokenmill, please report it"
        )

    def _get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """What a request being admitted can start from: its leader's prompt KV (a forked sample), the
        prefix cache, or nothing. Prompt logprobs need every prompt position's logits: no cache then."""
        leader = self.forks.get_leader_to_share(request)
        if leader is not None:
            return self.kv.get_forked_blocks(leader, request.num_prompt_tokens - 1)
        if request.sampling_params.prompt_logprobs is not None:
            return NO_HIT
        return self.kv.get_computed_blocks(request)

    def _allocate_or_preempt(
        self,
        request: Request,
        num_new: int,
        num_scheduled: dict[str, int],
        cached_requests: list[CachedRequestData],
        lookahead: dict[str, int],
    ) -> list[int] | None:
        """Allocate for a running request, preempting others (or itself) until it fits."""
        while True:
            new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self._pick_victim()
            if victim.request_id in num_scheduled:
                # Only the priority policy can pick a request already scheduled in this step: unschedule it whole,
                # its draft slots too (the worker drafts for every request in lookahead).
                del num_scheduled[victim.request_id]
                lookahead.pop(victim.request_id, None)
                cached_requests[:] = [c for c in cached_requests if c.request_id != victim.request_id]
            self._preempt(victim)
            if victim is request:
                return None

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            # A tie taken by list order let two requests preempt each other for ever (each re-admitted behind).
            return max(self.running, key=lambda r: (r.priority, r.arrival_time, r.arrival_order))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_request_ids.add(request.request_id)
        self.waiting.add_preempted(request)

    # ---- results of a step -----------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs: list[EngineCoreOutput] = []
        scheduled = self.steps_in_flight.popleft() if self.steps_in_flight else {}
        num_with_lookahead = num_accepted = 0
        for request_id, token_ids in runner_output.sampled_token_ids.items():
            request, num_drafts = scheduled.get(request_id, (None, 0))
            if request is None or request.is_finished:
                continue  # finished or aborted while the step ran
            if runner_output.num_draft_tokens:
                self._record_drafts(runner_output.num_draft_tokens.get(request_id, 0), len(token_ids) - 1)
            if num_drafts:
                num_with_lookahead += 1
                num_accepted += len(token_ids) - 1
            # A request preempted while this step ran still gets the tokens: its KV was intact then.
            request.num_output_placeholders -= 1 + num_drafts
            if request.status == RequestStatus.RUNNING:
                # The KV of rejected drafts is not part of the sequence: those slots are written again.
                request.num_computed_tokens -= 1 + num_drafts - len(token_ids)
            new_token_ids = self._append_until_stop(request, token_ids)
            logprobs = runner_output.logprobs.get(request_id)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    finish_reason=finish_reason_of(request.status),
                    stop_reason=request.stop_token_id,
                    num_cached_tokens=request.num_cached_tokens or 0,
                    new_logprobs=None if logprobs is None else logprobs[: len(new_token_ids)],
                    new_prompt_logprobs=runner_output.prompt_logprobs.get(request_id),
                )
            )
        if self.draft_budget is not None:
            self.draft_budget.record_step(num_with_lookahead, num_accepted)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats())

    def _append_until_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append a step's tokens one by one; a stop condition met inside the run drops the rest."""
        for i, token_id in enumerate(token_ids):
            # A negative id is the worker's mark of a row whose constraints left no token (NO_TOKEN_LEFT).
            status = RequestStatus.FINISHED_NO_TOKEN if token_id < 0 else None
            if status is None:
                request.output_token_ids.append(token_id)
                status = check_stop(request, self.max_model_len)
            if status is not None:
                if request.status == RequestStatus.RUNNING:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                self._finish(request, status)
                return token_ids[: i + (status != RequestStatus.FINISHED_NO_TOKEN)]
        return token_ids

    def _record_drafts(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        if len(stats.accepted_per_position) < num_drafts:
            stats.accepted_per_position += [0] * (num_drafts - len(stats.accepted_per_position))
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        if self.draft_budget is not None:
            self.draft_budget.record(num_drafts, num_accepted)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.gate.forget(request)
        for follower in self.forks.release(request):
            self.waiting.add(follower)
        self.finished_request_ids.add(request.request_id)
        del self.requests[request.request_id]

    def make_stats(self) -> SchedulerStats:
        """Current gauges and counters, and the queue times gathered since the last call (cleared)."""
        queue_times, self.queue_times = self.queue_times, []
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.gate.parked),
            kv_cache_usage=self.kv.usage,
            prefix_cache_requests=self.kv.prefix_cache_stats.requests,
            prefix_cache_queries=self.kv.prefix_cache_stats.queries,
            prefix_cache_hits=self.kv.prefix_cache_stats.hits,
            num_preemptions=self.num_preemptions,
            queue_times=queue_times,
            spec_decoding=self.spec_stats.copy() if self.draft_budget is not None else None,
        )
