"""The float32 GEMM of CPUs with AVX-512 (layers.cpu_f32_gemm) against float64, and its place in layers.cpu_gemm.

Each output is a float32 sum of exact-product FMAs over K, so it is held to K float32 roundings of the sum of |x| |w|;
shapes cover partial panels (N not a multiple of 64), partial row blocks (M not a multiple of 6), more rows than one
chunk (192), strided rows and a bias. Skipped where the CPU has no AVX-512 (oneDNN serves float32 there).
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.cpu_f32_gemm import F32Panels, f32_linear, load_kernel, pack_f32
from tokenmill.layers.cpu_gemm import cpu_linear, pack_weight, packed_linear

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no AVX-512 on this CPU: oneDNN serves float32")


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    reference = x.double() @ w.double().T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = scale * x.shape[1] * 2.0**-24
    assert y.dtype == torch.float32 and y.shape == reference.shape
    assert ((y.double() - reference).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("m, n, k", [(1, 64, 8), (5, 50, 33), (6, 960, 576), (7, 129, 64), (64, 576, 1536),
                                     (200, 70, 96), (400, 128, 17)])
def test_matches_float64_reference(m, n, k):
    generator = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=generator)
    w = torch.randn(n, k, generator=generator) * 0.05
    bias = torch.randn(n, generator=generator)
    packed = pack_f32(w)
    assert_close(f32_linear(x, packed, None), x, w)
    assert_close(f32_linear(x, packed, bias), x, w, bias)


def test_strided_rows_and_a_row_does_not_depend_on_the_batch():
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(300, 256, generator=generator)
    x = wide[:, 64:192]  # rows 256 apart, 128 inputs each
    w = torch.randn(150, 128, generator=generator) * 0.05
    packed = pack_f32(w)
    y = f32_linear(x, packed, None)
    assert torch.equal(y, f32_linear(x.contiguous(), packed, None))
    for rows in (1, 5, 6, 7, 64, 193):  # whole and partial row blocks and chunks: one order of sums per row
        assert torch.equal(f32_linear(x[:rows], packed, None), y[:rows])
    for threads in (1, 3):  # the split over threads moves no row's sums either
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert torch.equal(f32_linear(x, packed, None), y)
        finally:
            torch.set_num_threads(previous)


def test_cpu_linear_packs_float32_weights_for_it():
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=generator) * 0.05
    bias = torch.randn(96, generator=generator)
    x = torch.randn(9, 64, generator=generator)
    packed = pack_weight(w)
    assert isinstance(packed, F32Panels)
    assert torch.equal(packed_linear(x, packed, bias), f32_linear(x, packed, bias))
    with torch.no_grad():
        assert torch.equal(cpu_linear(x, w, bias), f32_linear(x, packed, bias))
    assert torch.allclose(cpu_linear(x, w, bias), torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
