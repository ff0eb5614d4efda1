"""Reasoning parsers (tokenmill/server/reasoning_parsers): <think> blocks split off as reasoning, whole or streamed
(any cut of the text into deltas gives what `split` gives, and no tag leaks into either part)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.server.reasoning_parsers import REASONING_PARSERS, ReasoningParser, get_reasoning_parser


def stream(name: str, chunks: list[str]) -> tuple[str | None, str | None]:
    parser = get_reasoning_parser(name)()
    reasoning, content = [], []
    for out in [parser.feed(chunk) for chunk in chunks] + [parser.finish()]:
        assert len(out) == 2 and all(part is None or (isinstance(part, str) and part) for part in out)
        reasoning.append(out[0] or "")
        content.append(out[1] or "")
    assert parser.finish() == (None, None)
    return "".join(reasoning) or None, "".join(content) or None


def cut(text: str, points: list[int]) -> list[str]:
    points = sorted({min(p, len(text)) for p in points} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


@pytest.mark.parametrize(("text", "expected"), [
    ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", ("\nThe user wants 2+2.\n", "\n\nIt is 4.")),
    ("The template opened it.</think>Answer: 日本 🚀", ("The template opened it.", "Answer: 日本 🚀")),
    ("<think>cut off while thinking", ("cut off while thinking", None)),
    ("no tags at all", ("no tags at all", None)),
    ("<think></think>Only content", (None, "Only content")),
    ("  \n<think>r</think>c", ("r", "c")),
    ("r</think>c</think>d", ("r", "c</think>d")),  # only the first closes the block
    ("", (None, None)),
    ("<thi", ("<thi", None)),
    ("<think>\n\n</think>\n\n", (None, None)),  # blanks only: no part
])
def test_deepseek_r1(text, expected):
    assert get_reasoning_parser("deepseek_r1").split(text) == expected
    assert stream("deepseek_r1", list(text)) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("<think>\nLet me think.\n</think>\n\nHello!", ("\nLet me think.\n", "\n\nHello!")),
    ("Hello! (enable_thinking=false: no think block)", (None, "Hello! (enable_thinking=false: no think block)")),
    ("<think>\n\n</think>\n\nEmpty block", (None, "\n\nEmpty block")),
    ("<think>ü 🚀</think>", ("ü 🚀", None)),
    ("<think>cut off, never closed", (None, "<think>cut off, never closed")),  # no </think>: all content
    ("opened in the prompt</think>answer", ("opened in the prompt", "answer")),
    ("", (None, None)),
])
def test_qwen3_split(text, expected):
    assert get_reasoning_parser("qwen3").split(text) == expected


def test_qwen3_streams_like_split_on_the_templates_path():
    for text in ["<think>\nLet me think.\n</think>\n\nHello!", "Hello, no thinking.", "<think></think>x",
                 "  <think>a</think>b", "<thin", "a < b and <thinking> is a word"]:
        assert stream("qwen3", list(text)) == get_reasoning_parser("qwen3").split(text), text


def test_qwen3_stream_decides_at_the_start():
    # The two documented differences: the stream cannot take back what it sent before </think> shows up, or not.
    assert stream("qwen3", ["<think>cut off"]) == ("cut off", None)
    assert stream("qwen3", ["opened in the prompt</think>answer"]) == (None, "opened in the prompt</think>answer")


MAGISTRAL = "[THINK]Okay, 2+2: add them.\n[/THINK]\n\nThe answer is **4**."
GRANITE = ("Here is my thought process:\nThe user asks for 2+2. That is 4.\n\nHere is my response:\n"
           "2 + 2 = 4.")


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("mistral", MAGISTRAL, ("Okay, 2+2: add them.\n", "\n\nThe answer is **4**.")),
    ("mistral", "No thinking asked: 4.", (None, "No thinking asked: 4.")),
    ("mistral", "[THINK]cut off while thinking", ("cut off while thinking", None)),
    ("mistral", "[THINK][/THINK]4", (None, "4")),
    ("granite", GRANITE, ("\nThe user asks for 2+2. That is 4.\n\n", "\n2 + 2 = 4.")),
    ("granite", "Here's my thought process: quick. Here's my response: 4", (" quick. ", " 4")),  # quantized models
    ("granite", "Thinking off: 4.", (None, "Thinking off: 4.")),
    ("glm45", "<think>The user wants 2+2.</think>\n4", ("The user wants 2+2.", "\n4")),
    ("glm45", "\n4", (None, "\n4")),  # enable_thinking=false: the prompt holds the empty block
])
def test_family_formats(name, text, expected):
    assert get_reasoning_parser(name).split(text) == expected
    assert stream(name, list(text)) == expected


def test_granite_markers_are_held_across_deltas():
    parser = get_reasoning_parser("granite")()
    assert parser.feed("Here is my") == (None, None)
    assert parser.feed(" thought process: a b Here is") == (" a b ", None)
    assert parser.feed(" my resp") == (None, None)
    assert parser.feed("onse: it is 4") == (None, " it is 4")
    other = get_reasoning_parser("granite")()
    assert other.feed("Here") == (None, None) and other.feed(" you go.") == (None, "Here you go.")
    # Cut off while thinking: streamed as reasoning, all content whole (see test_qwen3_stream_decides_at_the_start).
    assert get_reasoning_parser("granite").split("Here is my thought process: cut") == (
        None, "Here is my thought process: cut")
    assert stream("granite", ["Here is my thought process: cut"]) == (" cut", None)


def test_deepseek_v3_thinks_only_when_the_request_turns_thinking_on():
    """As vLLM: chat_template_kwargs thinking (or enable_thinking) true reads the output as DeepSeek-R1's;
    anything else (DeepSeek-V3.1's template does not think by default) leaves it all content."""
    v3 = get_reasoning_parser("deepseek_v3")
    assert v3.for_request({"thinking": True}) is get_reasoning_parser("deepseek_r1")
    assert v3.for_request({"enable_thinking": True}) is get_reasoning_parser("deepseek_r1")
    for kwargs in ({}, {"thinking": False}, {"enable_thinking": False}, {"other": 1}):
        assert v3.for_request(kwargs) is None
    assert get_reasoning_parser("qwen3").for_request({"enable_thinking": False}) is get_reasoning_parser("qwen3")


def test_partial_tags_are_held_back():
    parser = get_reasoning_parser("deepseek_r1")()
    assert parser.feed("<thi") == (None, None)
    assert parser.feed("nk>step one</th") == ("step one", None)
    assert parser.feed("ought") == ("</thought", None)  # not the closing tag after all
    assert parser.feed(" more</think>\n\nThe ans") == (" more", "\n\nThe ans")
    assert parser.feed("wer.") == (None, "wer.")
    assert parser.finish() == (None, None)
    held = get_reasoning_parser("deepseek_r1")()
    assert held.feed("abc</thi") == ("abc", None) and held.finish() == ("</thi", None)


MARKERS = [m for name in REASONING_PARSERS for m in get_reasoning_parser(name).starts + get_reasoning_parser(name).ends]
MARKER_CHARACTERS = "".join(sorted(set("".join(MARKERS)))) + "\n "
PART = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from(MARKER_CHARACTERS),
               max_size=20)
