"""W4A16 GEMMs (kernels.w4a16_gemm) against bf16 (skinny GEMM / cuBLAS) on Llama-3.1-8B's projections, group 128.

python benchmarks/w4a16_gemm.py [--sweep]  (on a CUDA device)

Per row count, each projection's time for the kernel int_weight_gemm picks and for bf16; at 1-4 rows also the
skinny kernel, and with --sweep the GEMV's (BLOCK_N, BLOCK_K, warps, stages) configs (each one compiles once per
row count: 18 at one row, 13 at four).
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
# BLOCK_N 2-16, 64-256 words per column per step over at most BLOCK_K / 8 / 32 warps (more would send the words
# through shared memory, kernels.w4a16_gemm._gemv_int_kernel), at most 16 words per thread, 8 from 3 rows
# (registers); the GEMV has no shared-memory pipeline, so num_stages stays 1. 18 configs at 1 row, 13 at 4.
GEMV_CONFIGS = [(bn, bk, w, 1) for bn, (bk, w) in itertools.product(
    (2, 4, 8, 16), ((512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8))) if bn * bk // 8 // (32 * w) <= 16]


def gemv_configs(rows: int) -> list[tuple[int, int, int, int]]:
    return [c for c in GEMV_CONFIGS if rows <= 2 or c[0] * c[1] // 8 // (32 * c[2]) <= 8]


def us(fn) -> float:
    return triton.testing.do_bench(fn) * 1e3


def sweep_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=20) * 1e3  # shorter: many configs


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
                    best = min((sweep_us(functools.partial(gemv_int, x, q, scale, None, None, 4, config=c)), c)
                               for c in gemv_configs(rows))
                    line += f"   best GEMV {best[0]:.1f} us at {best[1]}"
            print(line, flush=True)
        print(f"rows {rows:5d} all four: int4 {total_int:.1f} us, bf16 {total_dense:.1f} us "
              f"(x32 layers: {total_int * 32 / 1e3:.2f} vs {total_dense * 32 / 1e3:.2f} ms)", flush=True)


if __name__ == "__main__":
    main()
