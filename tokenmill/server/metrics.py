"""Prometheus metrics (prefix `tokenmill:`), fed by the AsyncEngine with every batch of outputs.

Latencies come from the frontend's per-request timestamps; gauges and cache/preemption counters
from the SchedulerStats the core sends with each step (its counters are cumulative, so they are
turned into increments here), and so do speculative decoding's counters (vLLM's spec_decode_*
names), which exist only while speculation is on.

With data parallelism every metric above covers all the replicas (gauges: the sum, KV usage: the mean),
and the `tokenmill:engine_*` metrics, labelled `engine` (the replica's index), show each replica alone.
Each replica's cumulative counters are followed separately; a total below the last one means a new core
(a restart) that counts from zero.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.outputs import RequestOutput
from tokenmill.protocol import SchedulerStats, SpecDecodingStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class SpecDecodingMetrics:
    """vLLM's speculative decoding counters; the acceptance rate is num_accepted_tokens / num_draft_tokens,
    the mean acceptance length 1 + num_accepted_tokens / num_drafts, and position i's acceptance rate
    num_accepted_tokens_per_pos{position="i"} / num_drafts."""

    def __init__(self, model_name: str, registry: CollectorRegistry, num_positions: int = 0) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tokenmill:{name}", doc, ["model_name"], registry=registry).labels(model_name)

        self._model_name = model_name
        self.num_drafts = counter("spec_decode_num_drafts", "Request-steps that verified draft tokens.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._per_pos = Counter("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by draft position (0: a step's first draft).",
                                ["model_name", "position"], registry=registry)
        self.accepted_per_pos: list[Counter] = []
        self._grow(num_positions)  # every position shows from the start, at 0
        self._last: dict[int, SpecDecodingStats] = {}
        """Per engine (data-parallel replica): its last cumulative totals."""

    def _grow(self, num_positions: int) -> None:
        while len(self.accepted_per_pos) < num_positions:
            self.accepted_per_pos.append(self._per_pos.labels(self._model_name, str(len(self.accepted_per_pos))))

    def record(self, totals: SpecDecodingStats, engine_index: int = 0) -> None:
        """Increments since the engine's last totals (the core's counters are cumulative)."""
        last = self._last.get(engine_index, SpecDecodingStats())
        for metric, new, old in (
            (self.num_drafts, totals.num_drafts, last.num_drafts),
            (self.num_draft_tokens, totals.num_draft_tokens, last.num_draft_tokens),
            (self.num_accepted_tokens, totals.num_accepted_tokens, last.num_accepted_tokens),
        ):
            _add(metric, new, old)
        self._grow(len(totals.accepted_per_position))
        for position, new in enumerate(totals.accepted_per_position):
            old = last.accepted_per_position[position] if position < len(last.accepted_per_position) else 0
            _add(self.accepted_per_pos[position], new, old)
        self._last[engine_index] = totals

    def reset(self, engine_index: int) -> None:
        """The engine's core is gone: the next one counts from zero."""
        self._last.pop(engine_index, None)


