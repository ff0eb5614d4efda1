# ruff: noqa: B023 - the lambdas run inside the iteration that made them
"""FP8 decode GEMMs of Llama-3.1-8B (GPU): the Triton skinny W8A16 kernel's tile configs and the CUDA-core
GEMV against cuBLASLt (per-token quantization + torch._scaled_mm) and the bf16 skinny GEMM, per shape and
row count, 32 layers' weights each in a CUDA graph (so nothing is served from L2). Prints the best config
per (rows, shape) and the bytes-per-second each reaches.

    PYTHONPATH=. python3 benchmarks/fp8_gemm.py [--rows 1,4] [--gemv-only]

With --out, the GEMV's best tiles per (n, k, rows) go to kernels/configs/fp8_gemv_<device>.json, which
kernels/fp8_gemm.py reads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skinny_gemm import LAYERS, SHAPES, time_graph  # noqa: E402

from tokenmill.kernels.fp8_gemm import gemv_fp8, gemv_key, quantize_fp8, skinny_fp8_gemm  # noqa: E402
from tokenmill.kernels.fused_moe import config_path  # noqa: E402
from tokenmill.kernels.skinny_gemm import skinny_gemm  # noqa: E402

SKINNY = list(itertools.product((32, 64), (512, 1024), (4, 8), (3, 4)))
GEMV = list(itertools.product((4, 8, 16), (512, 1024, 2048), (2, 4, 8), (2, 3)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--gemv-only", action="store_true", help="sweep the GEMV's tiles alone")
    parser.add_argument("--out", type=Path, help="write the GEMV's best tiles to DIR/fp8_gemv_<device>.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = {name: [torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn) for _ in range(LAYERS)]
               for name, (n, k) in SHAPES.items()}
    scales = {name: torch.rand(n, device="cuda") * 1e-2 for name, (n, _) in SHAPES.items()}
    bf16 = {name: [w.to(torch.bfloat16) for w in ws] for name, ws in weights.items()}
    totals: dict[tuple[int, str], float] = {}
    gemv_tiles: dict[str, tuple] = {}  # table key -> the GEMV's best tiles
    for rows, (name, (n, k)) in itertools.product(map(int, args.rows.split(",")), SHAPES.items()):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        ws, s = weights[name], scales[name]
        ref = (x.double() @ (ws[0].double() * s.double()[:, None]).T)
        gb = n * k / 1e9

        def err(out):
            return ((out.double() - ref).norm() / ref.norm()).item()

        found = {}
        skinny_configs = [] if args.gemv_only else SKINNY
        for label, configs, fn in (("skinny", skinny_configs, lambda w, c: skinny_fp8_gemm(x, w, s, 0, c)),
                                   ("gemv", GEMV if rows <= 4 else [], lambda w, c: gemv_fp8(x, w, s, c))):
            best = None
            for config in configs:
                try:
                    assert err(fn(ws[0], config)) < 2e-2
                    t = time_graph(lambda c=config, fn=fn: [fn(w, c) for w in ws]) / LAYERS
                except Exception as e:  # noqa: BLE001 - a config over the shared-memory limit
                    print(f"  {label} {config}: {type(e).__name__}", flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, config)
            if best:
                found[label] = best
                if label == "gemv":
                    gemv_tiles[gemv_key(n, k, rows)] = best[1]
        scaled = time_graph(lambda: [torch._scaled_mm(*[quantize_fp8(x)[0], w.t()], scale_a=quantize_fp8(x)[1],
                                                      scale_b=s.view(1, -1), out_dtype=torch.bfloat16)
                                     for w in ws]) / LAYERS
        dense = time_graph(lambda: [skinny_gemm(x, w) for w in bf16[name]]) / LAYERS
        line = f"rows {rows:2d} {name:8s} bf16 skinny {dense * 1e3:6.1f} us ({2 * gb / dense:4.2f} TB/s)  " \
               f"scaled_mm {scaled * 1e3:6.1f} us"
        for label, (t, config) in found.items():
            line += f"  {label} {t * 1e3:6.1f} us ({gb / t:4.2f} TB/s) {config}"
            totals[rows, label] = totals.get((rows, label), 0) + t * LAYERS
        totals[rows, "bf16"] = totals.get((rows, "bf16"), 0) + dense * LAYERS
        totals[rows, "scaled_mm"] = totals.get((rows, "scaled_mm"), 0) + scaled * LAYERS
        print(line, flush=True)
    for (rows, label), t in sorted(totals.items()):
        print(f"== rows {rows}: 32 layers x 4 projections, {label}: {t:.3f} ms", flush=True)
    if args.out is not None:
        path = config_path(torch.cuda.get_device_name(), args.out, kind="fp8_gemv")
        tables = {key: list(config) for key, config in sorted(gemv_tiles.items())}
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                                    "configs": tables}, indent=1) + "\n")
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
