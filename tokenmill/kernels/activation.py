"""Fused SiLU-and-multiply over a [gate | up] tensor: out = silu(gate) * up, rounded as torch rounds it; or that
output quantized per row to e4m3 in the same kernel, for an FP8 linear layer after it (layers.quant.fp8)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.fp8_quant import FUSED_MAX_FEATURES, fp8_quantize
from tokenmill.kernels.pdl import pdl_launch, pdl_start


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr,
                         QUANTIZE_FP8: tl.constexpr, PDL: tl.constexpr = False):
    # QUANTIZE_FP8: out is e4m3 and each row's scale goes to scale_ptr; BLOCK then covers the whole row.
    # PDL: kernels.pdl.
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    y = (silu * up).to(dtype)
    if QUANTIZE_FP8:  # the row as silu_and_mul stores it, then quantize_fp8's per-row scale (masked lanes are 0)
        q, scale = fp8_quantize(y.to(tl.float32))
        tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]."""
    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, out, x2.stride(0), out.stride(0), d, BLOCK=block, QUANTIZE_FP8=False, num_warps=4,
            **pdl_launch(x.device),
        )
    return out.view(*x.shape[:-1], d)


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2 * d] (d <= FUSED_MAX_FEATURES) -> (e4m3 [..., d], float32 scales [rows, 1]): bit for bit
    kernels.fp8_gemm.quantize_fp8(silu_and_mul(x)), without writing and reading back the 16-bit product."""
    d = x.shape[-1] // 2
    assert d <= FUSED_MAX_FEATURES, f"a row of {d} features is wider than one program quantizes"
    x2 = _rows(x)
    q = torch.empty((x2.shape[0], d), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(d)
        _silu_and_mul_kernel[(x2.shape[0], 1)](
            x2, q, scales, x2.stride(0), q.stride(0), d, BLOCK=block, QUANTIZE_FP8=True,
            # 64 elements of gate and of up a thread: at 16,384 wide (Llama-3.1-8B) 8 warps ran 150 us at 8,192 rows
            # on the H200 against 161 at 16 and 158 at 32 (benchmarks/prefill_kernels.py --sections silu).
            num_warps=min(16, max(4, block // 2048)), **pdl_launch(x.device),
        )
    return q.view(*x.shape[:-1], d), scales


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
