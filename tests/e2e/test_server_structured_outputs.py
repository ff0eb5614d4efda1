"""Structured outputs through the server (issue 18): response_format, vLLM's structured_outputs and its
older guided_* keys on /v1/chat/completions and /v1/completions, through the openai SDK against a real
`tokenmill serve` on SmolLM2 (the shared server of conftest.py). What does not compile is a 400 naming the
field it came in; what does constrains the output, greedy and sampled."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_harness import SHARED_SERVER_MODEL

pytestmark = pytest.mark.slow

MODEL = SHARED_SERVER_MODEL
MAX_TOKENS = 200
"""Room enough for every constrained output below to end by itself (finish_reason stop)."""

PERSON = {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "urn:person", "title": "Person",  # annotations
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12, "description": "first name", "examples": ["Ann"]},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150, "default": 30, "$comment": "years"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"
COLORS = ["red", "green", "blue"]
YES_NO = 'root ::= "yes" | "no"'
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
ASK_PHONE = [{"role": "user", "content": "Give me a phone number."}]
ASK_COLOR = [{"role": "user", "content": "What color is the sky?"}]
SAMPLED = {"temperature": 0.8, "seed": 1234}
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def client(shared_server):
    return shared_server.openai_client()


def chat(client, messages, **kwargs) -> str:
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, **kwargs)
    [choice] = response.choices
    assert choice.finish_reason == "stop", choice  # the constraint ended the output, not max_tokens
    return choice.message.content


def complete(client, prompt, **kwargs) -> str:
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, **kwargs)
    [choice] = response.choices
    assert choice.finish_reason == "stop", choice
    return choice.text


def json_schema_format(schema: dict | None, name: str = "person") -> dict:
    spec = {"name": name, "strict": True}
    if schema is not None:
        spec["schema"] = schema
    return {"type": "json_schema", "json_schema": spec}


# ---- what does not compile, or is not supported: 400s naming the field ---------------------------

def expect_400(call, param: str, *words: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value
    assert error.status_code == 400 and error.param == param, (error.param, error.body)
    message = error.body["message"] if isinstance(error.body, dict) else str(error)
    for word in words:
        assert word in message, message
    return error


INVALID = [  # (id, extra_body, param, words in the message)
    ("response_format_schema", {"response_format": json_schema_format({"type": "nonsense"})},
     "response_format", ["JSON schema"]),
    ("structured_outputs_schema", {"structured_outputs": {"json": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}}, "structured_outputs", ["JSON schema"]),
    ("structured_outputs_schema_text", {"structured_outputs": {"json": "{not json"}}, "structured_outputs",
     ["not valid JSON"]),
    ("guided_json", {"guided_json": {"type": "nonsense"}}, "guided_json", ["JSON schema"]),
    # Parts xgrammar would silently leave out (tests/unit/test_json_schema_check.py): refused, each named.
    ("response_format_unenforced", {"response_format": json_schema_format({**PERSON, "properties": {
        **PERSON["properties"], "tags": {"type": "array", "uniqueItems": True}, "n": {"type": "integer", "not": {
            "const": 3}}}})}, "response_format", ["cannot enforce", "uniqueItems at #/properties/tags",
                                                  "not at #/properties/n", "nor can llguidance",
                                                  'Unimplemented keys: ["uniqueItems"]']),
    ("guided_json_unenforced", {"guided_json": {"type": "string", "format": "regex"}}, "guided_json",
     ["cannot enforce", "format 'regex'"]),
    # Before: a 500 (a TypeError in the check of what xgrammar leaves out).
    ("guided_json_format_not_a_string", {"guided_json": {"type": "string", "format": {}}}, "guided_json",
     ["JSON schema"]),
    ("structured_outputs_regex", {"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", ["regex"]),
    ("guided_regex", {"guided_regex": "(unclosed"}, "guided_regex", ["regex"]),
    ("structured_outputs_grammar", {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
     "structured_outputs", ["grammar"]),
    ("guided_grammar", {"guided_grammar": "this is not ebnf"}, "guided_grammar", ["grammar"]),
    ("empty_choice", {"structured_outputs": {"choice": []}}, "structured_outputs", ["choice"]),
    # xgrammar cannot match a NUL alone (outside a class of more): it dropped it, and "a" was the answer (200s).
    ("choice_with_nul", {"structured_outputs": {"choice": ["a\x00b", "c"]}}, "structured_outputs", ["NUL"]),
    ("regex_with_nul", {"guided_regex": r"a\x00b"}, "guided_regex", ["NUL"]),
    ("regex_with_nul_escape", {"structured_outputs": {"regex": r"a(\u0000|\0)?b"}}, "structured_outputs", ["NUL"]),
    ("regex_with_a_class_of_nul", {"guided_regex": r"a[\x00]b"}, "guided_regex", ["NUL"]),
    ("nothing_in_structured_outputs", {"structured_outputs": {}}, "structured_outputs", ["exactly one"]),
    ("two_in_structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     ["exactly one"]),
    ("response_format_and_structured_outputs", {"response_format": {"type": "json_object"},
                                                "structured_outputs": {"regex": "a+"}},
     "structured_outputs", ["response_format", "structured_outputs"]),
    ("structured_outputs_and_guided", {"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]},
     "guided_choice", ["structured_outputs", "guided_choice"]),
    ("two_guided", {"guided_json": PERSON, "guided_regex": "a+"}, "guided_regex", ["guided_json", "guided_regex"]),
    ("structural_tag", {"structured_outputs": {"structural_tag": json.dumps({"structures": [], "triggers": []})}},
     "structured_outputs", ["structural tag", "triggers"]),
    ("top_level_structural_tag", {"structural_tag": json.dumps({"structures": [], "triggers": []})},
     "structural_tag", ["structural tag", "triggers"]),
    ("top_level_structural_tag_and_guided", {"guided_regex": "a+", "structural_tag": "{}"}, "structural_tag",
     ["guided_regex", "structural_tag"]),
    ("structural_tag_schema", {"structured_outputs": {"structural_tag": {"structures": [
        {"begin": "<p>", "schema": {"type": "nonsense"}, "end": "</p>"}], "triggers": ["<p>"]}}},
     "structured_outputs", ["structural tag", "structures[0].schema"]),
    ("response_format_structural_tag", {"response_format": {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<x>"], "tags": [{"type": "tag", "begin": "<p>", "end": "</p>",
                                                                  "content": {"type": "any_text"}}]}}},
     "response_format", ["structural tag", "trigger"]),
    ("response_format_structural_tag_empty", {"response_format": {"type": "structural_tag"}}, "response_format",
     ["format", "structures"]),
    # xgrammar builds these without the vocabulary, then fails to compile them in the engine: before, the request
    # was aborted there, a 200 with empty content and finish_reason "abort".
    ("structural_tag_token_past_the_vocabulary", {"response_format": {"type": "structural_tag", "format": {
        "type": "sequence", "elements": [{"type": "const_string", "value": "A"}, {"type": "token", "token": 49152}]}}},
     "response_format", ["token id 49152", "vocabulary"]),
    ("structural_tag_excluding_a_token_past_the_vocabulary", {"structured_outputs": {"structural_tag": {
        "type": "structural_tag", "format": {"type": "any_tokens", "exclude_tokens": [2, 10**6]}}}},
     "structured_outputs", ["token id 1000000", "vocabulary"]),
    ("structural_tag_excluding_no_token", {"structured_outputs": {"structural_tag": {
        "type": "structural_tag", "format": {"type": "exclude_token"}}}}, "structured_outputs", ["exclude_tokens"]),
    ("grammar_token_past_the_vocabulary", {"structured_outputs": {"grammar": 'root ::= "[" Token(99999) "]"'}},
     "structured_outputs", ["token id 99999"]),
    ("json_schema_negative_min_length", {"response_format": json_schema_format({**PERSON, "properties": {
        **PERSON["properties"], "name": {"type": "string", "minLength": -1}}})}, "response_format",
     ["#/properties/name/minLength: -1 is less than the minimum of 0"]),
    ("json_schema_negative_property_name_length", {"structured_outputs": {"json": {
        "type": "object", "propertyNames": {"minLength": -1}}}}, "structured_outputs",
     ["#/propertyNames/minLength: -1"]),
    ("json_schema_malformed_keyword", {"structured_outputs": {"json": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": "0"}}}}}, "structured_outputs",
     ["#/properties/n/minimum: '0' is not of type 'number'"]),
    ("structural_tag_excluding_the_empty_text", {"response_format": {"type": "structural_tag", "format": {
        "type": "any_text", "excludes": [""]}}}, "response_format", ["structural tag", "non-empty string"]),
    ("unknown_structured_outputs_option", {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
     "structured_outputs", ["whitespace_pattern"]),
    ("guided_whitespace_pattern", {"guided_json": PERSON, "guided_whitespace_pattern": r"[\n ]*"},
     "guided_whitespace_pattern", ["not supported"]),
    ("json_schema_without_name", {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
     "response_format.json_schema.name", []),
    ("json_schema_missing", {"response_format": {"type": "json_schema"}}, "response_format", ["json_schema"]),
    ("unknown_response_format", {"response_format": {"type": "xml"}}, "response_format.type", []),
]


@pytest.mark.parametrize(("extra", "param", "words"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_chat_requests_are_400s(client, extra, param, words):
    expect_400(lambda: client.chat.completions.create(model=MODEL, messages=ASK_PHONE, max_tokens=5,
                                                      extra_body=extra), param, *words)


@pytest.mark.parametrize("name", ["response_format_schema", "guided_regex", "structured_outputs_grammar",
                                  "two_guided", "structural_tag", "top_level_structural_tag",
                                  "grammar_token_past_the_vocabulary", "json_schema_negative_min_length",
                                  "structural_tag_excluding_the_empty_text", "guided_json_format_not_a_string"])
def test_invalid_completion_requests_are_400s(client, name):
    [(extra, param, words)] = [c[1:] for c in INVALID if c[0] == name]
    expect_400(lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, extra_body=extra),
               param, *words)


def test_auto_tool_choice_is_refused_without_the_flags(client):
    """tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice (test_server_tools.py)."""
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    expect_400(lambda: client.chat.completions.create(model=MODEL, messages=ASK_PHONE, max_tokens=3, tools=tools),
               "tool_choice", "--enable-auto-tool-choice")
    response = client.chat.completions.create(model=MODEL, messages=ASK_PHONE, max_tokens=3, tools=tools,
                                              tool_choice="none")
    assert response.choices[0].message.content is not None


def test_response_format_text_is_unconstrained(client):
    response = client.chat.completions.create(model=MODEL, messages=ASK_PHONE, max_tokens=3,
                                              response_format={"type": "text"})
    assert response.choices[0].finish_reason == "length"


# ---- valid requests constrain the output (these need the engine side of structured outputs) -------

def test_bans_that_leave_the_grammar_no_token_are_a_400(client):
    """allowed_token_ids of EOS alone: the choice's grammar allows none of it at the first token. Found only while
    generating: a full response is a 400, a stream ends with the error event (the SDK raises it)."""
    body = {"structured_outputs": {"choice": COLORS}, "allowed_token_ids": [0]}
    error = expect_400(lambda: client.chat.completions.create(model=MODEL, messages=ASK_COLOR, extra_body=body),
                       None, "no token was left", "allowed_token_ids")
    assert error.code == "no_token_left"
    expect_400(lambda: client.completions.create(model=MODEL, prompt="The sky is", extra_body=body), None,
               "no token was left")
    with pytest.raises(openai.APIError, match="no token was left"):
        for _ in client.chat.completions.create(model=MODEL, messages=ASK_COLOR, extra_body=body, stream=True):
            pass
    assert chat(client, ASK_COLOR, extra_body={"structured_outputs": {"choice": COLORS}}) in COLORS


def test_a_grammar_that_fails_to_compile_in_the_engine_is_a_400(client):
    """A spec the server's check passes but the engine cannot compile (llguidance runs out of fuel on this
    multipleOf once the tokenizer is bound, which the check does not do): a 200 with no text and finish_reason
    "abort" before; now a 400 with the compiler's reason, whole or streamed (the error event), and the engine serves
    on. (Should the check learn to refuse this spec, its 400 changes code: pick another the engine fails on.)"""
    body = {"guided_json": {"type": "number", "multipleOf": 2147483647}}
    error = expect_400(lambda: client.completions.create(model=MODEL, prompt="A number:", max_tokens=8,
                                                         extra_body=body), None, "could not be compiled", "fuel")
    assert error.code == "structured_outputs_failed"
    with pytest.raises(openai.APIError, match="could not be compiled"):
        for _ in client.chat.completions.create(model=MODEL, messages=ASK_COLOR, max_tokens=8, extra_body=body,
                                                stream=True):
            pass
    assert chat(client, ASK_COLOR, extra_body={"structured_outputs": {"choice": COLORS}}) in COLORS


def outside_strings(text: str) -> str:
    """JSON text with its strings emptied: what the grammar's whitespace rules shape."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_chat_json_schema(client, sampling):
    text = chat(client, ASK_PERSON, response_format=json_schema_format(PERSON), **sampling)
    jsonschema.validate(json.loads(text), PERSON)
    # structured_outputs_config's disable_any_whitespace, true by default: xgrammar's ", " and ": " only.
    assert not re.search(r"\s", outside_strings(text).replace(", ", ",").replace(": ", ":")), text


