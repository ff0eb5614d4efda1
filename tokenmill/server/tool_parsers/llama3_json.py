"""Llama 3.1 / 3.2 JSON tool calls: the output is a JSON object, or several separated by ";",

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

optionally after <|python_tag|> (which may follow some content). "arguments" is accepted for "parameters".
An output that starts with "{" but is not a call stays content.
"""

from __future__ import annotations

import json
import re

from tokenmill.server.tool_parsers.base import BracketScanner, ToolParser, skip_blank
from tokenmill.server.tool_parsers.hermes import json_call, load_json

# A call's object opens with a key: "{" then blanks then '"'; anything else ("{{ template }}") is content.
OPENING = re.compile(r"\{\s*(\")?")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)
    start_chars = "{"
    # A call has no marker of its own: the grammar takes the start of its object as one, wherever it comes.
    strict_trigger = '{"name": "'
    call_end = "}"

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": '

    def _begin(self) -> None:
        self._object = -1
        self._scanner = BracketScanner(0)

    def _scan(self, text, final):
        if self._object < 0:
            i = skip_blank(text, self._body)
            if i == len(text):
                return None
            if text[i] != "{":
                return i, None
            opening = OPENING.match(text, i)
            if not opening.group(1):
                return (i + 1, None) if opening.end() < len(text) else None
            self._object, self._scanner = i, BracketScanner(i)
        end = self._scanner.advance(text)
        if end is None:
            return None
        call = json_call(load_json(text[self._object:end]), bare=True)
        return end, [call] if call else None

    def _after(self, text, pos, final):
        i = skip_blank(text, pos)
        if i == len(text):
            return None if not final else (i, None)
        if text[i] != ";":
            return i, None
        j = skip_blank(text, i + 1)
        if j == len(text):
            return None if not final else (i, None)
        return (i, i + 1) if text[j] == "{" else (i, None)


class Llama4JsonToolParser(Llama3JsonToolParser):
    """vLLM's name for Llama 4 served with a JSON tool-calling template: the same format."""

    name = "llama4_json"