def _add(counter: Counter, total: int, last_total: int) -> None:
    """Add what a cumulative total grew by; a total below the last one is a new core's, counted from zero."""
    increment = total - last_total if total >= last_total else total
    if increment > 0:
        counter.inc(increment)


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry, num_speculative_tokens: int | None = None,
                 num_engines: int = 1) -> None:
        """`num_speculative_tokens`: with speculative decoding on, its metrics show from the start (else
        they appear with the first stats that carry speculative decoding's counters). `num_engines`: the
        data-parallel replicas, whose per-engine series show from the start."""
        labels = {"model_name": model_name}
        self._model_name = model_name
        self._registry = registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tokenmill:{name}", doc, list(labels), registry=registry).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenmill:{name}", doc, list(labels), registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tokenmill:{name}", doc, list(labels), buckets=buckets, registry=registry).labels(
                **labels
            )

        self.request_success = Counter(
            "tokenmill:request_success", "Finished sequences, by finish reason.",
            ["model_name", "finished_reason"], registry=registry,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a sequence.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.", _REQUEST_BUCKETS)
        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted to free KV-cache blocks.")
        self.engine_metrics = EngineMetrics(model_name, registry, num_engines)
        self._last_token_time: dict[str, dict[int, float]] = {}
        """Per open request, per sample index: when its last token arrived."""
        self._last_totals: dict[int, SchedulerStats] = {}
        """Per engine (data-parallel replica): its latest stats."""
        self.spec_decoding = (None if num_speculative_tokens is None
                              else SpecDecodingMetrics(model_name, registry, num_speculative_tokens))

    def record(self, outputs: list[RequestOutput], stats: SchedulerStats | None, engine_index: int = 0) -> None:
        now = time.time()
        for output in outputs:
            self._record_output(output, now, engine_index)
        if stats is not None:
            self._record_stats(stats, engine_index)

    def _record_output(self, output: RequestOutput, now: float, engine_index: int) -> None:
        metrics = output.metrics
        last_times = self._last_token_time.get(output.request_id)
        if last_times is None:
            last_times = self._last_token_time[output.request_id] = {}
            if metrics.first_token_time is not None:
                self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        for completion in output.outputs:
            if completion.token_ids:
                self.generation_tokens.inc(len(completion.token_ids))
                previous = last_times.get(completion.index)
                if previous is not None:
                    self.itl.observe((now - previous) / len(completion.token_ids))
                last_times[completion.index] = now
            if completion.finish_reason is not None:
                self.request_success.labels(self._model_name, completion.finish_reason).inc()
        if output.finished:
            del self._last_token_time[output.request_id]
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.e2e.observe((metrics.finished_time or now) - metrics.arrival_time)
            self.engine_metrics.finished(engine_index).inc()

    def _record_stats(self, stats: SchedulerStats, engine_index: int) -> None:
        last = self._last_totals.get(engine_index, SchedulerStats())
        self._last_totals[engine_index] = stats
        self.engine_metrics.record(stats, engine_index)
        latest = list(self._last_totals.values())
        self.running.set(sum(s.num_running_reqs for s in latest))
        self.waiting.set(sum(s.num_waiting_reqs for s in latest))
        self.kv_usage.set(sum(s.kv_cache_usage for s in latest) / len(latest))
        for metric, new, old in (
            (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
            (self.preemptions, stats.num_preemptions, last.num_preemptions),
        ):
            _add(metric, new, old)
        for seconds in stats.queue_times:
            self.queue_time.observe(seconds)
        if stats.spec_decoding is not None:
            if self.spec_decoding is None:
                self.spec_decoding = SpecDecodingMetrics(self._model_name, self._registry)
            self.spec_decoding.record(stats.spec_decoding, engine_index)
        elif self.spec_decoding is not None:  # the empty stats of a replica that failed
            self.spec_decoding.reset(engine_index)


class EngineMetrics:
    """Each data-parallel replica's own gauges and finished requests, labelled `engine` (its index)."""

    def __init__(self, model_name: str, registry: CollectorRegistry, num_engines: int) -> None:
        def family(kind: type, name: str, doc: str):
            return kind(f"tokenmill:engine_{name}", doc, ["model_name", "engine"], registry=registry)

        self._model_name = model_name
        self._running = family(Gauge, "num_requests_running", "Sequences in the running batch, per engine core.")
        self._waiting = family(Gauge, "num_requests_waiting", "Sequences waiting to be scheduled, per engine core.")
        self._kv_usage = family(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use, per engine core.")
        self._finished = family(Counter, "requests_finished", "Requests finished (or aborted), per engine core.")
        for engine_index in range(num_engines):  # every replica shows from the start, at 0
            self.record(SchedulerStats(), engine_index)
            self.finished(engine_index)

    def finished(self, engine_index: int) -> Counter:
        return self._finished.labels(self._model_name, str(engine_index))

    def record(self, stats: SchedulerStats, engine_index: int) -> None:
        labels = (self._model_name, str(engine_index))
        self._running.labels(*labels).set(stats.num_running_reqs)
        self._waiting.labels(*labels).set(stats.num_waiting_reqs)
        self._kv_usage.labels(*labels).set(stats.kv_cache_usage)
