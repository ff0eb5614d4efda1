"""The server's periodic stats lines (vLLM's "Engine 000: Avg prompt throughput: ..."), from the outputs and
SchedulerStats the engine hands its stat loggers."""

import logging
import re
import time

import pytest

from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.protocol import SchedulerStats, SpecDecodingStats
from tokenmill.server.stats_log import INTERVAL_ENV, CachingMetrics, LoggingStatLogger, log_stats_interval

LINE = re.compile(r"Engine (\d{3}): Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) "
                  r"tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, GPU KV cache usage: ([\d.]+)%, "
                  r"Prefix cache hit rate: ([\d.]+)%")


def output(request_id: str, num_prompt: int, new_token_ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, None, list(range(num_prompt)),
                         [CompletionOutput(0, "", new_token_ids, "length" if finished else None)], finished,
                         RequestMetrics(arrival_time=time.time()))


def lines(caplog, stats_log: LoggingStatLogger, elapsed_s: float = 2.0) -> list[str]:
    """The lines of one interval that lasted `elapsed_s`."""
    caplog.clear()
    stats_log._last_line_time = time.monotonic() - elapsed_s
    with caplog.at_level(logging.INFO, logger="tokenmill.server.stats_log"):
        stats_log.log()
    return [record.getMessage() for record in caplog.records]


def test_an_interval_with_requests_logs_throughput_counts_kv_usage_and_hit_rate(caplog):
    stats_log = LoggingStatLogger()
    assert lines(caplog, stats_log) == []  # idle from the start: silent
    stats = SchedulerStats(num_running_reqs=1, num_waiting_reqs=2, kv_cache_usage=0.25, prefix_cache_requests=2,
                           prefix_cache_queries=40, prefix_cache_hits=10)
    stats_log.record([output("a", 30, [5])], stats)  # the first token: the prompt's 30 tokens are done
    stats_log.record([output("a", 30, [6, 7])], stats)
    stats_log.record([output("a", 30, [8], finished=True)], stats)
    [line] = lines(caplog, stats_log)
    engine, prompt, generation, running, waiting, kv, hit_rate = LINE.fullmatch(line).groups()
    assert engine == "000" and int(running) == 1 and int(waiting) == 2
    assert float(prompt) == pytest.approx(15, abs=0.1) and float(generation) == pytest.approx(2, abs=0.1)
    assert (float(kv), float(hit_rate)) == (25.0, 25.0)


def test_the_line_after_the_work_drains_shows_it_then_silence(caplog):
    stats_log = LoggingStatLogger()
    stats_log.record([output("a", 4, [1], finished=True)], SchedulerStats(num_running_reqs=1))
    assert len(lines(caplog, stats_log)) == 1
    stats_log.record([], SchedulerStats())  # done: nothing running
    [drained] = lines(caplog, stats_log)
    assert LINE.fullmatch(drained).groups()[1:5] == ("0.0", "0.0", "0", "0")
    assert lines(caplog, stats_log) == []


def test_each_data_parallel_engine_has_its_own_line(caplog):
    stats_log = LoggingStatLogger(num_engines=3)
    stats_log.record([output("a", 10, [1])], SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5), 0)
    stats_log.record([output("b", 20, [1, 2])], SchedulerStats(num_running_reqs=1, kv_cache_usage=0.1), 2)
    found = [LINE.fullmatch(line).groups() for line in lines(caplog, stats_log)]
    assert [(g[0], g[1], g[5]) for g in found] == [("000", "5.0", "50.0"), ("002", "10.0", "10.0")]


def test_speculation_adds_the_interval_acceptance(caplog):
    stats_log = LoggingStatLogger()

    def spec(drafts, draft_tokens, accepted, per_pos):
        return SchedulerStats(num_running_reqs=1, spec_decoding=SpecDecodingStats(drafts, draft_tokens, accepted,
                                                                                  per_pos))

    stats_log.record([output("a", 4, [1, 2])], spec(2, 6, 3, [2, 1, 0]))
    assert "Mean acceptance length: 2.50" in lines(caplog, stats_log)[1]
    stats_log.record([output("a", 4, [3])], spec(6, 18, 5, [4, 1, 0]))  # this interval: 4 drafts, 2 accepted
    [_, spec_line] = lines(caplog, stats_log)
    assert ("Mean acceptance length: 1.50, Accepted throughput: 1.00 tokens/s, Drafted throughput: 6.00 tokens/s, "
            "Accepted: 2 tokens, Drafted: 12 tokens, Per-position acceptance rate: 0.500, 0.000, 0.000, "
            "Avg Draft acceptance rate: 16.7%") in spec_line
    stats_log.record([output("a", 4, [4])], spec(6, 18, 5, [4, 1, 0]))  # no draft verified: no spec line
    assert len(lines(caplog, stats_log)) == 1


def hit_rate(caplog, stats_log: LoggingStatLogger) -> float:
    [line] = lines(caplog, stats_log)
    return float(LINE.fullmatch(line).groups()[6])


def test_the_hit_rate_is_that_of_the_most_recent_1000_requests(caplog):
    """vLLM's CachingMetrics window: after 1,000 misses, 500 requests that hit 80 of their 100 prompt tokens show
    40.0% (the window: 500 misses, 500 hits), not the 26.7% since start."""
    stats_log = LoggingStatLogger()
    totals = SchedulerStats(num_running_reqs=1)

    def admit(num_requests: int, hits_each: int) -> None:
        for _ in range(num_requests):  # one request looked up per stats update; the counts are cumulative
            totals.prefix_cache_requests += 1
            totals.prefix_cache_queries += 100
            totals.prefix_cache_hits += hits_each
            stats_log.record([], SchedulerStats(**vars(totals)))

    admit(1000, 0)
    assert hit_rate(caplog, stats_log) == 0.0
    admit(500, 80)
    assert totals.prefix_cache_hits / totals.prefix_cache_queries == pytest.approx(0.267, abs=1e-3)
    assert hit_rate(caplog, stats_log) == 40.0
    admit(500, 80)
    assert hit_rate(caplog, stats_log) == 80.0
    stats_log.record([], SchedulerStats(num_running_reqs=1))  # a restarted core: its cache and counts start empty
    assert hit_rate(caplog, stats_log) == 0.0
    stats_log.record([], SchedulerStats(num_running_reqs=1, prefix_cache_requests=1, prefix_cache_queries=10,
                                        prefix_cache_hits=5))
    assert hit_rate(caplog, stats_log) == 50.0


def test_the_window_keeps_whole_updates_and_always_the_newest():
    window = CachingMetrics(max_recent_requests=4)
    window.observe(3, 30, 0)
    window.observe(0, 0, 0)  # no lookups: changes nothing
    window.observe(3, 30, 30)  # 6 requests: the oldest update leaves
    assert (window.num_requests, window.hit_rate) == (3, 1.0)
    window.observe(10, 100, 50)  # over the limit alone: kept
    assert (window.num_requests, window.hit_rate) == (10, 0.5)


def test_the_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert log_stats_interval() == 10.0
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    assert log_stats_interval() == 0.5
    monkeypatch.setenv(INTERVAL_ENV, "0")
    with pytest.raises(ValueError, match=INTERVAL_ENV):
        log_stats_interval()
