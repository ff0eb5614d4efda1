"""Tool-call parsers (tokenmill/server/tool_parsers): each family's published format, malformed output kept as
text, and streaming: any cut of the text into deltas assembles to exactly the non-streamed parse."""

import json
import keyword
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tokenmill.server.tool_parsers import (
    TOOL_PARSERS,
    ParsedToolCalls,
    ToolCallDelta,
    ToolParser,
    assemble,
    get_tool_parser,
)

DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                                      "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
KIMI_CALLS, KIMI_CALLS_END, KIMI_CALL, KIMI_CALL_END, KIMI_ARGS = (
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
    "<|tool_call_argument_begin|>")
MARKERS = {
    "deepseek_v3": (DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP, "```"),
    "deepseek_v31": (DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP),
    "glm45": ("<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>"),
    "granite": ("<|tool_call|>", "<tool_call>", "</tool_call>", '"arguments"'),
    "hermes": ("<tool_call>", "</tool_call>"),
    "kimi_k2": (KIMI_CALLS, KIMI_CALLS_END, KIMI_CALL, KIMI_CALL_END, KIMI_ARGS),
    "phi4_mini_json": ("functools[", '"arguments"'),  # "functools" alone is a word
    "qwen3_coder": ("<tool_call>", "</tool_call>", "<function=", "<parameter="),
    "llama3_json": ("<|python_tag|>", '"parameters"'),
    "llama4_json": ("<|python_tag|>", '"parameters"'),
    "llama4_pythonic": ("<|python_start|>", "<|python_end|>", "<|python_tag|>", "get_weather("),
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    "pythonic": ("<|python_start|>", "<|python_end|>", "<|python_tag|>", "get_weather("),
}

WEATHER_PROPERTIES = {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "temp": {"type": "number"}, "where": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": ["string", "null"]}, "limit": {"type": ["integer", "null"]}}
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                                   "parameters": {"type": "object", "properties": WEATHER_PROPERTIES}}}]


def calls(result: ParsedToolCalls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def stream(name: str, chunks: list[str], tools=None) -> tuple[ParsedToolCalls, list]:
    """Feed the chunks, check the deltas follow OpenAI's order, and assemble them as a client would."""
    parser = get_tool_parser(name)(tools)
    deltas = []
    for chunk in chunks:
        deltas += parser.feed(chunk)
    deltas += parser.finish()
    assert parser.finish() == []
    heads = 0
    for delta in deltas:
        if isinstance(delta, ToolCallDelta):
            if delta.name is not None:  # a head: the next index, with an id, before any of its arguments
                assert delta.index == heads and delta.id and delta.arguments is None
                heads += 1
            else:
                assert delta.index == heads - 1 and delta.id is None and delta.arguments is not None
        else:
            assert isinstance(delta, str) and delta
    return assemble(deltas), deltas


def cut(text: str, points: list[int]) -> list[str]:
    points = sorted({min(p, len(text)) for p in points} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


def assert_same(name: str, text: str, chunks: list[str], tools=None, well_formed: bool = False) -> ParsedToolCalls:
    whole = get_tool_parser(name).parse(text, tools)
    streamed, _ = stream(name, chunks, tools)
    assert streamed.content == whole.content
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    if well_formed:
        for marker in MARKERS[name]:
            assert marker not in (streamed.content or ""), marker
    return whole


# -- published formats, one family at a time

HERMES_TWO = ('I will check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "opts": '
              '{"fmt": [24, {"sec": false}]}}}\n</tool_call>')


HERMES_NULL = '<tool_call>\n{"name": "h", "arguments": null}\n</tool_call>'


def test_hermes_calls_and_content():
    result = get_tool_parser("hermes").parse(HERMES_TWO)
    assert result.content == "I will check both.\n\n"
    assert calls(result) == [("get_weather", {"city": "Paris"}),
                             ("get_time", {"zone": "CET", "opts": {"fmt": [24, {"sec": False}]}})]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in result.tool_calls)
    assert len({c.id for c in result.tool_calls}) == 2
    one = get_tool_parser("hermes").parse('<tool_call>\n{"name": "f", "arguments": {"q": "日本語 🚀 \\"x\\""}}\n'
                                          "</tool_call>\n\nDone, see above.")
    assert one.content == "Done, see above." and calls(one) == [("f", {"q": '日本語 🚀 "x"'})]
    assert json.loads(one.tool_calls[0].arguments)["q"] == '日本語 🚀 "x"' and "日本語" in one.tool_calls[0].arguments
    assert get_tool_parser("hermes").parse("Just text, no call.") == ParsedToolCalls("Just text, no call.", [])
    # arguments given as a JSON string (some fine-tunes), none at all, and null (as {}: before, the call was text)
    odd = get_tool_parser("hermes").parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
                                          '<tool_call>{"name": "g"}</tool_call>' + HERMES_NULL)
    assert odd.content is None and calls(odd) == [("f", {"a": 1}), ("g", {}), ("h", {})]
    assert [c.arguments for c in odd.tool_calls[1:]] == ["{}", "{}"]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # broken JSON
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',  # unclosed
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n[1, 2]\n</tool_call>',
    "Text <tool_call> and more",
    "<tool_call",
])
def test_hermes_malformed_stays_text(text):
    assert get_tool_parser("hermes").parse(text) == ParsedToolCalls(text, [])