DECIDES_AT_THE_START = {"qwen3", "glm45", "granite"}
"""Parsers for which an output not closed is all content in `split` but streams as reasoning when opened."""


@pytest.mark.parametrize("name", REASONING_PARSERS)
@settings(max_examples=150, deadline=None)
@given(reasoning=PART, content=PART, opened=st.booleans(), points=st.lists(st.integers(0, 60), max_size=12))
def test_streaming_random_cuts_match_split(name, reasoning, content, opened, points):
    parser = get_reasoning_parser(name)
    start, end = parser.starts[0], parser.ends[0]
    if any(marker in reasoning + content for marker in parser.starts + parser.ends):
        return
    if name in DECIDES_AT_THE_START or not parser.unopened_is_reasoning:
        opened = True  # the block is the model's own (see test_qwen3_stream_decides_at_the_start)
    text = (start if opened else "") + reasoning + end + content
    split = parser.split(text)
    assert stream(name, cut(text, points)) == split
    if opened or not reasoning.lstrip().startswith(start[:-1]):
        assert split == (reasoning if reasoning.strip() else None, content if content.strip() else None)


@pytest.mark.parametrize("name", REASONING_PARSERS)
@settings(max_examples=100, deadline=None)
@given(text=PART, points=st.lists(st.integers(0, 30), max_size=8))
def test_streaming_text_without_a_closing_tag(name, text, points):
    parser = get_reasoning_parser(name)
    if any(end in text for end in parser.ends) or (
            name in DECIDES_AT_THE_START and text.lstrip().startswith(parser.starts)):
        return
    assert stream(name, cut(text, points)) == parser.split(text)


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "deepseek_v3", "glm45", "granite", "mistral", "qwen3"}
    for name in REASONING_PARSERS:
        assert issubclass(get_reasoning_parser(name), ReasoningParser) and get_reasoning_parser(name).name == name
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")
