"""tool_choice and reasoning in the chat server, without an engine: what a request's tools plan, and one
choice's text turned into message fields, whole and streamed (a stream cut anywhere assembles to the whole)."""

from __future__ import annotations

import copy
import json

import pytest

from tokenmill.engine.chat_template import normalize_messages
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.protocol import EngineCoreOutput
from tokenmill.sampling_params import RequestOutputKind
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError
from tokenmill.server.openai_protocol import ChatCompletionRequest
from tokenmill.server.reasoning_parsers import get_reasoning_parser
from tokenmill.server.sampling import to_sampling_params
from tokenmill.server.tools import ChoiceText, decode_options, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
AUTO = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kwargs})


def streamed(text: ChoiceText, pieces: list[str], reason: str = "stop") -> dict:
    """The deltas of a stream assembled as a client does."""
    message: dict = {}
    calls: dict[int, dict] = {}
    deltas = [text.feed(piece) for piece in pieces] + [text.finish()]
    for delta in deltas:
        for key in ("content", "reasoning_content"):
            if delta.get(key):
                message[key] = message.get(key, "") + delta[key]
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"id": entry.get("id"), "type": "function",
                                                     "function": {"name": None, "arguments": ""}})
            call["function"]["name"] = entry["function"].get("name") or call["function"]["name"]
            call["function"]["arguments"] += entry["function"].get("arguments", "")
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    message["finish_reason"] = text.finish_reason(reason)
    return message


def strip_ids(message: dict) -> dict:
    for call in message.get("tool_calls", []):
        assert call["id"].startswith("call_")
        call["id"] = None
    return {k: v for k, v in message.items() if v is not None}


def test_plans():
    assert plan_tools(request(), AUTO, False).mode == "none"
    assert plan_tools(request(tools=[WEATHER], tool_choice="none"), ServerConfig(), False).mode == "none"
    assert plan_tools(request(tools=[WEATHER]), AUTO, False).mode == "auto"
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        plan_tools(request(tools=[WEATHER]), ServerConfig(), False)
    with pytest.raises(APIError, match="not in tools"):
        plan_tools(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}), AUTO, False)
    with pytest.raises(APIError, match="response_format"):
        plan_tools(request(tools=[WEATHER], tool_choice="required"), AUTO, True)
    with pytest.raises(APIError, match="needs tools"):
        plan_tools(request(tool_choice="required"), AUTO, False)
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), AUTO, False)
    schema = json.loads(plan.constraint.params.key[1])
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    named = plan_tools(request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                   "function": {"name": "get_time"}}), AUTO, False)
    assert named.named == "get_time"


def test_template_messages_parse_arguments():
    [message] = normalize_messages([{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}])
    assert message["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    [message] = normalize_messages([message])  # already an object (offline callers may pass one): kept
    assert message["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    with pytest.raises(ValueError, match="arguments"):
        normalize_messages([{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}])


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_forced_whole_equals_streamed(cut):
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), AUTO, False)
    output = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]'
    whole = ChoiceText(plan, None)
    message = whole.full(output)
    assert message["content"] is None and whole.finish_reason("stop") == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}, {}]
    pieces = [output[i:i + cut] for i in range(0, len(output), cut)]
    stream = streamed(ChoiceText(plan, None), pieces)
    assert strip_ids(stream) == {**strip_ids(message), "finish_reason": "tool_calls"}
    cut_off = ChoiceText(plan, None)
    assert cut_off.full(output[:20]) == {"content": output[:20]} and cut_off.finish_reason("length") == "length"


