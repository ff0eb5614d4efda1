"""LLMEngine stepped by hand on a tiny random Llama: abort, streaming deltas, request errors."""

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLM(tiny_llama.path, skip_tokenizer_init=True, kv_cache_space=0.01, max_num_batched_tokens=16,
               max_model_len=128).engine


def free_blocks(engine):
    kv = engine.core.scheduler.kv
    return kv.pool.num_free_blocks, kv.pool.num_blocks


def test_abort_at_any_point_frees_every_block(engine):
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(1, 40 + i))}, params)
    engine.step()  # r0 mid-prefill, the rest waiting
    aborted = engine.abort_request(["r0", "r3"])
    assert [(o.request_id, o.outputs[0].finish_reason, o.finished) for o in aborted] == [
        ("r0", "abort", True), ("r3", "abort", True)]
    for _ in range(8):
        engine.step()
    engine.abort_request(["r1"])  # decoding by now
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["r2"]
    free, total = free_blocks(engine)
    assert free == total
    assert engine.abort_request(["r2", "unknown"]) == []  # finished or unknown ids are ignored


def test_delta_outputs_concatenate_to_the_final_output(engine):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("cumulative", {"prompt_token_ids": [5, 6, 7]}, params, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("delta", {"prompt_token_ids": [5, 6, 7]}, params, output_kind=RequestOutputKind.DELTA)
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "delta":
                pieces += out.outputs[0].token_ids
            elif out.finished:
                final = out.outputs[0].token_ids
    assert pieces == final and len(final) == 12


def test_bad_requests_fail_before_scheduling_and_leave_others_running(engine):
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("ok", {"prompt_token_ids": [1, 2, 3]}, good)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []}, good)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", {"prompt_token_ids": [1] * 128}, good)
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.add_request("oov", {"prompt_token_ids": [1, 999]}, good)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", {"prompt_token_ids": [1, 2, 3]}, good)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in outputs] == [("ok", 5)]


def test_long_prefill_token_threshold_changes_the_chunks_not_the_greedy_tokens(engine, monkeypatch):
    """A long and a short prompt together, prefilled in the budget's chunks and then in chunks capped at 5 (the cap
    LLM(long_prefill_token_threshold=5) gives this engine's scheduler): the same greedy tokens."""
    scheduler, schedule, chunks = engine.core.scheduler, engine.core.scheduler.schedule, []

    def recording_schedule():
        out = schedule()
        chunks.append(out.num_scheduled_tokens)
        return out

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(salt):  # salted apart, so that the second run computes every prompt token again
        engine.add_request(f"long-{salt}", {"prompt_token_ids": list(range(3, 50))}, params, cache_salt=salt)
        engine.add_request(f"short-{salt}", {"prompt_token_ids": [9, 8, 7, 6, 5]}, params, cache_salt=salt)
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id.split("-")[0], o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return outputs

    reference = run("uncapped")
    assert max(n for step in chunks for n in step.values()) == 16
    chunks.clear()
    monkeypatch.setattr(scheduler, "max_chunk_tokens", 5)
    assert run("capped") == reference
    assert max(n for step in chunks for n in step.values()) == 5
    assert chunks[0] == {"long-capped": 5, "short-capped": 5}
