"""kernels.kv_widen: every pair of bytes (all 65,536) read as a float16 pattern widens to its two bytes' exact fp8
or int8 values. On a GPU both ways (the PTX and Triton's casts), under the interpreter its casts."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_fp8 import FP8_DTYPE
from tokenmill.kernels.kv_widen import as_pairs, widen_pairs

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]


@triton.jit
def _widen_kernel(pairs_ptr, even_ptr, odd_ptr, IS_FP8: tl.constexpr, USE_ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    even, odd = widen_pairs(tl.load(pairs_ptr + offs), IS_FP8, USE_ASM)
    tl.store(even_ptr + offs, even)
    tl.store(odd_ptr + offs, odd)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_every_byte_pair_widens_exactly(device, kind):
    byte_dtype = FP8_DTYPE if kind == "fp8" else torch.int8
    pool = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.uint8).view(byte_dtype).to(device)
    want = pool.to(torch.float32).view(-1, 2)  # every e4m3 and int8 value is a float16 one: exact either way
    # e4m3's two NaN patterns aside: the writers saturate, a pool never holds them (and the interpreter's
    # casts do not keep them NaN)
    stored = want.isfinite().all(dim=1)
    pairs = as_pairs(pool)
    for use_asm in [False, True] if device == "cuda" else [False]:
        even, odd = torch.full_like(pairs, float("nan")), torch.full_like(pairs, float("nan"))
        _widen_kernel[(pairs.numel() // 1024,)](pairs, even, odd, IS_FP8=kind == "fp8", USE_ASM=use_asm, BLOCK=1024)
        got = torch.stack([even.float(), odd.float()], dim=1)
        torch.testing.assert_close(got[stored], want[stored], rtol=0, atol=0)
