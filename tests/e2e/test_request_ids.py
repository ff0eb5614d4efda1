"""Request ids as callers use them: all-or-nothing adds, and ids reused while the aborted request's
last step is still in flight (async scheduling), on a tiny random Llama."""

import pytest

from tokenmill import LLM, SamplingParams

ARGS = dict(skip_tokenizer_init=True, kv_cache_space=0.01, max_model_len=128)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def run_to_end(engine) -> dict[str, list[int]]:
    finished = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = [c.token_ids for c in output.outputs]
    raise AssertionError(f"requests never finish: {finished} finished so far")


def test_a_request_whose_sample_id_is_taken_is_refused_whole(tiny_llama):
    engine = LLM(tiny_llama.path, **ARGS).engine
    engine.add_request("1_x", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    with pytest.raises(ValueError, match="'1_x' is already in use"):
        engine.add_request("x", {"prompt_token_ids": [8, 9]}, SamplingParams(n=2, max_tokens=4))
    assert list(run_to_end(engine)) == ["1_x"]  # no sample of "x" ran, and "1_x" kept its own
    assert engine.core.scheduler.kv.usage == 0


def test_an_id_reused_while_its_aborted_step_runs_gets_only_its_own_tokens(tiny_llama):
    """The aborted request's token arrives after the new request took its id and its worker row: it must
    not land in the new prompt (position 8, which the new request computes in its second chunk)."""
    long_prompt = list(range(30, 60))
    reference = LLM(tiny_llama.path, **ARGS).generate({"prompt_token_ids": long_prompt}, GREEDY, use_tqdm=False)
    engine = LLM(tiny_llama.path, async_scheduling=True, max_num_batched_tokens=8, **ARGS).engine
    engine.add_request("r", {"prompt_token_ids": list(range(1, 9))}, GREEDY)
    engine.step()  # its whole prompt; the sampled token is still in flight
    engine.abort_request(["r"])
    engine.add_request("r", {"prompt_token_ids": long_prompt}, GREEDY)
    assert run_to_end(engine) == {"r": [reference[0].outputs[0].token_ids]}
