"""`tokenmill bench serve`'s arrivals, metrics and result file, in vLLM's names (the server side is in
tests/e2e/test_cli_errors.py); its datasets' prompts (random with a shared prefix and spread lengths,
prefix_repetition); and the server-side figures it reads off /metrics."""

import argparse
import collections
import math
import random
import re

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tokenmill.bench import serve, serve_datasets, server_metrics
from tokenmill.bench.serve import RequestResult, arrival_gaps, summarize
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.protocol import SchedulerStats
from tokenmill.server.metrics import PrometheusStatLogger


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_keep_the_rate_and_burstiness_sets_their_spread(burstiness):
    gaps = np.array(arrival_gaps(20_001, 16.0, burstiness, random.Random(0))[1:])
    assert gaps.mean() == pytest.approx(1 / 16, rel=0.05)
    # A gamma distribution of shape k has a coefficient of variation of 1 / sqrt(k) (1: Poisson arrivals).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_an_infinite_rate_sends_everything_at_once():
    assert arrival_gaps(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5


def test_summary_has_vllms_keys_and_counts():
    results = [RequestResult(ok=True, prompt_len=8, ttft=0.1, latency=0.5, output_tokens=5, itl=[0.1] * 4),
               RequestResult(ok=True, prompt_len=12, ttft=0.3, latency=0.7, output_tokens=5, itl=[0.1] * 4),
               RequestResult(prompt_len=100, error="HTTP 503")]
    summary = summarize(results, 2.0, metrics=["ttft", "tpot", "itl"], percentiles=[99], peak_concurrency=2)
    assert summary["completed"] == 2 and summary["failed"] == 1 and summary["errors"] == ["HTTP 503"]
    # The completed requests' own prompt lengths (the datasets draw them): 8 + 12.
    assert summary["total_input_tokens"] == 20 and summary["total_output_tokens"] == 10
    assert summary["output_throughput"] == 5.0 and summary["max_concurrent_requests"] == 2
    assert summary["median_ttft_ms"] == pytest.approx(200) and summary["mean_tpot_ms"] == pytest.approx(100)
    assert {"std_itl_ms", "p99_itl_ms", "p99_ttft_ms"} <= set(summary) and "mean_e2el_ms" not in summary


VOCAB = list(range(100, 150))
"""Stands in for the server's tokens of the built-in text (any ids: they are only drawn from)."""


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(argv)


def requests_of(*argv: str, seed: int = 0) -> list[serve_datasets.BenchRequest]:
    args = parse(*argv)
    serve_datasets.check_args(args)
    return serve_datasets.make_requests(args, VOCAB, random.Random(seed))


def test_random_prompts_share_one_prefix_and_draw_lengths_over_vllms_interval():
    requests = requests_of("--num-prompts", "400", "--random-input-len", "10", "--random-output-len", "20",
                           "--random-prefix-len", "24", "--random-range-ratio", "0.5")
    prefix = requests[0].prompt_token_ids[:24]
    assert all(r.prompt_token_ids[:24] == prefix for r in requests)
    # Uniform over [floor(len * 0.5), ceil(len * 1.5)], ends included, after the prefix.
    assert {len(r.prompt_token_ids) - 24 for r in requests} == set(range(5, 16))
    assert {r.output_len for r in requests} == set(range(10, 31))
    assert len({tuple(r.prompt_token_ids[24:]) for r in requests}) == 400


def test_the_default_random_prompts_are_the_ones_earlier_versions_drew():
    requests = requests_of("--num-prompts", "5", "--random-input-len", "7", "--random-output-len", "3")
    rng = random.Random(0)
    assert [r.prompt_token_ids for r in requests] == [[rng.choice(VOCAB) for _ in range(7)] for _ in range(5)]
    assert [r.output_len for r in requests] == [3] * 5


def test_length_bounds_are_vllms_without_float_noise():
    assert serve_datasets.length_bounds(128, 0.1) == (115, 141)
    assert serve_datasets.length_bounds(100, 0.1) == (90, 110)  # 100 * 1.1 is 110.00000000000001 in floats
    assert serve_datasets.draw_lengths(3, 0, 0.5, random.Random(0), minimum=1) == [1, 1, 1]


PREFIX_REPETITION = ["--dataset-name", "prefix_repetition", "--num-prompts", "14", "--prefix-repetition-prefix-len",
                     "32", "--prefix-repetition-suffix-len", "6", "--prefix-repetition-num-prefixes", "3",
                     "--prefix-repetition-output-len", "5"]


def test_prefix_repetition_shares_each_prefix_among_its_requests_in_a_shuffled_order():
    requests = requests_of(*PREFIX_REPETITION)
    assert len(requests) == 12  # 14 rounded down to a multiple of the 3 prefixes, as vLLM's
    assert all(len(r.prompt_token_ids) == 38 and r.output_len == 5 for r in requests)
    prefixes = [tuple(r.prompt_token_ids[:32]) for r in requests]
    assert sorted(collections.Counter(prefixes).values()) == [4, 4, 4]
    assert len({tuple(r.prompt_token_ids[32:]) for r in requests}) == 12
    assert prefixes != sorted(prefixes, key=prefixes.index)  # interleaved, not one prefix's requests in a row
    assert "sends 12 requests" in serve_datasets.rounding_note(parse(*PREFIX_REPETITION))


@pytest.mark.parametrize("argv", [["--random-prefix-len", "16", "--random-range-ratio", "0.3"], PREFIX_REPETITION])
def test_a_seed_gives_the_same_requests(argv):
    assert requests_of(*argv, seed=1) == requests_of(*argv, seed=1)
    assert requests_of(*argv, seed=1) != requests_of(*argv, seed=2)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_concurrency_below_one_is_refused(value, capsys):
    """Before: -1 left the run waiting forever (a semaphore no request could take), 0 meant no limit."""
    with pytest.raises(SystemExit):
        parse("--max-concurrency", value)
    assert f"argument --max-concurrency: must be at least 1, got {value}" in capsys.readouterr().err
    assert parse("--max-concurrency", "4").max_concurrency == 4


def test_a_url_for_host_points_at_base_url(capsys):
    """Before: --host http://127.0.0.1 made http://http://127.0.0.1:8000, 'cannot reach the server at http://http'."""
    with pytest.raises(SystemExit):
        parse("--host", "http://127.0.0.1")
    assert "got the URL 'http://127.0.0.1': pass it with --base-url" in capsys.readouterr().err
    assert parse("--host", "10.0.0.2").host == "10.0.0.2"


@pytest.mark.parametrize("value", ["nan", "4,nan", "0", "-2"])
def test_request_rates_must_be_positive(value, capsys):
    """Before: nan ran all requests at once, reported as a run at 'nan req/s'."""
    with pytest.raises(SystemExit):
        parse("--request-rate", value)
    assert "argument --request-rate: rates must be positive numbers or inf" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "nan", "inf"])
