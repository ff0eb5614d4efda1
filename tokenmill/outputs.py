"""What users get back: RequestOutput with one CompletionOutput per sample, and timing metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    """Rank in the model's distribution (1 = most likely)."""
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated position: token id -> its Logprob (the chosen token and the top alternatives)."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt position; the first token has no logprob (None)."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """"stop", "length", "abort", or "error"; None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended generation; None for EOS-less endings. With finish_reason
    "error": what went wrong (request.GRAMMAR_FAILED and its reason), None where no token was left to sample
    (request.NO_TOKEN_LEFT)."""
    cumulative_logprob: float | None = None
    """Sum of the chosen tokens' logprobs; set when logprobs were computed."""
    logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = field(default=None)