# minLength/maxLength beside a pattern or a format: xgrammar would leave the lengths out; the server's backend auto
# has llguidance enforce them (each output checked; jsonschema checks no uri format without rfc3987: its scheme).
LENGTHS = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 3, "maxLength": 5},
    "site": {"type": "string", "format": "uri", "maxLength": 30}}, "required": ["code", "site"],
    "additionalProperties": False}


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_chat_json_schema_that_only_llguidance_enforces(client, sampling):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A product code and a website, as JSON."}], n=3,
        max_tokens=MAX_TOKENS, response_format=json_schema_format(LENGTHS, "product"), **sampling)
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        jsonschema.validate(value, LENGTHS)
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:\S*", value["site"]), value
        assert not re.search(r"\s", outside_strings(choice.message.content)), choice  # llguidance's compact JSON


# Patterns naming a character JSON escapes: xgrammar wrote it into the string unescaped (SmolLM2 answered '"27""' and
# '"C:\\Users"': not JSON, or JSON breaking the pattern); the server's backend auto has llguidance enforce them.
ESCAPED = {"type": "object", "properties": {
    "size": {"type": "string", "pattern": '^[0-9]{2}"$'},
    "path": {"type": "string", "pattern": r"^C:\\[A-Za-z]{1,8}$"},
    "lines": {"type": "string", "pattern": r"^[a-z]{1,5}\n[a-z]{1,5}$"}}, "required": ["size", "path", "lines"],
    "additionalProperties": False}


