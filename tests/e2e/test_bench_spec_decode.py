"""`tokenmill bench throughput|latency --speculative-config ...` on a tiny random Llama: the run's
acceptance printed after the results and kept in the JSON, and nothing of it without speculation."""

import json

import httpx
import pytest
from server_harness import RemoteServer

from tokenmill.bench import spec_decode
from tokenmill.cli import main

ENGINE = ["--kv-cache-space", "0.01", "--max-model-len", "128"]
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
"""Short n-grams: a random model's greedy output soon repeats itself, so there is something to draft."""

BENCHES = {
    "throughput": ["--num-prompts", "4", "--input-len", "16", "--output-len", "48", "--temperature", "0"],
    "latency": ["--batch-size", "2", "--input-len", "16", "--output-len", "32", "--temperature", "0",
                "--num-iters", "2", "--num-iters-warmup", "1"],
}


@pytest.mark.parametrize("bench", BENCHES)
def test_the_acceptance_of_the_run_is_printed_and_saved(bench, tiny_llama, tmp_path, capsys):
    result_file = tmp_path / "result.json"
    assert main(["bench", bench, "--model", tiny_llama.path, *ENGINE, *BENCHES[bench],
                 "--speculative-config", NGRAM, "--output-json", str(result_file)]) == 0
    result = json.loads(result_file.read_text())
    if bench == "latency" and result["spec_decode_num_drafts"] == 0:
        # A random model's drafts are rejected in the warm-up; the budget may then draft nothing in the timed
        # iterations, which must be reported as such.
        assert result["spec_decode_acceptance_rate"] == 0
        assert not any(result["spec_decode_per_position_acceptance_rates"])
        assert any(line.startswith("Speculative decoding:") for line in capsys.readouterr().out.splitlines())
        return
    assert result["spec_decode_num_drafts"] > 0, result
    assert 0 < result["spec_decode_draft_tokens"] <= 3 * result["spec_decode_num_drafts"]
    assert result["spec_decode_acceptance_rate"] == pytest.approx(  # in percent, as vLLM's
        100 * result["spec_decode_accepted_tokens"] / result["spec_decode_draft_tokens"])
    assert result["spec_decode_acceptance_length"] == pytest.approx(
        1 + result["spec_decode_accepted_tokens"] / result["spec_decode_num_drafts"])
    per_position = result["spec_decode_per_position_acceptance_rates"]
    assert 1 <= len(per_position) <= 3 and per_position == sorted(per_position, reverse=True)
    assert sum(per_position) == pytest.approx(result["spec_decode_acceptance_length"] - 1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Speculative decoding:")]
    assert len(lines) == 1 and f"{result['spec_decode_acceptance_rate']:.1f}%" in lines[0], lines


def test_without_speculation_nothing_of_it_is_reported(tiny_llama, tmp_path, capsys):
    result_file = tmp_path / "result.json"
    assert main(["bench", "throughput", "--model", tiny_llama.path, *ENGINE, *BENCHES["throughput"],
                 "--output-json", str(result_file)]) == 0
    assert not any(key.startswith("spec_decode") for key in json.loads(result_file.read_text()))
    assert "Speculative decoding" not in capsys.readouterr().out


@pytest.mark.slow
def test_bench_serve_reads_the_acceptance_off_a_speculating_server(smollm2_path, tmp_path, capsys):
    server = RemoteServer(smollm2_path, "--max-model-len", "512", "--kv-cache-space", "0.05",
                          "--speculative-config", NGRAM)
    try:
        result_file = tmp_path / "result.json"
        assert main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "4", "--random-input-len",
                     "32", "--random-output-len", "32", "--ignore-eos", "--result-file", str(result_file)]) == 0
        metrics = httpx.get(server.url("/metrics")).text
    finally:
        server.stop()
    result = json.loads(result_file.read_text())
    assert result["completed"] == 4 and result["spec_decode_num_drafts"] > 0, result
    # Nothing else ran on the server: its counters are the run's, and every position 0 to k - 1 shows.
    totals = spec_decode.from_metrics(metrics)
    assert spec_decode.summary(totals) == {k: v for k, v in result.items() if k.startswith("spec_decode_")}
    assert len(totals.accepted_per_position) == 3
    assert "spec_decode_acceptance_rate" in capsys.readouterr().out
