"""`tokenmill bench serve`'s arrivals, metrics and result file, in vLLM's names (the server side is in
tests/e2e/test_cli_errors.py)."""

import math
import random

import numpy as np
import pytest

from tokenmill.bench.serve import RequestResult, arrival_gaps, summarize


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_keep_the_rate_and_burstiness_sets_their_spread(burstiness):
    gaps = np.array(arrival_gaps(20_001, 16.0, burstiness, random.Random(0))[1:])
    assert gaps.mean() == pytest.approx(1 / 16, rel=0.05)
    # A gamma distribution of shape k has a coefficient of variation of 1 / sqrt(k) (1: Poisson arrivals).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_an_infinite_rate_sends_everything_at_once():
    assert arrival_gaps(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5


def test_summary_has_vllms_keys_and_counts():
    results = [RequestResult(ok=True, ttft=0.1, latency=0.5, output_tokens=5, itl=[0.1] * 4),
               RequestResult(ok=True, ttft=0.3, latency=0.7, output_tokens=5, itl=[0.1] * 4),
               RequestResult(error="HTTP 503")]
    summary = summarize(results, 2.0, input_len=10, metrics=["ttft", "tpot", "itl"], percentiles=[99],
                        peak_concurrency=2)
    assert summary["completed"] == 2 and summary["failed"] == 1 and summary["errors"] == ["HTTP 503"]
    assert summary["total_input_tokens"] == 20 and summary["total_output_tokens"] == 10
    assert summary["output_throughput"] == 5.0 and summary["max_concurrent_requests"] == 2
    assert summary["median_ttft_ms"] == pytest.approx(200) and summary["mean_tpot_ms"] == pytest.approx(100)
    assert {"std_itl_ms", "p99_itl_ms", "p99_ttft_ms"} <= set(summary) and "mean_e2el_ms" not in summary
