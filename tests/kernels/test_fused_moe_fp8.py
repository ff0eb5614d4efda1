"""The fused MoE kernel with e4m3 expert weights (kernels.fused_moe, W8A16) against float64 computed on the same
e4m3 values: fused_experts_torch on the dequantized weights.

Block scales (128 x 128 as the DeepSeek-V3 / Qwen3 FP8 releases, 32 under the interpreter) and per-row scales
(online quantization), decode and prefill token counts, idle experts, expert-parallel -1 ids, each tile class.
A scale read from the wrong block or row moves the output by far more than the bound. The cases marked
`interpret` run on the CPU under TRITON_INTERPRET=1 (widening e4m3 is exact there; only the conversion *to*
e4m3 is wrong in Triton 3.6's interpreter, and the kernel never converts to it).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tokenmill.layers.moe_routing import fused_experts_torch, select_experts
from tokenmill.layers.quant.fp8 import FP8, FP8_MAX, dequantize_fp8

sys.path.insert(0, os.path.dirname(__file__))
import cases  # noqa: E402

pytestmark = pytest.mark.gpu
interpret = pytest.mark.interpret


def quantize_experts(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (e4m3 [E, N, K], scales [E, N / b, K / b], or [E, N, 1] with block 0)."""
    if block:
        e, n, k = w.shape
        tiles = w.reshape(e, n // block, block, k // block, block)
        # Each block's own range, spread over several binades: a scale from the wrong block shows.
        tiles = tiles * torch.logspace(-1, 1, (n // block) * (k // block)).reshape(1, n // block, 1, k // block, 1)
        scale = tiles.abs().amax(dim=(2, 4)) / FP8_MAX
        q = (tiles / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(e, n, k)
        return q, scale
    w = w * torch.logspace(-1, 1, w.shape[1]).reshape(1, -1, 1)
    scale = w.abs().amax(dim=2, keepdim=True) / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_experts(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return torch.stack([dequantize_fp8(q[e], scale[e] if block else scale[e].reshape(-1), block)
                        for e in range(q.shape[0])]).double()


def run_case(num_tokens, num_experts, top_k, hidden, inter, dtype, device, block, unused=0, config=None,
             expert_parallel=False, decode=False) -> float:
    """decode: through kernels.fused_moe_decode (config then a DecodeConfig)."""
    from tokenmill.kernels.fused_moe import fused_experts
    from tokenmill.kernels.fused_moe_decode import fused_experts_decode

    g = torch.Generator().manual_seed(num_tokens + hidden)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if unused:
        logits[:, num_experts - unused:] = -1e9
    weights, ids = select_experts(logits, top_k, renormalize=True)
    if expert_parallel:  # another rank's experts: -1, weight 0
        weights, ids = weights.masked_fill(ids % 2 == 1, 0.0), ids.masked_fill(ids % 2 == 1, -1)
    q13, s13 = quantize_experts(w13, block)
    q2, s2 = quantize_experts(w2, block)
    x = x.to(dtype)
    ref = fused_experts_torch(x.double(), dequantize_experts(q13, s13, block), dequantize_experts(q2, s2, block),
                              weights.double(), ids)
    inputs = (x.to(device), q13.to(device), q2.to(device), weights.to(device), ids.to(device))
    scales = dict(w13_scale=s13.to(device), w2_scale=s2.to(device), scale_block=block)
    if decode:
        out = fused_experts_decode(*inputs, config=config, **scales)
    else:
        out = fused_experts(*inputs, config=config, skip_negative_ids=expert_parallel, **scales)
    assert out.shape == ref.shape and out.dtype == dtype
    return cases.rel_error(out.cpu(), ref)


# (tokens, experts, top_k, hidden, intermediate, experts that get no token)
GPU_SHAPES = [
    (1, 128, 8, 2048, 768, 0),  # Qwen3-30B-A3B-FP8 decode
    (16, 128, 8, 2048, 384, 64),  # its TP=2 slice, half the experts idle
    (300, 128, 8, 2048, 768, 0),  # 2400 assignments
    (1500, 8, 2, 512, 256, 0),  # the 128-row tiles
    (77, 8, 2, 1024, 512, 3),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block", [128, 0], ids=["block128", "per-row"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "T{}-E{}-K{}-H{}-I{}-idle{}".format(*s))
def test_fused_experts_fp8(device, dtype, block, shape):
    if device == "cpu":
        pytest.skip("GPU shapes")
    assert run_case(*shape[:5], dtype, device, block, unused=shape[5]) < cases.TOLERANCE[dtype]


@pytest.mark.parametrize("shape", [(1, 8, 2, 4096, 1000, 0), (40, 60, 4, 1000, 96, 0)], ids=["I1000", "H1000"])
def test_fused_experts_fp8_per_row_sizes_off_the_tiles(device, shape):
    """Per-row scales have no block constraint: sizes that are not multiples of the tiles."""
    if device == "cpu":
        pytest.skip("GPU shapes")
    assert run_case(*shape[:5], torch.bfloat16, device, 0) < cases.TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("name", ["m16", "m64", "m128", "m32-wide-k"])
def test_fused_experts_fp8_tile_classes(device, name):
    """Every tile class, BLOCK_K 256 cut down to the 128-wide scale block; expert-parallel -1 ids."""
    from test_fused_moe import CONFIGS

    from tokenmill.kernels.fused_moe import MoeConfig

    if device == "cpu":
        pytest.skip("GPU shapes")
    error = run_case(200, 16, 4, 1024, 384, torch.bfloat16, device, 128, unused=2,
                     config=MoeConfig(*CONFIGS[name]), expert_parallel=True)
    assert error < cases.TOLERANCE[torch.bfloat16]


SMALL = (16, (16, 32, 1, 4, 2), (16, 32, 2, 4, 2))


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("block", [32, 0], ids=["block32", "per-row"])
@pytest.mark.parametrize("shape", [(1, 8, 2, 64, 64, 0), (37, 6, 3, 64, 32, 2)], ids=["decode", "idle-experts"])
def test_fused_experts_fp8_interpreted(device, dtype, block, shape):
    from tokenmill.kernels.fused_moe import MoeConfig

    config = None if shape[0] == 1 else MoeConfig(*SMALL)  # decode: the default tiles (BLOCK_K cut to 32)
    error = run_case(*shape[:5], dtype, device, block, unused=shape[5], config=config,
                     expert_parallel=shape[0] > 1)
    assert error < cases.TOLERANCE[dtype]


@interpret
def test_a_wrong_scale_block_fails_the_bound(device):
    """The bound can fail: the same case with every scale block of one expert taken from its neighbour."""
    from tokenmill.kernels.fused_moe import fused_experts

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    w13, w2 = torch.randn(2, 64, 64, generator=g) / 8, torch.randn(2, 64, 32, generator=g) / 6
    q13, s13 = quantize_experts(w13, 32)
    q2, s2 = quantize_experts(w2, 32)
    ids = torch.zeros(5, 1, dtype=torch.int64)
    weights = torch.ones(5, 1)
    ref = fused_experts_torch(x.double(), dequantize_experts(q13, s13, 32), dequantize_experts(q2, s2, 32),
                              weights.double(), ids)
    good = fused_experts(x.to(device), q13.to(device), q2.to(device), weights.to(device), ids.to(device),
                         w13_scale=s13.to(device), w2_scale=s2.to(device), scale_block=32)
    bad = fused_experts(x.to(device), q13.to(device), q2.to(device), weights.to(device), ids.to(device),
                        w13_scale=s13.flip(2).contiguous().to(device), w2_scale=s2.to(device), scale_block=32)
    assert cases.rel_error(good.cpu(), ref) < cases.TOLERANCE[torch.float32]
    assert cases.rel_error(bad.cpu(), ref) > 0.1


@interpret
def test_bad_fp8_scales_are_refused():
    from tokenmill.kernels.fused_moe import fused_experts

    x = torch.zeros(2, 64)
    q13, q2 = torch.zeros(2, 64, 64).to(FP8), torch.zeros(2, 64, 32).to(FP8)
    ids, weights = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    with pytest.raises(ValueError, match="fp8 expert scales"):
        fused_experts(x, q13, q2, weights, ids, w13_scale=torch.ones(2, 2, 2), w2_scale=torch.ones(2, 2, 2),
                      scale_block=32)
    with pytest.raises(ValueError, match="scale blocks of 24"):
        fused_experts(x, q13, q2, weights, ids, w13_scale=torch.ones(2, 2, 2), w2_scale=torch.ones(2, 2, 1),
                      scale_block=24)


@interpret
@pytest.mark.parametrize("block,block_k,prefetch,split_k", [(32, 64, 0, 1), (32, 16, 1, 3), (0, 64, 0, 1)],
                         ids=["block32-wide", "block32-prefetch-split3", "per-row"])
def test_fused_experts_fp8_decode_path_interpreted(device, block, block_k, prefetch, split_k):
    """The GEMVs of kernels.fused_moe_decode on e4m3 experts: 3 tokens, expert-parallel -1 ids; K-tiles that
    span two 32-wide scale blocks, or lie inside one; the next K-tile prefetched, the down kernel's K split."""
    from tokenmill.kernels.fused_moe_decode import DecodeConfig

    config = DecodeConfig((16, block_k, 4, 2, prefetch), (16, block_k, 4, 2, prefetch, split_k))
    error = run_case(3, 8, 3, 64, 96, torch.float16, device, block, config=config, expert_parallel=True, decode=True)
    assert error < cases.TOLERANCE[torch.float16]


@pytest.mark.parametrize("block", [128, 0], ids=["block128", "per-row"])
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_fused_experts_fp8_decode_path(device, block, num_tokens):
    """Qwen3-30B-A3B-FP8's experts through the decode path with its default tiles."""
    if device == "cpu":
        pytest.skip("GPU shapes")
    error = run_case(num_tokens, 128, 8, 2048, 768, torch.bfloat16, device, block, expert_parallel=True, decode=True)
    assert error < cases.TOLERANCE[torch.bfloat16]