@pytest.mark.parametrize("cut", [1, 2, 5, 11])
def test_auto_with_reasoning_whole_equals_streamed(cut):
    plan = plan_tools(request(tools=[WEATHER]), AUTO, False)
    reasoning = get_reasoning_parser("deepseek_r1")
    output = ('<think>They want the weather.</think>Let me look.\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Paris"}}\n</tool_call>')
    whole = ChoiceText(plan, reasoning)
    message = whole.full(output)
    assert message["reasoning_content"] == "They want the weather."
    assert message["content"] == "Let me look.\n"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    pieces = [output[i:i + cut] for i in range(0, len(output), cut)]
    assert strip_ids(streamed(ChoiceText(plan, reasoning), pieces)) == {**strip_ids(message),
                                                                         "finish_reason": "tool_calls"}


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["reasoning", "reasoning-and-auto-tools"])
def test_markers_that_are_special_tokens_still_split(smollm2_tokenizer, tools):
    """A tokenizer with <think>, </think> and <tool_call> as special tokens (as GGUF conversions make them): the
    output decoded as the server asks still splits reasoning and calls off, whole and token by token alike, while
    other special tokens stay skipped."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>", "<tool_call>", "</tool_call>"]})
    req = request(tools=tools)
    plan, reasoning = plan_tools(req, AUTO, False), get_reasoning_parser("deepseek_r1")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' if tools else ""
    ids = tok.encode("<think>Sunny?<|im_start|></think>Let me look." + call)
    params = to_sampling_params(req, 100, defaults={}, **decode_options(plan, reasoning, tok))
    params.output_kind = RequestOutputKind.DELTA
    processor = OutputProcessor(tok)
    processor.add_request("r", None, tok.encode("Hi"), params, arrival_time=0.0)
    deltas = [processor.process_outputs([EngineCoreOutput("r", [t])])[0][0].outputs[0].text for t in ids]
    message = ChoiceText(plan, reasoning).full("".join(deltas))
    assert message["reasoning_content"].startswith("Sunny?") and message["content"] == "Let me look."
    if tools:
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    else:  # only the markers are kept: <|im_start|> is skipped as the request's skip_special_tokens asks
        assert message["reasoning_content"] == "Sunny?"
    assert strip_ids(streamed(ChoiceText(plan, reasoning), deltas)) == {
        **strip_ids(message), "finish_reason": "tool_calls" if tools else "stop"}


STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
SPECIAL_MARKER_CALLS = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "deepseek_v31": ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "kimi_k2": ("Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'),
}
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "<|tool_call|>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
                 "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<|tool_calls_section_begin|>",
                 "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                 "<|tool_calls_section_end|>"]


@pytest.fixture(scope="module")
def marker_tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer with the tool parsers' markers as special tokens, as their models' tokenizers have them,
    and the server's grammar compiler on it."""
    from tokenmill.structured.compiler import GrammarCompiler

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": MARKER_TOKENS})
    compiler = GrammarCompiler(lambda: tok, len(tok), num_threads=1)
    yield tok, compiler
    compiler.shutdown()