def test_chat_json_schema_pattern_of_characters_json_escapes(client):
    text = chat(client, [{"role": "user", "content": "A screen size, a folder and two words, as JSON."}],
                response_format=json_schema_format(ESCAPED, "screen"), **GREEDY)
    jsonschema.validate(strict_json(text), ESCAPED)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_responses_text_format_json_schema(client, streamed):
    """/v1/responses' text.format json_schema is chat's response_format: the same JSON, valid for the schema."""
    text_format = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    kwargs = dict(model=MODEL, input=ASK_PERSON[0]["content"], text=text_format, max_output_tokens=MAX_TOKENS,
                  **GREEDY)
    if streamed:
        with client.responses.stream(**kwargs) as stream:
            response = stream.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    assert response.status == "completed" and response.text.format.type == "json_schema", response
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.output_text == chat(client, ASK_PERSON, response_format=json_schema_format(PERSON), **GREEDY)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_chat_json_object(client, sampling):
    text = chat(client, ASK_PERSON, response_format={"type": "json_object"}, **sampling)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_chat_regex(client, sampling):
    text = chat(client, ASK_PHONE, extra_body={"structured_outputs": {"regex": PHONE}}, **sampling)
    assert re.fullmatch(PHONE, text), text


DOMAIN = r"[a-z]{2,8}\x2Ecom"
HEX_ESCAPES = [{"structured_outputs": {"regex": DOMAIN}},
               {"structured_outputs": {"grammar": r'root ::= [a-z] [a-z]+ "\x2Ecom"'}},  # GBNF's \xHH
               {"response_format": {"type": "structural_tag", "format": {"type": "regex", "pattern": DOMAIN}}}]


