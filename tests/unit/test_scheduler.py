"""Scheduler: token budget, chunked prefill, decodes first, preemption order, no leaks.

The model runner is replaced by hand-built ModelRunnerOutputs: the scheduler only sees token ids.
"""

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler

BLOCK = 4
EOS = 0


def make_scheduler(num_blocks=64, budget=32, max_seqs=8, policy="fcfs", max_model_len=64, caching=True,
                   long_prefill=0):
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy,
                             long_prefill_token_threshold=long_prefill)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, enable_caching=caching), max_model_len)


def make_request(rid, num_prompt, max_tokens=4, priority=0, arrival=0.0, first_token=1):
    tokens = list(range(first_token, first_token + num_prompt))
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), eos_token_ids=frozenset([EOS]),
                   priority=priority, arrival_time=arrival)


def run_step(scheduler: Scheduler, token=7) -> SchedulerOutput:
    """Schedule one step and sample `token` for every request that reached its end."""
    out = scheduler.schedule()
    sampled = {}
    for rid in out.num_scheduled_tokens:
        req = scheduler.requests[rid]
        if req.num_computed_tokens == req.num_tokens:
            sampled[rid] = [token]
    scheduler.update_from_output(out, ModelRunnerOutput(sampled))
    return out


def drain(scheduler: Scheduler, max_steps=500) -> list[SchedulerOutput]:
    outs = []
    while scheduler.has_requests():
        outs.append(run_step(scheduler))
        assert len(outs) < max_steps
    return outs


def test_long_prompt_is_chunked_within_the_budget():
    s = make_scheduler(budget=16)
    s.add_request(make_request("a", 40))
    outs = [run_step(s) for _ in range(3)]
    assert [o.num_scheduled_tokens["a"] for o in outs] == [16, 16, 8]
    assert s.requests["a"].num_output_tokens == 1  # sampled only once the prompt is complete


def test_decodes_come_first_and_prefill_fills_the_rest_of_the_budget():
    s = make_scheduler(budget=16)
    s.add_request(make_request("a", 5, max_tokens=10))
    run_step(s)  # a prefilled, now decoding
    s.add_request(make_request("b", 40))
    out = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]
    assert out.total_num_scheduled_tokens <= 16


def test_long_prefill_token_threshold_caps_each_chunk_so_a_short_prompt_runs_beside_a_long_one():
    def chunks(long_prefill):
        s = make_scheduler(budget=32, long_prefill=long_prefill)
        s.add_request(make_request("long", 40, max_tokens=2))
        s.add_request(make_request("short", 6, max_tokens=3, first_token=50))
        return [dict(o.num_scheduled_tokens) for o in drain(s)]

    # Without the cap the long prompt's 32-token chunk takes the whole budget; the short one waits a step.
    assert chunks(0)[:3] == [{"long": 32}, {"long": 8, "short": 6}, {"long": 1, "short": 1}]
    # With it each step computes at most 10 of the long prompt, the rest of the budget goes to the short one.
    assert chunks(10) == [{"long": 10, "short": 6}, {"long": 10, "short": 1}, {"long": 10, "short": 1},
                          {"long": 10}, {"long": 1}]


def test_long_prefill_token_threshold_counts_the_tokens_after_the_prefix_cache_hit():
    s = make_scheduler(long_prefill=8)
    s.add_request(make_request("a", 13, max_tokens=1))
    assert [o.num_scheduled_tokens["a"] for o in drain(s)] == [8, 5]
    s.add_request(make_request("b", 30, max_tokens=1))  # its first 12 tokens are a's three full blocks
    outs = drain(s)
    assert outs[0].new_requests[0].num_computed_tokens == 12
    assert [o.num_scheduled_tokens["b"] for o in outs] == [8, 8, 2]


def test_long_prefill_token_threshold_caps_the_recompute_of_a_preempted_request():
    s = make_scheduler(num_blocks=6, budget=64, max_model_len=24, long_prefill=5)
    for i, rid in enumerate("abc"):
        s.add_request(make_request(rid, 7, max_tokens=12, arrival=i, first_token=10 * i + 1))
    requests = dict(s.requests)
    outs = drain(s)
    assert s.num_preemptions >= 1 and s.kv.pool.num_free_blocks == 6
    assert max(n for o in outs for n in o.num_scheduled_tokens.values()) == 5
    assert all(r.num_output_tokens == 12 for r in requests.values())


