"""DeepSeek-V3.1: DeepSeek-V3's section and tokens, but a call is the name, the separator and the JSON arguments
with no type and no code fence, the calls one after another (on one line; cut here),

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import re

from tokenmill.server.tool_parsers.deepseek_v3 import NAME, DeepSeekV3ToolParser


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"
    head = re.compile(rf"\s*(?P<name>{NAME})\s*<｜tool▁sep｜>\s*")
    fence = ""
    call_end = "<｜tool▁call▁end｜>"

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f"{cls.begin}{name}<｜tool▁sep｜>"
