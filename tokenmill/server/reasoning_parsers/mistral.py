"""Magistral (Mistral's reasoning models): [THINK] reasoning [/THINK] content, the markers special tokens of
its tokenizer. Only an output that opens with [THINK] has reasoning (until [/THINK], or to the end if cut off
while thinking); any other is all content."""

from __future__ import annotations

from tokenmill.server.reasoning_parsers.base import ReasoningParser


class MistralReasoningParser(ReasoningParser):
    name = "mistral"
    starts = ("[THINK]",)
    ends = ("[/THINK]",)
    unopened_is_reasoning = False
