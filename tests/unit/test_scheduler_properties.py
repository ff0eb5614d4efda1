"""Randomized (hypothesis) runs of the engine core's loop over the real scheduler and KV-cache manager,
with a fake model runner that models the KV pool itself.

The fake runner writes, for every token a step computes, "what the KV there would hold" (the cache
salt and every token id up to that position) into the slot the block table names, performs the
block copies, and then checks that every position each computed token attends to holds exactly its
own sequence's KV: a prefix-cache hit, a fork or a reused block that serves stale or foreign KV fails
at once. Its sampled token is a pure function of the request id and its tokens so far, so the tokens
each request must receive, and where it must stop, are known in advance.

With speculative decoding, the fake runner drafts into the lookahead it is given (some drafts right,
some wrong, some steps none) and verifies them against the same function: the emitted run is the
longest right prefix plus one token, and the KV of rejected drafts must be written again before anyone
reads it.

Random sequences of adds (shared prefixes, n > 1 forks, priorities, salts, a grammar to wait for: the prompt
computed but the first token held until its compile ends, which the script decides), compiles ending, aborts,
stop-string stops and steps run on tiny pools, under FCFS and priority, with and without prefix caching, chunked
prefill (and a long_prefill_token_threshold capping each chunk), async scheduling, speculative decoding and pipeline
micro-batches (two or three steps in flight). After every step: waiting requests hold no blocks, the block reference
counts add up, the limits hold; at the end every request finished exactly once with the right tokens, and every block
is free. A step that schedules nothing while work waits raises SchedulerStalledError.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.config import SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.kv_cache.block import KVCacheBlock
from tokenmill.kv_cache.manager import KVCacheManager, cdiv
from tokenmill.protocol import EngineRequest
from tokenmill.request import FinishReason, RequestStatus
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.scheduler.draft_budget import DraftBudget
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.structured import waiting
from tokenmill.worker.pending_output import ReadyOutput

EOS = 0
VOCAB = 50
PREFIXES = [list(range(1, 13)), list(range(20, 31))]
"""Prompts start with one of these, so prefix-cache hits are common."""


def next_token(request_id: str, token_ids: list[int]) -> int:
    """The fake model's choice: depends only on the request id and its tokens; EOS about one time in eight."""
    value = zlib.crc32(f"{request_id}:{token_ids}".encode())
    return EOS if value % 8 == 0 else 1 + value % (VOCAB - 1)


def fake_drafts(request_id: str, token_ids: list[int], max_drafts: int) -> list[int]:
    """Up to max_drafts guesses, each right two times in three (wrong ones stay wrong), sometimes none."""
    value = zlib.crc32(f"draft:{request_id}:{token_ids}".encode())
    drafts, tokens = [], list(token_ids)
    for i in range(value % (max_drafts + 1)):
        right = next_token(request_id, tokens)
        drafts.append(right if (value >> (i + 4)) % 3 else (right + 1) % VOCAB)
        tokens.append(drafts[-1])
    return drafts


def verify(request_id: str, token_ids: list[int], drafts: list[int]) -> list[int]:
    """The drafts the fake model agrees with, then its own next token."""
    emitted = []
    for draft in drafts:
        target = next_token(request_id, token_ids + emitted)
        if draft != target:
            return emitted + [target]
        emitted.append(draft)
    return emitted + [next_token(request_id, token_ids + emitted)]


