"""Request: the scheduler's record of one generation (token ids, progress counters, status)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_NO_TOKEN = enum.auto()
    """The request's own constraints left no token to sample (see NO_TOKEN_LEFT)."""

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_NO_TOKEN: FinishReason.ERROR,
}

NO_TOKEN_LEFT = ("no token was left to sample: the request's grammar (structured outputs), allowed_token_ids, "
                 "bad_words, logit_bias and min_tokens together allow no token at this point")
"""Why a request ended with finish_reason "error": only found mid-generation (a grammar's allowed tokens change
with every token), so it ends there, with the tokens before, rather than emit a token outside its constraints."""


GRAMMAR_FAILED = "the request's structured output could not be compiled"
"""The start of the stop_reason of a request that ended with finish_reason "error" because its grammar did not
compile in the engine (the server checks a spec first, so this is rare)."""


def finish_reason_of(status: RequestStatus) -> FinishReason | None:
    return _FINISH_REASONS.get(status)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    """Lower runs first under the priority policy (vLLM's convention)."""
    arrival_order: int = 0
    """Requests the scheduler took before this one: breaks ties of (priority, arrival_time), which requests added
    together share (an n > 1 request's samples, a caller's batch), so the priority policy's preemption victim is
    always the request its queue would admit last."""
    cache_salt: str | None = None
    """Isolates this request's prefix-cache entries from requests with another salt."""

    fork_of: str | None = None
    """Another sample of the same n > 1 request, whose prompt KV this one shares (scheduler/forks.py)."""

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (computed or taken from the prefix cache)."""
    num_cached_tokens: int | None = None
    """Prompt tokens served by the prefix cache at first scheduling; None until scheduled."""
    num_output_placeholders: int = 0
    """Tokens sampled in scheduled steps whose results the scheduler has not seen yet: with async
    scheduling, step N+1 is scheduled while step N runs, assuming step N's token exists."""
    num_preemptions: int = 0
    stop_token_id: int | None = None
    """The stop_token_ids entry that finished the request, if any (not set for EOS)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of this request's full blocks, kept by the KV-cache manager."""
    can_sample: bool = True
    """False while its next token may not be sampled yet (its grammar is compiling): the scheduler computes most of
    its prompt meanwhile (scheduler/sampling_gate.py)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) without copying the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