def test_burstiness_must_be_a_positive_number(value):
    """Before: nan passed the check, and the run waited forever."""
    with pytest.raises(ValueError, match="--burstiness must be a positive number"):
        serve.main(parse("--burstiness", value))


def test_the_dataset_and_its_parameters_are_named():
    args = parse("--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", "4")
    assert serve_datasets.dataset_params(args) == {"prefix_len": 256, "suffix_len": 256, "num_prefixes": 4,
                                                   "output_len": 128}
    assert serve_datasets.describe(parse("--random-prefix-len", "64")) == (
        "random (input_len=128, output_len=64, prefix_len=64, range_ratio=0)")


@pytest.mark.parametrize("argv, message", [
    (["--random-range-ratio", "1"], "--random-range-ratio must be in [0, 1), got 1.0"),
    (["--random-input-len", "1", "--random-range-ratio", "0.5"], "a prompt could be empty"),
    (["--random-prefix-len", "-1"], "--random-prefix-len must not be negative"),
    (["--dataset-name", "prefix_repetition", "--num-prompts", "4", "--prefix-repetition-num-prefixes", "5"],
     "--prefix-repetition-num-prefixes must be between 1 and --num-prompts (4), got 5"),
    (["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "0", "--prefix-repetition-suffix-len",
      "0"], "must be at least 1"),
])
def test_flags_no_dataset_can_be_made_from_are_refused_in_one_line(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        serve_datasets.check_args(parse(*argv))


def test_the_servers_ttft_queue_time_and_prefix_hit_rate_over_a_run():
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger("m", registry)

    def read() -> dict[str, float] | None:
        return server_metrics.from_metrics(generate_latest(registry).decode())

    def first_token(request_id: str, ttft: float) -> RequestOutput:
        return RequestOutput(request_id, None, [1, 2], [CompletionOutput(0, "a", [5])], finished=False,
                             metrics=RequestMetrics(arrival_time=100.0, first_token_time=100.0 + ttft))

    stat_logger.record([first_token("old", 9.0)], SchedulerStats(prefix_cache_queries=10, queue_times=[5.0]))
    before = read()
    stat_logger.record([first_token("a", 0.2), first_token("b", 0.4)],
                       SchedulerStats(prefix_cache_queries=110, prefix_cache_hits=75, queue_times=[0.1, 0.3]))
    run = server_metrics.summary(server_metrics.difference(before, read()))
    assert run == {"server_mean_ttft_ms": pytest.approx(300), "server_mean_queue_time_ms": pytest.approx(200),
                   "server_prefix_cache_hit_rate": 0.75, "server_prefix_cache_hits": 75,
                   "server_prefix_cache_queries": 100}


def test_vllms_metric_names_summed_over_engines_and_a_server_without_them():
    text = "".join(f'vllm:{name}{{engine="{engine}"}} {value}\n' for engine in (0, 1) for name, value in (
        ("time_to_first_token_seconds_sum", 0.5), ("time_to_first_token_seconds_count", 2),
        ("prefix_cache_queries_total", 40), ("prefix_cache_hits_total", 10)))
    run = server_metrics.summary(server_metrics.from_metrics(text))
    assert run == {"server_mean_ttft_ms": 250.0, "server_prefix_cache_hit_rate": 0.25,
                   "server_prefix_cache_hits": 20, "server_prefix_cache_queries": 80}
    assert server_metrics.from_metrics("# TYPE up gauge\nup 1.0\n") is None
    assert server_metrics.summary(None) == {}
