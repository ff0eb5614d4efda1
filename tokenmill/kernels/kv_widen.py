"""Widening a one-byte (fp8 e4m3 or int8) KV tile to float16 in the attention kernels, two elements at a time.

The kernels read a one-byte pool through a float16 view of it (each "element" the bit pattern of two adjacent
head-dim bytes) and split every tile into its even and odd head-dim columns, each widened exactly to float16. The
attention then runs on the two halves as two half-width dots (q's even columns with K's even columns plus the odd
ones; P with V's even and odd columns, the output interleaved once at the end). Why: the tensor cores' operands
come out of shared memory with ldmatrix, which moves 16-bit elements only. A one-byte V tile (whose reduction
dimension, the keys, is not the contiguous one) otherwise goes through byte-wise shared loads and register
shuffles that cost more issue slots than the bytes they save; the pairs load transposed like any float16 tile.

On the GPU the widening is a few integer instructions per four bytes: fp8 through the hardware's e4m3x2 to
f16x2 conversion, int8 through the float16 magic number (0x6400 | (byte ^ 0x80) is 1152 + byte, exactly).
The interpreter (no PTX) takes the same bits through Triton's own casts.

The dots are float16 (a bfloat16 query widens to it exactly). Their softmax weights are float16 too: an int8
pool's, which carry each value row's scale, are taken times V_WEIGHT_GAIN (and the output divided by it at the
end) so that rows of small scale keep their precision where float16 turns subnormal (below 6e-5). A float32
query keeps the kernels' float32 path (CUDA-core dots, the tile widened in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.kv_fp8 import KVScaleArgs

# Two pairs in, per output: even = (byte 0 of pair 0, byte 0 of pair 1), odd = (byte 1, byte 1).
_FP8_PAIRS_ASM = tl.constexpr("{ .reg .b16 lo, hi; .reg .b32 e; prmt.b32 e, $2, 0, 0x3120; mov.b32 {lo, hi}, e; "
                              "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")
_INT8_PAIRS_ASM = tl.constexpr("{ .reg .b32 x, m; xor.b32 x, $2, 0x80808080; mov.b32 m, 0x64806480; "
                               "prmt.b32 $0, x, 0x64646464, 0x4240; prmt.b32 $1, x, 0x64646464, 0x4341; "
                               "sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; }")

V_WEIGHT_GAIN = tl.constexpr(256.0)
"""Past 65504 / V_WEIGHT_GAIN (a row's elements past ~32,000) an int8 pool's weights saturate instead of overflowing."""


def reads_pairs(scales: KVScaleArgs, query_dtype: torch.dtype) -> bool:
    """Whether a kernel reads its pool (kv_fp8.kv_scales' arguments) as pairs: a one-byte pool, a 16-bit query."""
    return (scales.is_fp8 or scales.is_int8) and query_dtype != torch.float32


def head_dim_pad(head_dim: int, pairs: bool) -> int:
    """The kernels' padded head dim: a power of two, and half of it at least 16 when read as pairs (a dot's K)."""
    return 2 * max(16, triton.next_power_of_2(head_dim // 2)) if pairs else max(16, triton.next_power_of_2(head_dim))


def as_pairs(pool: torch.Tensor) -> torch.Tensor:
    """A one-byte pool [..., head_dim] seen as float16 [..., head_dim / 2], what the kernels read."""
    assert pool.element_size() == 1 and pool.shape[-1] % 2 == 0, "pairs of a one-byte pool of even head_dim"
    return pool.view(torch.float16)


@triton.jit
def as_float16(q):
    """A 16-bit query's columns for the float16 dots: exact for a bfloat16 query (so those dots lose no more than
    bfloat16's would), the rare element past float16's range clamped to it."""
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def widen_pairs(pairs, IS_FP8: tl.constexpr, USE_ASM: tl.constexpr):
    """pairs: a tile of float16-viewed byte pairs -> (even bytes, odd bytes) as float16 tiles of its shape."""
    if USE_ASM:
        if IS_FP8:
            return tl.inline_asm_elementwise(_FP8_PAIRS_ASM, "=r,=r,r", [pairs], dtype=(tl.float16, tl.float16),
                                             is_pure=True, pack=2)
        return tl.inline_asm_elementwise(_INT8_PAIRS_ASM, "=r,=r,r", [pairs], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=2)
    bits = pairs.to(tl.uint16, bitcast=True)
    lo = (bits & 0xFF).to(tl.uint8)
    hi = (bits >> 8).to(tl.uint8)
    byte_type = tl.float8e4nv if IS_FP8 else tl.int8
    return lo.to(byte_type, bitcast=True).to(tl.float16), hi.to(byte_type, bitcast=True).to(tl.float16)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
