"""The FP8 linear kernels (kernels.fp8_gemm) against float64 computed on the same e4m3 values.

Quantization itself is compared with the pure-torch version the CPU path runs (layers.quant.fp8); the GEMMs
take quantized inputs and are checked against dequantize-then-matmul in float64, across decode and prefill
row counts, channel and block scales, and shapes that are not multiples of the tiles.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels import cases
from tokenmill.layers.quant.fp8 import FP8, dequantize_fp8, quantize_fp8_torch


def _weight(n: int, k: int, block: int, g: torch.Generator, device: str):
    w = torch.randn(n, k, generator=g) * k**-0.5
    if block:
        tiles = w.reshape(n // block, block, k // block, block)
        scale = tiles.abs().amax(dim=(1, 3)) / 448
        q = (tiles / scale[:, None, :, None]).to(FP8).reshape(n, k)
    else:
        scale = w.abs().amax(1) / 448
        q = (w / scale[:, None]).to(FP8)
    return q.to(device), scale.to(device)


# GPU only, all of them: Triton 3.6's interpreter converts to e4m3 wrongly (124.0 becomes 64.0).
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("rows", [1, 37])
def test_quantize_fp8_matches_the_torch_path(device, rows, group):
    from tokenmill.kernels.fp8_gemm import quantize_fp8

    x = (torch.randn(rows, 4096) * 3).to(torch.bfloat16).to(device)
    q, s = quantize_fp8(x, group)
    q_ref, s_ref = quantize_fp8_torch(x, group)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # e4m3 rounding of the same float32 quotient: identical but for rare last-bit ties.
    assert (q.float() != q_ref.float()).float().mean() < 1e-3


@pytest.mark.parametrize("block", [0, 128])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144 + 128, 4096 + 128), (4096, 14336)])
def test_skinny_fp8_gemm(device, rows, block, n, k):
    from tokenmill.kernels.fp8_gemm import skinny_fp8_gemm

    g = torch.Generator().manual_seed(rows + n)
    w, scale = _weight(n, k, block, g, device)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(device)
    ref = x.double() @ dequantize_fp8(w, scale, block).double().T
    assert cases.rel_error(skinny_fp8_gemm(x, w, scale, block), ref) < cases.TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("rows", [17, 100, 1000])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024 + 128, 2048 + 128)])
def test_block_fp8_gemm(device, rows, n, k):
    from tokenmill.kernels.fp8_gemm import block_fp8_gemm, quantize_fp8

    g = torch.Generator().manual_seed(rows + n)
    w, scale = _weight(n, k, 128, g, device)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(device)
    q, q_scale = quantize_fp8(x, 128)
    x_deq = (q.double().reshape(rows, -1, 128) * q_scale.double()[..., None]).reshape(rows, k)
    ref = x_deq @ dequantize_fp8(w, scale, 128).double().T
    out = block_fp8_gemm(q, q_scale, w, scale, 128, torch.bfloat16)
    assert cases.rel_error(out, ref) < cases.TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("block", [0, 128])
@pytest.mark.parametrize("rows", [1, 16, 17, 300])
def test_fp8_linear_on_cuda_matches_the_cpu_math(device, rows, block):
    """The layer's GPU dispatch (skinny W8A16, cuBLASLt row-wise W8A8, block W8A8) against the float32 path."""
    from tokenmill.layers.quant.fp8 import _fp8_linear_cuda, fp8_linear_torch

    if device != "cuda":
        pytest.skip("torch._scaled_mm needs a GPU")
    g = torch.Generator().manual_seed(rows)
    w, scale = _weight(4096, 4096, block, g, device)
    x = torch.randn(rows, 4096, generator=g).to(torch.bfloat16).to(device)
    bias = torch.randn(4096, generator=g).to(torch.bfloat16).to(device)
    out = _fp8_linear_cuda(x, w, scale, block, None, bias)
    ref = fp8_linear_torch(x.float(), w, scale, block, None, bias)
    # W8A16 (decode rows) keeps the activations unquantized: within e4m3's activation rounding of W8A8.
    assert cases.rel_error(out, ref) < 0.05


@pytest.mark.interpret
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_gemv_fp8(device, rows):
    """The CUDA-core kernel for 1-4 rows (benchmarks/fp8_gemm.py weighs it against the skinny GEMM); edges masked."""
    from tokenmill.kernels.fp8_gemm import gemv_fp8

    g = torch.Generator().manual_seed(rows)
    n, k = (4096 + 40, 4096 + 72) if device == "cuda" else (100, 300)
    w = torch.randn(n, k, generator=g).to(FP8).to(device)
    scale = (torch.rand(n, generator=g) * 1e-2).to(device)
    x = torch.randn(rows, k, generator=g).to(torch.float16).to(device)
    ref = x.double() @ dequantize_fp8(w, scale).double().T
    config = None if device == "cuda" else (16, 128, 4, 2)
    assert cases.rel_error(gemv_fp8(x, w, scale, config), ref) < cases.TOLERANCE[torch.float16]
