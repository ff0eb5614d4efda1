"""GLM-4.5 and GLM-4.6: each call in <tool_call> tags, the name then key/value pairs in tags, as the chat
template writes them,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

(GLM-4.7 writes the same without the newlines.) The template writes a string value as it is and any other as
JSON, so a value is kept as text where the tool's schema says string, converted where it names another type
(as qwen3_coder does), and read as JSON where the schema says nothing, text if it is not JSON.
"""

from __future__ import annotations

import json
import re

from tokenmill.server.tool_parsers.base import Call
from tokenmill.server.tool_parsers.hermes import load_json
from tokenmill.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser, convert, schema_types

HEAD = re.compile(r"\s*([^\s<]+)\s*")
ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


def glm_value(value: str, schema) -> object:
    if schema_types(schema):
        return convert(value, schema)
    if value.strip() == "null":
        return None
    parsed = load_json(value)
    return value if parsed is None else parsed


class Glm45ToolParser(Qwen3CoderToolParser):
    name = "glm45"
    call_end = "</tool_call>"
    arguments_style = "glm_xml"  # <arg_key>key</arg_key><arg_value>value</arg_value>, as read below

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f"<tool_call>{name}"

    def _in_value(self, text: str, end: int, call: Call | None) -> bool:
        """Whether the end tag at `end` is inside a value not yet closed (code or markup that writes it)."""
        start = text.rfind("<arg_value>", self._body, end)
        return start >= 0 and text.find("</arg_value>", start, end) < 0

    def _call(self, body: str) -> Call | None:
        head = HEAD.match(body)
        if head is None:
            return None
        name, pos = head.group(1), head.end()
        properties = self._schemas.get(name, {})
        arguments = {}
        while pos < len(body):
            argument = ARGUMENT.match(body, pos)
            if argument is None:
                return None  # text that is not a key/value pair: not this format
            key = argument.group(1).strip()
            arguments[key] = glm_value(argument.group(2), properties.get(key))
            pos = argument.end()
        return name, json.dumps(arguments, ensure_ascii=False), None
