"""Async scheduling (step N+1 scheduled while step N runs) gives exactly the tokens of the synchronous loop.

On the CPU nothing actually overlaps, but every mechanism is the same as on the GPU: placeholders in
the scheduler, the next step's inputs read from the last step's sampled tokens on the device, tokens of
requests that stopped in the step in flight discarded, preempted requests keeping their in-flight token.
"""

import pytest

from tokenmill import LLM, SamplingParams

ENGINES = {
    "default": dict(kv_cache_space=0.01),
    "chunked-prefill": dict(kv_cache_space=0.01, max_num_batched_tokens=16),
    "preempting": dict(num_gpu_blocks_override=12, max_num_batched_tokens=64),
}


def ban_last_output_token(output_token_ids, logits):
    """A logits processor that reads the output on the host (the slow path, which waits for the last step)."""
    if output_token_ids:
        logits[output_token_ids[-1]] = float("-inf")
    return logits


def workload():
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 1 for j in range(5 + 9 * i)]} for i in range(9)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[17, 42, 99, 123, 200]),
        SamplingParams(temperature=1.0, seed=7, max_tokens=25, min_tokens=10),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=18, logits_processors=[ban_last_output_token], ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11, max_tokens=40),
        SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True),  # forked samples
    ]
    return prompts, params


def generate(tiny_llama, async_scheduling, **engine_kwargs):
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, max_model_len=128, async_scheduling=async_scheduling,
              **engine_kwargs)
    assert llm.engine.core.async_scheduling is async_scheduling
    prompts, params = workload()
    outputs = llm.generate(prompts, params)
    assert not llm.engine.core.has_requests()
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    return outputs, llm.engine.core.scheduler.num_preemptions


@pytest.mark.parametrize("engine", list(ENGINES))
def test_async_scheduling_gives_the_synchronous_tokens(tiny_llama, engine):
    expected, sync_preemptions = generate(tiny_llama, False, **ENGINES[engine])
    actual, async_preemptions = generate(tiny_llama, True, **ENGINES[engine])
    if engine == "preempting":
        assert sync_preemptions > 0 and async_preemptions > 0
    for want, got in zip(expected, actual):
        assert len(got.outputs) == len(want.outputs)
        assert [c.token_ids for c in got.outputs[1:]] == [c.token_ids for c in want.outputs[1:]]
        w, g = want.outputs[0], got.outputs[0]
        assert g.token_ids == w.token_ids, want.request_id
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)
        if w.logprobs is not None:
            assert [sorted(p) for p in g.logprobs] == [sorted(p) for p in w.logprobs]
            for gp, wp in zip(g.logprobs, w.logprobs):
                for token_id, logprob in wp.items():
                    assert gp[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-5)
                    assert gp[token_id].rank == logprob.rank
    lengths = [len(o.outputs[0].token_ids) for o in actual]
    assert lengths[0] == 1 and lengths[1] == 20 and lengths[4] == 24


def test_abort_while_a_step_is_in_flight(tiny_llama):
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, max_model_len=128, kv_cache_space=0.01,
              async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = {o.request_id: o.outputs[0].token_ids
                 for o in llm.generate([{"prompt_token_ids": [i + 1, i + 2, i + 3]} for i in range(3)], params)}
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": [i + 1, i + 2, i + 3]}, params)
    for _ in range(4):
        engine.step()
    assert engine.core._in_flight  # a step is queued that samples r1 too
    engine.abort_request(["r1"])
    engine.add_request("r1", {"prompt_token_ids": [2, 3, 4]}, params)  # the id is free again at once
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert finished == {"r0": reference["0"], "r1": reference["1"], "r2": reference["2"]}
    kv = engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
