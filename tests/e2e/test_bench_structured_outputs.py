"""benchmarks/structured_outputs.py --smoke on the CPU: every section runs on a tiny Qwen3 with the real model's
151,936-token vocabulary under SmolLM2's 49,152-token tokenizer, and every finished output validates."""

import json
import re

from test_benchmark_spec_decode import run_benchmark


def test_smoke_run_writes_every_measurement_and_its_outputs_validate(tmp_path, monkeypatch):
    assert run_benchmark(monkeypatch, "structured_outputs.py", "--smoke", "--num-requests", "4", "--output-len",
                         "32", "--out", str(tmp_path)) == 0
    results = json.loads((tmp_path / "structured_outputs.json").read_text())
    for key in ("compile: cold, 4 schemas", "compile: cached (same spec again)", "ratio: structured, cached grammars",
                "mask: total per step", "throughput: unconstrained, structured run's lengths"):
        assert key in results, sorted(results)
    assert "failed:" not in results["compile: cold, 4 schemas"]
    # Grammars on the tokenizer's vocabulary constrain as on the model's padded one: the same tokens drawn.
    assert results["replay: the same tokens drawn on both vocabularies"] == "True"
    # The cached runs alternate with unconstrained ones (2 pairs in smoke mode), each pair's ratio reported.
    assert re.search(r"the median of 2 pairs \([0-9.]+, [0-9.]+\)", results["ratio: structured, cached grammars"])
    for run, num_runs in (("cold run", 1), ("cached runs (2)", 2)):
        line = results[f"validate: {run}"]
        stopped, failed, cut = map(int, re.match(r"(\d+) finished with stop, (\d+) .*; (\d+) cut", line).groups())
        assert failed == 0 and stopped + cut == 4 * num_runs, line