def test_hermes_malformed_next_to_a_good_call():
    text = '<tool_call>{"name": "f"</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    result = get_tool_parser("hermes").parse(text)
    assert result.content == '<tool_call>{"name": "f"</tool_call>\n' and calls(result) == [("g", {})]


HERMES_TAG_IN_ARGUMENT = ('<tool_call>\n{"name": "write", "arguments": {"text": "ends with </tool_call> \\" and '
                          '</tool_call>"}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')


def test_hermes_end_tag_inside_an_argument_string():
    result = get_tool_parser("hermes").parse(HERMES_TAG_IN_ARGUMENT)
    assert result.content is None
    assert calls(result) == [("write", {"text": 'ends with </tool_call> " and </tool_call>'}), ("g", {})]
    # A broken call whose end tag sits in an unclosed string stays text, and the next call is still read.
    broken = '<tool_call>{"name": "f", "arguments": {"s": "x}}</tool_call> <tool_call>{"name": "g"}</tool_call>'
    result = get_tool_parser("hermes").parse(broken)
    assert result.content == '<tool_call>{"name": "f", "arguments": {"s": "x}}</tool_call> ' and calls(result) == [
        ("g", {})]


def test_llama3_json():
    parse = get_tool_parser("llama3_json").parse
    assert calls(parse('{"name": "get_weather", "parameters": {"city": "Zürich", "opts": {"units": ["c"]}}}')) == [
        ("get_weather", {"city": "Zürich", "opts": {"units": ["c"]}})]
    several = parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": null};'
                    '{"name": "c", "parameters": {"s": "a;b}"}}')
    assert several.content is None and calls(several) == [("a", {"x": 1}), ("b", {}), ("c", {"s": "a;b}"})]
    before = parse('Let me look.<|python_tag|>{"name": "a", "parameters": {}}\nDone.')
    assert before.content == "Let me look.Done." and calls(before) == [("a", {})]
    assert calls(parse('  \n{"name": "a", "parameters": {}}')) == [("a", {})]


@pytest.mark.parametrize("text", [
    '{"name": "a", "parameters": {"x": 1}',  # unclosed
    '{"name": "a", "parameters": {"x": 1,}}',  # broken JSON
    '{"city": "Paris"}',  # an object, not a call
    '{"name": "Ann", "age": 31}',  # an answer in JSON that has a name: no arguments, not a call
    "{{ template }} text",
    "Here is JSON: {\"name\": \"a\", \"parameters\": {}}",  # not at the start: prose
    '<|python_tag|>print("hi")',  # code for the interpreter, not a call
    '{"name": "a", "parameters": {}}; oops',
])
def test_llama3_json_malformed_stays_text(text):
    result = get_tool_parser("llama3_json").parse(text)
    if text.endswith("; oops"):  # the call is good, the "; oops" after it is text
        assert result.content == "; oops" and calls(result) == [("a", {})]
    else:
        assert result == ParsedToolCalls(text, [])


def test_mistral_both_formats():
    parse = get_tool_parser("mistral").parse
    old = parse('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}, '
                '{"name": "get_time", "arguments": {"tz": ["CET", {"dst": true}]}}]')
    assert old.content is None
    assert calls(old) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": ["CET", {"dst": True}]})]
    assert old.tool_calls[0].id == "a1b2c3d4e" and re.fullmatch(r"[A-Za-z0-9]{9}", old.tool_calls[1].id)
    new = parse('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]get_time[CALL_ID]xyzXYZ789'
                '[ARGS]{"tz": "CET"}')
    assert new.content == "Sure." and calls(new) == [("get_weather", {"city": "Zürich"}), ("get_time", {"tz": "CET"})]
    assert new.tool_calls[1].id == "xyzXYZ789"
    # Any name a request's tools may have ([A-Za-z0-9_.:-]).
    named = parse('[TOOL_CALLS]db:query.v2-x[ARGS]{"q": 1}')
    assert named.content is None and calls(named) == [("db:query.v2-x", {"q": 1})]


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}}",  # unclosed list
    "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {]}]",
    "[TOOL_CALLS]get weather[ARGS]{}",  # not a name
    "[TOOL_CALLS]f[ARGS]{\"a\": ",
    "[TOOL_CALLS]f[ARGS]nope",
    "[TOOL_CALLS]f",
    "[TOOL_CALLS] []",
])
def test_mistral_malformed_stays_text(text):
    assert get_tool_parser("mistral").parse(text) == ParsedToolCalls(text, [])


