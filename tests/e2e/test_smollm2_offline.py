"""The offline LLM API on the real SmolLM2-135M-Instruct GGUF, on CPU: exact greedy tokens against
transformers, chat, every way a request stops, errors before scheduling, seeds, token-id prompts."""

import functools
import json
import os

import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    # Long enough to fill several KV blocks of 16 tokens.
    "A long time ago, in a small village at the edge of a great forest, there lived an old clockmaker. "
    "Every morning he opened his shop, wound each of the hundred clocks on the walls, and waited for "
    "customers who rarely came. One winter evening, a girl knocked on the door holding a broken pocket "
    "watch that had belonged to her grandmother. The clockmaker looked at it for a long time and said",
]
NUM_TOKENS = 24


def greedy(max_tokens: int = NUM_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def generate_one(llm: LLM, prompt, params: SamplingParams):
    [output] = llm.generate(prompt, params, use_tqdm=False)
    return output.outputs[0]


@pytest.fixture(scope="module")
def reference(smollm2_llm):
    """Greedy continuation of PROMPTS[0] from tokenmill: the base of the stop-condition tests."""
    return generate_one(smollm2_llm, PROMPTS[0], greedy())


# ---- (a) exact greedy tokens against transformers on the same GGUF -------------------------------


@torch.no_grad()
def test_greedy_batch_equals_transformers_on_the_same_gguf(smollm2_llm, smollm2_path, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM

    # transformers' GGUF loader reads the file's metadata twice (config, then weights) and builds the same
    # tensor-name map once per submodule (~400 times): some 15 s on a small CPU. Both are pure functions of
    # their arguments, read-only after: built once, they are the same reader and map.
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    outputs = smollm2_llm.generate(PROMPTS, greedy(), use_tqdm=False)
    folder, name = os.path.split(smollm2_path)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    for prompt, output in zip(PROMPTS, outputs):
        ids = torch.tensor([output.prompt_token_ids])
        assert output.prompt_token_ids == smollm2_llm.get_tokenizer().encode(prompt)
        # One prompt at a time: padding would change transformers' numerics. EOS ends both.
        expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=NUM_TOKENS)[0, ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == expected, prompt
    # The prompts are chosen so that none ends early: all 24 tokens are compared.
    assert [len(o.outputs[0].token_ids) for o in outputs] == [NUM_TOKENS] * len(PROMPTS)


# ---- (b) chat ------------------------------------------------------------------------------------


def test_chat_answers_the_capital_of_france(smollm2_llm):
    [output] = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                                greedy(max_tokens=32), use_tqdm=False)
    assert "Paris" in output.outputs[0].text
    assert "<|im_start|>" in output.prompt and output.prompt.rstrip().endswith("assistant")
    # `tokenmill chat --local` streams the same reply piece by piece as the steps decode it.
    from tokenmill.cli.chat import stream_local_reply

    pieces = list(stream_local_reply(smollm2_llm, [{"role": "user", "content": "What is the capital of France?"}],
                                     greedy(max_tokens=32)))
    assert len(pieces) > 1 and "".join(pieces) == output.outputs[0].text


def test_chat_takes_content_parts_and_none_content_as_the_server_does(smollm2_llm):
    """A list of text parts failed in the template (str + list) and None content broke it; as OpenAI's API they are
    the parts' text joined, and no text."""
    plain = [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": ""},
             {"role": "user", "content": "What is the capital of France?"}]
    odd = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
           {"role": "assistant", "content": None},
           {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                        {"type": "text", "text": "of France?"}]}]
    plain[2]["content"] = "What is the capital\nof France?"
    [expected, got] = smollm2_llm.chat([plain, odd], greedy(max_tokens=2), use_tqdm=False)
    assert got.prompt == expected.prompt and got.outputs[0].token_ids == expected.outputs[0].token_ids
    with pytest.raises(ValueError, match="the rendered conversation holds a lone surrogate"):
        smollm2_llm.chat([{"role": "user", "content": "Hi \ud800"}], use_tqdm=False)
    with pytest.raises(ValueError, match="only text content parts"):
        smollm2_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                         use_tqdm=False)


