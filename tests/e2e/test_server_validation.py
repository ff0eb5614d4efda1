"""The edge of the server: every bound a request field has is published in /openapi.json and enforced
with a 400 in OpenAI's format, before anything reaches the engine; request chat templates (trusted
here) render off the event loop. On the shared `tokenmill serve` of conftest.py (SmolLM2, with
--trust-request-chat-template, load tracking, default chat template variables and an API key)."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_ID_END = 2**31
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def post(server, path, body, headers=None, **kwargs) -> httpx.Response:
    kwargs.setdefault("json", body)
    return httpx.post(server.url(path), timeout=120, headers={**server.headers, **(headers or {})}, **kwargs)


def assert_openai_error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def completion(**fields) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": "Hi", "max_tokens": 1, **fields}


def chat(**fields) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": HI, "max_tokens": 1, **fields}


# ---- the published schema --------------------------------------------------------------------------


def member(schema: dict, kind: str) -> dict:
    """The non-null member of an optional field's schema."""
    for option in schema.get("anyOf", [schema]):
        if option.get("type") == kind:
            return option
    raise AssertionError(f"no {kind} in {schema}")


def test_openapi_publishes_the_bounds(server):
    spec = httpx.get(server.url("/openapi.json"), headers=server.headers).json()
    schemas = spec["components"]["schemas"]
    completion, chat_request = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    fields = completion["properties"]
    assert (fields["n"]["minimum"], fields["n"]["maximum"]) == (1, 128)
    assert member(fields["best_of"], "integer")["maximum"] == 128
    assert member(fields["temperature"], "number")["minimum"] == 0
    top_p = member(fields["top_p"], "number")
    assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0, 1)
    assert member(fields["top_k"], "integer")["minimum"] == -1
    assert (member(fields["seed"], "integer")["minimum"], member(fields["seed"], "integer")["maximum"]) == (
        INT64_MIN, INT64_MAX)
    assert (fields["priority"]["minimum"], fields["priority"]["maximum"]) == (INT64_MIN, INT64_MAX)
    assert (fields["presence_penalty"]["minimum"], fields["presence_penalty"]["maximum"]) == (-2, 2)
    assert member(fields["repetition_penalty"], "number")["exclusiveMinimum"] == 0
    # max_tokens 0 only with echo (a 400 otherwise: the bound below).
    assert member(fields["max_tokens"], "integer")["minimum"] == 0 and fields["min_tokens"]["minimum"] == 0
    assert member(fields["logprobs"], "integer")["maximum"] == 20
    bias = member(fields["logit_bias"], "object")
    assert (bias["additionalProperties"]["minimum"], bias["additionalProperties"]["maximum"]) == (-100, 100)
    assert member(fields["stop_token_ids"], "array")["items"]["exclusiveMaximum"] == TOKEN_ID_END
    assert member(fields["stop"], "string")["minLength"] == 1 and member(fields["stop"], "array")["maxItems"] == 1024
    assert member(fields["bad_words"], "array")["maxItems"] == 1024
    assert "prompt" in completion["required"]
    assert [form.get("maxItems") for form in fields["prompt"]["oneOf"]] == [None, 256, None, 256]
    assert member(chat_request["properties"]["top_logprobs"], "integer")["maximum"] == 20
    assert chat_request["properties"]["messages"]["minItems"] == 1 and "messages" in chat_request["required"]
    message = schemas["ChatMessage"]
    assert message["properties"]["role"]["enum"] == ["system", "user", "assistant", "tool", "developer"]
    assert message["required"] == ["role"] and message["additionalProperties"] is True
    assert schemas["TextPart"]["properties"]["type"]["const"] == "text"
    assert "text" in chat_request["properties"]["response_format"]["description"]
    # Refusals are documented as they come: 400s in OpenAI's format, not FastAPI's 422s.
    responses = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in responses and responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/Error")


# ---- each bound: just inside is served, just past is a 400 ----------------------------------------