def test_budget_and_max_num_seqs_are_never_exceeded():
    s = make_scheduler(budget=24, max_seqs=3)
    for i in range(10):
        s.add_request(make_request(f"r{i}", 5 + 3 * i, first_token=100 * i + 1))
    for out in drain(s):
        assert out.total_num_scheduled_tokens <= 24
        assert len(out.num_scheduled_tokens) <= 3


def test_no_block_leaks_after_finish_and_abort():
    s = make_scheduler(num_blocks=32)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 7, max_tokens=5, first_token=10 * i + 1))
    run_step(s)
    s.finish_requests(["r1", "r4"], RequestStatus.FINISHED_ABORTED)
    run_step(s)
    s.finish_requests(["r2"], RequestStatus.FINISHED_ABORTED)
    drain(s)
    assert s.kv.pool.num_free_blocks == 32
    assert not s.requests and not s.running and len(s.waiting) == 0


def test_abort_of_a_waiting_request_frees_it_before_it_runs():
    s = make_scheduler(max_seqs=1)
    s.add_request(make_request("a", 5))
    s.add_request(make_request("b", 5))
    run_step(s)
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    outs = drain(s)
    assert all("b" not in o.num_scheduled_tokens for o in outs)


def test_finished_ids_reach_the_worker_once():
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=1))
    s.add_request(make_request("b", 5, max_tokens=3, first_token=50))
    assert run_step(s).finished_request_ids == set()  # a finishes in this step
    assert run_step(s).finished_request_ids == {"a"}
    assert run_step(s).finished_request_ids == set()


def test_eos_and_length_finish_reasons():
    s = make_scheduler()
    s.add_request(make_request("eos", 5, max_tokens=10))
    s.add_request(make_request("len", 5, max_tokens=2, first_token=50))
    first = s.update_from_output(s.schedule(), ModelRunnerOutput({"eos": [EOS], "len": [3]})).outputs
    assert [(r.request_id, r.finish_reason and r.finish_reason.value, r.stop_reason) for r in first] == [
        ("eos", "stop", None), ("len", None, None)]
    second = s.update_from_output(s.schedule(), ModelRunnerOutput({"len": [3]})).outputs
    assert [(r.request_id, r.finish_reason.value) for r in second] == [("len", "length")]


def test_fcfs_preempts_the_latest_request_and_recomputes_it_later():
    # 6 blocks of 4 tokens; three requests of 7 prompt tokens grow until the pool runs out.
    s = make_scheduler(num_blocks=6, budget=64, max_model_len=24)
    for i, rid in enumerate("abc"):
        s.add_request(make_request(rid, 7, max_tokens=12, arrival=i, first_token=10 * i + 1))
    preempted_order = []
    while s.has_requests():
        before = {r.request_id for r in s.running}
        run_step(s)
        after = {r.request_id for r in s.running}
        preempted_order += [rid for rid in before - after if s.requests.get(rid) and
                            s.requests[rid].status == RequestStatus.PREEMPTED]
    assert preempted_order and preempted_order[0] == "c"
    assert s.num_preemptions >= 1 and s.kv.pool.num_free_blocks == 6


def test_priority_policy_runs_and_keeps_the_most_urgent_request():
    s = make_scheduler(num_blocks=6, budget=64, max_model_len=24, policy="priority", max_seqs=2)
    s.add_request(make_request("low", 7, max_tokens=12, priority=5, arrival=0))
    s.add_request(make_request("high", 7, max_tokens=12, priority=0, arrival=1, first_token=50))
    s.add_request(make_request("mid", 7, max_tokens=12, priority=1, arrival=2, first_token=90))
    first = s.schedule()
    assert set(first.num_scheduled_tokens) == {"high", "mid"}  # lower value runs first
    s.update_from_output(first, ModelRunnerOutput({"high": [7], "mid": [7]}))
    high, mid = s.requests["high"], s.requests["mid"]
    while high.status == RequestStatus.RUNNING:
        run_step(s)
        assert high.status != RequestStatus.PREEMPTED
    assert mid.num_preemptions > 0  # the pool could not hold both; the less urgent one yielded
    assert high.status == RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preempted_requests_finish_with_exactly_their_token_count(policy):
    s = make_scheduler(num_blocks=8, budget=20, max_model_len=32, policy=policy)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 6 + i, max_tokens=9, priority=i % 2, arrival=i, first_token=20 * i + 1))
    requests = dict(s.requests)
    drain(s)
    assert s.num_preemptions > 0
    for req in requests.values():
        assert req.num_output_tokens == 9 and req.status == RequestStatus.FINISHED_LENGTH
    assert s.kv.pool.num_free_blocks == 8


