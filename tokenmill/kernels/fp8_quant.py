"""Dynamic FP8 (e4m3) quantization of a block of activations with one float32 scale, as a Triton helper.

kernels.fp8_gemm.quantize_fp8 runs it over rows or groups it loads; the kernels that produce a linear layer's
input (kernels.activation's SiLU-and-mul, kernels.rms_norm) run it on the row they hold, so an FP8 linear
layer's per-token quantization costs no pass of its own over the activations (layers.quant.fp8.Fp8Activation).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys

FUSED_MAX_FEATURES = 32768
"""The widest row the producing kernels quantize in the one program that holds it; wider rows take
quantize_fp8's own pass."""


@triton.jit
def fp8_quantize(x):
    """x float32 (masked lanes 0) -> (x / scale clamped to e4m3's range, still float32; the float32 scale):
    layers.quant.fp8.quantize_fp8_torch's formula."""
    # An all-zero block gets a tiny scale, not a division by zero (layers.quant.fp8.MIN_SCALE).
    scale = tl.maximum(tl.max(tl.abs(x)) / 448.0, 1e-12 / 448.0)
    return tl.clamp(x / scale, -448.0, 448.0), scale


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
