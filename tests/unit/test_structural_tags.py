"""Structural tags (issue 18), without a model: vLLM's two forms turned into xgrammar grammars that accept
exactly the texts they should (checked with xgrammar's matcher on strings), the 400-worthy errors, and the
structural tag each tool parser builds for strict tools under tool_choice "auto", read back by the parser."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError
from tokenmill.server.openai_protocol import ChatCompletionRequest
from tokenmill.server.tool_parsers import TOOL_PARSERS, get_tool_parser
from tokenmill.server.tools import plan_tools
from tokenmill.structured.grammar import build_grammar, validate

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
LEGACY = {"structures": [{"begin": "<person>", "schema": PERSON, "end": "</person>"}], "triggers": ["<person>"]}
FORMAT = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "Answer: "},
    {"type": "tag", "begin": "<person>", "content": {"type": "json_schema", "json_schema": PERSON},
     "end": "</person>"}]}}


def accepts(spec: dict | str | StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar of the structural tag `spec` (or of the params) takes `text` as a whole output."""
    import xgrammar as xgr

    params = spec if isinstance(spec, StructuredOutputsParams) else StructuredOutputsParams(structural_tag=spec)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(build_grammar(params))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_legacy_form_free_text_between_tags():
    ann, bob = '<person>{"name": "Ann", "age": 31}</person>', '<person>{"name": "Bob", "age": 4}</person>'
    for spec in (LEGACY, json.dumps(LEGACY), {**LEGACY, "type": "structural_tag"}):
        assert accepts(spec, f"Here: {ann} and {bob}.")
        assert accepts(spec, "No person at all.")
    assert not accepts(LEGACY, '<person>{"name": "Ann"}</person>')  # age is required
    assert not accepts(LEGACY, '<person>{"name": "Annabelle Smith", "age": 31}</person>')  # maxLength
    # JSON in a tag is compact, as everywhere: one space after ":" and ",", none elsewhere.
    assert not accepts(LEGACY, '<person>{ "name": "Ann", "age": 31}</person>')
    assert not accepts(LEGACY, '<person>{"name":"Ann","age":31}</person>')


def test_format_object():
    assert accepts(FORMAT, 'Answer: <person>{"name": "Ann", "age": 31}</person>')
    assert not accepts(FORMAT, '<person>{"name": "Ann", "age": 31}</person>')
    assert not accepts(FORMAT, 'Answer: <person>{"name": "Ann", "age": "31"}</person>')
    regex = {"type": "structural_tag", "format": {"type": "regex", "pattern": "[0-9]{3}"}}
    assert accepts(regex, "123") and not accepts(regex, "12a")


@pytest.mark.parametrize("spec, words", [
    ("{not json", ["structural tag", "not valid JSON"]),
    ([1], ["JSON object"]),
    ({"type": "structural_tag"}, ["format", "structures"]),
    ({"type": "regex", "format": {}}, ["type"]),
    ({**LEGACY, "triggers": []}, ["triggers"]),
    ({**LEGACY, "structures": [{"begin": "<b>", "schema": PERSON, "end": "</b>"}]}, ["structures[0].begin"]),
    ({**LEGACY, "structures": [{"begin": "<person>", "schema": {"type": "nonsense"}, "end": "</person>"}]},
     ["structures[0].schema", "nonsense"]),
    ({**LEGACY, "structures": [{"begin": "<person>", "end": "</person>"}]}, ["structures[0].schema"]),
    ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                           "content": {"type": "json_schema", "json_schema": {"type": "nonsense"}}}},
     ["format.content.json_schema", "nonsense"]),
    ({"type": "structural_tag", "format": {"type": "no_such_format"}}, ["no_such_format"]),
    ({"type": "structural_tag", "format": {"type": "token", "token": "<|im_end|>"}}, ["token", "id"]),
])
def test_bad_specs_say_what_is_wrong(spec, words):
    with pytest.raises(ValueError) as info:
        build_grammar(StructuredOutputsParams(structural_tag=spec))
    for word in words:
        assert word in str(info.value), str(info.value)
    assert str(info.value).startswith("invalid structural tag")


TRIGGERED_A = {"type": "triggered_tags", "triggers": ["<a"],
               "tags": [{"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"}]}


