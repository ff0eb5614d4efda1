"""Sampling through the whole engine on a tiny random Llama, checked against transformers."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(20, 57)), [8, 9]]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama.path, tiny_llama.model


@pytest.fixture(scope="module")
def llm(tiny):
    # float32: compared with transformers' float32 logprobs (dtype 'auto' picks bfloat16 on a CPU with
    # bfloat16 units); max_logprobs -1: test_logprobs_minus_one_are_the_whole_vocabulary's
    return LLM(tiny[0], skip_tokenizer_init=True, kv_cache_space=0.01, max_num_batched_tokens=16, dtype="float32",
               max_logprobs=-1)


def run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def hf_logprobs(model, token_ids):
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def test_seeded_sampling_is_independent_of_batch_and_preemption(tiny, llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=24, ignore_eos=True)
    alone = run(llm, [PROMPTS[0]], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batched = run(llm, PROMPTS, [params, others, others])[0].outputs[0].token_ids
    tight = LLM(tiny[0], skip_tokenizer_init=True, num_gpu_blocks_override=6, max_model_len=64,
                max_num_batched_tokens=16, dtype="float32")
    preempted = run(tight, PROMPTS, [params, others, others])
    assert tight.engine.last_stats.num_preemptions > 0
    assert alone == batched == preempted[0].outputs[0].token_ids
    other_seed = SamplingParams(temperature=1.0, seed=43, max_tokens=24, ignore_eos=True)
    assert run(llm, [PROMPTS[0]], other_seed)[0].outputs[0].token_ids != alone


def test_logprobs_equal_transformers_log_softmax(tiny, llm):
    _, model = tiny
    outs = run(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        completion = out.outputs[0]
        reference = hf_logprobs(model, prompt + completion.token_ids)
        assert len(completion.logprobs) == 6
        total = 0.0
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            expected = reference[len(prompt) - 1 + step]
            assert entry[token].logprob == pytest.approx(float(expected[token]), abs=1e-4)
            assert entry[token].rank == 1  # greedy picks the most likely token
            top = expected.topk(3)
            assert [entry[t].logprob for t in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-4)
            total += entry[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs_across_prefill_chunks(tiny, llm):
    _, model = tiny
    prompt = PROMPTS[1]  # 37 tokens, prefilled in 16-token chunks
    out = run(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    reference = hf_logprobs(model, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry, token = out.prompt_logprobs[pos], prompt[pos]
        assert entry[token].logprob == pytest.approx(float(reference[pos - 1, token]), abs=1e-4)
        assert entry[token].rank == int((reference[pos - 1] > reference[pos - 1, token]).sum()) + 1


def test_logprobs_minus_one_are_the_whole_vocabulary(tiny, llm):
    """vLLM's -1: every token's logprob, sampled and prompt ones, where the engine's max_logprobs is -1."""
    _, model = tiny
    prompt = PROMPTS[0]
    out = run(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=3, logprobs=-1, prompt_logprobs=-1,
                                            ignore_eos=True))[0]
    completion = out.outputs[0]
    reference = hf_logprobs(model, prompt + completion.token_ids)  # [positions, vocab]
    vocab_size = reference.shape[1]
    entries = out.prompt_logprobs[1:] + completion.logprobs  # predicting prompt[1:], then each sampled token
    assert len(entries) == len(prompt) - 1 + 3
    for position, entry in enumerate(entries):
        assert sorted(entry) == list(range(vocab_size))
        got = torch.tensor([entry[t].logprob for t in range(vocab_size)])
        torch.testing.assert_close(got, reference[position], atol=1e-4, rtol=0)
        token = (prompt + completion.token_ids)[position + 1]
        assert entry[token].rank == int((reference[position] > reference[position, token]).sum()) + 1


def test_seeded_top_k_draw_is_the_same_on_the_candidate_and_the_full_vocabulary_path(llm):
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    alone = run(llm, [PROMPTS[0]], params)[0].outputs[0].token_ids  # every row has a top_k: candidate path
    unfiltered = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)  # forces the full path
    batched = run(llm, PROMPTS[:2], [params, unfiltered])[0].outputs[0].token_ids
    assert alone == batched


