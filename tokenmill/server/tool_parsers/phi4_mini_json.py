"""Phi-4-mini: the calls as one JSON list after the plain-text marker "functools" (no closing marker), as its
chat template asks,

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]

"functools" not followed by "[" ("import functools") is content.
"""

from __future__ import annotations

from tokenmill.server.tool_parsers.granite import JsonListToolParser


class Phi4MiniJsonToolParser(JsonListToolParser):
    name = "phi4_mini_json"
    markers = ("functools",)
    strict_trigger = "functools["  # not the marker alone: "import functools" in the text must stay free