def test_pythonic():
    parse = get_tool_parser("pythonic").parse
    two = parse('[get_weather(city="Paris", unit="c"), other(x=1, y=-2.5, z=[True, None], w={"k": \'v\'})]')
    assert two.content is None
    assert calls(two) == [("get_weather", {"city": "Paris", "unit": "c"}),
                          ("other", {"x": 1, "y": -2.5, "z": [True, None], "w": {"k": "v"}})]
    assert calls(parse("[noargs()]")) == [("noargs", {})]
    llama4 = parse('I will look it up.<|python_start|>[search(q="a ] b (", n=3)]<|python_end|>\nThen answer.')
    assert llama4.content == "I will look it up.Then answer."
    assert calls(llama4) == [("search", {"q": "a ] b (", "n": 3})]
    assert calls(parse("[f(s='''triple ' quoted''', u=\"🚀\")]")) == [("f", {"s": "triple ' quoted", "u": "🚀"})]
    assert calls(parse("[f(flag=true, nothing=null)]")) == [("f", {"flag": True, "nothing": None})]


@pytest.mark.parametrize("text", [
    "[1] Smith et al. (2020)",
    "[link](https://example.com) text",
    "[f(x=1)",  # unclosed
    "[f(1, 2)]",  # positional arguments
    "[f(x=open('/etc/passwd'))]",  # not a literal: never evaluated
    "[f(x=__import__('os').system('true'))]",
    "[f(x=1) + g()]",
    "[f(**kw)]",
    "[f(x=1e999)]",  # infinite: no JSON for it
    "[]",
    "Text first [f(x=1)]",  # a bare list after content is prose
])
def test_pythonic_malformed_stays_text(text):
    assert get_tool_parser("pythonic").parse(text) == ParsedToolCalls(text, [])


QWEN3_CODER = ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=temp>\n-1.5\n"
               "</parameter>\n<parameter=where>\n{\"lat\": 40.7, \"tags\": [\"ü\"]}\n</parameter>\n<parameter=tags>\n"
               "['a', 'b']\n</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=limit>\n7\n</parameter>\n"
               "</function>\n</tool_call>\n<tool_call>\n<function=write_file>\n<parameter=content>\ndef f():\n"
               "    return '<b>'\n\n</parameter>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_types_from_the_schema():
    result = get_tool_parser("qwen3_coder").parse(QWEN3_CODER, WEATHER_TOOLS)
    assert result.content == "Let me check.\n\n"
    assert calls(result) == [
        ("get_weather", {"city": "New York", "days": 3, "metric": True, "temp": -1.5,
                         "where": {"lat": 40.7, "tags": ["ü"]}, "tags": ["a", "b"], "note": None, "limit": 7}),
        # no schema for this tool: every value stays the text it was, inner blank lines included
        ("write_file", {"content": "def f():\n    return '<b>'\n", "n": "5"})]
    untyped = get_tool_parser("qwen3_coder").parse(QWEN3_CODER, None)
    assert calls(untyped)[0][1]["days"] == "3"


def test_qwen3_coder_values_that_do_not_convert_stay_strings():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=metric>\nyes\n"
            "</parameter>\n<parameter=where>\n{broken\n</parameter>\n</function>\n</tool_call>")
    assert calls(get_tool_parser("qwen3_coder").parse(text, WEATHER_TOOLS)) == [
        ("get_weather", {"days": "three", "metric": "yes", "where": "{broken"})]
    # Numbers Python will not read from text (past 4300 digits: it raised out of the parser), NaN in an object
    # (it went out as arguments that are not JSON).
    digits = "9" * 5000
    text = (f"<tool_call>\n<function=get_weather>\n<parameter=days>\n{digits}\n</parameter>\n<parameter=temp>\n"
            f"{digits}\n</parameter>\n<parameter=where>\n{{\"lat\": NaN}}\n</parameter>\n</function>\n</tool_call>")
    [call] = get_tool_parser("qwen3_coder").parse(text, WEATHER_TOOLS).tool_calls
    assert json.loads(call.arguments) == {"days": digits, "temp": digits, "where": '{"lat": NaN}'}


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n",  # unclosed
    "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>",  # no function
    "<tool_call>\n<function=f>\nstray text\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",  # Hermes' JSON is not this format
])
def test_qwen3_coder_malformed_stays_text(text):
    assert get_tool_parser("qwen3_coder").parse(text, WEATHER_TOOLS) == ParsedToolCalls(text, [])


