"""Decode GEMMs of Llama-3.1-8B at 1, 8 and 16 rows (GPU): cuBLAS (torch.mm) against the Triton skinny GEMM.

Each case is 32 layers' worth of one projection, every layer its own weight (so nothing is served from
L2), launched back to back in a CUDA graph; the time is per launch, the rate the weight bytes over it.
Checks each config's result against torch first. The configs include splits of K (kernels.split_k).
With --out DIR the best per (shape, rows) go to DIR/skinny_gemm_<device>.json, the table the engine reads
from tokenmill/kernels/configs, with the LM head's (128,256 x 4,096, timed against cuBLAS too: the engine runs
its decode rows through the skinny GEMM, layers.embedding).

    PYTHONPATH=. python3 benchmarks/skinny_gemm.py [--out tokenmill/kernels/configs]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton

from tokenmill.kernels.fused_moe import config_path
from tokenmill.kernels.precompile import precompile
from tokenmill.kernels.skinny_gemm import TUNED_ROWS, skinny_gemm, tuned_key
from tokenmill.kernels.tile_tables import forget_tables

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
LM_HEAD = (128256, 4096)  # Llama-3's: 1 GB a read, beyond L2 with two copies
# 8 warps never won the first sweep (2026-11-30): 4 warps, and K in up to 4 splits.
CONFIGS = [(bn, bk, 4, s, splits) for bn, bk, s, splits in itertools.product((16, 32, 64), (128, 256, 512), (3, 5),
                                                                             (1, 2, 3, 4))
           if bn * bk <= 32 * 512]


def time_graph(fn, reps: int = 20) -> float:
    """Milliseconds per call of fn (which launches LAYERS kernels), from a captured CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


UNSWEPT = {"qkv": (32, 256, 4, 5), "o": (32, 256, 4, 5), "gate_up": (64, 256, 4, 3), "down": (32, 512, 4, 5)}
"""kernels.skinny_gemm's tiles by shape before this sweep (one split)."""


def chain(weights, best_configs, rows_list) -> None:
    """The 4 projections of 32 layers as a decode step runs them: each GEMM reads the previous one's output.
    (Tried on 2026-11-30 and dropped: programmatic dependent launch, alone or with an L2 prefetch of the
    first weights before the wait, made this chain slower: 3.77-4.88 ms against 3.67 at one row.)"""
    for rows in rows_list:
        _chain(rows, weights, {name: best_configs[rows, name][0] for name in SHAPES},
               {name: best_configs[rows, name][1] for name in SHAPES})


def _chain(rows: int, weights, configs, unsplit) -> None:
    x0 = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)

    def run(mm):
        x = x0
        for layer in range(LAYERS):
            for name in ("qkv", "o", "gate_up", "down"):
                k = SHAPES[name][1]
                x = mm(x[:, :k], weights[name][layer], name)
        return x

    variants = {
        "cuBLAS": lambda x, w, name: torch.mm(x, w.T),
        "skinny, best config per shape": lambda x, w, name: skinny_gemm(x, w, configs[name]),
        "skinny, best config per shape without splits": lambda x, w, name: skinny_gemm(x, w, unsplit[name]),
        "skinny, the engine's configs": lambda x, w, name: skinny_gemm(x, w),
        "skinny, the engine's configs before the split sweep": lambda x, w, name: skinny_gemm(x, w, UNSWEPT[name]),
    }
    ref = run(variants["cuBLAS"]).float()
    for label, mm in variants.items():
        try:
            out = run(mm).float()
            same = bool(torch.isfinite(out).all()) and ((out - ref).norm() / ref.norm()).item() < 0.05
            ms = time_graph(lambda mm=mm: run(mm))
        except Exception as e:  # noqa: BLE001
            print(f"chain rows {rows} {label}: {type(e).__name__}: {e}"[:300], flush=True)
            continue
        print(f"== chain rows {rows}, 32 layers x 4 GEMMs, {label}: {ms:.3f} ms (matches cuBLAS: {same})",
              flush=True)