@dataclass
class Row:
    """The fake runner's state of one request, rebuilt from NewRequestData like the real worker's rows."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int


@dataclass
class FakeRunner:
    block_size: int
    max_num_batched_tokens: int
    salts: dict[str, str | None]
    """Sample id -> its cache salt, which the KV content includes: a cross-salt hit reads foreign KV."""
    cached_blocks: Callable[[], Iterable[KVCacheBlock]]
    """The blocks the prefix cache may hand out now."""
    long_prefill_token_threshold: int = 0
    """Most known tokens (drafts aside) a request may compute in one step; 0: no cap."""
    rows: dict[str, Row] = field(default_factory=dict)
    kv: dict[tuple[int, int], tuple] = field(default_factory=dict)
    num_steps: int = 0

    def content(self, row: Row, position: int) -> tuple:
        return self.salts[row.request_id], tuple(row.token_ids[: position + 1])

    def slot(self, row: Row, position: int) -> tuple[int, int]:
        return row.block_ids[position // self.block_size], position % self.block_size

    def execute_model(self, out: SchedulerOutput) -> ReadyOutput:
        self.num_steps += 1
        assert out.total_num_scheduled_tokens <= self.max_num_batched_tokens
        for request_id in out.finished_request_ids:
            self.rows.pop(request_id, None)
        for new in out.new_requests:
            assert new.request_id not in self.rows
            self.rows[new.request_id] = Row(new.request_id, list(new.token_ids), list(new.block_ids),
                                            new.num_computed_tokens)
        for cached in out.cached_requests:
            self.rows[cached.request_id].block_ids += cached.new_block_ids
        for src, dst in out.block_copies:
            for offset in range(self.block_size):
                if (src, offset) in self.kv:
                    self.kv[dst, offset] = self.kv[src, offset]
        scheduled = []
        for rid, n in out.num_scheduled_tokens.items():
            row, lookahead = self.rows[rid], out.num_lookahead_tokens.get(rid, 0)
            assert len(row.block_ids) >= cdiv(row.num_computed + n, self.block_size)  # room for every draft
            n -= lookahead
            assert row.num_computed + n <= len(row.token_ids)
            assert n <= (self.long_prefill_token_threshold or n), "a chunk over long_prefill_token_threshold"
            drafts = []
            if lookahead:
                assert row.num_computed + n == len(row.token_ids), "lookahead for a request mid-prompt"
                drafts = fake_drafts(rid, row.token_ids, lookahead)
            scheduled.append((row, n + len(drafts), drafts))
            row.token_ids += drafts
        # Each layer writes the whole batch's KV before any token attends (so one step can share a prefix).
        for row, n, _ in scheduled:
            for position in range(row.num_computed, row.num_computed + n):
                self.kv[self.slot(row, position)] = self.content(row, position)
        # Only computed blocks may be handed out as prefix-cache hits.
        for block in self.cached_blocks():
            assert all((block.block_id, offset) in self.kv for offset in range(self.block_size)), (
                f"block {block.block_id} is in the prefix cache but was never computed")
        sampled, num_drafts = {}, {}
        for row, n, drafts in scheduled:
            row.num_computed += n
            for position in range(row.num_computed):
                assert self.kv.get(self.slot(row, position)) == self.content(row, position), (
                    f"{row.request_id} read stale KV at position {position}")
            if row.num_computed == len(row.token_ids):
                known = row.token_ids[: len(row.token_ids) - len(drafts)]
                emitted = verify(row.request_id, known, drafts)
                sampled[row.request_id] = emitted
                row.token_ids = known + emitted
                row.num_computed = len(row.token_ids) - 1  # the last emitted token has no KV yet
                if drafts:
                    num_drafts[row.request_id] = len(drafts)
        return ReadyOutput(ModelRunnerOutput(sampled, num_draft_tokens=num_drafts))


@dataclass
class Expected:
    """One sample as the caller sees it: the tokens it must receive and when it must stop."""

    prompt: list[int]
    params: SamplingParams
    max_model_len: int
    received: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    ended_by_caller: bool = False

    def check(self, request_id: str, new_token_ids: list[int], finish_reason: FinishReason | None) -> None:
        assert self.finish_reason is None and not self.ended_by_caller, f"{request_id} got output after its end"
        for token in new_token_ids:
            assert token == next_token(request_id, self.prompt + self.received), f"{request_id} lost a token"
            self.received.append(token)
        self.finish_reason = finish_reason
        must_stop = self.stop_reason()
        assert must_stop == finish_reason, f"{request_id}: finished {finish_reason}, expected {must_stop}"

    def stop_reason(self) -> FinishReason | None:
        if not self.received:
            return None
        num_output = len(self.received)
        if (not self.params.ignore_eos and self.received[-1] == EOS and num_output >= self.params.min_tokens):
            return FinishReason.STOP
        if num_output >= self.params.max_tokens or len(self.prompt) + num_output >= self.max_model_len:
            return FinishReason.LENGTH
        return None


@st.composite
def engine_configs(draw):
    block_size = draw(st.sampled_from([4, 8]))
    max_model_len = draw(st.sampled_from([16, 24, 32]))
    chunked = draw(st.booleans())
    min_budget = 4 if chunked else max_model_len
    return dict(
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=cdiv(max_model_len, block_size) + draw(st.integers(0, 6)),
        budget=draw(st.integers(min_budget, 40)),
        max_num_seqs=draw(st.integers(1, 6)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        caching=draw(st.booleans()),
        chunked=chunked,
        async_scheduling=draw(st.booleans()),
        num_speculative_tokens=draw(st.sampled_from([0, 0, 1, 3])),
        num_batches_in_flight=draw(st.sampled_from([1, 1, 2, 3])),
        long_prefill=draw(st.sampled_from([0, 0, 1, 3, 8])) if chunked else 0,
    )


actions = st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(PREFIXES) - 1), st.integers(0, 8), st.integers(1, 3),
              st.integers(1, 12), st.integers(0, 3), st.integers(0, 2), st.sampled_from([None, "a", "b"]),
              st.booleans(), st.booleans()),
    st.tuples(st.just("compiled"), st.integers(0, 20)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("stop"), st.integers(0, 20)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


class ScriptedCompiles:
    """Grammar compiles that end when the script says (the engine core's AwaitingGrammar submits each spec here)."""

    def __init__(self) -> None:
        self.pending: list[Future] = []

    def submit(self, spec) -> Future:
        self.pending.append(Future())
        return self.pending[-1]

    def finish(self, index: int) -> None:
        if self.pending:
            self.pending.pop(index % len(self.pending)).set_result(None)


GRAMMAR = StructuredOutputsParams(regex="[a-z]+")
"""The spec of a request that waits for a compile (the fake runner never masks anything)."""


class Driver:
    """Plays the frontend: splits n > 1 into forked samples, ends requests, checks every output."""

    def __init__(self, config: dict) -> None:
        self.max_model_len = config["max_model_len"]
        scheduler_config = SchedulerConfig(
            max_num_seqs=config["max_num_seqs"], max_num_batched_tokens=config["budget"], policy=config["policy"],
            enable_chunked_prefill=config["chunked"], long_prefill_token_threshold=config.get("long_prefill", 0),
        )
        self.kv = KVCacheManager(config["num_blocks"], config["block_size"], enable_caching=config["caching"])
        k = config.get("num_speculative_tokens", 0)
        num_batches = config.get("num_batches_in_flight", 1)
        self.scheduler = Scheduler(scheduler_config, self.kv, self.max_model_len,
                                   DraftBudget(k, cost=None) if k else None, num_batches)
        self.salts: dict[str, str | None] = {}
        self.runner = FakeRunner(config["block_size"], config["budget"], self.salts,
                                 lambda: self.kv.pool.cached_blocks.values(), config.get("long_prefill", 0))
        self.compiles = ScriptedCompiles()
        self.core = EngineCore(self.scheduler, self.runner, config["async_scheduling"], self.compiles,
                               num_batches_in_flight=num_batches)
        self.expected: dict[str, Expected] = {}
        self.parents: list[list[str]] = []
        self.compile_of: dict[str, Future] = {}
        """Sample id -> the compile its first token waits for."""
        self.num_added = 0

    def add(self, prefix, suffix_len, n, max_tokens, min_tokens, priority, salt, ignore_eos, grammar) -> None:
        prompt = PREFIXES[prefix] + [40 + (self.num_added + i) % 9 for i in range(suffix_len)]
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), ignore_eos=ignore_eos,
                                structured_outputs=GRAMMAR if grammar else None)
        self.add_prompt(prompt[: self.max_model_len - 1], n, params, priority, salt)

    def add_prompt(self, prompt: list[int], n: int, params: SamplingParams, priority=0, salt=None) -> None:
        # Ids come back after their request ends, as callers may reuse them.
        parent_id = f"r{self.num_added % 7}"
        self.num_added += 1
        sample_ids = [parent_id] if n == 1 else [f"{i}_{parent_id}" for i in range(n)]
        if any(sid in self.expected and not self.is_over(sid) for sid in sample_ids):
            return  # still in use
        for sid in sample_ids:
            self.salts[sid] = salt
            self.expected[sid] = Expected(prompt, params, self.max_model_len)
            fork_of = sample_ids[0] if sid != sample_ids[0] else None
            self.core.add_request(EngineRequest(sid, list(prompt), params, frozenset([EOS]), priority=priority,
                                                cache_salt=salt, fork_of=fork_of))
            if params.structured_outputs is not None:
                self.compile_of[sid] = self.compiles.pending[-1]
            else:  # a reused id: its last request's compile (never finished, if it was aborted) is not this one's
                self.compile_of.pop(sid, None)
        self.parents.append(sample_ids)

    def is_over(self, sample_id: str) -> bool:
        expected = self.expected[sample_id]
        return expected.finish_reason is not None or expected.ended_by_caller

    def end(self, index: int, status: RequestStatus) -> None:
        if not self.parents:
            return
        sample_ids = self.parents[index % len(self.parents)]
        live = [sid for sid in sample_ids if not self.is_over(sid)]
        for sid in live:
            self.expected[sid].ended_by_caller = True
        self.core.abort_requests(live, status)

    def step(self) -> None:
        if not self.core.has_requests():
            return
        for output in self.core.step().outputs:
            compile_ = self.compile_of.get(output.request_id)
            assert compile_ is None or compile_.done() or not output.new_token_ids, "sampled before its grammar"
            self.expected[output.request_id].check(output.request_id, output.new_token_ids, output.finish_reason)
        self.check_invariants()

    def check_invariants(self) -> None:
        scheduler, kv = self.scheduler, self.kv
        held_back = [r for followers in scheduler.forks.followers.values() for r in followers]
        for request in [*scheduler.waiting, *held_back, *scheduler.gate.parked.values()]:
            assert kv.get_block_ids(request.request_id) == [], f"waiting {request.request_id} holds blocks"
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        references: dict[int, int] = {}
        for request_id, blocks in kv.req_to_blocks.items():
            assert request_id in scheduler.requests, f"{request_id} holds blocks but is gone"
            assert len({b.block_id for b in blocks}) == len(blocks)
            for block in blocks:
                references[block.block_id] = references.get(block.block_id, 0) + 1
        for block in kv.pool.blocks:
            assert block.ref_count == references.get(block.block_id, 0), f"block {block.block_id} miscounted"
        assert kv.pool.num_free_blocks == sum(1 for b in kv.pool.blocks if b.ref_count == 0)

    def drain(self) -> None:
        limit = self.runner.num_steps + 40 * sum(len(e.prompt) + e.params.max_tokens for e in self.expected.values())
        while self.core.has_requests():
            self.compiles.finish(0)
            self.step()
            assert self.runner.num_steps <= limit, "no progress: the requests never finish"
        for sid, expected in self.expected.items():
            assert expected.ended_by_caller or expected.finish_reason is not None, f"{sid} was lost"
        assert not self.scheduler.requests and not self.kv.req_to_blocks
        assert not self.scheduler.forks.followers and not self.scheduler.forks.leader_of
        assert not self.scheduler.gate.parked and self.scheduler.gate.num_closed == 0
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=engine_configs(), script=st.lists(actions, max_size=40))
def test_random_workloads_keep_every_invariant(config, script):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(waiting, "IDLE_WAIT_S", 0)  # an idle core waits for a compile only the script ends
        run_script(Driver(config), script)