@pytest.mark.parametrize("extra", HEX_ESCAPES, ids=["regex", "grammar", "structural_tag_regex"])
def test_chat_hex_escapes(client, extra):
    """\\xHH is two hex digits, as in every regex dialect and GBNF: xgrammar read every hex digit after \\x, so
    \\x2Ecom was U+02EC then "om" (a 200 with "abˬom" before, not "ab.com")."""
    text = chat(client, [{"role": "user", "content": "Name a website."}], extra_body=extra, **GREEDY)
    assert re.fullmatch(DOMAIN, text), text


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_chat_choice(client, sampling):
    assert chat(client, ASK_COLOR, extra_body={"structured_outputs": {"choice": COLORS}}, **sampling) in COLORS


def test_chat_grammar(client):
    text = chat(client, [{"role": "user", "content": "Is the sky blue?"}],
                extra_body={"structured_outputs": {"grammar": YES_NO}}, **GREEDY)
    assert text in ("yes", "no")


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_chat_guided_json_alias(client, sampling):
    # guided_decoding_backend is accepted and ignored (always xgrammar).
    text = chat(client, ASK_PERSON, extra_body={"guided_json": PERSON, "guided_decoding_backend": "xgrammar"},
                **sampling)
    jsonschema.validate(json.loads(text), PERSON)