QWEN3_CODER_TAG_IN_VALUE = ('<tool_call>\n<function=write>\n<parameter=city>\nprint("</tool_call>")\n</parameter>\n'
                            '</function>\n</tool_call>\nDone.')


def test_qwen3_coder_end_tag_inside_a_parameter():
    result = get_tool_parser("qwen3_coder").parse(QWEN3_CODER_TAG_IN_VALUE, WEATHER_TOOLS)
    assert result.content == "Done." and calls(result) == [("write", {"city": 'print("</tool_call>")'})]
    # With no end tag after it, the one in the parameter ends the call, as before.
    cut_short = '<tool_call>\n<function=f>\n<parameter=a>\nx</tool_call> tail'
    result = get_tool_parser("qwen3_coder").parse(cut_short)
    assert result.content == "tail" and calls(result) == [("f", {"a": "x"})]


DEEPSEEK_V3 = (f"Let me check both.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
               f'{{"city": "Paris", "opts": {{"s": "a }} ``` {DS_CALL_END}"}}}}\n```{DS_CALL_END}\n'
               f"{DS_CALL}function{DS_SEP}get_time\n```json\n{{}}\n```{DS_CALL_END}{DS_CALLS_END}")
DEEPSEEK_V31 = (f'Sure.{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Zürich"}}{DS_CALL_END}'
                f"{DS_CALL}get_time{DS_SEP}{{}}{DS_CALL_END}{DS_CALLS_END}")


def test_deepseek_v3_and_v31():
    v3 = get_tool_parser("deepseek_v3").parse(DEEPSEEK_V3)
    assert v3.content == "Let me check both."
    assert calls(v3) == [("get_weather", {"city": "Paris", "opts": {"s": f"a }} ``` {DS_CALL_END}"}}),
                         ("get_time", {})]
    v31 = get_tool_parser("deepseek_v31").parse(DEEPSEEK_V31 + "\n\nDone.")
    assert v31.content == "Sure.Done." and calls(v31) == [("get_weather", {"city": "Zürich"}), ("get_time", {})]
    # Each reads only its own format: V3.1's calls have no type and no fence, V3's do.
    assert get_tool_parser("deepseek_v31").parse(DEEPSEEK_V3).tool_calls == []
    assert get_tool_parser("deepseek_v3").parse(DEEPSEEK_V31).tool_calls == []


@pytest.mark.parametrize("text", [
    f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{\"a\": 1}}\n```",  # no end token
    f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n[1]\n```{DS_CALL_END}{DS_CALLS_END}",  # not an object
    f"{DS_CALLS}{DS_CALL}function{DS_SEP}bad name\n```json\n{{}}\n```{DS_CALL_END}{DS_CALLS_END}",
    f"{DS_CALLS}{DS_CALL}function{DS_SEP}f{DS_CALL_END}{DS_CALLS_END}",  # no arguments
    f"{DS_CALLS}just text",
    f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{\"a\": 1}}\n``` stray {DS_CALL_END}",
])
def test_deepseek_v3_malformed_stays_text(text):
    assert get_tool_parser("deepseek_v3").parse(text) == ParsedToolCalls(text, [])


KIMI_K2 = (f"I will check both.{KIMI_CALLS}{KIMI_CALL}functions.get_weather:3{KIMI_ARGS}{{\"city\": \"Paris\", "
           f"\"s\": \"{KIMI_CALL_END}\"}}{KIMI_CALL_END}{KIMI_CALL}functions.get_time:4{KIMI_ARGS}{{}}{KIMI_CALL_END}"
           f"{KIMI_CALLS_END}")


def test_kimi_k2_ids_are_the_heads_the_model_wrote():
    """Kimi's chat template writes a call's id back as its head, so the id is the head as written."""
    parser = get_tool_parser("kimi_k2")
    result = parser.parse(KIMI_K2 + "\nDone.")
    assert result.content == "I will check both.Done."
    assert calls(result) == [("get_weather", {"city": "Paris", "s": KIMI_CALL_END}), ("get_time", {})]
    assert [c.id for c in result.tool_calls] == ["functions.get_weather:3", "functions.get_time:4"]
    streamed, _ = stream("kimi_k2", list(KIMI_K2))
    assert [c.id for c in streamed.tool_calls] == ["functions.get_weather:3", "functions.get_time:4"]
    # Without "functions." (as vLLM reads it), and a name with dots and colons of its own.
    result = parser.parse(f"{KIMI_CALLS}{KIMI_CALL} get_time:0 {KIMI_ARGS} {{}} {KIMI_CALL_END}\n"
                          f"{KIMI_CALL}functions.fs.read:v2:7{KIMI_ARGS}{{}}{KIMI_CALL_END}{KIMI_CALLS_END}")
    assert [(c.id, c.name) for c in result.tool_calls] == [("get_time:0", "get_time"), ("functions.fs.read:v2:7",
                                                                                         "fs.read:v2")]
    assert parser.make_id("get_weather", 5) == "functions.get_weather:5"
    # DeepSeek's tokens are not Kimi's, nor the other way round.
    assert parser.parse(DEEPSEEK_V31).tool_calls == []
    assert get_tool_parser("deepseek_v31").parse(KIMI_K2).tool_calls == []


@pytest.mark.parametrize("text", [
    f"{KIMI_CALLS}{KIMI_CALL}functions.f:0{KIMI_ARGS}{{\"a\": 1}}",  # no end token
    f"{KIMI_CALLS}{KIMI_CALL}functions.f{KIMI_ARGS}{{}}{KIMI_CALL_END}{KIMI_CALLS_END}",  # no call number
    f"{KIMI_CALLS}{KIMI_CALL}functions.f:0{{}}{KIMI_CALL_END}{KIMI_CALLS_END}",  # no argument token
    f"{KIMI_CALLS}{KIMI_CALL}functions.f:0{KIMI_ARGS}[1]{KIMI_CALL_END}{KIMI_CALLS_END}",  # not an object
    f"{KIMI_CALLS}{KIMI_CALL}functions.f:0{KIMI_ARGS}{KIMI_CALL_END}{KIMI_CALLS_END}",  # no arguments
    f"{KIMI_CALLS}just text",
])
def test_kimi_k2_malformed_stays_text(text):
    assert get_tool_parser("kimi_k2").parse(text) == ParsedToolCalls(text, [])


GRANITE = ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": "]"}]}}, '
           '{"name": "get_time", "arguments": {}}]')