@pytest.mark.parametrize(("spec", "words"), [
    ({"type": "structural_tag", "format": {"type": "any_text", "excludes": [""]}}, ["non-empty string"]),
    ({"type": "structural_tag", "format": {"type": "tag", "begin": "<", "content": TRIGGERED_A, "end": "<"}},
     ["prefix of trigger string"]),
], ids=["excludes-empty", "end-a-prefix-of-a-trigger"])
def test_specs_xgrammar_builds_but_cannot_compile_are_refused(spec, words):
    """Before: they passed the server's check (they build), their compile failed in the engine, and the request was
    aborted there: a 200 with no text and finish_reason "abort"."""
    import xgrammar as xgr

    params = StructuredOutputsParams(structural_tag=spec)
    with pytest.raises(RuntimeError):
        xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(build_grammar(params))
    with pytest.raises(ValueError) as info:
        validate(params)
    assert str(info.value).startswith("invalid structural tag") and all(w in str(info.value) for w in words), info


# ---- strict tools: the structural tag of each parser -------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
STRICT_PARSERS = ("deepseek_v3", "deepseek_v31", "glm45", "granite", "hermes", "kimi_k2", "llama3_json",
                  "phi4_mini_json", "qwen3_coder")


def call_text(parser: str, name: str, arguments: dict) -> str:
    """A call as the parser's model writes it."""
    if parser == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    if parser == "llama3_json":
        return f'{{"name": "{name}", "parameters": {json.dumps(arguments)}}}'
    if parser == "glm45":
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in arguments.items())
        return f"<tool_call>{name}\n{pairs}</tool_call>"
    if parser in ("granite", "phi4_mini_json"):
        marker = "<|tool_call|>" if parser == "granite" else "functools"
        return f'{marker}[{{"name": "{name}", "arguments": {json.dumps(arguments)}}}]'
    if parser.startswith("deepseek"):  # a section of one call (V3 fences the arguments, V3.1 does not)
        head, tail = ("function<｜tool▁sep｜>" + name + "\n```json\n", "\n```") if parser == "deepseek_v3" else (
            name + "<｜tool▁sep｜>", "")
        return (f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{head}{json.dumps(arguments)}{tail}<｜tool▁call▁end｜>"
                "<｜tool▁calls▁end｜>")
    if parser == "kimi_k2":
        return (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
                f"{json.dumps(arguments)}<|tool_call_end|><|tool_calls_section_end|>")
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


@pytest.mark.parametrize("name", STRICT_PARSERS)
def test_strict_tag_holds_calls_to_the_schema_and_the_parser_reads_them(name):
    parser = get_tool_parser(name)
    tag = parser.structural_tag(TOOLS)
    good = call_text(name, "get_weather", {"city": "Paris", "days": 3})
    free = call_text(name, "get_time", {"zone": "CET"})  # not strict: any arguments
    separator = "; " if name == "llama3_json" else "\n"
    text = ("" if name == "llama3_json" else "Let me look.\n") + good + separator + free
    assert accepts(tag, text)
    parsed = parser.parse(text, TOOLS)
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]
    jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), WEATHER)
    assert accepts(tag, "Just text, no call.")
    assert not accepts(tag, call_text(name, "get_weather", {"city": "Paris"}))  # days is required
    assert not accepts(tag, call_text(name, "get_weather", {"city": "Paris", "days": 3, "extra": 1}))
    assert not accepts(tag, call_text(name, "no_such_tool", {}))
    # parallel_tool_calls false: the output ends with the first call.
    single = parser.structural_tag(TOOLS, parallel=False)
    assert accepts(single, good) and not accepts(single, good + separator + free)


@pytest.mark.parametrize("name", STRICT_PARSERS)
def test_strict_tag_with_a_reasoning_parser_applies_after_thinking(name):
    """A trigger written while thinking ("<tool_call>" mentioned) is text, not a call forced into the reasoning;
    an output may end while thinking (as one may end without a call); after </think> calls hold to the schema."""
    from tokenmill.server.reasoning_parsers import get_reasoning_parser
    from tokenmill.server.tools import think_first

    plan = plan_tools(request(tools=TOOLS), auto(name), False)
    params = think_first(plan.constraint, get_reasoning_parser("deepseek_r1")).params
    trigger = get_tool_parser(name).strict_trigger
    assert accepts(params, f"I could write {trigger} here, but no.")
    good = call_text(name, "get_weather", {"city": "Paris", "days": 3})
    assert accepts(params, f"Use {trigger}.</think>\n{good}")
    assert not accepts(params, "Paris.</think>\n" + call_text(name, "get_weather", {"city": "Paris"}))