def test_second_request_with_shared_prefix_computes_only_the_new_tokens():
    s = make_scheduler()
    s.add_request(make_request("a", 13, max_tokens=1))
    drain(s)
    s.add_request(make_request("b", 13, max_tokens=1))
    out = s.schedule()
    assert out.new_requests[0].num_computed_tokens == 12
    assert out.num_scheduled_tokens["b"] == 1
    assert s.kv.prefix_cache_stats.hits == 12


def test_prefix_caching_off_recomputes_everything():
    s = make_scheduler(caching=False)
    s.add_request(make_request("a", 13, max_tokens=1))
    drain(s)
    s.add_request(make_request("b", 13, max_tokens=1))
    assert s.schedule().num_scheduled_tokens["b"] == 13


def test_async_steps_are_scheduled_before_the_last_step_is_updated():
    """Async scheduling: each decode is scheduled while the previous step's token is still in flight."""
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=3))
    first = s.schedule()  # the prompt; samples token 1
    second = s.schedule()  # token 1 is in flight: its decode is scheduled anyway
    assert second.num_scheduled_tokens == {"a": 1}
    s.update_from_output(first, ModelRunnerOutput({"a": [11]}))
    third = s.schedule()  # token 2 in flight; token 3 will be the last
    s.update_from_output(second, ModelRunnerOutput({"a": [12]}))
    fourth = s.schedule()  # the step in flight gives the last token: nothing more to schedule
    assert fourth.num_scheduled_tokens == {}
    outputs = s.update_from_output(third, ModelRunnerOutput({"a": [13]})).outputs
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([13], "length")]
    s.update_from_output(fourth, ModelRunnerOutput({}))
    assert not s.has_requests() and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_a_token_in_flight_goes_to_the_request_that_was_scheduled_not_to_a_new_one_with_its_id():
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=4))
    first = s.schedule()
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # aborted while its step runs
    s.add_request(make_request("a", 3, max_tokens=4, first_token=20))  # the id is free again
    second = s.schedule()
    assert s.update_from_output(first, ModelRunnerOutput({"a": [99]})).outputs == []
    outputs = s.update_from_output(second, ModelRunnerOutput({"a": [7]})).outputs
    assert [o.new_token_ids for o in outputs] == [[7]] and s.requests["a"].output_token_ids == [7]


