"""FP8 prefill GEMMs of Llama-3.1-8B (GPU): cuBLASLt through torch._scaled_mm with row-wise scales (one per
token, one per output channel), with and without fast accumulation (Hopper's FP8 MMA accumulates in reduced
precision unless the kernel promotes partial sums to float32 every few k-steps; "fast" skips the promotion),
against bf16 torch.mm, at prefill row counts. Each call runs 32 layers' weights of one shape in a CUDA graph
(nothing served from L2). "fp8 err" and "fast err" are against a float64 product of the dequantized operands
(the accumulation's error), "e4m3 err" the FP8 product's against the unquantized operands' (the rounding's).

    PYTHONPATH=. python3 benchmarks/fp8_prefill_gemm.py [--rows 2048,8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skinny_gemm import LAYERS, SHAPES, time_graph  # noqa: E402

from tokenmill.kernels.fp8_gemm import quantize_fp8  # noqa: E402


def measure(rows: int, n: int, k: int) -> tuple[dict[str, float], dict[str, float]]:
    """(ms per 32 layers, relative error) of bf16, FP8 and FP8 with fast accumulation at one shape."""
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    quantized = [quantize_fp8(w) for w in w16]  # per output channel: one scale per row of W
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    q, q_scale = quantize_fp8(x)

    def fp8(fast: bool, layer: int = 0) -> torch.Tensor:
        wq, w_scale = quantized[layer]
        return torch._scaled_mm(q, wq.t(), scale_a=q_scale, scale_b=w_scale.view(1, -1),
                                out_dtype=torch.bfloat16, use_fast_accum=fast)

    ref = (q.double() * q_scale.double()) @ (quantized[0][0].double() * quantized[0][1].double()).T
    exact = x.double() @ w16[0].double().T  # the unquantized operands' product: e4m3's own rounding
    times = {
        "bf16": time_graph(lambda: [torch.mm(x, w.t()) for w in w16]),
        "fp8": time_graph(lambda: [fp8(False, i) for i in range(LAYERS)]),
        "fast": time_graph(lambda: [fp8(True, i) for i in range(LAYERS)]),
    }
    errors = {key: ((fp8(fast).double() - ref).norm() / ref.norm()).item()
              for key, fast in (("fp8", False), ("fast", True))}
    errors["e4m3"] = ((fp8(False).double() - exact).norm() / exact.norm()).item()
    return times, errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="2048,8192")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{'rows':>6} {'shape':>8} {'bf16 ms':>8} {'fp8 ms':>8} {'fast ms':>8} {'fp8 TF/s':>9} {'fast TF/s':>9}"
          f" {'fp8 err':>9} {'fast err':>9} {'e4m3 err':>9}")
    for rows in map(int, args.rows.split(",")):
        totals = {"bf16": 0.0, "fp8": 0.0, "fast": 0.0}
        for name, (n, k) in SHAPES.items():
            times, errors = measure(rows, n, k)
            for key in totals:
                totals[key] += times[key]
            flop = 2 * rows * n * k * LAYERS / 1e12
            print(f"{rows:>6} {name:>8} {times['bf16']:>8.3f} {times['fp8']:>8.3f} {times['fast']:>8.3f} "
                  f"{flop / times['fp8'] * 1e3:>9.0f} {flop / times['fast'] * 1e3:>9.0f} "
                  f"{errors['fp8']:>9.2e} {errors['fast']:>9.2e} {errors['e4m3']:>9.2e}")
        print(f"{rows} rows, all four shapes: bf16 {totals['bf16']:.2f} ms, fp8 {totals['fp8']:.2f}, fp8 with fast "
              f"accumulation {totals['fast']:.2f} ({totals['fp8'] / totals['fast']:.3f}x)")


if __name__ == "__main__":
    main()
