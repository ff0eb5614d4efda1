"""Mistral: the [TOOL_CALLS] token, then the calls. Two published shapes:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]   (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}              (v11 and later)

v11 (Mistral Small 3.2) also writes the call's id: [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{...}.
An id the model gives is kept; else one of 9 letters and digits is made, the only kind Mistral's templates accept
back in the tool results.
"""

from __future__ import annotations

import re

from tokenmill.server.tool_parsers.base import BracketScanner, ToolParser, dump_arguments, random_id, skip_blank
from tokenmill.server.tool_parsers.hermes import json_call, load_json

ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
# A name as tools may spell it (openai_protocol.FunctionDefinition), then maybe the call's id.
HEAD = re.compile(r"([A-Za-z0-9_.:\-]+)(?:\[CALL_ID\]([A-Za-z0-9_\-]*))?")


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    # No structural tag (strict_trigger None): after [TOOL_CALLS] come two shapes, which one depending on the
    # tokenizer's version, that the text alone does not tell apart before the call is written.

    @classmethod
    def make_id(cls, name: str, index: int) -> str:
        return random_id(9)

    def _begin(self) -> None:
        self._start = -1  # first non-blank after the marker
        self._json = False
        self._args = -1  # where [ARGS] ends
        self._object = -1
        self._scanner = BracketScanner(0)

    def _scan(self, text, final):
        if self._start < 0:
            i = skip_blank(text, self._body)
            if i == len(text):
                return None
            self._start, self._json = i, text[i] in "[{"
            if self._json:
                self._scanner = BracketScanner(i)
        if self._json:
            end = self._scanner.advance(text)
            if end is None:
                return None
            loaded = load_json(text[self._start:end])
            items = loaded if isinstance(loaded, list) else [loaded]
            calls = [json_call(item, id_key="id") for item in items]
            return end, calls if calls and all(calls) else None
        if self._args < 0:
            i = text.find(ARGS, self._start)
            head = HEAD.match(text, self._start)
            head_end = head.end() if head else self._start
            if i < 0:
                rest = text[head_end:]
                if rest and not (ARGS.startswith(rest) or (head and not head.group(2) and CALL_ID.startswith(rest))):
                    return self._body, None  # not a name: the marker is content
                return None
            if not head or head_end != i:
                return self._body, None
            self._args = i + len(ARGS)
        if self._object < 0:
            i = skip_blank(text, self._args)
            if i == len(text):
                return None
            if text[i] != "{":
                return i, None
            self._object, self._scanner = i, BracketScanner(i)
        end = self._scanner.advance(text)
        if end is None:
            return None
        arguments = dump_arguments(load_json(text[self._object:end]))
        if arguments is None:
            return end, None
        head = HEAD.match(text, self._start)
        return end, [(head.group(1), arguments, head.group(2) or None)]
