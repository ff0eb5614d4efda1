"""What `tokenmill bench` reports of speculative decoding: the run's acceptance from two readings of the
cumulative counters (the offline engine's SpecDecodingStats, or a server's /metrics, tokenmill's or
vLLM's), its JSON keys and its printed line; and `bench serve` against a fake server's /metrics."""

import argparse
import json

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tokenmill.bench import serve, spec_decode
from tokenmill.protocol import SchedulerStats, SpecDecodingStats
from tokenmill.server.metrics import PrometheusStatLogger

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 6.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 18.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 9.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 1.0
"""


def tokenmill_metrics(*totals: SpecDecodingStats, num_speculative_tokens: int | None = 3) -> str:
    """The /metrics text of tokenmill's server after the core reported these totals."""
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry, num_speculative_tokens)
    for total in totals:
        logger.record([], SchedulerStats(num_running_reqs=1, spec_decoding=total))
    return generate_latest(registry).decode()


def test_tokenmill_metrics_read_back_as_the_core_counted():
    counted = SpecDecodingStats(12, 36, 20, [10, 7, 3])
    assert spec_decode.from_metrics(tokenmill_metrics(SpecDecodingStats(2, 6, 3, [2, 1, 0]), counted)) == counted


def test_vllm_metrics_are_summed_over_engines():
    assert spec_decode.from_metrics(VLLM_METRICS) == SpecDecodingStats(16, 48, 24, [13, 8, 3])


def test_metrics_without_spec_decode_counters_read_as_none():
    assert spec_decode.from_metrics(tokenmill_metrics(num_speculative_tokens=None)) is None
    assert spec_decode.from_metrics("# HELP up\n# TYPE up gauge\nup 1.0\n") is None
    assert spec_decode.from_metrics("") is None


def test_the_run_is_the_difference_of_two_readings():
    before, after = SpecDecodingStats(4, 12, 6, [3, 2]), SpecDecodingStats(14, 42, 26, [12, 9, 5])
    assert spec_decode.difference(before, after) == SpecDecodingStats(10, 30, 20, [9, 7, 5])
    assert spec_decode.difference(None, after) == after  # counters that first appeared during the run
    assert spec_decode.difference(before, None) is None


def test_summary_keys_and_the_printed_line():
    result = spec_decode.summary(SpecDecodingStats(10, 30, 20, [9, 7, 4]))
    # vLLM's result keys and units: the acceptance rate in percent, the per-position rates as fractions.
    assert result == {
        "spec_decode_acceptance_rate": pytest.approx(100 * 2 / 3),
        "spec_decode_acceptance_length": pytest.approx(3.0),  # 1 + 20 accepted / 10 drafts
        "spec_decode_num_drafts": 10,
        "spec_decode_draft_tokens": 30,
        "spec_decode_accepted_tokens": 20,
        "spec_decode_per_position_acceptance_rates": pytest.approx([0.9, 0.7, 0.4]),
    }
    assert spec_decode.describe(result) == (
        "Speculative decoding: acceptance rate 66.7%, mean acceptance length 3.00 (20 of 30 draft tokens "
        "accepted in 10 drafts); by position: 90.0%, 70.0%, 40.0%")
    assert spec_decode.summary(None) == {} and spec_decode.describe({}) is None


def test_the_offline_reading_copies_the_engines_counters():
    class Engine:
        last_stats = SchedulerStats(spec_decoding=SpecDecodingStats(1, 2, 1, [1, 0]))

    class LLM:
        engine = Engine()

    reading = spec_decode.stats_of(LLM())
    assert reading == LLM.engine.last_stats.spec_decoding and reading is not LLM.engine.last_stats.spec_decoding
    LLM.engine.last_stats = SchedulerStats()
    assert spec_decode.stats_of(LLM()) is None
    LLM.engine.last_stats = None  # no step yet
    assert spec_decode.stats_of(LLM()) is None


class FakeServer:
    """/v1/models, /tokenize, streamed /v1/completions of 3 chunks, and /metrics whose spec_decode counters
    advance by (1 draft, 2 draft tokens, 1 accepted at position 0) per completion."""

    def __init__(self, metrics: str | None) -> None:
        self.metrics, self.completions = metrics, 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": [5, 6, 7]})
        if path == "/v1/completions":
            self.completions += 1
            chunks = [{"choices": [{"text": "a"}]}] * 3 + [{"choices": [], "usage": {"completion_tokens": 3}}]
            body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, content=body.encode())
        if path == "/metrics" and self.metrics is not None:
            return httpx.Response(200, text=self.metrics.format(
                drafts=100 + self.completions, tokens=300 + 2 * self.completions, accepted=50 + self.completions))
        return httpx.Response(404, json={"error": {"message": "not found"}})


PROMETHEUS_TEMPLATE = """\
# TYPE PREFIX:spec_decode_num_drafts counter
PREFIX:spec_decode_num_drafts_total{{model_name="m"}} {drafts}
# TYPE PREFIX:spec_decode_num_draft_tokens counter
PREFIX:spec_decode_num_draft_tokens_total{{model_name="m"}} {tokens}
# TYPE PREFIX:spec_decode_num_accepted_tokens counter
PREFIX:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}
# TYPE PREFIX:spec_decode_num_accepted_tokens_per_pos counter
PREFIX:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {accepted}
PREFIX:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="1"}} 7
"""
"""A server's /metrics (PREFIX: tokenmill or vllm), for FakeServer to fill in."""


def run_bench_serve(monkeypatch, tmp_path, server: FakeServer) -> dict:
    """`tokenmill bench serve` against the fake server; its JSON result."""
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient",
                        lambda **kwargs: real_client(transport=httpx.MockTransport(server), **kwargs))
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    result_file = tmp_path / "result.json"
    args = parser.parse_args(["--base-url", "http://fake", "--num-prompts", "4", "--random-input-len", "3",
                              "--result-file", str(result_file)])
    assert serve.main(args) == 0
    return json.loads(result_file.read_text())


@pytest.mark.parametrize("prefix", ["tokenmill", "vllm"])
def test_bench_serve_reports_the_runs_acceptance(prefix, monkeypatch, tmp_path, capsys):
    server = FakeServer(PROMETHEUS_TEMPLATE.replace("PREFIX", prefix))
    result = run_bench_serve(monkeypatch, tmp_path, server)
    assert server.completions == 4 and result["completed"] == 4
    # 4 completions: 4 drafts, 8 draft tokens, 4 accepted (all at position 0); position 1 did not move.
    assert result["spec_decode_num_drafts"] == 4 and result["spec_decode_draft_tokens"] == 8
    assert result["spec_decode_acceptance_rate"] == 50.0 and result["spec_decode_acceptance_length"] == 2.0
    assert result["spec_decode_per_position_acceptance_rates"] == [1.0, 0.0]
    out = capsys.readouterr().out
    assert any(line.split() == ["spec_decode_acceptance_rate", "50.00"] for line in out.splitlines()), out
    assert "spec_decode_per_position_acceptance_rates 1.00, 0.00" in out


@pytest.mark.parametrize("metrics", [None, "# TYPE up gauge\nup 1.0\n"])
def test_bench_serve_says_nothing_of_spec_decoding_without_its_metrics(metrics, monkeypatch, tmp_path, capsys):
    result = run_bench_serve(monkeypatch, tmp_path, FakeServer(metrics))
    assert result["completed"] == 4 and not any(key.startswith("spec_decode") for key in result)
    assert "spec_decode" not in capsys.readouterr().out