STOPS = [f"zq{i}" for i in range(1025)]
BOUNDS = [  # (name, request at the bound, request just past it)
    ("n_min", completion(n=1), completion(n=0)),
    ("n_max", completion(n=128), completion(n=129)),
    ("best_of_max", completion(best_of=128), completion(best_of=129)),
    ("temperature_min", completion(temperature=0), completion(temperature=-1e-9)),
    ("top_p_min", completion(top_p=1e-9), completion(top_p=0)),
    ("top_p_max", completion(top_p=1), completion(top_p=1.000001)),
    ("top_k_min", completion(top_k=-1), completion(top_k=-2)),
    ("top_k_max", completion(top_k=2**31 - 1), completion(top_k=2**31)),
    ("min_p_min", completion(min_p=0), completion(min_p=-1e-9)),
    ("min_p_max", completion(min_p=1), completion(min_p=1.000001)),
    ("presence_penalty_min", completion(presence_penalty=-2), completion(presence_penalty=-2.000001)),
    ("presence_penalty_max", completion(presence_penalty=2), completion(presence_penalty=2.000001)),
    ("frequency_penalty_min", completion(frequency_penalty=-2), completion(frequency_penalty=-2.000001)),
    ("frequency_penalty_max", completion(frequency_penalty=2), completion(frequency_penalty=2.000001)),
    ("repetition_penalty_min", completion(repetition_penalty=1e-9), completion(repetition_penalty=0)),
    ("seed_min", completion(seed=INT64_MIN, n=2), completion(seed=INT64_MIN - 1)),
    ("seed_max", completion(seed=INT64_MAX, n=2), completion(seed=INT64_MAX + 1)),
    ("priority_min", completion(priority=INT64_MIN), completion(priority=INT64_MIN - 1)),
    ("priority_max", completion(priority=INT64_MAX), completion(priority=INT64_MAX + 1)),
    ("max_tokens_min", completion(max_tokens=1), completion(max_tokens=0)),
    ("min_tokens_min", completion(min_tokens=0), completion(min_tokens=-1)),
    ("logprobs_min", completion(logprobs=0), completion(logprobs=-1)),
    ("logprobs_max", completion(logprobs=20, echo=True), completion(logprobs=21, echo=True)),
    ("logit_bias_min", completion(logit_bias={"1": -100}), completion(logit_bias={"1": -100.000001})),
    ("logit_bias_max", completion(logit_bias={"1": 100}), completion(logit_bias={"1": 100.000001})),
    ("logit_bias_key", completion(logit_bias={"0": 1}), completion(logit_bias={"-1": 1})),
    ("stop_length", completion(stop=["a"]), completion(stop=[""])),
    ("stop_strings", completion(stop=STOPS[:1024]), completion(stop=STOPS)),
    ("chat_stop_strings", chat(stop=STOPS[:1024]), chat(stop=STOPS)),
    ("bad_words", completion(bad_words=STOPS[:1024]), completion(bad_words=STOPS)),
    ("allowed_token_ids_length", completion(allowed_token_ids=[1]), completion(allowed_token_ids=[])),
    ("prompts", completion(prompt=["Hi"] * 256), completion(prompt=["Hi"] * 257)),
    ("prompts_times_n", completion(prompt=["Hi"] * 8, n=128), completion(prompt=["Hi"] * 9, n=114)),
    ("chat_n_max", chat(n=128), chat(n=129)),
    ("max_completion_tokens_min", chat(max_completion_tokens=1), chat(max_completion_tokens=0)),
    ("top_logprobs_max", chat(logprobs=True, top_logprobs=20), chat(logprobs=True, top_logprobs=21)),
    ("top_logprobs_min", chat(logprobs=True, top_logprobs=0), chat(logprobs=True, top_logprobs=-2)),
    ("prompt_logprobs_min", completion(prompt_logprobs=0), completion(prompt_logprobs=-2)),
    ("messages_length", chat(messages=HI), chat(messages=[])),
    ("role", chat(messages=[{"role": "developer", "content": "Hi"}]),
     chat(messages=[{"role": "robot", "content": "Hi"}])),
    ("content_part", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]),
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "text": "Hi"}]}])),
    ("detokenize", ("/detokenize", {"tokens": [0]}), ("/detokenize", {"tokens": [-1]})),
]


