"""DeepSeek-V3 and R1: the calls in a section of special tokens, each call's arguments a fenced JSON object,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

after any content. SectionToolParser is the machine of this shape (a section, calls in it each with a head and
a JSON object), which DeepSeek-V3.1's and Kimi-K2's parsers reuse with their own tokens and heads.
"""

from __future__ import annotations

import re
from typing import ClassVar

from tokenmill.server.tool_parsers.base import BracketScanner, ToolParser, dump_arguments, skip_blank
from tokenmill.server.tool_parsers.hermes import load_json

NAME = r"[A-Za-z0-9_.:\-]+"
"""A function name as tools may spell it (openai_protocol.FunctionDefinition)."""


class SectionToolParser(ToolParser):
    """Subclasses set the tokens (markers: the section's begin; strict_trigger: a call's begin, which each call
    of a section starts with), and `head`: what comes between a call's begin token and its arguments' "{",
    matched whole, with the name as group "name" (and the call's id as group "id" where the model writes one)."""

    section_begin: ClassVar[str]
    section_end: ClassVar[str]
    begin: ClassVar[str]
    end: ClassVar[str]
    head: ClassVar[re.Pattern]
    fence: ClassVar[str] = ""
    """Text that may close the arguments before the call's end token (V3's "```")."""

    @classmethod
    def structural_tag(cls, tools: list[dict], parallel: bool = True) -> dict:
        tag = super().structural_tag(tools, parallel)
        if not parallel:  # the output ends with its one call: which closes the section too
            for call in tag["format"]["tags"]:
                call["end"] += cls.section_end
        return tag

    def _begin(self) -> None:
        self._call = -1  # where the call's head starts (after its begin token)
        self._name = self._id = None
        self._brace = self._close = -1  # where the arguments' object starts, and ends
        self._scanner: BracketScanner | None = None

    def _scan(self, text, final):
        if self._call < 0:
            i = skip_blank(text, self._body)
            if text.startswith(self.begin, i):
                self._call = i + len(self.begin)
            elif i == len(text) or self.begin.startswith(text[i:]):
                return None
            else:
                return self._body, None  # a section token with no call in it: content
        if self._scanner is None:
            brace, stop = text.find("{", self._call), text.find(self.end, self._call)
            if 0 <= stop and (brace < 0 or stop < brace):
                return stop + len(self.end), None  # no arguments
            if brace < 0:
                return None
            head = self.head.fullmatch(text, self._call, brace)
            if head is None:
                return brace, None
            self._name, self._id = head.group("name"), head.groupdict().get("id")
            self._brace, self._scanner = brace, BracketScanner(brace)
        if self._close < 0:
            close = self._scanner.advance(text)
            if close is None:
                return None
            self._close = close
        close = self._close
        end = self._tail(text, close)
        if end is None:
            return None
        if end < 0:
            return close, None
        arguments = dump_arguments(load_json(text[self._brace:close]))
        return end, [(self._name, arguments, self._id)] if arguments is not None else None

    def _tail(self, text: str, i: int) -> int | None:
        """After the arguments' closing "}": where the call's end token ends, None to wait for more, -1 if
        something else comes."""
        i = skip_blank(text, i)
        if self.fence and text.startswith(self.fence, i):
            i = skip_blank(text, i + len(self.fence))
        rest = text[i:]
        if rest.startswith(self.end):
            return i + len(self.end)
        if self.end.startswith(rest) or (self.fence and self.fence.startswith(rest)):
            return None
        return -1

    def _after(self, text, pos, final):
        i = skip_blank(text, pos)
        rest = text[i:]
        if rest.startswith(self.begin):
            return i, i  # the section's next call
        if rest.startswith(self.section_end):
            return i + len(self.section_end), None
        if not final and (self.begin.startswith(rest) or self.section_end.startswith(rest)):
            return None
        return pos, None


class DeepSeekV3ToolParser(SectionToolParser):
    name = "deepseek_v3"
    section_begin, section_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    begin, end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    markers, strict_trigger = (section_begin,), begin
    head = re.compile(rf"\s*(?:function)?\s*<｜tool▁sep｜>\s*(?P<name>{NAME})\s*(?:```(?:json)?\s*)?")
    fence = "```"
    call_end = "\n```<｜tool▁call▁end｜>"

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f"{cls.begin}function<｜tool▁sep｜>{name}\n```json\n"
