"""Kimi-K2: DeepSeek-V3's shape with Moonshot's tokens; a call's head is its id, `functions.NAME:IDX`, IDX
counting the calls of the whole conversation (cut here),

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}
    <|tool_call_end|><|tool_calls_section_end|>

Kimi's chat template writes a call's id back as its head on the next turn (and "## Return of ID" before the
result), so the id is the head as the model wrote it, and a call the server makes (a forced tool_choice) gets one
of that form too. As vLLM, a head without "functions." ("get_weather:0") is read as well.
"""

from __future__ import annotations

import re

from tokenmill.server.tool_parsers.deepseek_v3 import NAME, SectionToolParser

ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"


class KimiK2ToolParser(SectionToolParser):
    name = "kimi_k2"
    section_begin, section_end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    begin, end = "<|tool_call_begin|>", "<|tool_call_end|>"
    markers, strict_trigger = (section_begin,), begin
    head = re.compile(rf"\s*(?P<id>(?:functions\.)?(?P<name>{NAME}):[0-9]+)\s*{re.escape(ARGUMENT_BEGIN)}\s*")
    call_end = end

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f"{cls.begin}functions.{name}:"

    @classmethod
    def make_id(cls, name: str, index: int) -> str:
        return f"functions.{name}:{index}"

    @classmethod
    def structural_tag(cls, tools: list[dict], parallel: bool = True) -> dict:
        # A tag's begin is fixed text, and the head ends with the call's number: the tag's content starts there.
        tag = super().structural_tag(tools, parallel)
        for call in tag["format"]["tags"]:
            call["content"] = {"type": "sequence", "elements": [
                {"type": "regex", "pattern": "[0-9]+"}, {"type": "const_string", "value": ARGUMENT_BEGIN},
                call["content"]]}
        return tag
