"""W4A16 GEMM (kernels.w4a16_gemm) against bf16 (skinny GEMM / cuBLAS) on Llama-3.1-8B's projections.

python benchmarks/w4a16_gemm.py  (on a CUDA device)
"""

from __future__ import annotations

import torch
import triton

from tokenmill.kernels.skinny_gemm import skinny_gemm, skinny_gemm_applies
from tokenmill.kernels.w4a16_gemm import int_weight_gemm
from tokenmill.layers.quant.w4a16 import pack_int32

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    for rows in (1, 16, 256, 2048):
        total_int, total_dense = 0.0, 0.0
        for name, (n, k) in SHAPES.items():
            q = pack_int32(torch.randint(0, 16, (n, k), device="cuda"), 4, dim=1)
            scale = torch.rand(n, k // 128, device="cuda").half() * 0.01
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            t_int = triton.testing.do_bench(lambda: int_weight_gemm(x, q, scale, None, None, 4))
            dense = (lambda: skinny_gemm(x, w)) if skinny_gemm_applies(x, w) else (lambda: x @ w.T)
            t_dense = triton.testing.do_bench(dense)
            total_int, total_dense = total_int + t_int, total_dense + t_dense
            print(f"rows {rows:5d} {name:8s} int4 g128 {t_int * 1e3:8.1f} us   bf16 {t_dense * 1e3:8.1f} us")
        print(f"rows {rows:5d} all four: int4 {total_int * 1e3:.1f} us, bf16 {total_dense * 1e3:.1f} us "
              f"(x32 layers: {total_int * 32:.2f} vs {total_dense * 32:.2f} ms)")


if __name__ == "__main__":
    main()