def test_chat_gives_templates_tool_call_arguments_as_objects_and_refusals_as_text(smollm2_llm):
    """As the server does: OpenAI's tool calls carry their arguments as JSON text, which templates index as an object
    (the text rendered nothing for `arguments.city`); a refusal part is the assistant's text."""
    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}[{{ c.function.arguments.city }}]"
                "{% endfor %}{{ m.content }}|{% endfor %}")
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    conversation = [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                    {"role": "assistant", "content": [{"type": "refusal", "refusal": "No more."}]}]
    [output] = smollm2_llm.chat(conversation, greedy(max_tokens=1), chat_template=template,
                                add_generation_prompt=False, use_tqdm=False)
    assert output.prompt == "Weather?|[Paris]|sunny|No more.|"
    call["function"]["arguments"] = "[1]"
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments must be a JSON object"):
        smollm2_llm.chat(conversation, greedy(max_tokens=1), chat_template=template, use_tqdm=False)


def test_chat_passes_tools_and_chat_template_kwargs_to_the_template(smollm2_llm):
    """As vLLM's LLM.chat (enable_thinking=False and the like); they were refused: TypeError."""
    template = ("{% if formal %}Dear model. {% endif %}{{ tools | length if tools else 0 }} tools. "
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    [output] = smollm2_llm.chat([{"role": "user", "content": "Hi"}], greedy(max_tokens=1), use_tqdm=False,
                                chat_template=template, tools=tools, chat_template_kwargs={"formal": True})
    assert output.prompt == "Dear model. 1 tools. Hi"


# ---- (c) how requests stop -----------------------------------------------------------------------


def test_stop_string_truncates_text_before_it(smollm2_llm, reference):
    stop = reference.text[9:15]  # well inside the reference text, and split across tokens:
    assert not any(stop in smollm2_llm.get_tokenizer().decode(t) for t in reference.token_ids)
    cut = reference.text.index(stop)
    out = generate_one(smollm2_llm, PROMPTS[0], greedy(stop=[stop]))
    assert (out.text, out.finish_reason, out.stop_reason) == (reference.text[:cut], "stop", stop)
    # Generation really stopped: the tokens are the reference's, up to the one completing the stop.
    assert len(out.token_ids) < NUM_TOKENS and out.token_ids == reference.token_ids[: len(out.token_ids)]
    assert stop in smollm2_llm.get_tokenizer().decode(out.token_ids)

    kept = generate_one(smollm2_llm, PROMPTS[0], greedy(stop=[stop], include_stop_str_in_output=True))
    assert (kept.text, kept.stop_reason) == (reference.text[: cut + len(stop)], stop)


def test_no_stop_string_ends_the_output_before_min_tokens(smollm2_llm, reference):
    """As vLLM: stop strings are looked for once the output has min_tokens tokens (before, the sample goes on)."""
    decode = smollm2_llm.get_tokenizer().decode
    ids = reference.token_ids
    stop = decode(ids[1])  # met by the second token, and again later or not at all
    early = generate_one(smollm2_llm, PROMPTS[0], greedy(stop=[stop]))
    assert early.finish_reason == "stop" and len(early.token_ids) == 2
    late = generate_one(smollm2_llm, PROMPTS[0], greedy(stop=[stop], min_tokens=4))
    assert len(late.token_ids) >= 4 and late.token_ids[:4] == ids[:4]
    assert late.text.startswith(decode(ids[:4]))


def test_bad_words_leave_the_callers_params_as_they_were(smollm2_llm):
    """The bad words' token ids are the engine's (its tokenizer's): the caller's SamplingParams keeps none."""
    params = greedy(bad_words=[" Paris"])
    out = generate_one(smollm2_llm, PROMPTS[0], params)
    assert params.bad_words_token_ids == [] and "Paris" not in out.text


def test_one_bad_word_may_be_given_as_a_string(smollm2_llm):
    """As stop: one word. The string was iterated, each of its letters banned."""
    one, listed = (generate_one(smollm2_llm, PROMPTS[0], greedy(bad_words=words)) for words in (" Paris", [" Paris"]))
    assert "Paris" not in one.text and one.token_ids == listed.token_ids
    with pytest.raises(ValueError, match="bad_words must be a string or a list of strings"):
        greedy(bad_words=[" Paris", 5])


def test_bad_words_token_sequences_are_each_kept_once_in_order(smollm2_llm):
    """Each word mid-text and at the start of text, each distinct sequence once, in the words' order (kept in a dict:
    a list's `in` made 50,000 words take over a minute on the server's event loop)."""
    tokenize = smollm2_llm.engine.input_processor._tokenize_bad_words
    [paris, mid_paris], [rome, mid_rome] = tokenize(["Paris"]), tokenize(["Rome"])
    assert paris != mid_paris
    assert tokenize(["Paris", "Rome", " Paris", "Paris"]) == [paris, mid_paris, rome, mid_rome]
    # A word given with its leading space is banned at the start of text too (it was only mid-text).
    assert tokenize([" Paris"]) == [paris, mid_paris]


def test_earliest_of_several_stop_strings_wins(smollm2_llm, reference):
    early, late = reference.text[9:15], reference.text[20:26]
    out = generate_one(smollm2_llm, PROMPTS[0], greedy(stop=[late, early]))
    assert (out.text, out.stop_reason) == (reference.text[: reference.text.index(early)], early)


def test_stop_string_in_the_last_allowed_token_still_stops(smollm2_llm, reference):
    # The token that hits max_tokens also completes the stop string: the stop string must win.
    decode = smollm2_llm.get_tokenizer().decode
    ids = reference.token_ids

    def is_first_occurrence(k: int) -> bool:  # token k's text first appears in the text at token k
        piece = decode(ids[k])
        return len(piece) >= 2 and reference.text.find(piece) == len(decode(ids[:k]))

    k = next(k for k in range(3, NUM_TOKENS) if is_first_occurrence(k))
    out = generate_one(smollm2_llm, PROMPTS[0], greedy(max_tokens=k + 1, stop=[decode(ids[k])]))
    assert (out.text, out.finish_reason, out.stop_reason) == (decode(ids[:k]), "stop", decode(ids[k]))


def test_stop_token_ids_end_generation_with_that_token(smollm2_llm, reference):
    ids = reference.token_ids
    k = next(i for i in range(3, NUM_TOKENS) if ids[i] not in ids[:i])
    out = generate_one(smollm2_llm, PROMPTS[0], greedy(stop_token_ids=[ids[k]]))
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[: k + 1], "stop", ids[k])
    decode = smollm2_llm.get_tokenizer().decode
    assert out.text == decode(ids[:k])  # the stop token's own text is left out, as in vLLM
    kept = generate_one(smollm2_llm, PROMPTS[0], greedy(stop_token_ids=[ids[k]], include_stop_str_in_output=True))
    assert kept.text == decode(ids[: k + 1])