def test_chat_guided_aliases(client):
    assert re.fullmatch(PHONE, chat(client, ASK_PHONE, extra_body={"guided_regex": PHONE}, **GREEDY))
    assert chat(client, ASK_COLOR, extra_body={"guided_choice": COLORS}, **GREEDY) in COLORS
    assert chat(client, ASK_COLOR, extra_body={"guided_grammar": YES_NO}, **GREEDY) in ("yes", "no")


def test_chat_schema_as_json_text(client):
    text = chat(client, ASK_PERSON, extra_body={"structured_outputs": {"json": json.dumps(PERSON)}}, **GREEDY)
    jsonschema.validate(json.loads(text), PERSON)


def test_chat_json_schema_streamed_with_n(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=MAX_TOKENS, n=2,
                                            stream=True, response_format=json_schema_format(PERSON), **SAMPLED)
    texts, finish = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert finish == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_chat_structural_tags(client):
    """Free text, then tagged JSON: the legacy form (the model writes the trigger itself, copying it) and the
    format object, in structured_outputs and in response_format (streamed), and the legacy form at the top level."""
    copy = [{"role": "user", "content": 'Repeat exactly: <person>{"name": "Ann", "age": 31}</person>'}]
    legacy = {"structures": [{"begin": "<person>", "schema": PERSON, "end": "</person>"}], "triggers": ["<person>"]}
    tag = {"type": "tag", "begin": "<person>", "content": {"type": "json_schema", "json_schema": PERSON},
           "end": "</person>"}
    fmt = {"type": "sequence", "elements": [{"type": "const_string", "value": "Person: "}, tag]}
    texts = [chat(client, copy, extra_body={"structured_outputs": {"structural_tag": json.dumps(legacy)}}, **GREEDY)]
    stream = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=MAX_TOKENS, stream=True,
                                            response_format={"type": "structural_tag", "format": fmt}, **GREEDY)
    texts.append("".join(c.delta.content or "" for chunk in stream for c in chunk.choices))
    assert texts[1].startswith("Person: <person>")
    # vLLM's older top-level structural_tag (before: ignored, with a warning in the log) is the legacy form's alias.
    assert chat(client, copy, extra_body={"structural_tag": json.dumps(legacy)}, **GREEDY) == texts[0]
    for text in texts:
        parts = re.findall(r"<person>(.*?)</person>", text)
        assert parts, text
        for part in parts:
            jsonschema.validate(json.loads(part), PERSON)


