"""The int4/int8 GEMV computing its input from its producer's inputs (kernels.gemv_prologue): RMSNorm (with and
without the residual add, Gemma's offset) against a float64 norm-then-matmul reference, x + residual written exactly
as the norm kernel writes it; SiLU-and-mul bit for bit against the SiLU kernel then the GEMV. The cases marked
`interpret` run on the CPU under TRITON_INTERPRET=1 (float16: the interpreter truncates float32 to bfloat16)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import cases  # noqa: E402
from test_w4a16_gemm import make_weight, shape  # noqa: E402

from tokenmill.kernels.gemv_prologue import RmsNormPrologue, SiluAndMulPrologue  # noqa: E402

pytestmark = pytest.mark.gpu
interpret = pytest.mark.interpret


def _weight(device, n, k, group, bits, sym, seed=0):
    packed, scale, zero, w = make_weight(n, k, group, bits, sym, torch.Generator().manual_seed(seed))
    return (packed.to(device), scale.to(device), None if zero is None else zero.to(device)), w


def _dtypes(device):
    return [torch.float16] if device == "cpu" else [torch.float16, torch.bfloat16]


# Row counts 1-4, a residual or none (a model's first norm), Gemma's (1 + weight), group sizes and per-channel, and
# tiles with a split of K asked for (the norm takes one split: its sums of squares cover all of K).
@pytest.mark.parametrize("rows,residual,offset,group,bits,config", [
    pytest.param(1, True, 0.0, 128, 4, (8, 64, 2, 1), marks=interpret),
    pytest.param(3, True, 1.0, 32, 4, (16, 128, 4, 1), marks=interpret),
    pytest.param(2, False, 0.0, 0, 8, (4, 64, 1, 1), marks=interpret),
    pytest.param(4, True, 0.0, 64, 4, (4, 64, 1, 1, 3), marks=interpret),
    pytest.param(1, True, 0.0, 128, 4, None),
    pytest.param(4, True, 1.0, 128, 4, None),
    pytest.param(1, False, 0.0, 128, 4, (8, 2048, 2, 1)),
])
def test_rms_norm_prologue(device, rows, residual, offset, group, bits, config):
    from tokenmill.kernels.w4a16_gemm import gemv_int

    n, k = shape(device)
    (packed, scale, zero), w = _weight(device, n, k, group, bits, sym=False)
    g = torch.Generator().manual_seed(1)
    eps = 1e-5
    for dtype in _dtypes(device):
        x = torch.randn(rows, k, generator=g).to(dtype)
        res = torch.randn(rows, k, generator=g).to(dtype) if residual else None
        norm_weight = (torch.rand(k, generator=g) * 0.4 + 0.8).to(dtype)
        h = x if res is None else (x.float() + res.float()).to(dtype)  # the residual stream, as rms_norm rounds it
        normed = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + eps)
        ref = (normed * (offset + norm_weight.double())) @ w.T
        on = (lambda t: None if t is None else t.to(device))
        res_out = torch.full((rows, k), float("nan"), dtype=dtype, device=device) if residual else None
        prologue = RmsNormPrologue(x.to(device), norm_weight.to(device), eps, offset, on(res), res_out)
        out = gemv_int(prologue, packed, scale, zero, None, bits, config=config)
        assert out.shape == ref.shape and out.dtype == dtype
        assert cases.rel_error(out.cpu(), ref) < cases.TOLERANCE[dtype], dtype
        if residual:
            assert torch.equal(res_out.cpu(), h)
        # Its materialization is the norm kernel's output, and writes the same residual.
        from tokenmill.kernels.rms_norm import rms_norm

        expected = rms_norm(x.to(device), norm_weight.to(device), eps, offset, on(res))
        if residual:
            res_out.fill_(float("nan"))
            assert torch.equal(prologue.materialize().cpu(), expected[0].cpu())
            assert torch.equal(res_out.cpu(), h)
        else:
            assert torch.equal(prologue.materialize().cpu(), expected.cpu())


@pytest.mark.parametrize("rows,group,bits,config", [
    pytest.param(1, 128, 4, (8, 64, 2, 1), marks=interpret),
    pytest.param(3, 0, 8, (4, 64, 1, 1, 2), marks=interpret),
    pytest.param(1, 128, 4, None),
    pytest.param(4, 32, 4, (8, 512, 2, 1, 3)),
])
def test_silu_and_mul_prologue_is_bit_for_bit_the_unfused_gemv(device, rows, group, bits, config):
    from tokenmill.kernels.activation import silu_and_mul
    from tokenmill.kernels.w4a16_gemm import gemv_int

    n, k = shape(device)
    (packed, scale, zero), _ = _weight(device, n, k, group, bits, sym=True)
    for dtype in _dtypes(device):
        gate_up = (torch.randn(rows, 2 * k, generator=torch.Generator().manual_seed(2)) * 2).to(dtype).to(device)
        fused = gemv_int(SiluAndMulPrologue(gate_up), packed, scale, zero, None, bits, config=config)
        unfused = gemv_int(silu_and_mul(gate_up), packed, scale, zero, None, bits, config=config)
        assert torch.equal(fused, unfused), dtype
        assert torch.equal(SiluAndMulPrologue(gate_up).materialize(), silu_and_mul(gate_up))
