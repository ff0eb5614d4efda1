"""benchmarks/ab_trees.py on the CPU: a variant is a copy of the tree with its overlay's files in place, and what
runs in it imports that copy, not the repository (the device's command puts the repository on PYTHONPATH)."""

import json
import shlex
import sys

from test_benchmark_spec_decode import ROOT, run_benchmark


def test_each_variant_runs_its_own_copy_of_the_code(tmp_path, monkeypatch, capsys):
    overlay = tmp_path / "marked"
    target = overlay / "tokenmill" / "kernels" / "__init__.py"
    target.parent.mkdir(parents=True)
    target.write_text((ROOT / "tokenmill/kernels/__init__.py").read_text() + '\nAB_MARK = "overlay"\n')
    probe = ("import tokenmill.kernels as k; "
             "print('MARK', getattr(k, 'AB_MARK', 'repository'), k.__file__)")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # as the device's command sets it
    assert run_benchmark(monkeypatch, "ab_trees.py", "--variant", "main=.", "--variant", f"marked={overlay}",
                         "--command", f"{shlex.quote(sys.executable)} -c {shlex.quote(probe)}", "--rounds", "0",
                         "--out", str(tmp_path / "out")) == 0
    marks = [line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.startswith("MARK ")]
    assert marks[0] == ["repository", str(ROOT / "tokenmill/kernels/__init__.py")]
    assert marks[1][0] == "overlay" and not marks[1][1].startswith(str(ROOT))
    assert json.loads((tmp_path / "out" / "ab_trees.json").read_text()) == {}
