"""Forced tool calls streamed as they are generated (server.forced_calls): the head as soon as the name is
known, then argument fragments; the concatenated stream equals the whole response's calls."""

from __future__ import annotations

import json

import pytest

from tokenmill.server.forced_calls import Scanner, scan
from tokenmill.server.tools import ChoiceText, ToolPlan

PARAMS = {"city": "Pa{ri}s \"quoted\" [x]", "days": [1, 2, {"n": 3}], "unit": {"deep": {"er": []}}}
NAMED = json.dumps({"name": "get_weather", "parameters": PARAMS})
REQUIRED = json.dumps([{"name": "get_weather", "parameters": PARAMS}, {"name": "get_time", "parameters": {}}],
                      indent=1)


@pytest.mark.parametrize("text,named", [(NAMED, True), (REQUIRED, False)])
def test_scan_finds_names_and_raw_arguments(text, named):
    calls = scan(text, named)
    expected = [json.loads(text)] if named else json.loads(text)
    assert [c.name for c in calls] == [item["name"] for item in expected]
    assert [json.loads(c.arguments) for c in calls] == [item["parameters"] for item in expected]
    assert all(c.complete for c in calls)
    # Every prefix: what is known is a prefix of the final arguments, never more.
    for end in range(len(text)):
        for partial, final in zip(scan(text[:end], named), calls):
            assert final.arguments.startswith(partial.arguments)
            assert partial.name in (None, final.name)


@pytest.mark.parametrize("text,named", [(NAMED, True), (REQUIRED, False)])
def test_a_stream_reads_each_character_once(text, named):
    """A stream's scanner reads only what each step added (it read the whole text again at every step: seconds of
    the event loop for a call of some thousands of tokens), and finds what scanning each prefix finds."""
    scanner = Scanner(named)
    for end in range(len(text) + 1):
        assert scanner.advance(text[:end]) == scan(text[:end], named)
    # What was read is not read again: text changed before the scanner's position goes unseen.
    read = text.index('"parameters"')  # nothing open there but brackets
    scanner = Scanner(named)
    scanner.advance(text[:read])
    assert scanner.advance(" " * read + text[read:]) == scan(text, named)


@pytest.mark.parametrize("text,named", [(NAMED, "get_weather"), (REQUIRED, None)])
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_deltas_concatenate_to_the_whole_response(text, named, piece):
    plan = ToolPlan([], "forced", named=named, parallel=True, constraint=None)
    whole = ChoiceText(plan, None).full(text)["tool_calls"]
    stream = ChoiceText(plan, None)
    deltas = []
    for start in range(0, len(text), piece):
        deltas += stream.feed(text[start:start + piece]).get("tool_calls", [])
    deltas += stream.finish().get("tool_calls", [])
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"name": None, "arguments": ""})
        if "id" in delta:  # the head comes first, once, with its name
            assert call["name"] is None and call["arguments"] == ""
            call["name"] = delta["function"]["name"]
        call["arguments"] += delta["function"]["arguments"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    assert len(deltas) > len(whole)  # the arguments came in fragments, not at the end
    assert stream.finish_reason("stop") == "tool_calls"


def test_a_call_cut_before_its_name_stays_text():
    plan = ToolPlan([], "forced", named=None, parallel=True, constraint=None)
    stream = ChoiceText(plan, None)
    assert stream.feed('[{"na') == {}
    assert stream.finish() == {"content": '[{"na'}


def assembled(stream: ChoiceText, text: str) -> dict:
    """The message a client builds from the stream of `text` in one-character deltas."""
    content, calls = "", {}
    for delta in [stream.feed(ch) for ch in text] + [stream.finish()]:
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], ["", ""])
            call[0] += entry["function"].get("name", "")
            call[1] += entry["function"]["arguments"]
    return {"content": content or None, "tool_calls": list(calls.values()) or None}


@pytest.mark.parametrize("text,named", [(NAMED, "get_weather"), (REQUIRED, None)])
def test_a_response_cut_by_max_tokens_holds_what_its_stream_sent(text, named):
    """Cut anywhere (finish_reason "length"), the whole response has the calls the stream began, with their
    arguments so far (before: the JSON text as content, while the stream had sent tool_calls)."""
    plan = ToolPlan([], "forced", named=named, parallel=True, constraint=None)
    for end in range(1, len(text)):
        whole = ChoiceText(plan, None)
        message = whole.full(text[:end])
        calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls", [])]
        stream = ChoiceText(plan, None)
        assert {"content": message["content"], "tool_calls": calls or None} == assembled(stream, text[:end]), end
        assert whole.finish_reason("length") == stream.finish_reason("length") == "length"


@pytest.mark.parametrize("text,named", [(NAMED, "get_weather"), (REQUIRED, None)])
def test_calls_a_stop_string_cut_do_not_finish_as_tool_calls(text, named):
    """A stop string (or stop token) inside the JSON leaves broken arguments: finish_reason stays "stop", streamed
    or not; the whole JSON finishes as "tool_calls"."""
    plan = ToolPlan([], "forced", named=named, parallel=True, constraint=None)
    cut = text[:text.index("[x]")]
    for output, reason in ((cut, "stop"), (text, "tool_calls")):
        whole, stream = ChoiceText(plan, None), ChoiceText(plan, None)
        assert whole.full(output)["tool_calls"] and assembled(stream, output)["tool_calls"]
        assert whole.finish_reason("stop") == stream.finish_reason("stop") == reason