def test_forked_samples_share_the_prompt_blocks_and_compute_one_token_each():
    s = make_scheduler(caching=False)
    prompt = list(range(1, 11))  # 10 tokens: two full blocks of 4 and a partial one
    s.add_request(Request("0_r", prompt, SamplingParams(max_tokens=2)))
    for i in (1, 2):
        s.add_request(Request(f"{i}_r", prompt, SamplingParams(max_tokens=2), fork_of="0_r"))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"0_r": 10}  # the followers wait for the leader's prompt
    s.update_from_output(first, ModelRunnerOutput({"0_r": [5]}))
    second = s.schedule()
    assert second.num_scheduled_tokens == {"0_r": 1, "1_r": 1, "2_r": 1}
    leader_blocks = s.kv.get_block_ids("0_r")
    copies = dict((dst, src) for src, dst in second.block_copies)
    for follower in ("1_r", "2_r"):
        blocks = s.kv.get_block_ids(follower)
        assert blocks[:2] == leader_blocks[:2]  # full blocks shared
        assert copies[blocks[2]] == leader_blocks[2]  # the partial one copied into a block of its own
    s.update_from_output(second, ModelRunnerOutput({"0_r": [6], "1_r": [7], "2_r": [8]}))
    drain(s)
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_a_follower_aborted_before_the_fork_never_runs():
    s = make_scheduler(caching=False, budget=4)
    prompt = list(range(1, 11))
    s.add_request(Request("0_r", prompt, SamplingParams(max_tokens=2)))
    for i in (1, 2):
        s.add_request(Request(f"{i}_r", prompt, SamplingParams(max_tokens=2), fork_of="0_r"))
    run_step(s)  # the leader's first 4-token chunk
    s.finish_requests(["1_r"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in s.forks.followers["0_r"]] == ["2_r"]
    outs = drain(s)
    scheduled = {rid for out in outs for rid in out.num_scheduled_tokens}
    assert scheduled == {"0_r", "2_r"} and not s.forks.followers
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks



def gated(rid, num_prompt, **kwargs):
    request = make_request(rid, num_prompt, **kwargs)
    request.can_sample = False  # as the engine core adds a request whose grammar is compiling
    return request


def test_a_request_that_may_not_sample_computes_its_prompt_but_the_tail():
    """The whole blocks before its last token (what a repeat of it would find in the prefix cache)."""
    s = make_scheduler(budget=16)
    s.add_request(gated("g", 41))
    s.add_request(make_request("a", 5, max_tokens=3, first_token=100))
    outs = [run_step(s) for _ in range(3)]
    assert [o.num_scheduled_tokens.get("g") for o in outs] == [16, 16, 8]  # 10 blocks of 4
    assert s.requests["g"].num_computed_tokens == 40 and not s.requests["g"].output_token_ids
    out = run_step(s)  # only "a" decodes: "g"'s last token waits, and no stall is raised
    assert "g" not in out.num_scheduled_tokens
    drain_until = [run_step(s) for _ in range(2)]
    assert all(not o.num_scheduled_tokens for o in drain_until[1:])
    assert s.has_requests() and not s.has_work()
    s.allow_sampling("g")
    assert s.has_work()
    out = run_step(s)
    assert out.num_scheduled_tokens == {"g": 1} and s.requests["g"].output_token_ids == [7]
    s.add_request(gated("h", 39, first_token=200))
    for _ in range(3):
        run_step(s)
    assert s.requests["h"].num_computed_tokens == 36  # 39 tokens: 36 in blocks, 3 left with the last one
    s.allow_sampling("h")
    assert run_step(s).num_scheduled_tokens["h"] == 3
    drain(s)
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks and s.gate.num_closed == 0


def test_a_request_with_nothing_to_compute_before_it_may_sample_is_parked_outside_the_queue():
    """A prompt found in the prefix cache, or one shorter than a block: parked holding no blocks, counted as
    waiting, queued again once it may sample; aborted while parked, it leaves nothing behind."""
    s = make_scheduler()
    s.add_request(make_request("a", 13, max_tokens=1))
    drain(s)
    s.add_request(gated("cached", 13, max_tokens=2))  # 12 tokens from the cache: its last token is all that is left
    s.add_request(gated("one", 4))
    s.add_request(make_request("b", 6, first_token=50))
    out = run_step(s)
    assert out.num_scheduled_tokens == {"b": 6}  # the parked ones did not hold the queue up
    assert set(s.gate.parked) == {"cached", "one"} and s.make_stats().num_waiting_reqs == 2
    assert s.kv.get_block_ids("cached") == []
    s.finish_requests(["one"], RequestStatus.FINISHED_ABORTED)
    s.allow_sampling("cached")
    out = run_step(s)
    assert out.num_scheduled_tokens["cached"] == 1 and out.new_requests[-1].num_computed_tokens == 12
    drain(s)
    assert not s.gate.parked and s.gate.num_closed == 0
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_a_request_that_may_not_sample_may_be_preempted_and_its_forks_wait_for_it():
    """Preempted before it may sample, it computes its prompt's blocks again; its samples (forks)
    wait for their leader's whole prompt, so for its gate too."""
    s = make_scheduler(num_blocks=6, budget=32, caching=False)
    s.add_request(make_request("a", 8, max_tokens=12, first_token=60))  # grows from 2 blocks to 5
    run_step(s)
    prompt = list(range(1, 11))
    s.add_request(Request("0_g", prompt, SamplingParams(max_tokens=4), can_sample=False))
    s.add_request(Request("1_g", prompt, SamplingParams(max_tokens=4), fork_of="0_g", can_sample=False))
    out = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "0_g": 8} and s.forks.followers  # the follower waits for the fork
    while "a" in s.requests:
        run_step(s)  # "a" needs the leader's blocks: the leader (the latest) is preempted
    assert s.num_preemptions == 1
    run_step(s)  # and comes back
    assert s.requests["0_g"].num_computed_tokens == 8 and not s.requests["0_g"].output_token_ids
    s.allow_sampling("0_g")
    s.allow_sampling("1_g")
    drain(s)
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks and s.gate.num_closed == 0
