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
from tokenmill.bench.serve import RequestResult, arrival_times, summarize
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.protocol import SchedulerStats
from tokenmill.server.metrics import PrometheusStatLogger


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_keep_the_rate_and_burstiness_sets_their_spread(burstiness):
    times = arrival_times(20_000, 16.0, burstiness, random.Random(0))
    # As vLLM's: the first request waits a gap too, and the times are scaled so that the last is num / rate.
    assert times[-1] == pytest.approx(20_000 / 16) and times[0] > 0
    gaps = np.diff([0.0, *times])
    # A gamma distribution of shape k has a coefficient of variation of 1 / sqrt(k) (1: Poisson arrivals).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_an_infinite_rate_sends_everything_at_once_and_an_infinite_burstiness_evenly():
    assert arrival_times(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5
    assert arrival_times(4, 2.0, math.inf, random.Random(0)) == [0.5, 1.0, 1.5, 2.0]  # vLLM's constant gaps


def test_summary_has_vllms_keys_and_counts():
    results = [RequestResult(ok=True, prompt_len=8, ttft=0.1, latency=0.5, output_tokens=5, itl=[0.1] * 4),
               RequestResult(ok=True, prompt_len=12, ttft=0.3, latency=0.7, output_tokens=5, itl=[0.1] * 4),
               RequestResult(prompt_len=100, error="HTTP 503")]
    summary = summarize(results, 2.0, metrics=["ttft", "tpot", "itl"], percentiles=[99])
    assert summary["completed"] == 2 and summary["failed"] == 1
    # The completed requests' own prompt lengths (the datasets draw them): 8 + 12.
    assert summary["total_input_tokens"] == 20 and summary["total_output_tokens"] == 10
    assert summary["output_throughput"] == 5.0 and summary["total_token_throughput"] == 15.0
    assert summary["median_ttft_ms"] == pytest.approx(200) and summary["mean_tpot_ms"] == pytest.approx(100)
    assert {"std_itl_ms", "p99_itl_ms", "p99_ttft_ms"} <= set(summary) and "mean_e2el_ms" not in summary


def test_tpot_leaves_out_the_first_token_and_one_token_requests():
    """vLLM's TPOT: (E2E latency - TTFT) / (output tokens - 1), over the requests of more than one token."""
    results = [RequestResult(ok=True, ttft=0.2, latency=1.0, output_tokens=5, itl=[0.2] * 4),
               RequestResult(ok=True, ttft=0.4, latency=0.4, output_tokens=1)]
    summary = summarize(results, 1.0, metrics=["tpot", "e2el"], percentiles=[50])
    assert summary["mean_tpot_ms"] == pytest.approx(200) and summary["p50_tpot_ms"] == pytest.approx(200)
    assert summary["mean_e2el_ms"] == pytest.approx(700)


def test_peak_output_throughput_and_concurrency_are_vllms_one_second_buckets():
    """vLLM counts each streamed chunk in the second (since the first request's start) it arrived in, and each
    request in every second it was running in: the peaks are the fullest seconds."""
    results = [
        # Chunks at 0.2, 0.5, 0.8, 1.1 s; running in seconds 0 and 1.
        RequestResult(ok=True, start_time=100.0, ttft=0.2, latency=1.1, output_tokens=4, itl=[0.3] * 3),
        # Chunks at 1.6, 1.7, 1.8 s; running in second 1 only, after the first ended: never at once, but in
        # the same second.
        RequestResult(ok=True, start_time=101.5, ttft=0.1, latency=0.3, output_tokens=3, itl=[0.1] * 2),
        RequestResult(start_time=100.0, error="HTTP 503"),
    ]
    summary = summarize(results, 2.0, metrics=[], percentiles=[])
    assert summary["max_output_tokens_per_s"] == 4.0 and summary["max_concurrent_requests"] == 2


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


@pytest.mark.parametrize("value", ["0", "nan"])
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


def test_random_prompts_ignore_eos_and_only_the_sampling_flags_given_are_sent():
    """As vLLM's: the random dataset generates every request's whole output length; requests are greedy unless
    --temperature is given, and the server's other sampling defaults hold unless --top-p and the like are given
    (before: always temperature 0, no other flags, EOS honoured)."""
    def body(*argv: str) -> dict:
        args = parse(*argv)
        serve.apply_vllm_defaults(args)
        return serve.request_body(args, "m", serve_datasets.BenchRequest([1, 2, 3], 16))

    assert body()["ignore_eos"] is True and body()["max_tokens"] == 16
    assert body()["temperature"] == 0.0 and "top_p" not in body()
    sampled = body("--temperature", "0.7", "--top-p", "0.9", "--top-k", "5")
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.7, 0.9, 5)
    assert body(*PREFIX_REPETITION)["ignore_eos"] is False
    assert body(*PREFIX_REPETITION, "--ignore-eos")["ignore_eos"] is True


