"""DeepSeek-V3.1 (and later V3 versions), hybrid: its chat template thinks only when chat_template_kwargs say
{"thinking": true} (also read: "enable_thinking"), as vLLM decides. Then the output is DeepSeek-R1's (the
prompt opened <think>, reasoning runs to </think>); otherwise there is no reasoning parser for the request and
the whole output is content."""

from __future__ import annotations

from typing import Any

from tokenmill.server.reasoning_parsers.base import ReasoningParser
from tokenmill.server.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    """Used as is (no request to decide), it reads the output as thinking was on."""

    name = "deepseek_v3"

    @classmethod
    def for_request(cls, chat_template_kwargs: dict[str, Any]) -> type[ReasoningParser] | None:
        thinking = chat_template_kwargs.get("thinking") or chat_template_kwargs.get("enable_thinking")
        return DeepSeekR1ReasoningParser if thinking else None
