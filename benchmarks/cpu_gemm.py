"""The CPU's linear layers at the default model's shapes: the panel kernel (layers.cpu_panel_gemm) against oneDNN.

    python3 benchmarks/cpu_gemm.py --dtype float32 --rows 1,8,64,512
    python3 benchmarks/cpu_gemm.py --dtype bfloat16 --rows 64

For each row count, each of SmolLM2-135M's linear shapes (qkv, o, gate_up, down: 30 layers of distinct weights, so
that the weights come from memory as in a step; the LM head once) is timed through both kernels, alternated,
best of `--repeats`; prints GFLOP/s per shape and the whole step's ratio of times. Threads: torch's
(OMP_NUM_THREADS sets them).
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.layers.cpu_panel_gemm import pack_panels, panel_applies, panel_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not panel_applies(torch.zeros(1, 2, dtype=dtype)):
        raise SystemExit(f"the panel kernel does not serve {args.dtype} on this CPU")
    torch.manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        ours_total = onednn_total = 0.0
        for name, (n, k) in SHAPES.items():
            weights = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(1 if name == "lm_head" else LAYERS)]
            panels = [pack_panels(w) for w in weights]
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
            x = torch.randn(rows, k).to(dtype)

            def run_ours(panels=panels, x=x):
                for w in panels:
                    panel_linear(x, w, None)

            def run_onednn(onednn=onednn, x=x):
                for w in onednn:
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

            ours = min(best_time(run_ours, args.repeats), best_time(run_ours, args.repeats))
            theirs = min(best_time(run_onednn, args.repeats), best_time(run_onednn, args.repeats))
            flops = 2 * rows * n * k * len(weights)
            print(f"rows {rows:5d} {name:8s} panels {flops / ours / 1e9:6.0f} GFLOP/s  oneDNN "
                  f"{flops / theirs / 1e9:6.0f}  ratio {theirs / ours:.2f}x", flush=True)
            ours_total += ours
            onednn_total += theirs
        print(f"RESULT rows {rows}: step's linears {ours_total * 1e3:.1f} ms (panels) against {onednn_total * 1e3:.1f} "
              f"ms (oneDNN): {onednn_total / ours_total:.2f}x", flush=True)


if __name__ == "__main__":
    main()
