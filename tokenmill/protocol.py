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
    new_logprobs: TokenLogprobs | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    """Prompt logprobs arrive with the step that completes the prompt (chunks are gathered by the
    worker until then)."""


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    queue_times: list[float] = field(default_factory=list)
    """Seconds from arrival to first scheduling, of each request first scheduled since the last stats."""


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    engine_error: str | None = None
    """Set on the core's last message when a step raised: it is exiting, and every request it held is lost."""