@pytest.mark.parametrize(("inside", "past"), [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_bound_is_enforced_where_published(server, inside, past):
    assert post(server, *inside).status_code == 200, post(server, *inside).text
    assert_openai_error(post(server, *past))


def test_tool_fields_from_clients_are_accepted(server):
    messages = [HI[0], {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"}, {"role": "user", "content": "So?"}]
    assert post(server, *chat(messages=messages)).status_code == 200


# ---- integers past 64 bits, non-finite floats: 400s, not 500s ----------------------------------------

HUGE = 2**64
WIDE_INTEGERS = [
    ("seed", completion(seed=HUGE)), ("priority", completion(priority=HUGE)), ("top_k", completion(top_k=HUGE)),
    ("n", completion(n=HUGE)), ("best_of", completion(best_of=HUGE)), ("max_tokens", completion(max_tokens=HUGE)),
    ("min_tokens", completion(min_tokens=HUGE, max_tokens=None)), ("logprobs", completion(logprobs=HUGE)),
    ("prompt_token", completion(prompt=[1, HUGE])), ("prompt_token_lists", completion(prompt=[[1], [HUGE]])),
    ("stop_token_ids", completion(stop_token_ids=[HUGE])), ("allowed_token_ids", completion(allowed_token_ids=[HUGE])),
    ("logit_bias_key", completion(logit_bias={str(HUGE): 1})), ("chat_seed", chat(seed=-HUGE)),
    ("max_completion_tokens", chat(max_completion_tokens=HUGE)),
    ("top_logprobs", chat(logprobs=True, top_logprobs=HUGE)),
    ("detokenize", ("/detokenize", {"tokens": [HUGE]})),
]


@pytest.mark.parametrize(("path", "body"), [w[1] for w in WIDE_INTEGERS], ids=[w[0] for w in WIDE_INTEGERS])
def test_integers_past_64_bits_are_refused(server, path, body):
    assert_openai_error(post(server, path, body))


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "logit_bias", "repetition_penalty"])
def test_non_finite_numbers_are_refused(server, field, literal):
    value = f'{{"1": {literal}}}' if field == "logit_bias" else literal  # Python's json reads these literals
    body = f'{{"prompt": "Hi", "max_tokens": 1, "{field}": {value}}}'
    error = assert_openai_error(post(server, "/v1/completions", None, content=body,
                                     headers={"Content-Type": "application/json"}))
    assert error["param"].startswith(field)


@pytest.mark.parametrize(("body", "says"), [
    (b'{"prompt": "Hi \xff there", "max_tokens": 1}', "the body is not valid UTF-8: byte 0xff at position 15"),
    (b'{"prompt": "Hi", "max_tokens": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "the body's JSON nests too deeply"),
    (b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}",  # before: "There was an error parsing the body"
     "the body's JSON holds an integer of more than 4300 digits"),
])
def test_an_unreadable_body_is_a_400_that_says_why(server, body, says):
    # Before: FastAPI's "There was an error parsing the body", whatever was wrong.
    error = assert_openai_error(post(server, "/v1/completions", None, content=body,
                                     headers={"Content-Type": "application/json"}))
    assert error["message"] == says, error


# ---- lone UTF-16 surrogates ("\ud800" in JSON): a 400 naming the field, wherever they are -----------------

SURROGATE = "\ud800"
LONE_SURROGATES = [  # before: a TypeError from the tokenizer (a 500 for /tokenize and bad_words), a 500 while
    # rendering the 404 of an unknown model, or a 400 whose message named none of the request's fields
    ("prompt", completion(prompt=f"Hi{SURROGATE}"), "prompt"),
    ("prompts", completion(prompt=["Hi", SURROGATE]), "prompt.1"),
    ("bad_words", completion(bad_words=[SURROGATE]), "bad_words.0"),
    ("model", completion(model=SURROGATE), "model"),
    ("cache_salt", completion(cache_salt=SURROGATE), "cache_salt"),
    ("logit_bias_key", completion(logit_bias={f"1{SURROGATE}": 1}), "logit_bias.1\\ud800"),
    ("chat_content", chat(messages=[{"role": "user", "content": SURROGATE}]), "messages.0.content"),
    ("tokenize", ("/tokenize", {"prompt": SURROGATE}), "prompt"),
]


@pytest.mark.parametrize(("request_", "param"), [case[1:] for case in LONE_SURROGATES],
                         ids=[case[0] for case in LONE_SURROGATES])
def test_lone_surrogates_are_refused_by_name(server, request_, param):
    path, body = request_
    # json.dumps writes the surrogate as the escape \ud800, as a client's JSON encoder would.
    response = post(server, path, None, content=json.dumps(body), headers={"Content-Type": "application/json"})
    error = assert_openai_error(response)
    assert error["param"] == param and "lone surrogate" in error["message"], error


def test_a_surrogate_pair_is_text(server):
    # The escaped pair of one emoji, as json.dumps writes it: valid, unlike either half alone.
    body = json.dumps(completion(prompt="Hi \U0001F600")[1])
    assert "\\ud83d\\ude00" in body
    response = post(server, "/v1/completions", None, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("key", ["add_generation_prompt", "chat_template", "messages", "tokenize"])
def test_chat_template_kwargs_may_not_set_what_the_server_passes(server, key):
    # Before: a 400 about "off_loop() got multiple values for keyword argument", naming messages.
    error = assert_openai_error(post(server, *chat(chat_template_kwargs={key: False})))
    assert error["param"] == "chat_template_kwargs" and key in error["message"], error


def test_a_body_that_is_no_json_names_no_param(server):
    # Before: param "11", the position of the error in the body, as if it were a field.
    response = post(server, "/v1/completions", None, content=b'{"prompt": }',
                    headers={"Content-Type": "application/json"})
    error = assert_openai_error(response)
    assert error["param"] is None and error["code"] == "json_invalid", error
    assert error["message"].startswith("the body is not valid JSON at position 11: "), error


def test_suffix_is_refused_as_not_supported(server):
    # Before: "suffix: Input should be None", as if null were its only value rather than a missing feature.
    error = assert_openai_error(post(server, *completion(suffix="return x")))
    assert error["param"] == "suffix" and "suffix is not supported" in error["message"], error
    assert post(server, *completion(suffix=None)).status_code == 200


@pytest.mark.parametrize("request_, message", [
    (completion(n=3, best_of=2, temperature=1), "best_of (2) must be at least n (3)"),
    (chat(n=3, best_of=2, temperature=1), "best_of (2) must be at least n (3)"),
    (completion(n=1, best_of=2, temperature=0), "best_of > n needs sampling"),
    (chat(min_tokens=5, max_tokens=2), "min_tokens (5) must not exceed max_tokens (2)"),
    # Past the engine's --max-logprobs (vLLM's default of 20), named as the request spells it.
    (completion(logprobs=21), "logprobs must be at most 20 (the server's --max-logprobs), got 21"),
    (chat(logprobs=True, top_logprobs=30), "top_logprobs must be at most 20"),
    (completion(prompt_logprobs=21), "prompt_logprobs must be at most 20"),
    # vLLM's -1 (the whole vocabulary) needs --max-logprobs -1.
    (chat(logprobs=True, top_logprobs=-1), "top_logprobs -1 asks for the whole vocabulary (49152 tokens), more than "
                                           "the server's --max-logprobs (20)"),
    (chat(prompt_logprobs=-1), "prompt_logprobs -1 asks for the whole vocabulary (49152 tokens)"),
    # The engine's checks, past SamplingParams' (before: param null).
    (chat(min_tokens=1, response_format={"type": "json_object"}), "min_tokens cannot be combined with structured"),
    (completion(ignore_eos=True, guided_choice=["a"]), "ignore_eos cannot be combined with structured outputs"),
], ids=["completion", "chat", "greedy", "min-tokens", "max-logprobs", "max-top-logprobs", "max-prompt-logprobs",
        "all-top-logprobs", "all-prompt-logprobs", "engine-min-tokens", "engine-ignore-eos"])
def test_sampling_params_errors_name_their_field(server, request_, message):
    # Before: the same 400s with param null (SamplingParams' checks, which know no request fields).
    error = assert_openai_error(post(server, *request_))
    assert error["param"] == message.split()[0] and error["message"].startswith(message), error


def test_unknown_fields_are_served_and_logged_once(server):
    # Before: ignored without a word, so a misspelt extra (min_token) silently did nothing.
    field = f"unknown_{uuid.uuid4().hex}"
    assert post(server, *completion(**{field: 1, "min_token": 2, "logprobs": 0})).status_code == 200
    assert post(server, *chat(**{field: 1})).status_code == 200
    log = server.log_tail(100_000)
    assert log.count(f"the request's fields min_token, {field} are not known and were ignored") == 1, log[-2000:]
    assert log.count(f"the request's fields {field} are not known and were ignored") == 1


VLLM_EXTRAS = {"completion-add_special_tokens": completion(add_special_tokens=False),
               "chat-add_special_tokens": chat(add_special_tokens=True),
               "completion-truncate_prompt_tokens": completion(truncate_prompt_tokens=1),
               "chat-truncate_prompt_tokens": chat(truncate_prompt_tokens=3),
               "spaces_between_special_tokens": completion(spaces_between_special_tokens=False,
                                                           skip_special_tokens=False)}
"""Requests with vLLM extras once ignored (a warning in the log), each now served (its test is the field's own)."""


@pytest.mark.parametrize("request_", list(VLLM_EXTRAS.values()), ids=list(VLLM_EXTRAS))
def test_vllm_extras_are_served_not_ignored(server, request_):
    start = os.path.getsize(server.log.name)
    assert post(server, *request_).status_code == 200
    with open(server.log.name) as log:
        log.seek(start)
        assert "are not known and were ignored" not in log.read()


@pytest.mark.parametrize("request_, param", [
    (completion(logits_processors=["my_module.MyProcessor"]), "logits_processors"),
    (chat(kv_transfer_params={"do_remote_prefill": True}), "kv_transfer_params"),
    (completion(vllm_xargs={"my_key": 1}), "vllm_xargs"),
    (chat(mm_processor_kwargs={"num_crops": 4}), "mm_processor_kwargs"),
    (completion(prompt_embeds="AAAA"), "prompt_embeds"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_vllm_extras_without_a_counterpart_are_refused_by_name(server, request_, param):
    # Before: ignored (a warning in the log), the request served as if they were not there.
    error = assert_openai_error(post(server, *request_))
    assert error["param"] == param and "not supported" in error["message"], error
    path, body = request_
    assert post(server, path, {**body, param: None}).status_code == 200  # null (or empty) is their default


def test_a_thinking_token_budget_needs_the_reasoning_markers(server):
    """This server has no --reasoning-parser (nor --reasoning-config): nothing to count between, a 400 saying what
    gives the markers (test_server_tools.py serves a budget with them)."""
    error = assert_openai_error(post(server, *chat(thinking_token_budget=16)))
    assert "thinking_token_budget" in error["message"] and "--reasoning-parser" in error["message"], error
    for no_cap in (None, -1):
        assert post(server, *chat(thinking_token_budget=no_cap)).status_code == 200
    error = assert_openai_error(post(server, *chat(thinking_token_budget=-2)))
    assert error["param"] == "thinking_token_budget", error


@pytest.mark.parametrize("request_, param", [
    (completion(use_beam_search=True, top_p=0.5), "top_p"),
    (chat(use_beam_search=True, top_k=5), "top_k"),
    (completion(use_beam_search=True, n=2, best_of=3), "best_of"),
    (chat(use_beam_search=True, logprobs=True), "logprobs"),
    (completion(use_beam_search=True, logprobs=0), "logprobs"),  # 0 asks for the sampled token's
    (chat(use_beam_search=True, response_format={"type": "json_object"}), "response_format"),
    (completion(length_penalty=0.5), "length_penalty"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_beam_search_refuses_the_sampling_fields_it_would_ignore(server, request_, param):
    error = assert_openai_error(post(server, *request_))
    assert error["param"] == param and "use_beam_search" in error["message"], error


def test_beam_search_takes_logprob_fields_that_ask_for_nothing(server):
    # Before: top_logprobs 0 (and logprobs false) were refused as fields the search would ignore.
    response = post(server, *chat(use_beam_search=True, n=2, logprobs=False, top_logprobs=0))
    assert response.status_code == 200, response.text
    assert [choice["logprobs"] for choice in response.json()["choices"]] == [None, None]
    error = assert_openai_error(post(server, *chat(use_beam_search=True, logprobs=True, top_logprobs=0)))
    assert error["param"] == "logprobs", error


@pytest.mark.parametrize("logprobs", [{}, {"logprobs": False}], ids=["absent", "false"])
def test_top_logprobs_0_needs_no_logprobs(server, logprobs):
    """As vLLM's: top_logprobs without logprobs is refused only when it asks for some (above 0, or -1: the whole
    vocabulary); 0 asks for none and the answer comes without logprobs (before: a 400)."""
    response = post(server, *chat(top_logprobs=0, **logprobs))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None
    for top in (1, -1):
        error = assert_openai_error(post(server, *chat(top_logprobs=top, **logprobs)))
        assert error["param"] == "top_logprobs" and "logprobs=true" in error["message"], error


def test_a_completion_prompt_that_fills_the_context_is_named(server):
    # With max_tokens null no room is left for output: the prompt's fault (before: param "messages").
    error = assert_openai_error(post(server, *completion(prompt=[1] * 1024, max_tokens=None)))
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded", error
    # Nor with max_tokens given (or completions' default of 16): before, "reduce the prompt or max_tokens", with
    # param "max_tokens", though no max_tokens could help.
    for max_tokens in (1, "default"):
        fields = {} if max_tokens == "default" else {"max_tokens": max_tokens}
        error = assert_openai_error(post(server, "/v1/completions", {"prompt": [1] * 1030, **fields}))
        assert error["param"] == "prompt" and "the prompt has 1030: no room is left" in error["message"], error


def test_truncate_prompt_tokens_minus_one_leaves_room_for_max_tokens(server):
    # A prompt past the context, cut to what leaves max_tokens room (the one token EOS is the whole output).
    ids = list(range(100, 1130))
    response = post(server, *completion(prompt=ids, max_tokens=1020, truncate_prompt_tokens=-1, return_token_ids=True,
                                        allowed_token_ids=[2]))
    assert response.json()["choices"][0]["prompt_token_ids"] == ids[-4:], response.text
    for past in (0, 1025):  # -1 or 1 up to max_model_len
        error = assert_openai_error(post(server, *chat(truncate_prompt_tokens=past)))
        assert error["param"] == "truncate_prompt_tokens" and f"got {past}" in error["message"], error
    assert post(server, *chat(truncate_prompt_tokens=1024)).status_code == 200


@pytest.mark.parametrize("prompt", ["", ["Hi", ""]])
def test_an_empty_prompt_is_named(server, prompt):
    # Before: param null (the engine's check, which knows no request fields).
    error = assert_openai_error(post(server, *completion(prompt=prompt)))
    assert error["param"] == "prompt" and error["message"] == "the prompt is empty", error


def test_a_long_list_of_bad_values_gets_a_short_message(server):
    error = assert_openai_error(post(server, "/detokenize", {"tokens": [-1] * 10_000}))
    assert len(error["message"]) < 1000 and "more errors" in error["message"]


def test_refused_requests_leave_the_engine_idle(server):
    """After all those 400s nothing runs or waits, and requests are served."""
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(server.url("/metrics"), headers=server.headers).text
        gauges = {sample.name: sample.value for family in text_string_to_metric_families(text)
                  for sample in family.samples if sample.name.startswith("tokenmill:num_requests_")}
        if gauges["tokenmill:num_requests_running"] == gauges["tokenmill:num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, gauges
        time.sleep(0.2)
    assert post(server, *completion()).json()["usage"]["completion_tokens"] == 1


# ---- request chat templates (this server trusts them) -----------------------------------------------


def test_request_chat_template_renders(server, smollm2_tokenizer):
    template = "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
    response = post(server, *chat(chat_template=template))
    assert response.status_code == 200, response.text
    expected = smollm2_tokenizer.encode("[user] Hi\n", add_special_tokens=False)
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_documents_and_reasoning_effort_reach_the_chat_template(server, smollm2_tokenizer):
    # Before: both ignored (a warning in the log), the template rendered without them.
    template = ("{{ reasoning_effort }} {{ enable_thinking }}"
                "{% for d in documents or [] %} [{{ d.title }}: {{ d.text }}]{% endfor %}")
    documents = [{"title": "A", "text": "one"}, {"title": "B", "text": "two"}]

    def prompt(**fields) -> str:
        response = post(server, *chat(chat_template=template, return_token_ids=True, **fields))
        assert response.status_code == 200, response.text
        return smollm2_tokenizer.decode(response.json()["prompt_token_ids"])

    assert prompt(documents=documents, reasoning_effort="low") == "low True [A: one] [B: two]"
    assert prompt(documents=[], reasoning_effort="none") == "none False"
    assert prompt(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == "none True"


def test_default_chat_template_kwargs_and_the_content_format_reach_the_template(server, smollm2_tokenizer):
    """The server's --default-chat-template-kwargs (set in its --config file), under a request's own; the content
    format (auto) follows the template: parts for one that loops over content, one string for one that does not."""
    loops = ("{{ tm_default }} {{ tm_other }}|{% for m in messages %}{% if m.content is string %}S:{{ m.content }}"
             "{% else %}{% for p in m.content %}P:{{ p.text }};{% endfor %}{% endif %}{% endfor %}")
    prints = "{{ tm_default }} {{ tm_other }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]

    def prompt(template, messages, **fields) -> str:
        response = post(server, *chat(messages=messages, chat_template=template, return_token_ids=True, **fields))
        assert response.status_code == 200, response.text
        return smollm2_tokenizer.decode(response.json()["prompt_token_ids"])

    assert prompt(loops, HI) == "server server|P:Hi;"
    assert prompt(prints, parts, chat_template_kwargs={"tm_other": "request"}) == "server request|a\nb"
    # And the file's max-model-len gave way to the command line's.
    assert post(server, "/tokenize", {"prompt": "Hi"}).json()["max_model_len"] == 1024


def test_tokenize_renders_messages_as_the_chat_completion_does(server, smollm2_tokenizer):
    # Before: /tokenize ignored chat_template and chat_template_kwargs (the model's template, no variables).
    template = ("{{ tm_default }} {{ tm_other }} {{ add_generation_prompt }}|{% for m in messages %}{{ m.role }}:"
                "{{ m.content }};{% endfor %}{% for t in tools or [] %}T:{{ t.function.name }};{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    continued = [*HI, {"role": "assistant", "content": "Sure"}]
    for fields, expected in (
        ({"chat_template_kwargs": {"tm_other": "request"}, "tools": tools},
         "server request True|user:Hi;T:get_weather;"),
        ({"messages": continued, "add_generation_prompt": False, "continue_final_message": True},
         "server server False|user:Hi;assistant:Sure"),
    ):
        body = {"messages": HI, "chat_template": template, **fields}
        tokenized = post(server, "/tokenize", body)
        # tool_choice "none": this server has no tool parser for "auto"; the tools still reach the template.
        chat_response = post(server, *chat(return_token_ids=True, tool_choice="none", **body))
        assert tokenized.status_code == chat_response.status_code == 200, (tokenized.text, chat_response.text)
        assert tokenized.json()["tokens"] == chat_response.json()["prompt_token_ids"]
        assert smollm2_tokenizer.decode(tokenized.json()["tokens"]) == expected


def test_load_counts_the_generation_requests_in_flight(server):
    """vLLM's /load with --enable-server-load-tracking: a stream counts until it ends."""
    def load() -> int:
        return httpx.get(server.url("/load"), headers=server.headers, timeout=30).json()["server_load"]

    def settles_at_zero() -> None:
        deadline = time.monotonic() + 20
        while load() != 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)

    settles_at_zero()
    body = {"messages": HI, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url("/v1/chat/completions"), json=body, headers=server.headers,
                      timeout=60) as response:
        lines = response.iter_lines()  # held: a dropped iterator closes the connection
        assert next(lines).startswith("data: ")
        assert load() == 1
    settles_at_zero()  # the client went away: the stream ended


@pytest.mark.parametrize("template", ["{{ 1 // 0 }}", "{{ raise_exception('no') }}", "{% for %}"])
def test_a_failing_request_chat_template_is_a_400(server, template):
    assert_openai_error(post(server, *chat(chat_template=template)))


def test_a_slow_chat_template_does_not_stall_other_requests(server):
    # Some 3 s of Jinja on a small CPU (the sandbox caps a range at 100,000 items, not a loop nest).
    slow = "{% for i in range(400) %}{% for j in range(100000) %}{% set x = i * j %}{% endfor %}{% endfor %}Hi"
    result = {}
    thread = threading.Thread(target=lambda: result.update(response=post(server, *chat(chat_template=slow))))
    started = time.monotonic()
    thread.start()
    time.sleep(0.3)  # rendering by now
    latencies = []
    for _ in range(5):
        start = time.monotonic()
        assert httpx.get(server.url("/health"), timeout=30).status_code == 200
        latencies.append(time.monotonic() - start)
    still_rendering = thread.is_alive()
    thread.join()
    assert result["response"].status_code == 200, result["response"].text
    assert still_rendering, f"the template rendered too fast to tell ({time.monotonic() - started:.1f} s)"
    assert max(latencies) < 0.5, latencies


@pytest.mark.parametrize("written_by", ["prompt", "chat_template"])
def test_a_huge_prompt_does_not_hold_up_other_requests(server, written_by):
    """Two million characters take over a second to tokenize (then a 400: longer than max_model_len); a short
    request sent meanwhile is tokenized and served beside them, not queued behind them on one tokenizer thread. So
    too where the chat template writes them from a short message (the tools, documents or a loop of the template's
    own), whose tokenization ran on the one tokenizer thread before."""
    if written_by == "prompt":
        huge = " ".join(["lorem", "ipsum", "dolor", "sit", "amet", "42", "x"] * 50_000) * 2
        huge_request, short_request = completion(prompt=huge), completion()
    else:
        template = "{{ 'lorem ipsum dolor sit amet 42 x ' * 70000 }}"  # 2.4 million characters
        huge_request, short_request = chat(chat_template=template), chat()
    result = {}
    thread = threading.Thread(target=lambda: result.update(response=post(server, *huge_request)))
    thread.start()
    time.sleep(0.3)  # tokenizing by now
    short = post(server, *short_request)
    still_tokenizing = thread.is_alive()
    thread.join()
    assert short.status_code == 200, short.text
    assert "context length" in assert_openai_error(result["response"])["message"]
    assert still_tokenizing, "the huge prompt was tokenized too fast to tell"
