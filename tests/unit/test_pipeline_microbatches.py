"""Pipeline micro-batches in the scheduler: several steps in flight, a request whose next token one of them
computes sits out the others, the requests spread evenly, and the tokens are those of one step at a time.

The model runner is replaced by hand-built ModelRunnerOutputs (as in test_scheduler.py); each request's k-th
token is a function of its id and k, so any schedule must give the same outputs.
"""

from collections import deque

from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import ModelRunnerOutput
from tokenmill.scheduler.scheduler import Scheduler

BLOCK = 4


def make_scheduler(num_batches: int, num_blocks=64, budget=32, max_seqs=8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, enable_caching=True), max_model_len=64,
                     num_batches_in_flight=num_batches)


def add_requests(scheduler: Scheduler, prompt_lengths: list[int], max_tokens=6) -> None:
    for i, length in enumerate(prompt_lengths):
        prompt = [(5 * i + j) % 50 + 1 for j in range(length)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens)))


def token_of(request: Request) -> int:
    return 100 * int(request.request_id[1:]) + request.num_output_tokens


def run_pipelined(scheduler: Scheduler, max_in_flight: int) -> tuple[dict[str, list[int]], list[list[str]]]:
    """The engine core's loop: schedule, keep up to `max_in_flight` steps in flight, update the oldest. Returns
    each request's tokens and each step's sampled ids; asserts that no request samples in two steps at once."""
    in_flight: deque = deque()
    outputs: dict[str, list[int]] = {}
    sampled_per_step = []

    def update_oldest() -> None:
        step, sampled = in_flight.popleft()
        tokens = {rid: [token_of(request)] for rid, request in sampled.items()}
        for out in scheduler.update_from_output(step, ModelRunnerOutput(tokens)).outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    while scheduler.has_requests() or in_flight:
        if scheduler.has_requests():
            step = scheduler.schedule()
            # Right after schedule(), a request this step samples for holds a token in flight.
            sampled = {rid: scheduler.requests[rid] for rid in step.num_scheduled_tokens
                       if scheduler.requests[rid].num_output_placeholders}
            busy = {rid for _, earlier in in_flight for rid in earlier}
            assert not busy & set(step.num_scheduled_tokens)  # never while its next token is computed
            sampled_per_step.append(sorted(sampled))
            in_flight.append((step, sampled))
            if len(in_flight) <= max_in_flight:
                continue
        update_oldest()
        assert len(sampled_per_step) < 500
    return outputs, sampled_per_step


def test_two_micro_batches_split_the_requests_and_give_the_tokens_of_one_step_at_a_time():
    expected = {f"r{i}": [100 * i + k for k in range(6)] for i in range(6)}
    s = make_scheduler(num_batches=2)
    add_requests(s, [3, 5, 4, 6, 3, 2])
    outputs, steps = run_pipelined(s, max_in_flight=1)
    assert outputs == expected
    assert steps[:4] == [["r0", "r1", "r2"], ["r3", "r4", "r5"]] * 2  # three each, alternating
    assert not s.has_requests() and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_prompt_chunks_follow_each_other_but_the_token_waits_for_its_batch():
    s = make_scheduler(num_batches=2, budget=8)
    add_requests(s, [20], max_tokens=3)
    first, second = s.schedule(), s.schedule()
    assert first.num_scheduled_tokens == {"r0": 8} and second.num_scheduled_tokens == {"r0": 8}
    s.update_from_output(first, ModelRunnerOutput({}))
    third = s.schedule()
    assert third.num_scheduled_tokens == {"r0": 4}  # the last chunk samples the first token
    s.update_from_output(second, ModelRunnerOutput({}))
    assert s.schedule().num_scheduled_tokens == {}  # its token is in flight: nothing to do yet
    outputs = s.update_from_output(third, ModelRunnerOutput({"r0": [42]})).outputs
    assert [o.new_token_ids for o in outputs] == [[42]]
    assert s.schedule().num_scheduled_tokens == {"r0": 1}


def test_three_micro_batches_with_preemption_abort_and_reused_ids():
    """A pool too small for every request: requests are preempted while their token is in flight and wait
    for it before they start again; an aborted request's token in flight goes nowhere."""
    expected = {f"r{i}": [100 * i + k for k in range(10)] for i in range(6)}
    s = make_scheduler(num_batches=3, num_blocks=6, budget=12)
    add_requests(s, [10, 3, 8, 2, 7, 4], max_tokens=10)
    outputs, steps = run_pipelined(s, max_in_flight=2)
    assert s.num_preemptions > 0
    assert outputs == expected
    assert not s.has_requests() and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks

    s = make_scheduler(num_batches=2)
    add_requests(s, [3, 4])
    first = s.schedule()
    assert list(first.num_scheduled_tokens) == ["r0"]
    s.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)  # aborted while its batch runs
    s.add_request(Request("r0", [7, 8, 9], SamplingParams(max_tokens=2)))  # the id is free again
    second, third = s.schedule(), s.schedule()
    assert list(second.num_scheduled_tokens) == ["r1"]
    assert list(third.num_scheduled_tokens) == ["r0"]  # the new r0 has no token in flight
    assert s.update_from_output(first, ModelRunnerOutput({"r0": [99]})).outputs == []
    s.update_from_output(second, ModelRunnerOutput({"r1": [6]}))
    outputs = s.update_from_output(third, ModelRunnerOutput({"r0": [5]})).outputs
    assert [o.new_token_ids for o in outputs] == [[5]] and s.requests["r0"].output_token_ids == [5]
