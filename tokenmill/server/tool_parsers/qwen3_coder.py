"""Qwen3-Coder: XML calls, one per <tool_call>, as its chat template writes them,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is text; where the tool's JSON schema types the parameter (integer, number, boolean, object, array,
null) it is converted, and a value that does not convert stays a string.
"""

from __future__ import annotations

import ast
import json
import re

from tokenmill.server.tool_parsers.base import Call
from tokenmill.server.tool_parsers.hermes import HermesToolParser, load_json
from tokenmill.server.tool_parsers.pythonic import literal

FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
INTEGER = re.compile(r"[-+]?\d+")
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def schema_types(schema) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        types = [kind]
    else:
        types = [t for t in kind if isinstance(t, str)] if isinstance(kind, list) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types += [t for t in schema_types(sub) if t not in types]
    if not types and ("properties" in schema):
        types = ["object"]
    return types


def convert(value: str, schema) -> object:
    """The parameter's text as the JSON value its schema asks for; the text itself when it asks for a string,
    says nothing, or the text does not convert."""
    types = schema_types(schema)
    word = value.strip()
    if "null" in types and word.lower() in ("null", "none"):
        return None
    if not types or "string" in types:
        return value
    for kind in types:
        if kind in ("integer", "number") and NUMBER.fullmatch(word):
            try:
                number = int(word) if INTEGER.fullmatch(word) else float(word) if kind == "number" else None
            except ValueError:  # past 4300 digits Python reads no int from text
                number = None
            if number is not None and number == number and abs(number) != float("inf"):
                return number
        if kind == "boolean" and word.lower() in ("true", "false"):
            return word.lower() == "true"
        if kind in ("object", "array"):
            want = dict if kind == "object" else list
            parsed = load_json(word)
            if parsed is None:
                try:
                    parsed = literal(ast.parse(word, mode="eval").body)
                except (SyntaxError, ValueError, RecursionError, MemoryError):
                    parsed = None
            if isinstance(parsed, want):
                return parsed
    return value


class Qwen3CoderToolParser(HermesToolParser):
    name = "qwen3_coder"
    call_end = "</function>\n</tool_call>"
    arguments_style = "qwen_xml"  # <parameter=key>value</parameter>, as read below

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f"<tool_call>\n<function={name}>\n"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._schemas: dict[str, dict] = {}
        for tool in self.tools:
            function = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                parameters = function.get("parameters")
                properties = parameters.get("properties") if isinstance(parameters, dict) else None
                self._schemas[function["name"]] = properties if isinstance(properties, dict) else {}

    def _in_value(self, text: str, end: int, call: Call | None) -> bool:
        """Whether the end tag at `end` is inside a parameter not yet closed (code or markup that writes it)."""
        start = text.rfind("<parameter=", self._body, end)
        return start >= 0 and text.find("</parameter>", start, end) < 0

    def _call(self, body: str) -> Call | None:
        match = FUNCTION.match(body)
        if not match:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        if not name:
            return None
        properties = self._schemas.get(name, {})
        arguments, last = {}, 0
        for parameter in PARAMETER.finditer(inner):
            if inner[last:parameter.start()].strip():
                return None  # text between parameters: not this format
            last = parameter.end()
            key, value = parameter.group(1).strip(), parameter.group(2)
            # The template writes "\n" + value + "\n": take those two off and nothing else.
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            arguments[key] = convert(value, properties.get(key))
        if inner[last:].strip():
            return None
        return name, json.dumps(arguments, ensure_ascii=False), None