def test_max_tokens_ends_with_length(smollm2_llm, reference):
    out = generate_one(smollm2_llm, PROMPTS[0], greedy(max_tokens=5))
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (reference.token_ids[:5], "length", None)
    assert out.text == smollm2_llm.get_tokenizer().decode(reference.token_ids[:5])


def test_eos_ends_with_stop_and_is_not_in_the_text(smollm2_llm):
    eos = smollm2_llm.get_tokenizer().eos_token_id
    [output] = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                                greedy(max_tokens=200), use_tqdm=False)
    out = output.outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
    assert out.stop_reason is None  # EOS is not a stop_token_ids entry (vLLM reports None too)
    assert "<|im_end|>" not in out.text and out.text.strip()
    # Nor with special tokens shown (as the server's tool parsers ask), unless include_stop_str_in_output.
    for shown in (False, True):
        [special] = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                                     greedy(max_tokens=200, skip_special_tokens=False,
                                            include_stop_str_in_output=shown), use_tqdm=False)
        assert special.outputs[0].text == out.text + ("<|im_end|>" if shown else "")
    # ignore_eos runs past it, to max_tokens.
    n = len(out.token_ids)
    [longer] = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                                greedy(max_tokens=n + 3, ignore_eos=True), use_tqdm=False)
    assert longer.outputs[0].token_ids[:n] == out.token_ids
    assert (len(longer.outputs[0].token_ids), longer.outputs[0].finish_reason) == (n + 3, "length")


