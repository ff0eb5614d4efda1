"""The server's periodic stats lines (vLLM's LoggingStatLogger): every interval, one INFO line per engine core
(data-parallel replica) that served requests in it, from the same outputs and SchedulerStats /metrics is fed.

    Engine 000: Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 45.6 tokens/s, Running: 2 reqs,
    Waiting: 0 reqs, GPU KV cache usage: 3.1%, Prefix cache hit rate: 25.0%

The prefix cache hit rate is that of the most recent 1,000 requests (vLLM's CachingMetrics), not since start, so
a change in the traffic shows in it. Followed, while speculating, by a "SpecDecoding metrics: ..." line. Prompt
tokens count when a request's first token arrives (the prefill is done), generated tokens as they arrive. An engine
is quiet once idle: no tokens in this interval and none running or waiting, after one last line that shows it
drained.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque

from tokenmill.outputs import RequestOutput
from tokenmill.protocol import SchedulerStats, SpecDecodingStats

logger = logging.getLogger(__name__)

INTERVAL_ENV = "TOKENMILL_LOG_STATS_INTERVAL"
"""Seconds between the stats lines (vLLM's VLLM_LOG_STATS_INTERVAL); default 10."""
DEFAULT_INTERVAL_S = 10.0


def log_stats_interval() -> float:
    value = os.environ.get(INTERVAL_ENV)
    if not value:
        return DEFAULT_INTERVAL_S
    try:
        interval = float(value)
    except ValueError:
        interval = -1.0
    if not interval > 0:
        raise ValueError(f"{INTERVAL_ENV}={value!r}: give the seconds between stats lines, a positive number")
    return interval


class CachingMetrics:
    """The prefix cache hit rate of the most recent `max_recent_requests` requests (vLLM's CachingMetrics).

    Fed one group of requests at a time (those whose lookups one stats update brought); the oldest groups
    leave once the window holds more requests than the limit, the newest group always stays.
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self._groups: deque[tuple[int, int, int]] = deque()
        """(requests, queries, hits) per group, oldest first."""
        self.num_requests = self.num_queries = self.num_hits = 0

    def observe(self, num_requests: int, num_queries: int, num_hits: int) -> None:
        if num_requests == 0:  # nothing looked up: keeps the window's requests in it
            return
        self._groups.append((num_requests, num_queries, num_hits))
        self.num_requests += num_requests
        self.num_queries += num_queries
        self.num_hits += num_hits
        while len(self._groups) > 1 and self.num_requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = self._groups.popleft()
            self.num_requests -= old_requests
            self.num_queries -= old_queries
            self.num_hits -= old_hits

    def reset(self) -> None:
        self._groups.clear()
        self.num_requests = self.num_queries = self.num_hits = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


class _EngineWindow:
    """One engine core's counts since the last line, and its latest (cumulative) stats."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.stats = SchedulerStats()
        self.prefix_cache = CachingMetrics()
        self.spec_at_last_line: SpecDecodingStats | None = None
        self.was_active = False


class LoggingStatLogger:
    def __init__(self, num_engines: int = 1, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._engines = [_EngineWindow() for _ in range(num_engines)]
        self._prefilled: set[str] = set()
        """Requests whose prompt was counted (their first token came), until they finish."""
        self._last_line_time = time.monotonic()

    def record(self, outputs: list[RequestOutput], stats: SchedulerStats | None, engine_index: int = 0) -> None:
        engine = self._engines[engine_index]
        for output in outputs:
            num_new_tokens = sum(len(completion.token_ids) for completion in output.outputs)
            engine.num_generation_tokens += num_new_tokens
            if num_new_tokens and output.request_id not in self._prefilled:
                self._prefilled.add(output.request_id)
                engine.num_prompt_tokens += len(output.prompt_token_ids)
            if output.finished:
                self._prefilled.discard(output.request_id)
        if stats is not None:
            _observe_prefix_cache(engine, stats)
            engine.stats = stats

    def log(self) -> None:
        """One line per engine that served requests since the last call (or is holding some now)."""
        now = time.monotonic()
        elapsed = max(now - self._last_line_time, 1e-9)
        self._last_line_time = now
        for index, engine in enumerate(self._engines):
            stats = engine.stats
            has_tokens = engine.num_prompt_tokens > 0 or engine.num_generation_tokens > 0
            is_active = has_tokens or stats.num_running_reqs > 0 or stats.num_waiting_reqs > 0
            if is_active or engine.was_active:
                logger.info(
                    "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    index, engine.num_prompt_tokens / elapsed, engine.num_generation_tokens / elapsed,
                    stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage * 100,
                    engine.prefix_cache.hit_rate * 100)
                self._log_spec_decoding(engine, elapsed)
            engine.was_active = is_active
            engine.num_prompt_tokens = engine.num_generation_tokens = 0

    def _log_spec_decoding(self, engine: _EngineWindow, elapsed: float) -> None:
        totals = engine.stats.spec_decoding
        if totals is None:  # off, or the empty stats of a replica that failed
            engine.spec_at_last_line = None
            return
        last = engine.spec_at_last_line
        # Cumulative counters: a total below the last one is a restarted core's, counted from zero.
        if last is None or totals.num_drafts < last.num_drafts:
            last = SpecDecodingStats()
        engine.spec_at_last_line = totals.copy()
        num_drafts = totals.num_drafts - last.num_drafts
        if num_drafts <= 0:
            return
        num_draft_tokens = totals.num_draft_tokens - last.num_draft_tokens
        num_accepted = totals.num_accepted_tokens - last.num_accepted_tokens
        old = last.accepted_per_position
        per_position = [(new - (old[i] if i < len(old) else 0)) / num_drafts
                        for i, new in enumerate(totals.accepted_per_position)]
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + num_accepted / num_drafts, num_accepted / elapsed, num_draft_tokens / elapsed, num_accepted,
            num_draft_tokens, ", ".join(f"{rate:.3f}" for rate in per_position),
            num_accepted / num_draft_tokens * 100 if num_draft_tokens else float("nan"))

    async def run(self) -> None:
        """Write the lines every interval until cancelled (a task of the server's event loop)."""
        self._last_line_time = time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.log()
            except Exception:  # stats must never stop serving
                logger.exception("stats line failed")


def _observe_prefix_cache(engine: _EngineWindow, stats: SchedulerStats) -> None:
    """Feed the window the lookups since the engine's last stats (the scheduler's counts are cumulative)."""
    last = engine.stats
    totals = (stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits)
    previous = (last.prefix_cache_requests, last.prefix_cache_queries, last.prefix_cache_hits)
    if any(total < old for total, old in zip(totals, previous)):
        # A new core (or the empty stats of one that failed), counting from zero with an empty cache.
        engine.prefix_cache.reset()
        previous = (0, 0, 0)
    engine.prefix_cache.observe(*(total - old for total, old in zip(totals, previous)))


class StatLoggers:
    """Hands every record to each of `loggers` (the AsyncEngine takes one)."""

    def __init__(self, *loggers) -> None:
        self.loggers = loggers

    def record(self, outputs: list[RequestOutput], stats: SchedulerStats | None, engine_index: int = 0) -> None:
        for stat_logger in self.loggers:
            stat_logger.record(outputs, stats, engine_index)
