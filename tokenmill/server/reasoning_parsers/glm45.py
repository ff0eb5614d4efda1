"""GLM-4.5 and GLM-4.6: as Qwen3, the model opens <think> itself (enable_thinking=false puts an empty think
block in the prompt); an output with no </think> is all content."""

from __future__ import annotations

from tokenmill.server.reasoning_parsers.qwen3 import Qwen3ReasoningParser


class Glm45ReasoningParser(Qwen3ReasoningParser):
    name = "glm45"