@pytest.mark.parametrize("name", SPECIAL_MARKER_CALLS)
def test_a_strict_tags_trigger_that_is_a_special_token_starts_the_call(marker_tokenizer, name):
    """Under "auto", a strict tool's structural tag fires on its trigger when the model writes it as one special
    token (xgrammar's vocabulary holds the added token's text), the call held to the schema from there; decoded as
    the server asks, the text keeps the markers, and the call comes out valid."""
    import xgrammar as xgr

    (tok, compiler), text = marker_tokenizer, SPECIAL_MARKER_CALLS[name]
    req = request(tools=[STRICT_WEATHER])
    plan = plan_tools(req, ServerConfig(enable_auto_tool_choice=True, tool_call_parser=name), False)
    compiled = compiler.get(plan.constraint.params)
    ids = tok.encode(text)
    assert tok.convert_tokens_to_ids(plan.parser.strict_trigger) in ids  # one token, not its text's pieces
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[tok.eos_token_id])
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    for token in ids + [tok.eos_token_id]:
        matcher.fill_next_token_bitmask(bitmask)
        assert int(bitmask[0, token // 32]) >> (token % 32) & 1, tok.convert_ids_to_tokens(token)
        assert matcher.accept_token(token), tok.convert_ids_to_tokens(token)
    assert matcher.is_terminated()
    off_schema = xgr.GrammarMatcher(compiled, override_stop_tokens=[tok.eos_token_id])
    assert not all(off_schema.accept_token(t) for t in tok.encode(text.replace('"Paris"', "3")))
    params = to_sampling_params(req, 100, defaults={}, **decode_options(plan, None, tok))
    params.output_kind = RequestOutputKind.DELTA
    processor = OutputProcessor(tok)
    processor.add_request("r", None, tok.encode("Hi"), params, arrival_time=0.0)
    deltas = [processor.process_outputs([EngineCoreOutput("r", [t])])[0][0].outputs[0].text for t in ids]
    assert "".join(deltas) == text
    for message in (ChoiceText(plan, None).full(text), streamed(ChoiceText(plan, None), deltas)):
        [call] = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_reasoning_parsers_own_special_markers_are_kept(smollm2_tokenizer):
    """Magistral's [THINK] and [/THINK] are special tokens: kept in the text for the mistral parser, as <think> is
    for the others; Granite's plain-text sentences need nothing kept."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    req = request()
    plan, reasoning = plan_tools(req, AUTO, False), get_reasoning_parser("mistral")
    options = decode_options(plan, reasoning, tok)
    assert options == {"keep_special_token_ids": tok.convert_tokens_to_ids(["[THINK]", "[/THINK]"])}
    assert decode_options(plan, get_reasoning_parser("granite"), tok) == {"keep_special_token_ids": []}
    params = to_sampling_params(req, 100, defaults={}, **options)
    params.output_kind = RequestOutputKind.DELTA
    processor = OutputProcessor(tok)
    processor.add_request("r", None, tok.encode("Hi"), params, arrival_time=0.0)
    ids = tok.encode("[THINK]Add them.<|im_start|>[/THINK]4")
    deltas = [processor.process_outputs([EngineCoreOutput("r", [t])])[0][0].outputs[0].text for t in ids]
    assert ChoiceText(plan, reasoning).full("".join(deltas)) == {"reasoning_content": "Add them.", "content": "4"}


def test_auto_without_calls_is_content():
    plan = plan_tools(request(tools=[WEATHER]), AUTO, False)
    text = ChoiceText(plan, None)
    assert text.full("Hello there") == {"content": "Hello there"} and text.finish_reason("stop") == "stop"


def test_forced_calls_to_tools_whose_parameters_use_refs():
    """pydantic writes nested models as "$defs" and "#/$defs/..." references: the forced call's schema, which
    nests the parameters, must keep them pointing at their definitions."""
    import xgrammar as xgr

    from tokenmill.structured.grammar import build_grammar

    parameters = {"type": "object", "properties": {"enum": {"$ref": "#/$defs/Place"}, "next": {"$ref": "#"},
                                                   "place": {"$ref": "#/$defs/Place"}},
                  "required": ["place"], "additionalProperties": False,
                  "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                                      "required": ["city"], "additionalProperties": False}}}
    trip = {"type": "function", "function": {"name": "trip", "parameters": parameters}}
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]))
    good = {"enum": {"city": "Oslo"}, "next": {"place": {"city": "Rome"}}, "place": {"city": "Paris"}}
    for choice, wrap in (("required", lambda call: [call]), ({"type": "function", "function": {"name": "trip"}},
                                                             lambda call: call)):
        plan = plan_tools(request(tools=[WEATHER, trip], tool_choice=choice), AUTO, False)
        compiled = compiler.compile_grammar(build_grammar(plan.constraint.params))
        for arguments, valid in ((good, True), ({"place": {"town": "Paris"}}, False)):
            matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
            text = json.dumps(wrap({"name": "trip", "parameters": arguments}))
            assert (matcher.accept_string(text) and matcher.is_terminated()) == valid, (choice, text)


@pytest.mark.parametrize("kind", ["array", "string", ["string", "null"]])
def test_tool_parameters_that_are_not_an_object_are_refused(kind):
    from pydantic import ValidationError

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": kind}}}
    with pytest.raises(ValidationError, match='parameters must be a JSON schema of type "object"') as info:
        request(tools=[tool], tool_choice="required")
    assert info.value.errors()[0]["loc"] == ("tools", 0, "function")
    for fine in ({"type": "object"}, {"type": ["object", "null"]}, {"properties": {}}, {}):
        request(tools=[{"type": "function", "function": {"name": "f", "parameters": fine}}])


def test_forced_calls_take_the_ids_of_the_servers_tool_parser():
    """Mistral's chat templates refuse a call id other than 9 letters or digits when the client sends the call
    back: a forced call on a server with --tool-call-parser mistral gets such an id, streamed or not."""
    import re

    output = '[{"name":"get_weather","parameters":{"city":"Paris"}}]'
    for parser, pattern in (("mistral", r"[A-Za-z0-9]{9}"), ("hermes", r"call_\w{24}"), (None, r"call_\w{24}")):
        config = ServerConfig(tool_call_parser=parser)
        plan = plan_tools(request(tools=[WEATHER], tool_choice="required"), config, False)
        [call] = ChoiceText(plan, None).full(output)["tool_calls"]
        [streamed_call] = streamed(ChoiceText(plan, None), [output])["tool_calls"]
        assert re.fullmatch(pattern, call["id"]) and re.fullmatch(pattern, streamed_call["id"]), parser


def test_kimi_k2_call_ids_are_the_heads_its_template_writes_back():
    """Kimi-K2's chat template writes a call's id back as the call's head, `functions.NAME:IDX`, IDX counting the
    conversation's calls: the parsed calls keep the head the model wrote, and forced ones number on from the
    calls of the request's assistant messages, streamed or not."""
    kimi = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="kimi_k2")
    history = [{"role": "user", "content": "weather and time?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "functions.get_weather:0", "function": {"name": "get_weather", "arguments": "{}"}},
                   {"id": "functions.get_time:1", "function": {"name": "get_time", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
               {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "noon"},
               {"role": "user", "content": "again"}]
    output = '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"Oslo"}}]'
    plan = plan_tools(ChatCompletionRequest.model_validate({"messages": history, "tools": [WEATHER, TIME],
                                                            "tool_choice": "required"}), kimi, False)
    expected = ["functions.get_time:2", "functions.get_weather:3"]
    assert [c["id"] for c in ChoiceText(plan, None).full(output)["tool_calls"]] == expected
    assert [c["id"] for c in streamed(ChoiceText(plan, None), list(output))["tool_calls"]] == expected
    named = plan_tools(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                       kimi, False)
    [call] = ChoiceText(named, None).full('{"name": "get_weather", "parameters": {"city": "Oslo"}}')["tool_calls"]
    assert call["id"] == "functions.get_weather:0"
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:7<|tool_call_argument_begin|>"
            '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>')
    auto = plan_tools(request(tools=[WEATHER]), kimi, False)
    for message in (ChoiceText(auto, None).full(text), streamed(ChoiceText(auto, None), list(text))):
        assert [(c["id"], c["function"]["name"]) for c in message["tool_calls"]] == [("functions.get_weather:7",
                                                                                      "get_weather")]
