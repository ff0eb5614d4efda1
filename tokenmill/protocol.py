"""What crosses the frontend <-> engine-core boundary: requests in, per-step outputs out.

Plain dataclasses, so the core imports nothing beyond the standard library here; msgspec can
encode them as they are when the core runs in its own process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.request import FinishReason
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import TokenLogprobs


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    fork_of: str | None = None
    """The first sample of the same n > 1 request: this one shares its prompt's KV blocks."""


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request."""
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprobs] | None = None
    """One entry per new token, for requests that asked for logprobs."""
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    """Prompt logprobs arrive with the step that completes the prompt (chunks are gathered by the
    worker until then)."""


@dataclass
class SpecDecodingStats:
    """Speculative decoding's cumulative counters (vLLM's spec_decode metrics)."""

    num_drafts: int = 0
    """Request-steps that verified at least one draft token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """Drafts accepted at each draft position (0 = the first draft of a step)."""

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_position))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying request-step: 1 + accepted drafts (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_requests: int = 0
    """Requests looked up in the prefix cache (cumulative, like the queries and hits)."""
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    queue_times: list[float] = field(default_factory=list)
    """Seconds from arrival to first scheduling, of each request first scheduled since the last stats."""
    spec_decoding: SpecDecodingStats | None = None
    """None when speculative decoding is off."""


@dataclass
class ProfileCommand:
    """Start or stop the engine core's torch profiler (the server's POST /start_profile and /stop_profile)."""

    call_id: int
    """Echoed in the ProfileReply, which is how the frontend matches the reply to its call."""
    start: bool
    output_dir: str = ""
    """start: the folder the stop writes the trace into."""


@dataclass
class ProfileReply:
    call_id: int
    trace_file: str | None = None
    """stop: the gzipped chrome trace (open it in https://ui.perfetto.dev)."""
    table_file: str | None = None
    """stop: the ops' times, a text table next to the trace."""
    error: str | None = None
    is_misuse: bool = False
    """The error is the caller's (start while running, stop while not), not the profiler's."""


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    engine_error: str | None = None
    """Set on the core's last message when a step raised: it is exiting, and every request it held is lost."""
    profile_reply: ProfileReply | None = None
    """The answer to a ProfileCommand (in a message of its own)."""
