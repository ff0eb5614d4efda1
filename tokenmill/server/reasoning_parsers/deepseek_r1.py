"""DeepSeek-R1 (and models whose template opens the think block in the prompt, e.g. Qwen3 Thinking-2507):
everything up to </think> is reasoning, the rest content. The opening <think> may be missing, since the
template put it in the prompt; with no </think> at all (cut off while thinking) the whole text is reasoning."""

from __future__ import annotations

from tokenmill.server.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    unopened_is_reasoning = True
