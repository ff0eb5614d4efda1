"""What every tool-call parser shares: the result types, the call ids, and one incremental machine.

A parser is one object fed the model's text as it arrives (`feed`, then `finish`), which answers deltas:
content text (a str) or ToolCallDelta pieces, shaped as OpenAI streams `delta.tool_calls`. The non-streamed
`parse` runs that same machine over the whole text, so a stream cut anywhere assembles to exactly the result
of `parse` (the tests check it for random cuts).

A call is sent only once it is whole and well-formed: its first delta holds index, id and name, the next its
arguments (a JSON string). Until then its text is held back, as is a suffix of the content that could start
a marker (a partial "<tool_call"); a call found malformed (broken JSON, an unclosed tag at the end) goes out as
content, unchanged, and nothing raises. Whitespace right after a call, and before the first call when nothing
else came first, is dropped.

A subclass names its markers and scans one call's text (`_scan`); see HermesToolParser for the smallest one.
A call's id is the one the model wrote (Kimi-K2's head); else `make_id(name, index)` makes one of the kind the
model's chat template takes back, as it does for the calls a forced tool_choice made.

A parser also says how its calls look to a grammar (`strict_trigger`, `call_begin`, `call_end`,
`arguments_style`): with tool_choice "auto", tools marked strict have their arguments enforced by a structural
tag (`structural_tag`) that leaves the text free until the trigger, then holds the call to this form. A parser
whose calls cannot be written so leaves `strict_trigger` None, and strict tools are refused with it.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import ClassVar

ALPHANUMERIC = string.ascii_letters + string.digits


def random_id(length: int) -> str:
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(length))


def make_tool_call_id() -> str:
    """"call_" and 24 random letters or digits, as OpenAI-compatible servers send."""
    return "call_" + random_id(24)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text: OpenAI sends `function.arguments` as a string

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedToolCalls:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class ToolCallDelta:
    """One piece of `delta.tool_calls[i]`: the head (id and name, arguments None) or a fragment of arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict:
        if self.name is not None:  # the head: OpenAI's first chunk of a call carries arguments ""
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments or ""}}
        return {"index": self.index, "function": {"arguments": self.arguments or ""}}


Delta = str | ToolCallDelta

# A parsed call: (name, arguments as a JSON string, id the model gave or None).
Call = tuple[str, str, str | None]


def assemble(deltas: list[Delta]) -> ParsedToolCalls:
    """Content concatenated and calls rebuilt from their deltas, as a client does from a stream."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if isinstance(delta, str):
            content.append(delta)
        elif delta.name is not None:
            calls[delta.index] = ToolCall(delta.id or "", delta.name, delta.arguments or "")
        else:
            calls[delta.index].arguments += delta.arguments or ""
    return ParsedToolCalls("".join(content) or None, [calls[i] for i in sorted(calls)])


def dump_arguments(arguments) -> str | None:
    """Arguments as the JSON string OpenAI sends; a JSON string holding an object is accepted too.
    None when they are not an object (the call is then malformed)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of the markers."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def skip_blank(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class BracketScanner:
    """Finds, a piece at a time, where a bracketed value that starts at `start` ends: JSON's, or Python's
    with its '...' and triple quotes (python=True). `advance(text)` answers the end (one past the closing
    bracket) or None while it is still open; it resumes where it stopped, so a long call costs linear time."""

    OPEN, CLOSE = "([{", ")]}"

    def __init__(self, start: int, python: bool = False):
        self.i = start
        self.depth = 0
        self.quote = ""  # the open string's delimiter: ", ', ''' or """
        self.escape = False
        self.python = python

    def advance(self, text: str) -> int | None:
        i, n = self.i, len(text)
        while i < n:
            c = text[i]
            if self.quote:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif text.startswith(self.quote, i):
                    i += len(self.quote)
                    self.quote = ""
                    continue
                elif len(self.quote) == 3 and self.quote.startswith(text[i:]):
                    break  # maybe the start of the closing triple quote: wait for more
                i += 1
                continue
            if c == '"' or (c == "'" and self.python):
                if self.python and n - i < 3 and text[i:] == c * (n - i):
                    break  # one or two quotes at the end: a triple quote may be coming
                self.quote = c * 3 if self.python and text.startswith(c * 3, i) else c
                i += len(self.quote)
                continue
            if c in self.OPEN:
                self.depth += 1
            elif c in self.CLOSE:
                self.depth -= 1
                if self.depth <= 0:
                    self.i = i + 1
                    return i + 1
            i += 1
        self.i = i
        return None