def test_vllms_general_lengths_and_progress_bar_flag_are_taken():
    args = parse("--input-len", "7", "--output-len", "3", "--disable-tqdm")
    serve.apply_vllm_defaults(args)
    assert (args.random_input_len, args.random_output_len, args.prefix_repetition_output_len) == (7, 3, 3)


@pytest.mark.parametrize("value", ["101", "-1", "ninety", "nan"])
def test_metric_percentiles_outside_0_to_100_are_refused_before_the_run(value, capsys):
    """Before: numpy refused them only after the whole run had been sent."""
    with pytest.raises(SystemExit):
        parse("--metric-percentiles", f"50,{value}")
    assert "percentiles must be numbers from 0 to 100, got" in capsys.readouterr().err
    assert parse("--metric-percentiles", "50,99.9").metric_percentiles == [50.0, 99.9]


RESULTS = [RequestResult(ok=True, prompt_len=8, start_time=5.0, ttft=0.1, latency=0.4, output_tokens=4,
                         itl=[0.1] * 3, generated_text="a b c d"),
           RequestResult(prompt_len=9, start_time=5.1, error="HTTP 503")]


def test_the_saved_result_has_vllms_setup_keys_and_values():
    args = parse("--request-rate", "2", "--max-concurrency", "4", "--burstiness", "0.5", "--num-prompts", "2",
                 "--api-key", "secret")
    args.request_rate = args.request_rate[0]
    summary = summarize(RESULTS, 1.0, ["ttft"], [99])
    record = serve.result_record(args, "org/model", summary, RESULTS, "20261206-104000")
    assert {k: record[k] for k in ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
                                   "num_prompts", "request_rate", "burstiness", "max_concurrency")} == {
        "date": "20261206-104000", "endpoint_type": "openai", "backend": "openai", "label": None,
        "model_id": "org/model", "tokenizer_id": "org/model", "num_prompts": 2, "request_rate": 2.0,
        "burstiness": 0.5, "max_concurrency": 4}
    assert record["completed"] == 1 and record["p99_ttft_ms"] == pytest.approx(100)
    assert "secret" not in str(record) and "input_lens" not in record and "errors" not in record
    args.request_rate = math.inf
    assert serve.result_record(args, "m", summary, RESULTS, "d")["request_rate"] == "inf"


def test_save_detailed_adds_vllms_per_request_lists():
    args = parse("--save-detailed")
    args.request_rate = math.inf
    record = serve.result_record(args, "m", summarize(RESULTS, 1.0, [], []), RESULTS, "d")
    assert record["input_lens"] == [8, 9] and record["output_lens"] == [4, 0]
    assert record["ttfts"] == [0.1, 0.0] and record["itls"] == [[0.1] * 3, []]
    assert record["start_times"] == [5.0, 5.1] and record["generated_texts"] == ["a b c d", ""]
    assert record["errors"] == ["", "HTTP 503"]


def test_the_default_result_file_is_named_as_vllms_in_a_folder_made_before_the_run(tmp_path):
    args = parse("--save-result", "--result-dir", str(tmp_path / "new"), "--max-concurrency", "4")
    args.request_rate = 2.0
    path = serve.result_path(args, "org/model-1", "20261206-104000")
    assert path == str(tmp_path / "new" / "openai-2.0qps-concurrency4-model-1-20261206-104000.json")
    # Before: a missing folder failed the write after the whole run. Made first, even for a server that is down.
    with pytest.raises(Exception, match="onnect"):
        serve.main(parse("--save-result", "--result-dir", str(tmp_path / "new"), "--base-url", "http://127.0.0.1:9"))
    assert (tmp_path / "new").is_dir()
    args = parse("--save-result", "--label", "tm", "--result-dir", str(tmp_path))
    args.request_rate = math.inf
    assert serve.result_path(args, "m", "d") == str(tmp_path / "tm-infqps-m-d.json")


