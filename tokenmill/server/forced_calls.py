"""Tool calls a forced tool_choice generated, read while they are being generated.

A forced call is JSON under a schema: `{"name": ..., "parameters": {...}}` for a named function, a list of
such objects for "required". `scan` walks the text generated so far and finds, per call, its name once the
name's string has closed and the raw text of its parameters object so far: streams send the head (id, name)
as soon as the name is known, then the parameters' text as argument fragments, as OpenAI streams calls. The
arguments are that raw text in the whole response too, so the concatenated stream equals it.
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
    item_depth = 1 if named else 2  # the container depth inside one call's object
    calls: list[PartialCall] = []
    stack: list[str] = []
    in_string = escape = False
    string_start = 0
    key: str | None = None  # the call object's key whose value comes next
    expect_key = False
    args_start: int | None = None
    for i, ch in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
                if len(stack) == item_depth:
                    raw = text[string_start:i + 1]
                    if expect_key:
                        key, expect_key = json.loads(raw), False
                    elif key == "name" and calls:
                        calls[-1].name = json.loads(raw)
            continue
        if ch == '"':
            in_string, string_start = True, i
        elif ch in "{[":
            stack.append(ch)
            if len(stack) == item_depth and ch == "{":
                calls.append(PartialCall())
                expect_key = True
            elif len(stack) == item_depth + 1 and key == "parameters" and args_start is None:
                args_start = i
        elif ch in "}]":
            if len(stack) == item_depth + 1 and args_start is not None:
                calls[-1].arguments, calls[-1].complete = text[args_start:i + 1], True
                args_start = None
            if stack:
                stack.pop()
        elif ch == "," and len(stack) == item_depth:
            expect_key, key = True, None
    if args_start is not None and calls:
        calls[-1].arguments = text[args_start:]
    return calls
