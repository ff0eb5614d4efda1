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


PART = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from("<>/think\n "), max_size=20)


@pytest.mark.parametrize("name", REASONING_PARSERS)
@settings(max_examples=150, deadline=None)
@given(reasoning=PART, content=PART, opened=st.booleans(), points=st.lists(st.integers(0, 60), max_size=12))
def test_streaming_random_cuts_match_split(name, reasoning, content, opened, points):
    if "<think>" in reasoning + content or "</think>" in reasoning + content:
        return
    if name == "qwen3":
        opened = True  # the think block is the model's own (see test_qwen3_stream_decides_at_the_start)
    text = ("<think>" if opened else "") + reasoning + "</think>" + content
    split = get_reasoning_parser(name).split(text)
    assert stream(name, cut(text, points)) == split
    if opened or not reasoning.lstrip().startswith("<think"):
        assert split == (reasoning if reasoning.strip() else None, content if content.strip() else None)


@pytest.mark.parametrize("name", REASONING_PARSERS)
@settings(max_examples=100, deadline=None)
@given(text=PART, points=st.lists(st.integers(0, 30), max_size=8))
def test_streaming_text_without_a_closing_tag(name, text, points):
    if "</think>" in text or (name == "qwen3" and text.lstrip().startswith("<think>")):
        return
    assert stream(name, cut(text, points)) == get_reasoning_parser(name).split(text)


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    for name in REASONING_PARSERS:
        assert issubclass(get_reasoning_parser(name), ReasoningParser) and get_reasoning_parser(name).name == name
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")
