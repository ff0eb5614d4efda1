"""N-gram speculation on the real default model (SmolLM2-135M-Instruct): an input-grounded task (rewrite a
given text) drafts long runs, and the output is exactly plain greedy decoding's, stop strings included."""

import pytest

from tests.e2e.test_spec_decode import always_draft, skip_step_cost_measurement
from tokenmill import LLM, SamplingParams

CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)
'''
PROMPT = [{"role": "user", "content": f"Repeat this Python function exactly, then stop:\n\n{CODE}"}]


@pytest.fixture(scope="module")
def speculative_llm(smollm2_path):
    with pytest.MonkeyPatch.context() as monkeypatch:
        skip_step_cost_measurement(monkeypatch)  # always_draft below throws it away
        llm = LLM(smollm2_path, kv_cache_space=0.5, max_model_len=2048, dtype="float32",  # as smollm2_llm
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                      "prompt_lookup_min": 2})
    # The step cost measured at start-up decides whether drafting pays; on a loaded CI machine it can say no.
    always_draft(llm)
    return llm


@pytest.fixture(scope="module")
def plain_output(smollm2_llm):
    return smollm2_llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)[0].outputs[0]


def test_rewriting_gives_the_plain_greedy_text_with_long_accepted_runs(speculative_llm, plain_output):
    out = speculative_llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain_output.token_ids
    assert out.text == plain_output.text
    stats = speculative_llm.engine.last_stats.spec_decoding
    assert stats.mean_acceptance_length > 1.5, stats  # the copied function is mostly drafted right


def test_a_stop_string_inside_an_accepted_run_cuts_the_text_and_tokens_there(speculative_llm, plain_output):
    text = plain_output.text
    stop = "/ len("  # copied from the prompt: inside a drafted run
    assert stop in text, text
    params = SamplingParams(temperature=0, max_tokens=80, stop=[stop], logprobs=1)
    out = speculative_llm.chat(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # The tokens end with the one that completed the stop string: none drafted after it are kept.
    assert out.token_ids == plain_output.token_ids[: len(out.token_ids)]
    assert stop in speculative_llm.get_tokenizer().decode(out.token_ids)
    assert stop not in speculative_llm.get_tokenizer().decode(out.token_ids[:-1])
    assert len(out.logprobs) == len(out.token_ids)