def test_n_samples_share_the_prompt_and_best_of_ranks_by_cumulative_logprob(llm):
    out = run(llm, [PROMPTS[1]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert out.outputs[0].cumulative_logprob is None  # not asked for
    best = run(llm, [PROMPTS[1]], SamplingParams(n=2, best_of=5, temperature=1.0, seed=7, max_tokens=8,
                                                  ignore_eos=True))[0]
    scores = [c.cumulative_logprob for c in best.outputs]
    assert len(scores) == 2 and scores[0] >= scores[1]
    every = run(llm, [PROMPTS[1]], SamplingParams(n=5, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True,
                                                   logprobs=0))[0]
    assert scores == pytest.approx(sorted((c.cumulative_logprob for c in every.outputs), reverse=True)[:2])


def test_min_tokens_masks_eos_and_logit_bias_and_allowed_tokens(tiny, llm):
    greedy = run(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    first = greedy.outputs[0].token_ids[0]
    # Make the greedy first token the end of sequence: it must not end the output before min_tokens.
    stop_early = run(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[first]))[0]
    assert stop_early.outputs[0].token_ids == [first] and stop_early.outputs[0].finish_reason == "stop"
    held = run(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[first],
                                                 min_tokens=3))[0]
    assert held.outputs[0].token_ids[0] != first and len(held.outputs[0].token_ids) >= 3
    biased = run(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=3, logit_bias={77: 100.0},
                                                   ignore_eos=True))[0]
    assert biased.outputs[0].token_ids == [77, 77, 77]
    # The largest bias at the lowest temperature that samples stays finite: the biased tokens, not the NaN draw's 0.
    forced = run(llm, [PROMPTS[0]], SamplingParams(temperature=1e-5, seed=1, max_tokens=4, ignore_eos=True,
                                                   logit_bias={77: 1e30, 78: 1e30}))[0]
    assert set(forced.outputs[0].token_ids) <= {77, 78}
    allowed = run(llm, [PROMPTS[0]], SamplingParams(temperature=1.0, seed=1, max_tokens=10, ignore_eos=True,
                                                    allowed_token_ids=[3, 4, 5]))[0]
    assert set(allowed.outputs[0].token_ids) <= {3, 4, 5}


@pytest.mark.parametrize("fields, match", [
    (dict(allowed_token_ids=[5, 6], logit_bias={5: float("-inf"), 6: float("-inf")}), "bans all of"),
    (dict(allowed_token_ids=[7, 255], stop_token_ids=[7], min_tokens=2), "all stop or EOS tokens"),  # EOS 255
    (dict(logit_bias=dict.fromkeys(range(256), float("-inf"))), "bans every token"),
    (dict(logit_bias=dict.fromkeys(range(255), float("-inf")), min_tokens=1), "every token but stop and EOS"),
    (dict(stop=["."]), "stop strings need a tokenizer"),
    (dict(logprobs=257), "logprobs must be at most the vocabulary size"),  # vocabulary: 256
    (dict(prompt_logprobs=257), "prompt_logprobs must be at most the vocabulary size"),
])
def test_requests_that_cannot_be_served_as_asked_are_refused(llm, fields, match):
    """With every logit masked, the draw would return a token outside every constraint (token 0); without a
    tokenizer, there is no text to find stop strings in; more logprobs than tokens failed the engine's step (and
    left the request running: every later step stalled). The engine still serves after each."""
    with pytest.raises(ValueError, match=match):
        run(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, **fields))
    assert len(run(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2))[0].outputs[0].token_ids) == 2


