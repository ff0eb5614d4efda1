"""Fused SiLU-and-multiply over a [gate | up] tensor: out = silu(gate) * up, rounded as torch rounds it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], d)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