def test_the_report_prints_vllms_lines():
    args = parse("--max-concurrency", "4")
    args.request_rate = 2.0
    summary = summarize(RESULTS, 2.0, ["ttft", "tpot", "itl", "e2el"], [90])
    report = serve.format_report(args, summary, ["ttft", "tpot", "itl", "e2el"], [90.0])
    lines = report.splitlines()
    assert lines[0] == "{:=^50}".format(" Serving Benchmark Result ") and lines[-1] == "=" * 50
    for line in ["Successful requests:                     1", "Failed requests:                         1",
                 "Maximum request concurrency:             4", "Request rate configured (RPS):           2.00",
                 "Benchmark duration (s):                  2.00", "Total input tokens:                      8",
                 "Total generated tokens:                  4", "Request throughput (req/s):              0.50",
                 "Output token throughput (tok/s):         2.00",
                 "Peak output token throughput (tok/s):    4.00",
                 "Peak concurrent requests:                1.00", "Total token throughput (tok/s):          6.00",
                 "{:-^50}".format("Time per Output Token (excl. 1st token)"),
                 "Mean TTFT (ms):                          100.00", "P90 TPOT (ms):                           100.00",
                 "Median ITL (ms):                         100.00", "P90 E2EL (ms):                           400.00"]:
        assert line in [row.rstrip() for row in lines] or line in lines, line


def test_goodput_counts_the_requests_within_every_slo():
    """vLLM's --goodput: completed requests per second whose TTFT, TPOT and E2EL (ms) are all within their
    objectives; a one-token request's TPOT counts as 0."""
    results = [RequestResult(ok=True, ttft=0.1, latency=0.5, output_tokens=5, itl=[0.1] * 4),  # good
               RequestResult(ok=True, ttft=0.3, latency=0.7, output_tokens=5, itl=[0.1] * 4),  # TTFT too long
               RequestResult(ok=True, ttft=0.1, latency=0.1, output_tokens=1),  # good: TPOT 0
               RequestResult(ok=True, ttft=0.1, latency=0.9, output_tokens=3, itl=[0.4] * 2),  # TPOT too long
               RequestResult(error="HTTP 503")]
    goodput = dict(parse("--goodput", "ttft:200", "tpot:100", "e2el:800").goodput)
    summary = summarize(results, 2.0, [], [], goodput=goodput)
    assert goodput == {"ttft": 200.0, "tpot": 100.0, "e2el": 800.0} and summary["request_goodput"] == 1.0
    assert summarize(results, 2.0, [], [])["request_goodput"] is None  # vLLM's key, null without --goodput
    report = serve.format_report(argparse.Namespace(max_concurrency=None, request_rate=math.inf), summary, [], [])
    assert "Request goodput (req/s):                 1.00" in report


@pytest.mark.parametrize("slo", ["ttft", "ttft:fast", "itl:5", "e2el:-1"])
def test_goodput_objectives_are_checked_before_the_run(slo, capsys):
    with pytest.raises(SystemExit):
        parse("--goodput", slo)
    assert "argument --goodput: expected KEY:VALUE, KEY one of ttft, tpot, e2el, VALUE" in capsys.readouterr().err


def test_metadata_goes_into_the_result_and_a_pair_without_equals_is_refused(capsys):
    args = parse("--metadata", "version=0.3.3", "tp=1")
    args.request_rate = math.inf
    record = serve.result_record(args, "m", summarize(RESULTS, 1.0, [], []), RESULTS, "d")
    assert record["version"] == "0.3.3" and record["tp"] == "1"
    with pytest.raises(SystemExit):
        parse("--metadata", "version")
    assert "argument --metadata: expected KEY=VALUE, got 'version'" in capsys.readouterr().err
