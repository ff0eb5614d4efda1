"""benchmarks/spec_decode.py --smoke on the CPU: the oracle, first knowing a wrong token, learns the target's
continuation past it and then drafts every token of the timed run; the EAGLE-3 cost section writes a head in
the published layout, loads it and drafts k = 4 every step."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_learns_the_oracles_continuation_and_times_the_eagle3_head(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks/spec_decode.py"), "--smoke", "--sections",
                             "oracle,eagle3_cost", "--oracle-k", "4", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "spec_decode.json").read_text())
    oracle = results["oracle: k=4 batch 1"]
    assert "1 divergences from what the oracle knew, at output positions [24] (learnt in 2 untimed runs)" in oracle
    assert "timed runs' tokens known to the oracle: [64] of 64 (every one), 0 undrafted steps" in oracle
    drafts = results["eagle3_cost: k=4 drafts"]
    steps = int(drafts.split(" drafting steps of ")[1].split()[0])
    assert int(drafts.split(" draft tokens in ")[1].split()[0]) >= steps - 3, drafts  # every decode step drafts
    assert "x a plain step" in results["eagle3_cost: k=4 batch 1"]