def time_configs(x: torch.Tensor, ws: list[torch.Tensor], name: str, rows: int) -> list[tuple[float, tuple]]:
    """(ms a launch, config) for every config of CONFIGS that runs, each checked against float64 first."""
    ref = x.double() @ ws[0].double().T
    timed = []
    for config in CONFIGS:
        try:
            err = ((skinny_gemm(x, ws[0], config).double() - ref).norm() / ref.norm()).item()
        except Exception as e:  # noqa: BLE001 - e.g. a config over the shared-memory limit
            print(f"  {config}: {type(e).__name__}")
            continue
        assert err < 1e-2, (name, rows, config, err)
        timed.append((time_graph(lambda c=config: [skinny_gemm(x, w, c) for w in ws]) / len(ws), config))
    return timed


def lm_head(rows_list) -> dict[str, list]:
    """The LM head at decode's row counts: cuBLAS against the skinny GEMM's configs (the engine takes the skinny GEMM
    for it: layers.embedding); returns the best tiles per row count, the table's entries."""
    n, k = LM_HEAD
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(2)]
    table = {}
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        cublas = time_graph(lambda x=x: [torch.mm(x, w.T) for w in ws]) / len(ws)
        best = min(time_configs(x, ws, "lm_head", rows))
        print(f"== LM head {n}x{k}, rows {rows}: cuBLAS {cublas * 1e3:.1f} us ({n * k * 2 / cublas / 1e9:.2f} TB/s), "
              f"skinny best {best[0] * 1e3:.1f} us ({n * k * 2 / best[0] / 1e9:.2f} TB/s) {best[1]}", flush=True)
        table[tuned_key(n, k, rows)] = list(best[1])
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="write the best tiles to DIR/skinny_gemm_<device>.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    rows_list = TUNED_ROWS
    weights = {name: [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5 for _ in range(LAYERS)]
               for name, (n, k) in SHAPES.items()}
    inputs = {(rows, k): torch.randn(rows, k, device=device, dtype=torch.bfloat16)
              for rows in rows_list for k in {k for _, k in SHAPES.values()}}

    def every_variant() -> None:
        for rows, (name, (_, k)), config in itertools.product(rows_list, SHAPES.items(), CONFIGS):
            skinny_gemm(inputs[rows, k], weights[name][0], config)

    print(f"compiling {precompile(every_variant, device)} variants", flush=True)
    results = []
    for rows, (name, (n, k)) in itertools.product(rows_list, SHAPES.items()):
        x, ws = inputs[rows, k], weights[name]
        gbytes = n * k * 2 / 1e9
        cublas = time_graph(lambda x=x, ws=ws: [torch.mm(x, w.T) for w in ws]) / LAYERS
        timed = time_configs(x, ws, name, rows)
        best, unsplit = min(timed), min(t for t in timed if t[1][4] == 1)
        results.append((rows, name, cublas, best, unsplit))
        print(f"rows {rows:2d} {name:8s} cuBLAS {cublas * 1e3:7.2f} us ({gbytes / cublas:5.2f} TB/s)   "
              f"triton {best[0] * 1e3:7.2f} us ({gbytes / best[0]:5.2f} TB/s) {best[1]}   without splits "
              f"{unsplit[0] * 1e3:7.2f} us {unsplit[1]}", flush=True)
    head_table = lm_head(rows_list)
    if args.out is not None:
        path = config_path(torch.cuda.get_device_name(), args.out, kind="skinny_gemm")
        table = {tuned_key(*SHAPES[name], rows): list(best[1]) for rows, name, _, best, _ in results} | head_table
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                                    "configs": dict(sorted(table.items()))}, indent=1) + "\n")
        print(f"wrote {path}", flush=True)
        forget_tables()
    chain(weights, {(rows, name): (best[1], unsplit[1]) for rows, name, _, best, unsplit in results}, rows_list)
    for rows in rows_list:
        c = sum(r[2] for r in results if r[0] == rows) * LAYERS
        t = sum(r[3][0] for r in results if r[0] == rows) * LAYERS
        u = sum(r[4][0] for r in results if r[0] == rows) * LAYERS
        print(f"== skinny GEMM, rows {rows}: 32 layers of the 4 projections: cuBLAS {c:.3f} ms, "
              f"triton (best config per shape) {t:.3f} ms, without splits {u:.3f} ms")


if __name__ == "__main__":
    main()