PHI4_MINI = ('functools[{"name": "get_weather", "arguments": {"city": "Zürich"}}, '
             '{"name": "get_time", "parameters": {}}]')


def test_granite_and_phi4_mini_json_lists():
    granite = get_tool_parser("granite").parse
    result = granite(GRANITE)
    assert result.content is None
    assert calls(result) == [("get_weather", {"city": "Paris", "days": [1, {"x": "]"}]}), ("get_time", {})]
    # Granite 3.1's text marker, a bare list at the start (as vLLM reads both), Granite 4's one object in tags.
    for text in ('<tool_call>[{"name": "f", "arguments": {"a": 1}}]', '\n[{"name": "f", "arguments": {"a": 1}}]',
                 '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'):
        result = granite(text)
        assert result.content is None and calls(result) == [("f", {"a": 1})]
    phi = get_tool_parser("phi4_mini_json").parse
    result = phi("I will look both up. " + PHI4_MINI)
    assert result.content == "I will look both up. "
    assert calls(result) == [("get_weather", {"city": "Zürich"}), ("get_time", {})]


@pytest.mark.parametrize(("name", "text"), [
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {"a": 1}}'),  # unclosed
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {"a": 1}}, {"oops": 1}]'),  # one is not a call
    ("granite", '[{"name": "Ann", "age": 3}] is the answer'),  # a bare list of objects that are not calls
    ("granite", "[1] Smith (2020)"),
    ("granite", "<|tool_call|>sorry"),
    ("phi4_mini_json", "import functools\nfunctools.partial(f)"),
    ("phi4_mini_json", 'functools[{"name": "f", "arguments": [1]}]'),
    ("phi4_mini_json", "functools[]"),
])
def test_json_lists_malformed_stay_text(name, text):
    assert get_tool_parser(name).parse(text) == ParsedToolCalls(text, [])


GLM45 = ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>where</arg_key>\n<arg_value>{\"lat\": 40.7}"
         "</arg_value>\n<arg_key>note</arg_key>\n<arg_value>null</arg_value>\n</tool_call>\n<tool_call>write_file\n"
         "<arg_key>content</arg_key>\n<arg_value>print(\"</tool_call>\")\n</arg_value>\n<arg_key>n</arg_key>\n"
         "<arg_value>5</arg_value>\n</tool_call>")
GLM47 = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"


def test_glm45_values_as_the_template_writes_them():
    result = get_tool_parser("glm45").parse(GLM45, WEATHER_TOOLS)
    assert result.content == "Let me check.\n"
    assert calls(result) == [
        ("get_weather", {"city": "New York", "days": 3, "where": {"lat": 40.7}, "note": None}),
        # no schema: JSON where the value is JSON, else the text; an end tag inside an open value is its text
        ("write_file", {"content": 'print("</tool_call>")\n', "n": 5})]
    assert calls(get_tool_parser("glm45").parse(GLM47)) == [("get_weather", {"city": "Paris"})]
    string_days = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"days": {"type": "string"}}}}}]
    assert calls(get_tool_parser("glm45").parse(GLM45, string_days))[0][1]["days"] == "3"