class ToolParser:
    """The incremental machine. Subclasses set `name`, `markers` (strings that open a call anywhere) and/or
    `start_chars` (characters that open one when they are the first non-blank of the output), and implement
    `_scan`; `_after` may continue a run of calls (Llama's "; ")."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    start_chars: ClassVar[str] = ""
    strict_trigger: ClassVar[str | None] = None
    """The text every call starts with (a prefix of each call_begin); None: strict tools cannot be enforced."""
    call_end: ClassVar[str] = ""
    """The text after a call's arguments."""
    arguments_style: ClassVar[str] = "json"
    """How the arguments are written: the style of xgrammar's json_schema format (json, qwen_xml, ...)."""

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []
        self._buf = ""
        self._pos = 0  # everything before it is sent or dropped
        self._in_call = False
        self._after_call = False
        self._region = 0  # where the call's raw text (its marker included) starts
        self._body = 0  # where the text after its marker starts
        self._at_start = True  # nothing but blanks so far
        self._pending = ""  # blanks before a first call: dropped if it parses, sent if not
        self._skip_blank = False
        self._index = 0
        self._finished = False

    # -- the interface

    @classmethod
    def parse(cls, text: str, tools: list[dict] | None = None) -> ParsedToolCalls:
        parser = cls(tools)
        return assemble(parser.feed(text) + parser.finish())

    def feed(self, delta_text: str) -> list[Delta]:
        assert not self._finished, "feed after finish"
        self._buf += delta_text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        """The end of the output: flush what is held back (an unclosed call goes out as content)."""
        if self._finished:
            return []
        out = self._run(final=True)
        self._finished = True
        return out

    @classmethod
    def call_begin(cls, name: str) -> str:
        """A call to `name` up to its arguments, as the model's chat template writes it."""
        raise NotImplementedError

    @classmethod
    def structural_tag(cls, tools: list[dict], parallel: bool = True) -> dict:
        """xgrammar's structural tag of calls in this format: free text, but from the trigger on a call to one
        of `tools`, whose arguments follow the function's parameters when it is strict (any text otherwise,
        up to the call's end). `parallel` False: the output ends after the first call."""
        assert cls.strict_trigger is not None, f"the {cls.name} parser has no structural tag"
        tags = []
        for tool in tools:
            function = tool["function"]
            if function.get("strict"):
                parameters = function.get("parameters") or {"type": "object", "properties": {}}
                content = {"type": "json_schema", "json_schema": parameters, "style": cls.arguments_style}
            else:
                content = {"type": "any_text"}
            tags.append({"type": "tag", "begin": cls.call_begin(function["name"]), "content": content,
                         "end": cls.call_end})
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [cls.strict_trigger],
                                                     "tags": tags, "stop_after_first": not parallel}}

    # -- for subclasses

    def _begin(self) -> None:
        """A call starts at self._region, its body at self._body: reset the scan's state."""

    def _scan(self, text: str, final: bool) -> tuple[int, list[Call] | None] | None:
        """Look at the call that starts at self._body: None while it is incomplete (final is False), else
        (end of its raw text, its calls, or None when malformed)."""
        raise NotImplementedError

    def _after(self, text: str, pos: int, final: bool) -> tuple[int, int | None] | None:
        """Right after a call: None to wait for more text, else (where content resumes, or the body of a
        next call that starts at that position)."""
        return pos, None

    @classmethod
    def make_id(cls, name: str, index: int) -> str:
        """The id of a call to `name`, the conversation's call number `index` (counted from 0 over the assistant
        messages' calls, then this response's), of the kind the model's chat template takes back: for the calls a
        forced tool_choice made, and those the model wrote without an id."""
        return make_tool_call_id()

    # -- the machine

    def _open(self, region: int, body: int) -> None:
        self._in_call, self._region, self._body, self._at_start = True, region, body, False
        self._begin()

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        buf = self._buf

        def say(text: str) -> None:
            if text:
                if out and isinstance(out[-1], str):
                    out[-1] += text
                else:
                    out.append(text)

        while True:
            if self._in_call:
                found = self._scan(buf, final)
                if found is None:
                    if not final:
                        break
                    found = (len(buf), None)
                end, calls = found
                self._in_call, self._pos = False, end
                if not calls:
                    say(self._pending + buf[self._region:end])
                    self._pending = ""
                    continue
                self._pending = ""
                for name, arguments, given_id in calls:
                    out.append(ToolCallDelta(self._index, id=given_id or self.make_id(name, self._index), name=name))
                    out.append(ToolCallDelta(self._index, arguments=arguments))
                    self._index += 1
                self._after_call = self._skip_blank = True
                continue
            if self._after_call:
                step = self._after(buf, self._pos, final)
                if step is None:
                    if not final:
                        break
                    step = (self._pos, None)
                self._after_call = False
                self._pos, body = step
                if body is not None:
                    self._open(self._pos, body)
                continue
            if self._skip_blank:
                self._pos = skip_blank(buf, self._pos)
                if self._pos == len(buf):
                    break
                self._skip_blank = False
            rest = buf[self._pos:]
            if self._at_start:
                first = skip_blank(buf, self._pos)
                if first == len(buf):
                    if final:
                        say(rest)
                        self._pos = len(buf)
                    break
                if buf[first] in self.start_chars:
                    self._pending = buf[self._pos:first]
                    self._open(first, first)
                    continue
            where, marker = -1, ""
            for m in self.markers:
                i = buf.find(m, self._pos)
                if i >= 0 and (where < 0 or i < where):
                    where, marker = i, m
            if where >= 0:
                before = buf[self._pos:where]
                if self._at_start and not before.strip():
                    self._pending = before  # dropped if the call parses
                else:
                    say(before)
                self._open(where, where + len(marker))
                continue
            keep = 0 if final else held_suffix(rest, self.markers)
            text = rest[:len(rest) - keep]
            if self._at_start and not text.strip() and not final:
                break  # blanks, then maybe a marker
            say(text)
            self._pos += len(text)
            if text:
                self._at_start = False
            break
        if not self._in_call:
            self._buf, self._pos = buf[self._pos:], 0
        return out
