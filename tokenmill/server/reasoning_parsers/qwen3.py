"""Qwen3: the model opens <think> itself; reasoning is what comes before </think>, content what follows. With
no </think> in the output there is no reasoning: all of it is content (enable_thinking=false puts an empty
think block in the prompt, so the output has none).

Streaming cannot wait for a </think> that may never come without holding the whole reasoning back, so the
stream decides at the start: an output that opens with <think> streams as reasoning until </think>, any other
as content. It differs from `split` in two cases only, both off the template's path: an output that opens
<think> and never closes it (cut off by max_tokens: streamed as reasoning, `split` gives it all as content)
and one with a </think> it never opened (streamed as content, `split` gives the text before it as reasoning).
A prompt that opened the block (Qwen3 Thinking-2507's template) gives the parser that starts inside it, whole and
streamed (`after_prompt`): the text up to </think> is reasoning, all of it if cut off while thinking.
The parsers of other models that open their reasoning themselves (GLM-4.5, Granite) work the same way.
"""

from __future__ import annotations

from tokenmill.server.reasoning_parsers.base import ReasoningParser, find_first, non_blank


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    unopened_is_reasoning = False

    @classmethod
    def split(cls, text: str) -> tuple[str | None, str | None]:
        end, marker = find_first(text, cls.ends)
        if end < 0:
            return None, non_blank(text)
        reasoning, content = text[:end], text[end + len(marker):]
        head = reasoning.lstrip()
        opened = next((start for start in cls.starts if head.startswith(start)), None)
        if opened is not None:
            reasoning = head[len(opened):]
        return non_blank(reasoning), non_blank(content)
