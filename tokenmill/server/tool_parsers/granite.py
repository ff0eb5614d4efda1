"""IBM Granite 3.0 to 3.3: a JSON list of calls after the <|tool_call|> token (Granite 3.1's template may write
it as the text <tool_call>), the whole output as vLLM reads it,

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]

Also read: the list with no token at the start of the output (vLLM reads it too), and, after the token, one call
object closed by </tool_call> as Granite 4 writes it (vLLM sends Granite 4 to hermes). JsonListToolParser is the
machine of this shape, which phi4_mini_json reuses with its own marker.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from tokenmill.server.tool_parsers.base import BracketScanner, ToolParser, skip_blank
from tokenmill.server.tool_parsers.hermes import json_call, load_json

# A list at the start of the output with no marker holds calls only if an object opens it: "[1] ..." is content.
OPENING = re.compile(r"\[\s*(\{)?")


class JsonListToolParser(ToolParser):
    """A marker, then a JSON list of {"name": ..., "arguments": {...}} objects (or "parameters")."""

    object_alone: ClassVar[bool] = False
    """After a marker, one call object (not in a list) is a call too."""
    closing: ClassVar[str] = ""
    """Text that may follow the calls and is dropped with them."""
    call_end = "}]"

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f'{cls.markers[0]}[{{"name": {json.dumps(name)}, "arguments": '

    def _begin(self) -> None:
        self._start = -1  # where the list (or object) starts
        self._scanner = BracketScanner(0)

    def _scan(self, text, final):
        marked = self._body > self._region
        if self._start < 0:
            i = skip_blank(text, self._body)
            if i == len(text):
                return None
            if not marked:
                opening = OPENING.match(text, i)
                if not opening.group(1):
                    return (i + 1, None) if opening.end() < len(text) else None
            elif not (text[i] == "[" or (self.object_alone and text[i] == "{")):
                return self._body, None  # the marker alone is content
            self._start, self._scanner = i, BracketScanner(i)
        end = self._scanner.advance(text)
        if end is None:
            return None
        loaded = load_json(text[self._start:end])
        items = loaded if isinstance(loaded, list) else [loaded]
        calls = [json_call(item, bare=not marked) for item in items]
        return end, calls if calls and all(calls) else None

    def _after(self, text, pos, final):
        if not self.closing:
            return pos, None
        i = skip_blank(text, pos)
        if text.startswith(self.closing, i):
            return i + len(self.closing), None
        if not final and self.closing.startswith(text[i:]):
            return None
        return pos, None


class GraniteToolParser(JsonListToolParser):
    name = "granite"
    markers = ("<|tool_call|>", "<tool_call>")
    start_chars = "["
    strict_trigger = "<|tool_call|>"
    object_alone = True
    closing = "</tool_call>"
