"""Prototype for W1 (GPU, not used by the engine yet): the decode step's RMSNorm and SiLU-and-mul folded into
the skinny GEMM that follows each of them, against the two launches the engine makes today.

- norm + qkv / gate_up: RMSNorm(h + residual) @ W.T. The row's rstd is a scalar, so one pass over K can
  accumulate both (h + residual) * norm_weight @ W.T and the sum of squares, and scale by rstd at the end:
  the weight stream starts at once, with no first pass over the row. Program 0 also writes h + residual.
  The rounding differs from the two launches (the normed row is not rounded to bf16 before the weight).
- SiLU-and-mul + down: silu(gate) * up computed on the fly from the gate_up output as x's tiles load.

Checks each against a float64 reference, then times 32 layers of each pair both ways in a CUDA graph.

    PYTHONPATH=. python3 benchmarks/fused_skinny.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from benchmarks.skinny_gemm import time_graph
from tokenmill.kernels.activation import silu_and_mul, silu_and_mul_ref
from tokenmill.kernels.rms_norm import rms_norm, rms_norm_ref
from tokenmill.kernels.skinny_gemm import MAX_ROWS, skinny_gemm

LAYERS = 32


@triton.jit
def _norm_skinny_kernel(
    h_ptr, r_ptr, norm_w_ptr, w_ptr, out_ptr, residual_out_ptr, num_rows, n, k, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_rows
    n_mask = offs_n < n
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sum_sq = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + offs_k
        mask = m_mask[:, None] & (cols < k)[None, :]
        rows = offs_m[:, None] * k + cols[None, :]
        x = (tl.load(h_ptr + rows, mask=mask, other=0.0).to(tl.float32)
             + tl.load(r_ptr + rows, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        if pid == 0:
            tl.store(residual_out_ptr + rows, x, mask=mask)
        x = x.to(tl.float32)
        sum_sq += tl.sum(x * x, 1)
        xw = (x * tl.load(norm_w_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)[None, :]).to(dtype)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * k + cols[None, :],
                    mask=n_mask[:, None] & (cols < k)[None, :], other=0.0)
        acc = tl.dot(xw, tl.trans(w), acc)
    rstd = 1.0 / tl.sqrt(sum_sq / k + eps)
    tl.store(out_ptr + offs_m[:, None] * n + offs_n[None, :], (acc * rstd[:, None]).to(dtype),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _silu_skinny_kernel(
    gate_up_ptr, w_ptr, out_ptr, num_rows, n, k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_rows
    n_mask = offs_n < n
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + offs_k
        mask = m_mask[:, None] & (cols < k)[None, :]
        row_ptrs = gate_up_ptr + offs_m[:, None] * (2 * k) + cols[None, :]
        gate = tl.load(row_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(row_ptrs + k, mask=mask, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # rounded as kernels.activation rounds it
        x = (silu * up.to(tl.float32)).to(dtype)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * k + cols[None, :],
                    mask=n_mask[:, None] & (cols < k)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + offs_m[:, None] * n + offs_n[None, :], acc.to(dtype),
             mask=m_mask[:, None] & n_mask[None, :])


def norm_skinny(h, residual, norm_weight, eps, weight, config=(64, 128, 4, 5)):
    """(RMSNorm(h + residual) @ weight.T, h + residual) in one launch; h, residual [rows, k] contiguous."""
    num_rows, k = h.shape
    n = weight.shape[0]
    out = torch.empty((num_rows, n), dtype=h.dtype, device=h.device)
    residual_out = torch.empty_like(h)
    block_n, block_k, num_warps, num_stages = config
    _norm_skinny_kernel[(triton.cdiv(n, block_n),)](
        h, residual, norm_weight, weight, out, residual_out, num_rows, n, k, eps,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out, residual_out


def silu_skinny(gate_up, weight, config=(32, 512, 4, 5)):
    """silu(gate) * up @ weight.T in one launch; gate_up [rows, 2k] contiguous."""
    num_rows, k = gate_up.shape[0], gate_up.shape[1] // 2
    n = weight.shape[0]
    out = torch.empty((num_rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block_n, block_k, num_warps, num_stages = config
    _silu_skinny_kernel[(triton.cdiv(n, block_n),)](
        gate_up, weight, out, num_rows, n, k,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check(rows: int, dtype: torch.dtype, device: str) -> list[float]:
    g = torch.Generator().manual_seed(rows)
    h, r = (torch.randn(rows, 4096, generator=g).to(dtype).to(device) for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(4096, generator=g)).to(dtype).to(device)
    w_qkv = (torch.randn(6144, 4096, generator=g) * 4096**-0.5).to(dtype).to(device)
    gate_up = torch.randn(rows, 2 * 1000, generator=g).to(dtype).to(device)
    w_down = (torch.randn(4096, 1000, generator=g) * 1000**-0.5).to(dtype).to(device)
    out, residual = norm_skinny(h, r, norm_w, 1e-5, w_qkv)
    ref_normed, ref_residual = rms_norm_ref(h, norm_w, 1e-5, residual=r)
    errors = [rel_error(out, ref_normed.double() @ w_qkv.double().T), rel_error(residual, ref_residual)]
    errors.append(rel_error(silu_skinny(gate_up, w_down), silu_and_mul_ref(gate_up).double() @ w_down.double().T))
    return errors


def main() -> None:
    device, dtype = "cuda", torch.bfloat16
    for rows in (1, 8):
        print(f"rows {rows}: relative errors (norm + qkv, residual, silu + down):",
              ", ".join(f"{e:.1e}" for e in check(rows, dtype, device)), flush=True)
    g = torch.Generator().manual_seed(0)
    norm_w = [(1 + 0.1 * torch.randn(4096, generator=g)).to(dtype).to(device) for _ in range(LAYERS)]
    w_qkv = [torch.randn(6144, 4096, device=device, dtype=dtype) * 4096**-0.5 for _ in range(LAYERS)]
    w_down = [torch.randn(4096, 14336, device=device, dtype=dtype) * 14336**-0.5 for _ in range(LAYERS)]
    for rows in (1, 8):
        h, r = (torch.randn(rows, 4096, device=device, dtype=dtype) for _ in range(2))
        gate_up = torch.randn(rows, 2 * 14336, device=device, dtype=dtype)
        pairs = {
            "norm + qkv": (
                lambda h=h, r=r: [skinny_gemm(rms_norm(h, w, 1e-5, residual=r)[0], wq) for w, wq in zip(norm_w, w_qkv)],
                lambda h=h, r=r: [norm_skinny(h, r, w, 1e-5, wq) for w, wq in zip(norm_w, w_qkv)]),
            "silu + down": (
                lambda gate_up=gate_up: [skinny_gemm(silu_and_mul(gate_up), wd) for wd in w_down],
                lambda gate_up=gate_up: [silu_skinny(gate_up, wd) for wd in w_down]),
        }
        for name, (two_launches, fused) in pairs.items():
            print(f"== rows {rows}, {LAYERS} x {name}: two launches {time_graph(two_launches):.3f} ms, "
                  f"fused {time_graph(fused):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