def test_detokenize_false_decodes_no_logprobs_tokens_either(smollm2_llm):
    """As vLLM: no decoded_token without detokenization (each top-k token was decoded every step regardless)."""
    outs = smollm2_llm.generate([PROMPTS[0]] * 2, [greedy(max_tokens=3, logprobs=2, prompt_logprobs=1, detokenize=d)
                                                   for d in (True, False)], use_tqdm=False)
    def entries(output):
        return [e for pos in output.outputs[0].logprobs + output.prompt_logprobs[1:] for e in pos.values()]

    decoded, undecoded = map(entries, outs)
    assert outs[1].outputs[0].text == "" and all(e.decoded_token is None for e in undecoded)
    assert all(isinstance(e.decoded_token, str) for e in decoded)
    assert [e.logprob for e in undecoded] == [e.logprob for e in decoded]


# ---- (d) errors before anything is scheduled -----------------------------------------------------


def invalid_params(**fields) -> SamplingParams:
    """Params made invalid after construction, so that only the engine's own check can catch them."""
    params = greedy()
    for key, value in fields.items():
        setattr(params, key, value)
    return params


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", greedy(), "empty"),
        ({"prompt_token_ids": []}, greedy(), "empty"),
        ({"prompt_token_ids": [42] * 2048}, greedy(), "max_model_len"),
        ("hello " * 2100, greedy(), "max_model_len"),
        ({"prompt_token_ids": [1, 10**6]}, greedy(), "prompt token ids"),
        # A float passed the range check and failed in the detokenizer, the request half-tracked: every later
        # generate() stepped forever.
        ({"prompt_token_ids": [1.5, 2]}, greedy(), "prompt_token_ids must be a list of integers"),
        ({"prompt_token_ids": "12"}, greedy(), "prompt_token_ids must be a list of integers"),
        ({"prompt": None}, greedy(), "'prompt' must be a string"),
        # The tokenizer's TypeError named no input: "TextEncodeInput must be Union[...]".
        ("Hi \ud800", greedy(), "the prompt holds a lone surrogate"),
        ("Hi", greedy(bad_words=["\ud800"]), "a bad word holds a lone surrogate"),
        ("Hi", invalid_params(temperature=-1.0), "temperature"),
        ("Hi", invalid_params(top_p=0.0), "top_p"),
        ("Hi", invalid_params(repetition_penalty=1e-40), "repetition_penalty must be positive"),  # 0 in float32
        ("Hi", greedy(stop=["."], detokenize=False), "stop strings cannot be combined with detokenize=False"),
    ],
    ids=["empty-text", "empty-ids", "ids-too-long", "text-too-long", "id-out-of-vocab", "float-id", "ids-a-string",
         "prompt-none", "lone-surrogate", "lone-surrogate-bad-word",
         "negative-temperature", "zero-top-p", "tiny-repetition-penalty", "stop-strings-without-text"],
)
def test_bad_requests_fail_before_scheduling(smollm2_llm, prompt, params, match):
    scheduler = smollm2_llm.engine.core.scheduler
    with pytest.raises(ValueError, match=match):
        # A valid request ahead of the bad one must not be left queued either.
        smollm2_llm.generate(["Hi", prompt], [greedy(), params], use_tqdm=False)
    assert not smollm2_llm.engine.has_unfinished_requests() and not scheduler.has_requests()
    # The same engine still serves.
    assert generate_one(smollm2_llm, PROMPTS[0], greedy(max_tokens=3)).finish_reason == "length"


