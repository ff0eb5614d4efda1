"""Hermes 2 Pro / 3, Qwen2.5 and Qwen3: each call is a JSON object in its own tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one after another for several calls, with content before them (Qwen's template puts a blank line between).
"""

from __future__ import annotations

import json

from tokenmill.server.tool_parsers.base import Call, ToolParser, dump_arguments


def json_call(obj, id_key: str | None = None, bare: bool = False) -> Call | None:
    """{"name": ..., "arguments": {...}} (or "parameters", as Llama names them; null or left out: no arguments) as a
    call; None if it is not one.
    `bare`: no marker said it is a call, so it needs its arguments ({"name": "Ann", "age": 3} is an answer)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if bare and "arguments" not in obj and "parameters" not in obj:
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    # null, as some models write a call of a function without parameters: none, like no key at all ("{}")
    dumped = dump_arguments({} if arguments is None else arguments)
    if dumped is None:
        return None
    given_id = obj.get(id_key) if id_key else None
    return obj["name"], dumped, given_id if isinstance(given_id, str) and given_id else None


def load_json(text: str):
    """The JSON value of `text`, None if it is not JSON (NaN and Infinity, which json.loads reads, are not)."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return None


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    end = "</tool_call>"
    strict_trigger = "<tool_call>"
    call_end = "}\n</tool_call>"

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '

    def _begin(self) -> None:
        self._search = self._body
        self._skipped = -1  # the first end tag taken as an argument's text
        self._quoted = (self._body, False, False)  # a JSON string's state: (up to, inside one, after a backslash)

    def _scan(self, text, final):
        while (i := text.find(self.end, self._search)) >= 0:
            call = self._call(text[self._body:i])
            if not self._in_value(text, i, call):
                return i + len(self.end), [call] if call else None
            self._skipped = i if self._skipped < 0 else self._skipped
            self._search = i + 1
        if final and self._skipped >= 0:  # no end tag came after all: the first one was the call's end
            call = self._call(text[self._body:self._skipped])
            return self._skipped + len(self.end), [call] if call else None
        self._search = max(self._search, len(text) - len(self.end) + 1)
        return None

    def _call(self, body: str) -> Call | None:
        return json_call(load_json(body))

    def _in_value(self, text: str, end: int, call: Call | None) -> bool:
        """Whether the end tag at `end` is text inside an argument (a JSON string: "</tool_call>" in HTML, code),
        the call going on after it."""
        start, inside, escape = self._quoted
        for c in text[start:end]:
            if escape:
                escape = False
            elif inside and c == "\\":
                escape = True
            elif c == '"':
                inside = not inside
        self._quoted = (end, inside, escape)
        return call is None and inside
