"""The CPU C kernel for RMSNorm (+ residual add) against the torch ops it replaces.

float32: the residual add is exact; the normalized output differs from torch's only through the order of the
sum of squares (a few ulp of the variance, so ~1e-7 relative after the rsqrt and two products), hence
rtol 1e-6 (~8 ulp). bfloat16: both round the same float32 values to bfloat16 at the same points, so an output
may differ by one bfloat16 ulp only where a float32 value lies at a rounding boundary; we require that to be rare.
"""

import pytest
import torch

from tokenmill.layers import cpu_norm
from tokenmill.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(cpu_norm.load_kernels() is None, reason="no C compiler")


def torch_rms_norm(x, weight, eps, offset, residual):
    if residual is not None:
        x = residual = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * (offset + weight.float())).to(dtype) if offset else weight * h.to(dtype)
    return out, residual


def check(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:  # at most one bfloat16 ulp apart, and rarely
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-5)
        assert (out != ref).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 576), (7, 33), (3, 2, 17), (64, 1000), (5,)], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype, shape, offset, with_residual):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype) if with_residual else None
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    with torch.inference_mode():
        assert cpu_norm.rms_norm_applies(x, weight, residual)
        got = cpu_norm.rms_norm_cpu(x, weight, 1e-5, offset, residual)
    ref, ref_residual = torch_rms_norm(x, weight, 1e-5, offset, residual)
    if with_residual:
        got, got_residual = got
        assert torch.equal(got_residual, ref_residual)  # the add rounds once either way
    check(got, ref, dtype)


def test_the_module_uses_the_kernel_and_torch_for_strided_rows():
    norm = RMSNorm(40, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40))
    base = torch.randn(6, 100)
    x = base[:, 10:50]  # rows 100 apart
    residual = torch.randn(6, 40)
    ref, ref_residual = torch_rms_norm(x, norm.weight, 1e-6, 0.0, residual)
    with torch.inference_mode():
        assert not cpu_norm.rms_norm_applies(x, norm.weight, residual)  # the kernel goes by contiguous rows
        out, new_residual = norm(x, residual)
        assert torch.equal(out, ref) and torch.equal(new_residual, ref_residual)  # torch's own path
        assert cpu_norm.rms_norm_applies(x.contiguous(), norm.weight, residual)
        out, new_residual = norm(x.contiguous(), residual)
    assert torch.equal(new_residual, ref_residual)
    check(out, ref, torch.float32)


def test_rms_norm_is_deterministic_across_thread_counts():
    x = torch.randn(33, 577)
    weight = torch.randn(577)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(cpu_norm.rms_norm_cpu(x, weight, 1e-6, 0.0, None))
    torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_torch_paths_remain_where_the_kernels_do_not_apply():
    x = torch.randn(4, 8)
    assert not cpu_norm.rms_norm_applies(x, torch.ones(8), None)  # autograd on: the kernels have no backward
    with torch.inference_mode():
        assert not cpu_norm.rms_norm_applies(x.half(), torch.ones(8).half(), None)
        assert not cpu_norm.rms_norm_applies(x.t(), torch.ones(4), None)  # columns, not rows
        assert not cpu_norm.rms_norm_applies(x, torch.ones(7), None)  # a weight of another size
        assert not cpu_norm.rms_norm_applies(x, torch.ones(8), torch.randn(4, 8).bfloat16())
