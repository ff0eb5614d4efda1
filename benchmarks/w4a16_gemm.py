"""W4A16 GEMMs (kernels.w4a16_gemm) against bf16 (skinny GEMM / cuBLAS) on Llama-3.1-8B's projections, group 128.

python benchmarks/w4a16_gemm.py [--sweep]  (on a CUDA device)

Per row count, each projection's time for the kernel int_weight_gemm picks and for bf16; at 1-4 rows also the
GEMV and the skinny kernel side by side, and with --sweep the GEMV's (BLOCK_N, BLOCK_K, warps, stages) configs.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton

from tokenmill.kernels.skinny_gemm import skinny_gemm, skinny_gemm_applies
from tokenmill.kernels.w4a16_gemm import GEMV_MAX_ROWS, gemv_int, int_weight_gemm, skinny_int_gemm
from tokenmill.layers.quant.w4a16 import pack_int32

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GEMV_CONFIGS = list(itertools.product((8, 16, 32, 64), (256, 512, 1024, 2048), (4, 8), (2, 3)))


def us(fn) -> float:
    return triton.testing.do_bench(fn) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    for rows in (1, 4, 16, 256, 2048):
        total_int, total_dense = 0.0, 0.0
        for name, (n, k) in SHAPES.items():
            q = pack_int32(torch.randint(0, 16, (n, k), device="cuda"), 4, dim=1)
            scale = torch.rand(n, k // 128, device="cuda").half() * 0.01
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            t_int = us(functools.partial(int_weight_gemm, x, q, scale, None, None, 4))
            t_dense = us(functools.partial(skinny_gemm, x, w) if skinny_gemm_applies(x, w)
                         else functools.partial(torch.matmul, x, w.T))
            total_int, total_dense = total_int + t_int, total_dense + t_dense
            line = f"rows {rows:5d} {name:8s} int4 g128 {t_int:8.1f} us   bf16 {t_dense:8.1f} us"
            if rows <= GEMV_MAX_ROWS:
                t_skinny = us(functools.partial(skinny_int_gemm, x, q, scale, None, None, 4))
                line += f"   (skinny {t_skinny:.1f} us; the weight at 4.25 TB/s: {n * k / 2 / 4.25e6:.1f} us)"
                if args.sweep:
                    best = min((us(functools.partial(gemv_int, x, q, scale, None, None, 4, config=c)), c)
                               for c in GEMV_CONFIGS)
                    line += f"   best GEMV {best[0]:.1f} us at {best[1]}"
            print(line, flush=True)
        print(f"rows {rows:5d} all four: int4 {total_int:.1f} us, bf16 {total_dense:.1f} us "
              f"(x32 layers: {total_int * 32 / 1e3:.2f} vs {total_dense * 32 / 1e3:.2f} ms)", flush=True)


if __name__ == "__main__":
    main()
