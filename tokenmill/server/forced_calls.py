"""Tool calls a forced tool_choice generated, read while they are being generated.

A forced call is JSON under a schema: `{"name": ..., "parameters": {...}}` for a named function, a list of
such objects for "required". `scan` (a `Scanner`, for a stream) walks the text generated so far and finds, per
call, its name once the name's string has closed and the raw text of its parameters object so far: streams send
the head (id, name) as soon as the name is known, then the parameters' text as argument fragments, as OpenAI
streams calls. The arguments are that raw text in the whole response too, so the concatenated stream equals it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class PartialCall:
    name: str | None = None
    arguments: str = ""  # the parameters object's text so far
    complete: bool = False  # its closing brace was generated


def scan(text: str, named: bool) -> list[PartialCall]:
    """The calls in `text` so far: one object (named) or a list of objects (required)."""
    return Scanner(named).advance(text)


class Scanner:
    """`scan` fed the text as it grows: each `advance` reads only what is new (a stream would otherwise read its
    whole text again at every step, quadratic in a long call's arguments)."""

    def __init__(self, named: bool) -> None:
        self.item_depth = 1 if named else 2  # the container depth inside one call's object
        self.calls: list[PartialCall] = []
        self.pos = 0
        self.stack: list[str] = []
        self.in_string = self.escape = False
        self.string_start = 0
        self.key: str | None = None  # the call object's key whose value comes next
        self.expect_key = False
        self.args_start: int | None = None

    def advance(self, text: str) -> list[PartialCall]:
        """The calls in `text`, which extends the text of the previous call."""
        item_depth, calls, stack = self.item_depth, self.calls, self.stack
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if len(stack) == item_depth:
                        value = _string(text[self.string_start:i + 1])
                        if self.expect_key:
                            self.key, self.expect_key = value, False
                        elif self.key == "name" and calls:
                            calls[-1].name = value
                continue
            if ch == '"':
                self.in_string, self.string_start = True, i
            elif ch in "{[":
                stack.append(ch)
                if len(stack) == item_depth and ch == "{":
                    calls.append(PartialCall())
                    self.expect_key = True
                elif len(stack) == item_depth + 1 and self.key == "parameters" and self.args_start is None:
                    self.args_start = i
            elif ch in "}]":
                if len(stack) == item_depth + 1 and self.args_start is not None:
                    calls[-1].arguments, calls[-1].complete = text[self.args_start:i + 1], True
                    self.args_start = None
                if stack:
                    stack.pop()
            elif ch == "," and len(stack) == item_depth:
                self.expect_key, self.key = True, None
        self.pos = len(text)
        if self.args_start is not None and calls:
            calls[-1].arguments = text[self.args_start:]
        return calls


def _string(raw: str) -> str | None:
    """A JSON string's value; None for one that is not JSON ("\\p"): the text read is not always generated under
    the schema (Qwen3's reasoning parser gives a thinking that max_tokens cut as content)."""
    try:
        return json.loads(raw)
    except ValueError:
        return None
