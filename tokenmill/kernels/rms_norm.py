"""Fused RMSNorm (optionally with the residual add before it), one program per row.

Rounding follows the torch layer (tokenmill/layers/norm.py) step by step: the residual sum is rounded
to the input dtype and normalised from there, x * rstd is computed in float32 and rounded before the
weight is applied (Gemma's offset variant multiplies in float32). `rms_norm_fp8` quantizes the normed rows
per row to e4m3 in the same kernel, for an FP8 linear layer after the norm (layers.quant.fp8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.fp8_quant import FUSED_MAX_FEATURES, fp8_quantize
from tokenmill.kernels.pdl import pdl_launch, pdl_start


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
    stride_xt, stride_xh, num_heads, stride_r, stride_o, stride_ro,
    hidden_size, eps, offset,
    HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr, QUANTIZE_FP8: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # QUANTIZE_FP8: out is e4m3 and each row's scale goes to scale_ptr. PDL: kernels.pdl.
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x_row = (row // num_heads) * stride_xt + (row % num_heads) * stride_xh
    x = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden_size + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        y = x * rstd * (offset + w)
    else:
        y = (x * rstd).to(dtype).to(tl.float32) * w
    if QUANTIZE_FP8:  # the row as rms_norm stores it, then quantize_fp8's per-row scale (masked lanes are 0)
        q, scale = fp8_quantize(y.to(dtype).to(tl.float32))
        tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., hidden_size]; 2-D or 3-D with a unit last stride
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,  # same shape as x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) or, with a residual, (RMSNorm(x + residual), x + residual); outputs are new tensors."""
    out, _, residual_out = _rms_norm(x, weight, eps, offset, residual, quantize_fp8=False)
    return out if residual is None else (out, residual_out)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(e4m3 [..., hidden_size], float32 scales [rows, 1], x + residual or None): the normed rows bit for bit
    as kernels.fp8_gemm.quantize_fp8(rms_norm(...)) quantizes them, without writing and reading back the
    16-bit rows. hidden_size <= FUSED_MAX_FEATURES."""
    assert x.shape[-1] <= FUSED_MAX_FEATURES, f"a row of {x.shape[-1]} features is wider than one program quantizes"
    return _rms_norm(x, weight, eps, offset, residual, quantize_fp8=True)


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, residual: torch.Tensor | None,
    quantize_fp8: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(normed rows, in x's dtype or e4m3; their float32 scales [rows, 1] when quantized; x + residual)."""
    hidden_size = x.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        x = x.reshape(-1, hidden_size).contiguous()
    num_heads = x.shape[1] if x.dim() == 3 else 1
    stride_xh = x.stride(1) if x.dim() == 3 else 0
    num_rows = x.numel() // hidden_size
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn if quantize_fp8 else x.dtype, device=x.device)
    scales = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device) if quantize_fp8 else None
    residual_out = None
    if residual is not None:
        residual = residual.reshape(num_rows, hidden_size)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out, scales, residual_out
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out,
        residual_out if residual_out is not None else out, scales if scales is not None else out,
        x.stride(0), stride_xh, num_heads,
        residual.stride(0) if residual is not None else 0, hidden_size, hidden_size,
        hidden_size, eps, offset,
        HAS_RESIDUAL=residual is not None, HAS_OFFSET=offset != 0.0, BLOCK=block, QUANTIZE_FP8=quantize_fp8,
        # The same warps either way: the sum of squares then reduces in the same order, bit for bit.
        num_warps=min(16, max(1, block // 256)), **pdl_launch(x.device),
    )
    return out, scales, residual_out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    dtype = x.dtype
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = (h * (offset + weight.float())).to(dtype) if offset else weight * h.to(dtype)
    return h if residual is None else (h, residual)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