@pytest.mark.parametrize("fields, match", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.5), "max_tokens must be an integer"),
    (dict(seed="7"), "seed must be an integer"), (dict(stop=5), "stop must be a string or a list of strings"),
    (dict(temperature="0.5"), "temperature must be a number"), (dict(top_p=None), "top_p must be a number"),
    (dict(stop=["ok", None]), "stop must be"),
    (dict(logit_bias={5: float("nan")}), "logit_bias values"), (dict(logit_bias={5: float("inf")}), "logit_bias"),
    (dict(logit_bias={5: 1e38}), "logit_bias values must be numbers of at most 1e"),  # +inf once in float32 / T
    # Floats were truncated where the ids index: allowed_token_ids=[1.5, 3] sampled token 1.
    (dict(allowed_token_ids=[1.5, 3]), "allowed_token_ids must be a list of integers"),
    (dict(stop_token_ids=[2.0]), "stop_token_ids must be a list of integers"),
    (dict(logit_bias={1.5: 10.0}), "logit_bias keys must be a list of integers"),
])
def test_invalid_sampling_params_are_rejected_on_construction(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


def test_unsupported_architecture_is_named_in_the_error(tmp_path):
    config = {"architectures": ["FooForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # The folder has no tokenizer either: the architecture must be what is reported.
    with pytest.raises(ValueError, match="FooForCausalLM.*not supported"):
        LLM(str(tmp_path))


def test_a_prompts_cache_salt_is_used_and_other_keys_are_refused(smollm2_llm):
    """vLLM's prompt dicts carry a cache_salt: it was ignored (cached blocks shared between salts); other keys such
    as multi_modal_data were ignored too (the image unseen)."""
    def cached(salt):
        prompt = {"prompt": PROMPTS[2], "cache_salt": salt} if salt else PROMPTS[2]
        return smollm2_llm.generate(prompt, greedy(max_tokens=1), use_tqdm=False)[0].num_cached_tokens

    cached(None)
    assert cached("alice") == 0 and cached("alice") > 0 and cached("bob") == 0
    with pytest.raises(ValueError, match="the prompt's cache_salt and the cache_salt argument differ"):
        smollm2_llm.generate({"prompt": "Hi", "cache_salt": "alice"}, cache_salt="bob", use_tqdm=False)
    with pytest.raises(ValueError, match="a prompt's multi_modal_data is not supported"):
        smollm2_llm.generate({"prompt": "Hi", "multi_modal_data": {"image": None}}, use_tqdm=False)
    assert not smollm2_llm.engine.has_unfinished_requests()


def test_structured_outputs_may_be_given_as_a_dict(smollm2_llm):
    """It failed in the engine's validation with an AttributeError ('dict' object has no attribute 'key')."""
    out = generate_one(smollm2_llm, "Pick a color:", greedy(structured_outputs={"choice": ["red", "green"]}))
    assert out.text in ("red", "green") and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        greedy(structured_outputs='{"choice": ["red"]}')


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(smollm2_llm):
    """vLLM's SamplingParams field (it was refused: TypeError): the last k tokens, or with -1 as many as leave room for
    output."""
    ids = smollm2_llm.get_tokenizer().encode(PROMPTS[2])
    cut, whole = smollm2_llm.generate([PROMPTS[2], {"prompt_token_ids": ids[-10:]}],
                                      [greedy(max_tokens=3, truncate_prompt_tokens=10), greedy(max_tokens=3)],
                                      use_tqdm=False)
    assert cut.prompt_token_ids == ids[-10:] and cut.outputs[0].token_ids == whole.outputs[0].token_ids
    [longest] = smollm2_llm.generate({"prompt_token_ids": list(range(100, 2148))},
                                     greedy(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)
    assert longest.prompt_token_ids == list(range(101, 2148))  # max_model_len 2048, less one for the output
    for nonsense in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or at least 1"):
            greedy(truncate_prompt_tokens=nonsense)


# ---- (e) seeded sampling -------------------------------------------------------------------------


def test_seeded_sampling_does_not_depend_on_the_batch(smollm2_llm):
    prompt = "Write a short poem about the sea."
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = generate_one(smollm2_llm, prompt, seeded)
    batch = smollm2_llm.generate(
        [PROMPTS[2], prompt, PROMPTS[1], prompt],
        [SamplingParams(temperature=1.0, max_tokens=14), seeded, greedy(),
         SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=12, ignore_eos=True)],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone.token_ids and batch[1].outputs[0].text == alone.text
    assert batch[3].outputs[0].token_ids != alone.token_ids  # another seed, another sample


# ---- (f) priority, token-id prompts, metrics -----------------------------------------------------


def test_priority_and_token_id_prompts(smollm2_llm, reference):
    tokenizer = smollm2_llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(PROMPTS[0])}, PROMPTS[1],
               {"prompt": PROMPTS[0], "prompt_token_ids": tokenizer.encode(PROMPTS[0])}]
    outputs = smollm2_llm.generate(prompts, greedy(max_tokens=8), priority=[5, 0, 1], use_tqdm=False)
    # In input order, each with its own prompt, whatever the priorities.
    assert [o.prompt for o in outputs] == [None, PROMPTS[1], PROMPTS[0]]
    assert outputs[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids == reference.token_ids[:8]
    assert outputs[0].outputs[0].text == tokenizer.decode(reference.token_ids[:8])
    assert outputs[1].prompt_token_ids == tokenizer.encode(PROMPTS[1])
    for output in outputs:
        m = output.metrics
        assert output.finished
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
