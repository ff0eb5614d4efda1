"""The scheduler <-> worker contract: what to run this step, and what came out of it.

New requests are sent whole once; after that only diffs travel (new block ids, token counts).
The worker keeps its own per-request state (tokens, how many have KV) and appends the tokens it
samples itself. A step computes k + 1 tokens of a decoding request, k >= 0 of them draft tokens
its proposer chose, and emits 1 to k + 1 tokens for it; plain decoding is k = 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the worker has no state for: first scheduled, or resumed after preemption."""

    request_id: str
    token_ids: list[int]
    """Prompt plus any tokens generated before a preemption."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hit)."""
    eos_token_ids: frozenset[int] = frozenset()
    """Masked while fewer than min_tokens were generated."""


@dataclass(frozen=True)
class CachedRequestData:
    """A request the worker already tracks: only what changed since the last step."""

    request_id: str
    new_block_ids: list[int]


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """Most tokens to compute this step per request, lookahead included, in batch order (decodes first)."""
    total_num_scheduled_tokens: int
    finished_request_ids: set[str] = field(default_factory=set)
    """Requests finished, aborted or preempted since the last step: the worker drops their state."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) KV blocks to copy before this step's forward pass (forked samples)."""
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)
    """Requests given room for draft tokens, and how many: the worker's proposer fills up to that many,
    and the request's unused lookahead is simply not computed."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class TokenLogprobs:
    """Log probabilities at one position: the chosen token first, then the top-k alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int
    """Rank of the chosen token in the distribution (1 = most likely)."""


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]]
    """The new tokens of each request whose scheduled tokens reached the end of its sequence: its
    accepted drafts, then the token sampled after them; requests in the middle of a chunked prefill are
    absent."""
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """For sampled requests that asked for logprobs: one entry per new token."""
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """For requests that asked for prompt logprobs: one entry per prompt token computed this
    step whose successor is a prompt token (the first prompt token never has one)."""
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    """Draft tokens verified this step, for the requests that had any."""
