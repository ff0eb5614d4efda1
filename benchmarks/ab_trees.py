"""A/B of code variants in one device call: each variant is this tree with some files replaced, each workload run
in every variant in turn, round after round, so that the comparison shares one machine and its drift (the same
variant read 2,890 and 2,966 ms on two H100s: BENCHMARKS.md, thirty-fourth session).

    python3 benchmarks/ab_trees.py --variant before=.dev/before --variant after=. \\
        --workload W1-int4 --rounds 2 [--command "python3 benchmarks/gpu_check.py --sections anatomy8b-int4"]

A variant NAME=DIR is a copy of the tree's `tokenmill`, `benchmarks`, `tests` and pyproject.toml with every file
under DIR put at its path (DIR holds e.g. tokenmill/kernels/w4a16_gemm.py as it was: `git show REV:PATH`); NAME=.
is the tree itself. Workloads are gpu_check's (W1, W1-int4, W4-fp8, ...); a --command runs in each variant's
tree as it is (its output's last lines printed). Ends with a table of each workload's median latency (ms) or
total throughput (tok/s) per variant and round, also written to --out as ab_trees.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("tokenmill", "benchmarks", "tests", "pyproject.toml")


def make_variant(name: str, overlay: str, scratch: Path) -> Path:
    """The variant's tree: ROOT itself for ".", else a copy of it with the overlay's files in place."""
    if overlay == ".":
        return ROOT
    overlay_dir = Path(overlay).resolve()
    if not overlay_dir.is_dir():
        raise SystemExit(f"variant {name}: {overlay} is not a directory of replacement files")
    tree = scratch / name
    for entry in COPIED:
        source = ROOT / entry
        if source.is_dir():
            shutil.copytree(source, tree / entry, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, tree / entry)
    for path in overlay_dir.rglob("*"):
        if path.is_file():
            target = tree / path.relative_to(overlay_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return tree


def environment(tree: Path) -> dict[str, str]:
    """The variant's tree first on the path and the repository off it (the device's command puts the working tree
    on PYTHONPATH; installed wheels stay)."""
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *others]), "PYTHONUNBUFFERED": "1"}


def run_workload(tree: Path, workload: str, timeout: float, out_dir: Path, label: str) -> float | None:
    """A gpu_check workload in `tree`: its median latency (ms) or total throughput (tok/s; a fixed workload's
    output share is the same in every variant), None if it failed."""
    from gpu_check import run_workload as run_in

    result = run_in(workload, out_dir, timeout, {"PYTHONPATH": environment(tree)["PYTHONPATH"]}, cwd=tree,
                    label=label)
    if result is None:
        return None
    return result["median_s"] * 1e3 if "median_s" in result else result["total_tokens_per_s"]


def run_command(tree: Path, command: str, timeout: float, label: str) -> None:
    try:
        proc = subprocess.run(command, shell=True, cwd=tree, env=environment(tree), capture_output=True, text=True,
                              timeout=timeout)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        print(f"== {label} (rc {proc.returncode})\n" + "\n".join(lines[-40:]), flush=True)
    except subprocess.TimeoutExpired:
        print(f"== {label}: timed out after {timeout:.0f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=DIR",
                        help="a variant: NAME=. for this tree, NAME=DIR for this tree with DIR's files in place")
    parser.add_argument("--workload", action="append", default=[], help="a gpu_check workload (W1, W1-int4, ...)")
    parser.add_argument("--command", action="append", default=[], help="a shell command run in every variant")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=150, help="seconds per run")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    scratch = Path(tempfile.mkdtemp(prefix="ab_trees_"))
    variants = {}
    for spec in args.variant:
        name, _, overlay = spec.partition("=")
        if not name or not overlay:
            raise SystemExit(f"--variant {spec}: expected NAME=DIR")
        variants[name] = make_variant(name, overlay, scratch)
    start = time.perf_counter()
    table: dict[str, dict[str, list[float | None]]] = {w: {v: [] for v in variants} for w in args.workload}
    for round_ in range(1, args.rounds + 1):
        for workload in args.workload:
            for name, tree in variants.items():
                label = f"{workload} {name} round {round_}"
                table[workload][name].append(run_workload(tree, workload, args.timeout, out_dir, label))
    for command in args.command:
        for name, tree in variants.items():
            run_command(tree, command, args.timeout, f"{name}: {command}")
    (out_dir / "ab_trees.json").write_text(json.dumps(table, indent=1))
    print(f"\n{'workload':<12} {'variant':<12} " + " ".join(f"{f'round {r}':>10}" for r in range(1, args.rounds + 1)))
    for workload, by_variant in table.items():
        for name, values in by_variant.items():
            cells = " ".join(f"{v:>10,.1f}" if v is not None else f"{'failed':>10}" for v in values)
            print(f"{workload:<12} {name:<12} {cells}")
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
