"""A decode GEMV's input computed by the GEMV itself as it reads it (a prologue), not by a kernel of its own before.

At batch 1 a Llama layer's two RMSNorms and its SiLU-and-mul are ~2 us kernels between the weight-streaming GEMVs:
their launch, their loads' latency and the GEMV's wait for them cost more than their work. A producer (layers.norm's
RMSNorm, layers.activation's SiluAndMul) whose one consumer is a linear layer that takes a prologue
(QuantMethod.input_prologue_wanted: the int4/int8 CUDA-core GEMV, kernels.w4a16_gemm's gemv_int) hands it one of
these instead of a tensor, and the GEMV computes its input from them as it loads it; `materialize()` is the
producer's own kernel, for any other path.

Off unless asked for: TOKENMILL_GEMV_PROLOGUE=rms_norm,silu_and_mul (either or both). Measured on an H100
(BENCHMARKS.md, thirty-fourth session), W1 on int4 weights: without the norms' and SiLU's kernels at all (a probe,
its outputs wrong) a token took 4.5% less time without the norms, 1.2% without the SiLU, 6% without both; with both
prologues (their first form, which summed the squares across the program every step) it took 16% more (1,307 ->
1,510 ms). Each of the GEMV's programs (8 columns at one row) recomputes the prologue for all of K: a SiLU is an
exponential and a division per feature against 16 instructions of weights, an RMSNorm's add, square and scale ~5.
The sums of squares now stay per thread until the end; whether the norm's prologue then wins is not measured yet
(`benchmarks/gpu_check.py --sections prologue`).
Torch only (no triton import): the layers import it on any machine.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch


class RmsNormPrologue(NamedTuple):
    """RMSNorm(x [+ residual]) [rows, k] as a prologue; with a residual, the consumer's GEMV also writes x + residual
    (rounded to x's dtype) into residual_out, which the producer already handed on as the new residual stream.
    The GEMV multiplies by the rows' 1 / rms at the end, from the sum of squares it gathers on its walk over K: its
    input is (x + residual) * weight (or * (offset + weight), Gemma's), not rounded to 16 bits after the division
    as the norm kernel rounds it, so the result differs from norm-then-GEMV by that rounding."""

    x: torch.Tensor  # [rows, k], last stride 1
    weight: torch.Tensor  # [k]
    eps: float
    offset: float
    residual: torch.Tensor | None  # [rows, k], last stride 1
    residual_out: torch.Tensor | None  # [rows, k], contiguous

    def materialize(self) -> torch.Tensor:
        """The normed rows from the norm kernel (which writes residual_out too)."""
        from tokenmill.kernels.rms_norm import rms_norm_into

        return rms_norm_into(self.x, self.weight, self.eps, self.offset, self.residual, self.residual_out)


class SiluAndMulPrologue(NamedTuple):
    """silu(gate) * up [rows, d] of gate_up [rows, 2 * d] as a prologue, rounded as kernels.activation rounds it: the
    consumer's result is bit for bit the unfused one's."""

    gate_up: torch.Tensor  # [rows, 2 * d], last stride 1

    def materialize(self) -> torch.Tensor:
        from tokenmill.kernels.activation import silu_and_mul

        return silu_and_mul(self.gate_up)


GemvPrologue = RmsNormPrologue | SiluAndMulPrologue


PROLOGUE_KINDS = ("rms_norm", "silu_and_mul")


@functools.cache
def prologue_enabled(kind: str) -> bool:
    """Whether producers of this kind (PROLOGUE_KINDS) hand consumers that take one a prologue: where
    TOKENMILL_GEMV_PROLOGUE names it (comma-separated). Off by default: not measured faster yet."""
    named = {name.strip() for name in os.environ.get("TOKENMILL_GEMV_PROLOGUE", "").split(",") if name.strip()}
    unknown = named - set(PROLOGUE_KINDS)
    if unknown:
        raise ValueError(f"TOKENMILL_GEMV_PROLOGUE names {sorted(unknown)}: it takes {', '.join(PROLOGUE_KINDS)}")
    return kind in named


RMS_NORM, SILU_AND_MUL = 1, 2
"""The GEMV kernels' PROLOGUE constexpr (0: none)."""


def gemv_input(x: torch.Tensor | GemvPrologue) -> tuple[torch.Tensor, tuple, dict]:
    """For a GEMV kernel taking load_prologue_input's arguments: (its x as a [rows, k] view with a unit last stride:
    the normed rows' input or the gate half of [gate | up], whose row stride the GEMV walks; the arguments
    res_ptr, res_out_ptr, norm_w_ptr, stride_rm, stride_rom, eps, norm_offset; the constexprs PROLOGUE,
    HAS_RESIDUAL, HAS_OFFSET)."""
    if isinstance(x, RmsNormPrologue):
        res = x.residual
        res_out = x.residual_out
        assert res is None or (res.shape == x.x.shape and res.stride(-1) == 1 and res_out.is_contiguous())
        args = (res if res is not None else x.x, res_out if res is not None else x.x, x.weight,
                res.stride(0) if res is not None else 0, res_out.stride(0) if res is not None else 0, x.eps, x.offset)
        return x.x, args, {"PROLOGUE": RMS_NORM, "HAS_RESIDUAL": res is not None, "HAS_OFFSET": x.offset != 0.0}
    if isinstance(x, SiluAndMulPrologue):
        gate_up = x.gate_up
        unused = (gate_up, gate_up, gate_up, 0, 0, 0.0, 0.0)
        return gate_up[:, : gate_up.shape[1] // 2], unused, {"PROLOGUE": SILU_AND_MUL}
    return x, (x, x, x, 0, 0, 0.0, 0.0), {}
