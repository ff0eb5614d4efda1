"""benchmarks/spec_decode.py --smoke on the CPU: the oracle, first knowing a wrong token, learns the target's
continuation past it and then drafts every token of the timed run; the EAGLE-3 cost section writes a head in
the published layout, loads it and drafts k = 4 every step."""

import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(monkeypatch, script: str, *argv: str) -> int:
    """benchmarks/`script`'s main() with `argv`, in this process: a subprocess would spend seconds importing what
    this one holds already. The script's additions to sys.path are undone after."""
    path = str(ROOT / "benchmarks" / script)
    monkeypatch.setattr(sys, "argv", [path, *argv])
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(ROOT)
    return runpy.run_path(path, run_name="benchmark")["main"]()


def test_smoke_run_learns_the_oracles_continuation_and_times_the_eagle3_head(tmp_path, monkeypatch):
    assert run_benchmark(monkeypatch, "spec_decode.py", "--smoke", "--sections", "oracle,eagle3_cost",
                         "--oracle-k", "4", "--out", str(tmp_path)) == 0
    results = json.loads((tmp_path / "spec_decode.json").read_text())
    oracle = results["oracle: k=4 batch 1"]
    assert "1 divergences from what the oracle knew, at output positions [24] (learnt in 2 untimed runs)" in oracle
    assert "timed runs' tokens known to the oracle: [64] of 64 (every one), 0 undrafted steps" in oracle
    drafts = results["eagle3_cost: k=4 drafts"]
    steps = int(drafts.split(" drafting steps of ")[1].split()[0])
    assert int(drafts.split(" draft tokens in ")[1].split()[0]) >= steps - 3, drafts  # every decode step drafts
    assert "x a plain step" in results["eagle3_cost: k=4 batch 1"]