def test_structural_tag_tokens_in_the_vocabulary(client, smollm2_tokenizer):
    """Token formats by id: the last id of the vocabulary is one, an exclusion leaves the others."""
    last = len(smollm2_tokenizer) - 1
    [paris] = smollm2_tokenizer.encode(" Paris")
    fmt = {"type": "sequence", "elements": [{"type": "token", "token": paris}, {"type": "exclude_token",
                                                                              "exclude_tokens": [last]}]}
    response = client.chat.completions.create(model=MODEL, messages=ASK_PHONE, max_tokens=5, **GREEDY,
                                              response_format={"type": "structural_tag", "format": fmt})
    assert response.choices[0].message.content.startswith(" Paris") and response.choices[0].finish_reason == "stop"
    fmt = {"type": "token", "token": last}
    assert client.chat.completions.create(model=MODEL, messages=ASK_PHONE, max_tokens=5, **GREEDY,
                                          response_format={"type": "structural_tag", "format": fmt},
                                          ).choices[0].finish_reason == "stop"


PERSON_PROMPT = "Here is a person described as JSON with a name and an age:"


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_completion_json_schema(client, sampling):
    text = complete(client, PERSON_PROMPT, extra_body={"response_format": json_schema_format(PERSON)}, **sampling)
    jsonschema.validate(json.loads(text), PERSON)


def test_completion_json_object(client):
    text = complete(client, PERSON_PROMPT, extra_body={"response_format": {"type": "json_object"}}, **GREEDY)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_completion_regex_and_choice(client, sampling):
    text = complete(client, "My phone number is", extra_body={"structured_outputs": {"regex": PHONE}}, **sampling)
    assert re.fullmatch(PHONE, text), text
    text = complete(client, "The sky is", extra_body={"structured_outputs": {"choice": COLORS}}, **sampling)
    assert text in COLORS


def test_completion_guided_json_alias(client):
    text = complete(client, PERSON_PROMPT, extra_body={"guided_json": PERSON}, **GREEDY)
    jsonschema.validate(json.loads(text), PERSON)


def test_completion_several_prompts_share_the_constraint(client):
    response = client.completions.create(model=MODEL, prompt=["My number:", "Call me at"], max_tokens=MAX_TOKENS,
                                         extra_body={"guided_regex": PHONE}, **GREEDY)
    assert len(response.choices) == 2
    for choice in response.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(PHONE, choice.text), choice


def strict_json(text: str):
    """As a strict parser (JavaScript's JSON.parse) reads it: no NaN or Infinity."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


LOGPROBS_OF_RULED_OUT = [  # a constraint that allows far fewer than 20 first tokens, and the 20 most likely asked
    ("/v1/chat/completions", {"messages": ASK_PERSON, "response_format": {"type": "json_object"}, "logprobs": True,
                              "top_logprobs": 20}),
    ("/v1/completions", {"prompt": "Is the sky blue?", "guided_choice": ["yes", "no"], "logprobs": 20}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
@pytest.mark.parametrize(("path", "body"), LOGPROBS_OF_RULED_OUT, ids=["chat", "completion"])
def test_logprobs_of_ruled_out_tokens_are_json_numbers(shared_server, path, body, stream):
    # Their -inf logprobs were a 500 (the encoder refuses infinity) or -Infinity in a stream; now -9999, as vLLM's.
    response = httpx.post(shared_server.url(path), headers=shared_server.headers, timeout=120,
                          json={**body, "model": MODEL, "max_tokens": 1, "stream": stream})
    assert response.status_code == 200, response.text
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: {")]
    logprobs = [choice["logprobs"] for payload in map(strict_json, events if stream else [response.text])
                for choice in payload["choices"] if choice["logprobs"] is not None]
    if path == "/v1/chat/completions":
        [top] = [[alt["logprob"] for alt in entry["top_logprobs"]] for lp in logprobs for entry in lp["content"]]
    else:
        [top] = [list(alts.values()) for lp in logprobs for alts in lp["top_logprobs"]]
    assert len(top) == 20 and min(top) == -9999.0, top


def test_the_server_still_serves(client):
    """After the 400s and the constrained requests, an unconstrained request is served as before."""
    response = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length" and len(response.choices[0].text) > 0