@pytest.mark.parametrize("text", [
    "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n",  # unclosed
    "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # no name
    "<tool_call>f\nstray text<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',  # Hermes' JSON is not this format
])
def test_glm45_malformed_stays_text(text):
    assert get_tool_parser("glm45").parse(text, WEATHER_TOOLS) == ParsedToolCalls(text, [])


# -- streaming

WELL_FORMED = {
    "glm45": [GLM45, GLM47 + "\nDone.", "Nothing <tool_ here"],
    "granite": [GRANITE, '<tool_call>{"name": "f", "arguments": {"q": "ü"}}</tool_call> After.', "[1] a footnote",
                "Plain <|tool answer"],
    "phi4_mini_json": [PHI4_MINI, "Text first. " + PHI4_MINI + " and after", "functools is a module"],
    "deepseek_v3": [DEEPSEEK_V3, "No call here <｜tool▁calls", DEEPSEEK_V3 + "\nAfter."],
    "deepseek_v31": [DEEPSEEK_V31, DEEPSEEK_V31 + " and then text", "Nothing <｜tool"],
    "kimi_k2": [KIMI_K2, KIMI_K2 + " and then text", "Nothing <|tool_calls"],
    "hermes": [HERMES_TWO, '<tool_call>\n{"name": "f", "arguments": {"q": "日本語"}}\n</tool_call>\nAfter.',
               "No call <tool_ here, <tool_call is just text", HERMES_TAG_IN_ARGUMENT, HERMES_NULL],
    "llama3_json": ['{"name": "a", "parameters": {"x": "}{"}}; {"name": "b", "parameters": {}}',
                    'Checking.<|python_tag|>{"name": "a", "parameters": {"s": "ü"}}\nDone.', "Plain {text} answer."],
    "mistral": ['[TOOL_CALLS] [{"name": "a", "arguments": {"x": [1]}}, {"name": "b", "arguments": {}}]',
                'Ok.[TOOL_CALLS]a[ARGS]{"x": "]["}[TOOL_CALLS]b[CALL_ID]abcDEF123[ARGS]{}', "A [TOOL list."],
    # Llama 4 Scout's calls: the pythonic list between <|python_start|> and <|python_end|>, and its JSON ones.
    "llama4_pythonic": ['<|python_start|>[get_weather(city="Paris", days=3), get_time()]<|python_end|>',
                        '[get_weather(city="Zürich")]'],
    "llama4_json": ['{"name": "get_weather", "parameters": {"city": "Paris"}}'],
    "pythonic": ['[get_weather(city="Paris"), b(x=[1, {"k": "v)"}])]',
                 'Looking.<|python_start|>[get_weather(city="Zürich")]<|python_end|> Done.', "[1] a footnote"],
    "qwen3_coder": [QWEN3_CODER, "Nothing to call here <tool_", QWEN3_CODER_TAG_IN_VALUE],
}
MALFORMED = {
    "glm45": ["<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1", "<tool_call>oops <b></tool_call> then text"],
    "granite": ['<|tool_call|>[{"name": "f", "arguments": {"a": 1}}', '<|tool_call|>[{"name": 1}] tail',
                '[{"name": "Ann", "age": 3}] x'],
    "phi4_mini_json": ['functools[{"name": "f", "arguments": {}}', 'functools [{"name": "f"}, 3] tail'],
    "deepseek_v3": [f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{\"a\": 1}}\n```",
                    f"{DS_CALLS}{DS_CALL}function{DS_SEP}f x\n```json\n{{}}\n```{DS_CALL_END} tail",
                    f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{}}\n```{DS_CALL_END}{DS_CALL}oops{DS_CALLS_END}"],
    "deepseek_v31": [f"{DS_CALLS}{DS_CALL}f{DS_SEP}{{\"a\": 1}}", f"{DS_CALLS}{DS_CALL}f{DS_SEP}[]{DS_CALL_END} x"],
    "kimi_k2": [f"{KIMI_CALLS}{KIMI_CALL}functions.f:0{KIMI_ARGS}{{\"a\": 1}}",
                f"{KIMI_CALLS}{KIMI_CALL}functions.f:0{KIMI_ARGS}[]{KIMI_CALL_END} x",
                f"{KIMI_CALLS}{KIMI_CALL}functions.f:0{KIMI_ARGS}{{}}{KIMI_CALL_END}{KIMI_CALL}oops{KIMI_CALLS_END}"],
    "hermes": ['<tool_call>{"name": "f"</tool_call> and <tool_call>{"name": "g", "arguments": {}}</tool_call> x',
               'Hi <tool_call>\n{"name": "f", "arguments": {"a": 1}}',
               '<tool_call>{"name": "f", "arguments": {"s": "x}}</tool_call> <tool_call>{"name": "g"}</tool_call>'],
    "llama3_json": ['{"name": "a", "parameters": {"x": 1}', '{"name": "a", "parameters": {}} ; {"bad": 1} tail',
                    '<|python_tag|>print(1)'],
    "mistral": ['[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]bad name[ARGS]{}', "[TOOL_CALLS] [{\"name\": 1}] tail"],
    "llama4_pythonic": ["<|python_start|>[f(x=1)"],
    "llama4_json": ['{"name": "a", "parameters": {"x": 1}'],
    "pythonic": ["[f(x=1), g(open(1))] tail", "[f(x='unclosed)]"],
    "qwen3_coder": ["<tool_call>\n<function=f>\n<parameter=a>\n1\n", "<tool_call>oops</tool_call> then text"],
}


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_streaming_one_character_at_a_time(name):
    for text in WELL_FORMED[name] + MALFORMED[name]:
        assert_same(name, text, list(text), WEATHER_TOOLS, well_formed=text in WELL_FORMED[name])


@pytest.mark.parametrize("name", TOOL_PARSERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streaming_random_cuts_match_the_whole_parse(name, data):
    texts = WELL_FORMED[name] + MALFORMED[name]
    text = data.draw(st.sampled_from(texts))
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_same(name, text, cut(text, points), WEATHER_TOOLS, well_formed=text in WELL_FORMED[name])


def test_a_partial_marker_is_held_back_then_released():
    parser = get_tool_parser("hermes")()
    assert parser.feed("Hello <tool_") == ["Hello "]
    assert parser.feed("box> and") == ["<tool_box> and"]  # not a marker after all
    assert parser.feed(" <tool_call>\n{\"name\": \"f\", ") == [" "]
    head, arguments = parser.feed('"arguments": {"a": 1}}\n</tool_call>')
    assert head.to_openai() == {"index": 0, "id": head.id, "type": "function",
                                "function": {"name": "f", "arguments": ""}}
    assert arguments.to_openai() == {"index": 0, "function": {"arguments": '{"a": 1}'}}
    assert parser.feed("\n") == [] and parser.finish() == []
    unclosed = get_tool_parser("hermes")()
    assert unclosed.feed("<tool_call>{") == [] and unclosed.finish() == ["<tool_call>{"]


# -- generated calls: whatever the arguments, each format's text parses back to them, streamed or not

KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True).filter(lambda k: not keyword.iskeyword(k))
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from('<>[]{}()"\';\\/|=\n '),
               max_size=12)
SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | TEXT
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                      max_leaves=6)
ARGUMENTS = st.dictionaries(KEYS, VALUES, max_size=4)
CALL_LIST = st.lists(st.tuples(KEYS, ARGUMENTS), min_size=1, max_size=3)
PROSE = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from("<>[]{}|\n "), max_size=15)


def python_literal(value) -> str:
    return repr(value)


def qwen3_value(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, ensure_ascii=False)


def typed_tools(generated: list[tuple[str, dict]]) -> list[dict]:
    """Tools whose parameters are typed as the generated arguments are (for the formats whose values are text)."""
    tools = []
    for n, a in generated:
        kinds = {k: {"type": {str: "string", bool: "boolean", int: "integer", dict: "object", list: "array",
                              type(None): "null"}[type(v)]} for k, v in a.items()}
        tools.append({"type": "function", "function": {"name": n, "parameters": {"type": "object",
                                                                                  "properties": kinds}}})
    return tools


def render(name: str, generated: list[tuple[str, dict]], before: str, after: str) -> tuple[str, list[dict] | None]:
    if name == "glm45":
        tools, blocks = typed_tools(generated), []
        for n, a in generated:
            pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
                            "</arg_value>\n" for k, v in a.items())
            blocks.append(f"<tool_call>{n}\n{pairs}</tool_call>")
        return before + "\n" + "\n".join(blocks) + after, tools
    if name == "deepseek_v3":
        body = "\n".join(f"{DS_CALL}function{DS_SEP}{n}\n```json\n{json.dumps(a, ensure_ascii=False)}\n```{DS_CALL_END}"
                         for n, a in generated)
        return f"{before}{DS_CALLS}{body}{DS_CALLS_END}{after}", None
    if name == "deepseek_v31":
        body = "".join(f"{DS_CALL}{n}{DS_SEP}{json.dumps(a, ensure_ascii=False)}{DS_CALL_END}" for n, a in generated)
        return f"{before}{DS_CALLS}{body}{DS_CALLS_END}{after}", None
    if name == "kimi_k2":
        body = "\n".join(f"{KIMI_CALL}functions.{n}:{i}{KIMI_ARGS}{json.dumps(a, ensure_ascii=False)}{KIMI_CALL_END}"
                          for i, (n, a) in enumerate(generated))
        return f"{before}{KIMI_CALLS}{body}{KIMI_CALLS_END}{after}", None
    if name in ("granite", "phi4_mini_json"):
        body = json.dumps([{"name": n, "arguments": a} for n, a in generated], ensure_ascii=False)
        return f"{before}{'<|tool_call|>' if name == 'granite' else 'functools'}{body}{after}", None
    if name == "hermes":
        body = "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                         for n, a in generated)
        return f"{before}\n\n{body}{after}", None
    if name in ("llama3_json", "llama4_json"):
        body = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in generated)
        return f"{before}<|python_tag|>{body}{after}", None
    if name == "mistral":
        body = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, ensure_ascii=False)}" for n, a in generated)
        return f"{before}{body}{after}", None
    if name in ("pythonic", "llama4_pythonic"):
        body = ", ".join(f"{n}({', '.join(f'{k}={python_literal(v)}' for k, v in a.items())})" for n, a in generated)
        return f"{before}<|python_start|>[{body}]<|python_end|>{after}", None
    tools, blocks = typed_tools(generated), []
    for n, a in generated:
        params = "".join(f"<parameter={k}>\n{qwen3_value(v)}\n</parameter>\n" for k, v in a.items())
        blocks.append(f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
    return before + "\n\n" + "\n".join(blocks) + after, tools


def fits(name: str, generated, before: str, after: str) -> bool:
    """Drop the draws the format cannot carry (a parameter text holding Qwen3-Coder's tags, a name used twice
    with other schemas) or that make prose look like a marker."""
    text = before + after
    if any(m in text or m[:-1] in text for m in MARKERS[name] + ("<|python", "[TOOL", "<tool")):
        return False
    if name in ("llama3_json", "llama4_json") and after.lstrip().startswith(";"):
        return False
    if name in ("pythonic", "llama4_pythonic") and after.lstrip().startswith("<|"):
        return False
    if name == "glm45":
        if len({n for n, _ in generated}) != len(generated):
            return False
        if any(isinstance(v, str) and "</arg_value>" in v for _, a in generated for v in a.values()):
            return False
    if name == "qwen3_coder":
        if len({n for n, _ in generated}) != len(generated):
            return False
        for _, a in generated:
            for v in a.values():
                if isinstance(v, str) and ("<parameter=" in v or "</parameter>" in v
                                           or "</function>" in v):
                    return False
    return True


@pytest.mark.parametrize("name", TOOL_PARSERS)
@settings(max_examples=40, deadline=None)
@given(generated=CALL_LIST, before=PROSE, after=PROSE, points=st.lists(st.integers(0, 400), max_size=10))
def test_generated_calls_round_trip(name, generated, before, after, points):
    assume(fits(name, generated, before, after))
    text, tools = render(name, generated, before, after)
    whole = assert_same(name, text, cut(text, points), tools, well_formed=True)
    assert calls(whole) == [(n, a) for n, a in generated]
    # Blanks after a call are dropped, and before the first one when nothing else came first.
    before = {"hermes": before + "\n\n", "qwen3_coder": before + "\n\n", "glm45": before + "\n"}.get(name, before)
    expected = (before if before.strip() else "") + after.lstrip()
    assert whole.content == (expected or None)


def test_registry():
    assert set(TOOL_PARSERS) == {"deepseek_v3", "deepseek_v31", "glm45", "granite", "hermes", "kimi_k2",
                                 "llama3_json", "llama4_json", "llama4_pythonic", "mistral", "phi4_mini_json",
                                 "pythonic", "qwen3_coder"}
    for name in TOOL_PARSERS:
        assert issubclass(get_tool_parser(name), ToolParser) and get_tool_parser(name).name == name
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_serve_help_names_every_registered_parser():
    """--tool-call-parser's and --reasoning-parser's help come from ServerConfig's docstrings, written by hand."""
    from tokenmill.cli.args import field_docs
    from tokenmill.server.config import ServerConfig
    from tokenmill.server.reasoning_parsers import REASONING_PARSERS
    from tokenmill.server.tool_parsers import TOOL_PARSERS

    docs = field_docs(ServerConfig)
    assert [n for n in TOOL_PARSERS if n not in docs["tool_call_parser"]] == []
    assert [n for n in REASONING_PARSERS if n not in docs["reasoning_parser"]] == []