def run_script(driver: Driver, script) -> None:
    for action in script:
        kind, *args = action
        if kind == "add":
            driver.add(*args)
        elif kind == "compiled":
            driver.compiles.finish(args[0])
        elif kind == "abort":
            driver.end(args[0], RequestStatus.FINISHED_ABORTED)
        elif kind == "stop":
            driver.end(args[0], RequestStatus.FINISHED_STOPPED)
        else:
            for _ in range(args[0]):
                driver.step()
    driver.drain()


def test_a_forked_request_and_another_on_a_tiny_pool_finish():
    """The freeze the randomized test first found: 4 blocks of 8 tokens, one request with n=2 and one other.
    The waiting follower held its forked blocks at the head of the queue; nothing could be preempted."""
    config = dict(block_size=8, max_model_len=32, num_blocks=4, budget=64, max_num_seqs=8, policy="fcfs",
                  caching=True, chunked=True, async_scheduling=False)
    driver = Driver(config)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    driver.add_prompt(list(range(50, 66)), 1, params)
    driver.add_prompt([1, 2, 3, 4], 2, params)
    driver.drain()


def test_two_requests_that_arrived_together_do_not_preempt_each_other_for_ever():
    """Found by the randomized test: under the priority policy two requests of one priority and arrival time (0 here;
    an n > 1 request's samples share theirs) on a 4-block pool, one token a step each. The victim was the first of
    the tie in the running list, the one further on, and the other was re-admitted behind it: each preempted the
    other in turn, for ever. Ties now go by the order the scheduler took them (Request.arrival_order)."""
    config = dict(block_size=4, max_model_len=16, num_blocks=4, budget=4, max_num_seqs=2, policy="priority",
                  caching=False, chunked=True, async_scheduling=False, long_prefill=1)
    driver = Driver(config)
    driver.add_prompt(PREFIXES[0], 1, SamplingParams(max_tokens=1))
    driver.add_prompt(PREFIXES[0], 1, SamplingParams(max_tokens=2))
    driver.drain()
    assert driver.scheduler.num_preemptions == 1


def test_speculative_runs_stop_exactly_at_eos_and_max_tokens():
    """Accepted runs that cross EOS or max_tokens are cut there, with async scheduling and a tiny pool."""
    config = dict(block_size=4, max_model_len=32, num_blocks=10, budget=12, max_num_seqs=3, policy="fcfs",
                  caching=True, chunked=True, async_scheduling=True, num_speculative_tokens=3)
    driver = Driver(config)
    for max_tokens in (1, 2, 5, 13):
        driver.add_prompt(list(range(1, 9)), 1, SamplingParams(max_tokens=max_tokens))
        driver.add_prompt(list(range(20, 26)), 2, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    driver.drain()
    assert driver.scheduler.spec_stats.num_drafts > 0
    assert 0 < driver.scheduler.spec_stats.num_accepted_tokens < driver.scheduler.spec_stats.num_draft_tokens