def test_params_of_the_wrong_kind_are_a_one_line_error(llm):
    """They failed deep inside with an AttributeError ('NoneType' object has no attribute 'validate', ...)."""
    from tokenmill import BeamSearchParams

    with pytest.raises(TypeError, match="sampling_params must be SamplingParams.*got None"):
        run(llm, PROMPTS[:2], [SamplingParams(max_tokens=2), None])
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams.*got BeamSearchParams"):
        run(llm, PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="sampling_params has 0 entries for 2 prompts"):  # the defaults ran instead
        run(llm, PROMPTS[:2], [])
    with pytest.raises(ValueError, match="priority has 0 entries for 2 prompts"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], priority=[], use_tqdm=False)
    with pytest.raises(TypeError, match="beam_search takes BeamSearchParams, got SamplingParams"):
        llm.beam_search({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_penalties_change_greedy_output_only_when_set(llm):
    base = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = run(llm, [PROMPTS[2]], base)[0].outputs[0].token_ids
    again = run(llm, [PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                  repetition_penalty=1.0, presence_penalty=0.0))[0]
    assert again.outputs[0].token_ids == plain
    penalized = run(llm, [PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                      frequency_penalty=2.0))[0].outputs[0].token_ids
    assert penalized != plain
    assert max(penalized.count(t) for t in set(penalized)) <= max(plain.count(t) for t in set(plain))


@pytest.mark.parametrize("repetition, frequency, presence", [(1.5, 0.0, 0.0), (1.0, 0.4, 0.3)],
                         ids=["repetition", "frequency+presence"])
def test_greedy_penalties_equal_transformers_and_the_openai_formula(tiny, llm, repetition, frequency, presence):
    """The penalty state follows the tokens as they are sampled: each new output token is penalised from
    the next step on (repetition: transformers' rule over the whole sequence; frequency and presence:
    OpenAI's formula over the output). A preempted request gets it back with its output tokens when it
    resumes."""
    _, model = tiny
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=repetition,
                            frequency_penalty=frequency, presence_penalty=presence)
    tight = LLM(tiny[0], skip_tokenizer_init=True, num_gpu_blocks_override=6, max_model_len=64,
                max_num_batched_tokens=16, dtype="float32")
    preempted = run(tight, PROMPTS, params)
    assert tight.engine.last_stats.num_preemptions > 0
    for prompt, out, again in zip(PROMPTS, run(llm, PROMPTS, params), preempted):
        # a plain greedy loop: generate() would stop at EOS (ignore_eos does not)
        processor, ids = RepetitionPenaltyLogitsProcessor(repetition), torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(24):
                logits = processor(ids, model(ids).logits[:, -1])
                counts = torch.bincount(ids[0, len(prompt):], minlength=logits.shape[-1])
                logits = logits - frequency * counts - presence * (counts > 0)
                ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        assert out.outputs[0].token_ids == again.outputs[0].token_ids == ids[0, len(prompt):].tolist()


def test_logits_processors_run_per_request(llm):
    def only_token_9(output_token_ids, logits):
        logits[:] = float("-inf")
        logits[9] = 0.0
        return logits

    def echo_the_prompt(prompt_token_ids, output_token_ids, logits):  # vLLM's other form: the prompt first
        logits[:] = float("-inf")
        logits[prompt_token_ids[len(output_token_ids)]] = 0.0
        return logits

    def only(output_token_ids, logits, token=12):  # a third parameter with a default: the two-argument form
        logits[:] = float("-inf")
        logits[token] = 0.0
        return logits

    outs = run(llm, [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]], [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logits_processors=[only_token_9]),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, logits_processors=[echo_the_prompt]),
        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, logits_processors=[only]),
    ])
    assert outs[0].outputs[0].token_ids == [9, 9, 9] and outs[1].outputs[0].token_ids != [9, 9, 9]
    assert outs[2].outputs[0].token_ids == PROMPTS[1][:3] and outs[3].outputs[0].token_ids == [12, 12, 12]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_logits_processor_that_raises_fails_the_call_and_the_engine_serves_on(llm, error):
    """The step that raised was never updated: the scheduler matched the next step's tokens to it, and every later
    call stalled (SchedulerStalledError), its requests still tracked. Ctrl-C in the step (a notebook's interrupt)
    did the same."""
    def broken(output_token_ids, logits):
        raise error("the user's bug")

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in run(llm, PROMPTS, params)]
    with pytest.raises(error, match="the user's bug"):
        run(llm, PROMPTS, [params, SamplingParams(temperature=0.0, max_tokens=4, logits_processors=[broken]), params])
    assert not llm.engine.has_unfinished_requests() and not llm.engine.core.has_requests()
    assert [o.outputs[0].token_ids for o in run(llm, PROMPTS, params)] == expected


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_transformers(tiny, llm, width):
    from tokenmill import BeamSearchParams

    _, model = tiny
    prompts = [PROMPTS[0], PROMPTS[2]]
    ours = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            # No EOS on the reference side either, so both explore the same beams for all 6 steps.
            reference = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                       do_sample=False, max_new_tokens=6, min_new_tokens=6, eos_token_id=None,
                                       pad_token_id=0, length_penalty=1.0, early_stopping=False,
                                       output_scores=True, return_dict_in_generate=True)
        expected = [seq[len(prompt):].tolist() for seq in reference.sequences]
        assert [seq.tokens[len(prompt):] for seq in out.sequences] == expected
        # transformers' beam scores are cumulative logprob / generated length
        scores = reference.sequences_scores.tolist()
        assert [s.cum_logprob / 6 for s in out.sequences] == pytest.approx(scores, abs=1e-4)


def test_beam_search_salts_its_beams_as_the_prompt_says(llm):
    """A prompt's cache_salt was dropped: the beams' blocks were cached for every unsalted request to reuse."""
    from tokenmill import BeamSearchParams

    prompt = list(range(100, 140))
    llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "alice"}], BeamSearchParams(beam_width=2, max_tokens=2))
    cached = {salt: llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), cache_salt=salt,
                                 use_tqdm=False)[0].num_cached_tokens for salt in ("alice", None)}
    assert cached["alice"] > 0 and cached[None] == 0


@pytest.mark.parametrize("fields, match", [
    (dict(beam_width=0), "beam_width must be a positive integer"), (dict(max_tokens=0), "max_tokens must be"),
    (dict(temperature=-0.5), "temperature must be a non-negative"),
    (dict(length_penalty=float("nan")), "length_penalty"),
])
def test_beam_search_params_are_checked_on_construction(fields, match):
    from tokenmill import BeamSearchParams

    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})