def test_phi4_mini_tag_leaves_the_word_functools_free():
    tag = get_tool_parser("phi4_mini_json").structural_tag(TOOLS)
    assert accepts(tag, "Use functools.partial, or functools [see the docs].")


def test_kimi_k2_tag_takes_the_call_number_after_the_fixed_head():
    tag = get_tool_parser("kimi_k2").structural_tag(TOOLS)
    good = call_text("kimi_k2", "get_weather", {"city": "Paris", "days": 3})
    assert accepts(tag, good.replace(":0<", ":12<"))
    assert not accepts(tag, good.replace(":0<", ":x<")) and not accepts(tag, good.replace(":0<", ":<"))


def test_parsers_without_a_tag():
    assert {name for name in TOOL_PARSERS if get_tool_parser(name).strict_trigger is None} == {
        "llama4_pythonic", "mistral", "pythonic"}


def request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kwargs})


def auto(parser: str) -> ServerConfig:
    return ServerConfig(enable_auto_tool_choice=True, tool_call_parser=parser)


def test_plans_of_strict_tools_under_auto():
    plan = plan_tools(request(tools=TOOLS, parallel_tool_calls=False), auto("hermes"), False)
    assert plan.mode == "auto" and plan.constraint.param == "tools"
    assert plan.constraint.params.structural_tag == get_tool_parser("hermes").structural_tag(TOOLS, parallel=False)
    loose = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": False}}, TOOLS[1]]
    assert plan_tools(request(tools=loose), auto("hermes"), False).constraint is None
    for name in ("mistral", "pythonic"):
        with pytest.raises(APIError, match=name) as info:
            plan_tools(request(tools=TOOLS), auto(name), False)
        assert info.value.param == "tools"
    with pytest.raises(APIError, match="response_format") as info:
        plan_tools(request(tools=TOOLS), auto("hermes"), True)
    assert info.value.param == "tools"
    # tool_choice "none" ignores strict; "required" enforces every schema anyway.
    assert plan_tools(request(tools=TOOLS, tool_choice="none"), auto("mistral"), False).constraint is None
    assert plan_tools(request(tools=TOOLS, tool_choice="required"), auto("mistral"), False).mode == "forced"


def test_a_spec_that_built_is_not_built_again_and_a_bad_one_is_refused_every_time(monkeypatch):
    """validate() remembers the specs that built (clients send one schema with every request); a bad spec is
    not remembered, so it gets its error every time."""
    from tokenmill.structured import grammar

    builds = []
    build = grammar._build_grammar  # what validate builds with (build_grammar's grammar, and how it came)
    monkeypatch.setattr(grammar, "_build_grammar", lambda params: builds.append(params) or build(params))
    good = StructuredOutputsParams(regex=r"remembered-[0-9]{3}")
    for _ in range(3):
        grammar.validate(good)
    assert len(builds) == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="invalid regex"):
            grammar.validate(StructuredOutputsParams(regex="(unclosed"))
    assert len(builds) == 3


def test_a_json_schema_keeps_its_property_order():
    """As OpenAI's: the keys come in the schema's order (a "reasoning" property before "answer" is written first)."""
    for params in (StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json=json.dumps(PERSON))):
        assert accepts(params, '{"name": "Ann", "age": 31}')
        assert not accepts(params, '{"age": 31, "name": "Ann"}')


def test_choices_outside_the_basic_plane():
    """A choice is matched as written, emoji too (their JSON escapes, surrogate pairs, matched no text at all)."""
    params = StructuredOutputsParams(choice=["😀 yes", "🙁", 'a"b\\c', "café\n"])
    for choice in params.choice:
        assert accepts(params, choice)
    assert not accepts(params, "😀") and not accepts(params, "🙁 ")
