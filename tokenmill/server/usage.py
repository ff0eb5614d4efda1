"""A response's usage object: its prompt, completion and total tokens, and vLLM's details where asked for:
`prompt_tokens_details.cached_tokens` (--enable-prompt-tokens-details: the prompt tokens the prefix cache held)
and, for chat with a --reasoning-parser, `completion_tokens_details.reasoning_tokens` (the choices' tokens inside
reasoning blocks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.outputs import RequestOutput
from tokenmill.sample.thinking_budget import ReasoningTokenCount

if TYPE_CHECKING:
    from tokenmill.server.reasoning_parsers import ReasoningParser
    from tokenmill.server.state import ServerState


class ReasoningTokens:
    """A chat response's reasoning tokens, counted choice by choice as their tokens come, between the engine's
    reasoning markers' token ids (as a thinking_token_budget counts them; the markers' own tokens not counted).
    A marker is seen as those ids only: one the tokenizer splits otherwise in its context is not (README)."""

    def __init__(self, prompt_token_ids: list[int], markers: tuple[list[int], list[int]],
                 parser: type[ReasoningParser] | None) -> None:
        """`parser`: the request's reasoning parser; None where the request has no reasoning (thinking turned off,
        or the prompt closed the block): the output is all answer, 0 tokens."""
        self._start, self._end = markers
        self._choices: dict[int, tuple[ReasoningTokenCount, list[int]]] = {}
        """Each choice's count, and its first tokens (as many as the start marker has)."""
        self._parser = parser
        if parser is None:  # nothing to count: the prompt is not scanned
            return
        self._after_prompt = ReasoningTokenCount.after_prompt(prompt_token_ids, self._start, self._end)
        self._unopened_inside = parser.unopened_is_reasoning and not self._after_prompt.is_inside
        """The parser takes an output that opens no block as reasoning (deepseek_r1: its template opened it)."""

    def add(self, index: int, token_ids: list[int]) -> None:
        if self._parser is None:
            return
        if index not in self._choices:
            count = (ReasoningTokenCount.inside(self._start, self._end) if self._unopened_inside
                     else self._after_prompt.copy())
            self._choices[index] = (count, [])
        count, head = self._choices[index]
        head.extend(token_ids[: len(self._start) - len(head)])
        count.feed(token_ids)

    @property
    def total(self) -> int:
        if self._parser is None:
            return 0
        # Taken as inside from the start, an output that opens with the start marker counted it: not reasoning.
        opened = len(self._start) if self._unopened_inside else 0
        return sum(count.count - (opened if head == self._start else 0) for count, head in self._choices.values())


class Usage:
    def __init__(self, num_prompt_tokens: int, cached_tokens: bool = False,
                 reasoning: ReasoningTokens | None = None) -> None:
        """`cached_tokens`: report prompt_tokens_details; `reasoning`: report completion_tokens_details."""
        self.prompt_tokens = num_prompt_tokens
        self.completion_tokens = 0
        self._cached: dict[int, int] | None = {} if cached_tokens else None
        """Each prompt's tokens found in the prefix cache (a completion request may have several prompts)."""
        self._reasoning = reasoning

    def add(self, token_ids: list[int], index: int = 0) -> None:
        """A choice's new output tokens."""
        self.completion_tokens += len(token_ids)
        if self._reasoning is not None:
            self._reasoning.add(index, token_ids)

    def saw(self, output: RequestOutput, prompt_index: int = 0) -> None:
        if self._cached is not None:
            self._cached[prompt_index] = output.num_cached_tokens

    def body(self) -> dict:
        body = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self._cached is not None:
            body["prompt_tokens_details"] = {"cached_tokens": sum(self._cached.values())}
        if self._reasoning is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": self._reasoning.total}
        return body


def chat_usage(state: ServerState, prompt_token_ids: list[int], parser: type[ReasoningParser] | None,
               cached_tokens: bool | None = None, reported: bool = True) -> Usage:
    """A chat response's usage: reasoning tokens counted where the server has a reasoning parser (and the engine
    its markers: --reasoning-config may have set others, or none) and the usage is `reported` (a stream without a
    usage chunk does not run the count over its tokens); cached tokens where `cached_tokens` (None: where the
    server's --enable-prompt-tokens-details)."""
    markers = state.engine.input_processor.thinking_markers
    reasoning = None
    if reported and state.config.reasoning_parser is not None and markers is not None:
        reasoning = ReasoningTokens(prompt_token_ids, markers, parser)
    if cached_tokens is None:
        cached_tokens = state.config.enable_prompt_tokens_details
    return Usage(len(prompt_token_ids), cached_tokens, reasoning)
