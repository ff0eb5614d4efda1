"""Qwen3: the model opens <think> itself; reasoning is what comes before </think>, content what follows. With
no </think> in the output there is no reasoning: all of it is content (enable_thinking=false puts an empty
think block in the prompt, so the output has none).

Streaming cannot wait for a </think> that may never come without holding the whole reasoning back, so the
stream decides at the start: an output that opens with <think> streams as reasoning until </think>, any other
as content. It differs from `split` in two cases only, both off the template's path: an output that opens
<think> and never closes it (cut off by max_tokens: streamed as reasoning, `split` gives it all as content)
and one with a </think> it never opened (streamed as content, `split` gives the text before it as reasoning).
"""

from __future__ import annotations

from tokenmill.server.reasoning_parsers.base import END, START, ReasoningParser, non_blank


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    unopened_is_reasoning = False

    @classmethod
    def split(cls, text: str) -> tuple[str | None, str | None]:
        if END not in text:
            return None, non_blank(text)
        reasoning, _, content = text.partition(END)
        head = reasoning.lstrip()
        if head.startswith(START):
            reasoning = head[len(START):]
        return non_blank(reasoning), non_blank(content)
