"""The AVX-512 panel GEMM (layers.cpu_panel_gemm) against float64, and its place in layers.cpu_gemm.

float32: each output a float32 sum of exact-product FMAs over K, so it is held to K float32 roundings of the sum of
|x| |w|. bfloat16: products of bfloat16 inputs are exact and sums float32, so the same bound plus the output's
bfloat16 rounding. Shapes cover partial panels (N not a multiple of 64), partial row blocks (M not a multiple of 6),
more rows than one chunk (192), strided rows and a bias. Skipped where the CPU has no AVX-512 (bfloat16: no
AVX512_BF16), where oneDNN serves the linears.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.cpu_amx_gemm import amx_available
from tokenmill.layers.cpu_gemm import cpu_linear, pack_weight, packed_linear
from tokenmill.layers.cpu_panel_gemm import PanelWeight, load_kernel, pack_panels, panel_applies, panel_linear

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no AVX-512 on this CPU: oneDNN serves the linears")
NO_BF16 = not panel_applies(torch.zeros(1, 2, dtype=torch.bfloat16))
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(
    torch.bfloat16, id="bfloat16", marks=pytest.mark.skipif(NO_BF16, reason="no AVX512_BF16 on this CPU"))]


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> None:
    reference = x.double() @ w.double().T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = scale * x.shape[1] * 2.0**-24 + (reference.abs() * 2.0**-8 if out_dtype == torch.bfloat16 else 0)
    assert y.dtype == out_dtype and y.shape == reference.shape
    assert ((y.double() - reference).abs() <= bound + 1e-30).all()


def inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(dtype)
    w = (torch.randn(n, k, generator=generator) * 0.05).to(dtype)
    return x, w, torch.randn(n, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 64, 8), (5, 50, 34), (6, 960, 576), (7, 129, 64), (64, 576, 1536),
                                     (200, 70, 96), (400, 128, 18)])
def test_matches_float64_reference(m, n, k, dtype):
    x, w, bias = inputs(m, n, k, dtype, m * 1000 + n + k)
    packed = pack_panels(w)
    assert_close(panel_linear(x, packed, None), x, w, None, dtype)
    assert_close(panel_linear(x, packed, bias), x, w, bias, dtype)
    assert_close(panel_linear(x, packed, bias, out_float32=True), x, w, bias, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_a_row_does_not_depend_on_the_batch(dtype):
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(300, 256, generator=generator).to(dtype)
    x = wide[:, 64:192]  # rows 256 apart, 128 inputs each
    w = (torch.randn(150, 128, generator=generator) * 0.05).to(dtype)
    packed = pack_panels(w)
    y = panel_linear(x, packed, None)
    assert torch.equal(y, panel_linear(x.contiguous(), packed, None))
    for rows in (1, 5, 6, 7, 64, 193):  # whole and partial row blocks and chunks: one order of sums per row
        assert torch.equal(panel_linear(x[:rows], packed, None), y[:rows])
    for threads in (1, 3):  # the split over threads moves no row's sums either
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert torch.equal(panel_linear(x, packed, None), y)
        finally:
            torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_linear_packs_weights_for_it(dtype):
    if dtype == torch.bfloat16 and amx_available():
        pytest.skip("CPUs with AMX take bfloat16 weights into the AMX tiles")
    x, w, bias = inputs(9, 96, 64, dtype, 2)
    packed = pack_weight(w)
    assert isinstance(packed, PanelWeight)
    assert torch.equal(packed_linear(x, packed, bias), panel_linear(x, packed, bias))
    with torch.no_grad():
        assert torch.equal(cpu_linear(x, w, bias), panel_linear(x, packed, bias))
        assert torch.equal(cpu_linear(x, w, bias, out_float32=True), panel_linear(x, packed, bias, out_float32=True))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(cpu_linear(x, w, bias).float(), torch.nn.functional.linear(x, w, bias).float(),
                          rtol=tolerance, atol=tolerance)
