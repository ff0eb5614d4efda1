"""The Triton kernels on an int8 KV pool with a scale per (token, KV head) row (kernels.kv_int8): writers bit for
bit against the torch quantization, attention against the float64 reference on the dequantized pool, and both
backends on one mixed step.

The cases marked `interpret` also run on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import cases  # noqa: E402

from tokenmill.kernels.kv_int8 import dequantize_rows, quantize_rows  # noqa: E402

pytestmark = pytest.mark.gpu
interpret = pytest.mark.interpret

HEADS = {"gqa4": (8, 2), "mha": (4, 4), "mqa": (16, 1)}
INTERPRETED = {(torch.float16, "gqa4"), (torch.float32, "mha")}  # the interpreter is slow: two of the cases
ATTENTION_CASES = [pytest.param(dtype, heads, id=f"{heads}-{dtype}",
                                marks=[interpret] if (dtype, heads) in INTERPRETED else [])
                   for dtype in (torch.float32, torch.float16, torch.bfloat16) for heads in HEADS]


def make_int8_case(q_lens, context_lens, heads, head_dim, block_size, dtype, device, seed):
    """cases.make_paged_case's requests, each K/V row scaled by its own magnitude (10^-2 to 10^1: one scale per
    pool could not hold them all), quantized row by row. Returns the case and its (k_scale, v_scale)."""
    case = cases.make_paged_case(q_lens, context_lens, *heads, head_dim, block_size, torch.float32, device, seed)
    g = torch.Generator().manual_seed(seed + 100)
    magnitudes = 10.0 ** (3 * torch.rand(case.kv_cache.shape[:-1], generator=g) - 2)
    k, k_scale = quantize_rows(case.kv_cache[0] * magnitudes[0, ..., None].to(device))
    v, v_scale = quantize_rows(case.kv_cache[1] * magnitudes[1, ..., None].to(device))
    case.kv_cache = torch.stack([k, v])
    case.query = case.query.to(dtype)
    return case, k_scale, v_scale


@pytest.mark.parametrize("dtype, heads", ATTENTION_CASES)
def test_int8_paged_attention(device, dtype, heads):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter mishandles bfloat16")
    head_dim = 128 if device == "cuda" else 32
    # Decodes (one split and several), a prefill, and chunks after a cached prefix, in one batch.
    case, k_scale, v_scale = make_int8_case([1, 19, 1, 1, 40, 2], [63, 0, 1, 300, 35, 16], HEADS[heads], head_dim,
                                            16, dtype, device, 0)
    for num_splits in (1, 3):
        assert cases.run_paged_attention(case, num_splits=num_splits, k_scale=k_scale,
                                         v_scale=v_scale) < cases.TOLERANCE[dtype]
    # The same kernels with a softcap and a sliding window (the per-key scale goes before the cap).
    assert cases.run_paged_attention(case, sliding_window=24, logits_soft_cap=5.0, k_scale=k_scale,
                                     v_scale=v_scale) < cases.TOLERANCE[dtype]


@interpret
def test_int8_attention_reads_each_rows_own_scale(device):
    """A reference that dequantizes with other rows' scales (each block's scales rolled by one slot) is far from
    the kernels' output: the test can tell a kernel that reads the wrong row's scale."""
    from tokenmill.kernels.prefill_attention import paged_attention_ref

    dtype = torch.float32
    case, k_scale, v_scale = make_int8_case([1, 9, 1], [40, 5, 70], (8, 2), 32, 16, dtype, device, 1)
    args = dict(k_scale=k_scale, v_scale=v_scale)
    assert cases.run_paged_attention(case, **args) < cases.TOLERANCE[dtype]
    out = paged_attention_ref(case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_table,
                              case.scale, **args)
    wrong = paged_attention_ref(case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_table,
                                case.scale, k_scale=k_scale.roll(1, 1), v_scale=v_scale.roll(1, 1))
    assert cases.rel_error(out, wrong) > 0.2


@interpret
def test_int8_values_of_small_scale_keep_float16_precision(device):
    """Under a 16-bit query the softmax weights times each value row's scale are float16 (kernels.kv_widen): V
    rows of magnitude 1e-4 (scales ~3e-6, weights in float16's subnormals but for V_WEIGHT_GAIN: 5% off) stay
    within the float16 tolerance."""
    dtype = torch.float16
    case = cases.make_paged_case([1, 37, 1], [63, 100, 17], 8, 2, 32, 16, torch.float32, device, seed=0)
    (k, k_scale), (v, v_scale) = quantize_rows(case.kv_cache[0]), quantize_rows(case.kv_cache[1] * 1e-4)
    case.kv_cache = torch.stack([k, v])
    case.query = case.query.to(dtype)
    assert cases.run_paged_attention(case, k_scale=k_scale, v_scale=v_scale) < cases.TOLERANCE[dtype]


def written_int8_pools(writer: str, num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: str, norm_offset: float | None = None):
    """((kernel's pool, K scales, V scales), the torch reference's, stored slots): one writer on K/V rows of
    magnitudes 10^-3 to 10^2 (and one all-zero row), some tokens padding (slot -1)."""
    from types import SimpleNamespace

    from tokenmill.kernels.qk_norm_rope_cache import qk_norm_rope_cache, qk_norm_rope_cache_ref
    from tokenmill.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

    g = torch.Generator().manual_seed(0)
    block_size, num_heads = 16, 2 * num_kv_heads
    num_blocks = num_tokens // block_size + 4
    width = num_heads + 2 * num_kv_heads
    qkv = torch.randn((num_tokens, width, head_dim), generator=g) * 10.0 ** (5 * torch.rand(num_tokens, width, 1,
                                                                                           generator=g) - 3)
    qkv[0] = 0.0
    qkv = qkv.reshape(num_tokens, -1).to(dtype).to(device)
    q, k, v = cases.split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[1:][torch.rand(num_tokens - 1, generator=g) < 0.2] = -1
    slots = slots.to(device)

    def empty():
        return (torch.zeros((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.int8, device=device),
                torch.zeros((num_blocks, block_size, num_kv_heads), device=device),
                torch.zeros((num_blocks, block_size, num_kv_heads), device=device))

    got, want = empty(), empty()
    if writer == "reshape_and_cache":
        reshape_and_cache(k, v, got[0], slots.to(torch.int32), got[1], got[2])
        reshape_and_cache_ref(k, v, want[0], slots, want[1], want[2])
    else:
        positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(device)
        cos_sin = cases.rope_table(head_dim, device)
        norm = None
        if norm_offset is not None:
            norm = SimpleNamespace(weight=(1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(device),
                                   eps=1e-6, offset=norm_offset)
        # "qk_norm_rope_cache_heads": a program per token and 4 heads (a prefill's layout), not per head.
        heads = 4 if writer.endswith("_heads") else 1
        qk_norm_rope_cache(positions, q, k, v, got[0], slots.to(torch.int32), cos_sin, norm, norm, got[1], got[2],
                           heads_per_program=heads)
        qk_norm_rope_cache_ref(positions, q, k, v, want[0], slots, cos_sin, norm, norm, want[1], want[2])
    return got, want, slots[slots >= 0]


@pytest.mark.parametrize("writer", [pytest.param("reshape_and_cache", marks=interpret),
                                    pytest.param("qk_norm_rope_cache", marks=interpret),
                                    pytest.param("qk_norm_rope_cache_heads", marks=interpret)])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=interpret),
                                   pytest.param(torch.float16, marks=interpret), torch.bfloat16], ids=str)
def test_int8_writers_store_the_torch_quantization_bit_for_bit(device, writer, dtype):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter truncates float32 to bfloat16 rather than rounding it")
    got, want, stored = written_int8_pools(writer, 37 if device == "cuda" else 13, 2, 64, dtype, device)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    pool, k_scale = got[0], got[1]
    keys = pool[0].view(-1, 2, 64)[stored]
    assert (keys.abs().amax(-1) == 127).sum() == 2 * len(stored) - 2, "each nonzero row reaches ±127"
    assert (k_scale.view(-1, 2)[stored[0]] == 0).all() and (keys[0] == 0).all(), "the zero row: scale 0, zeros"
    # Slots not written keep zero scales (padding tokens store nothing).
    assert k_scale.view(-1, 2).abs().sum(-1).count_nonzero() == len(stored) - 1


@interpret
def test_int8_qk_norm_rope_cache_with_norms_is_within_one_int8_step(device):
    """With q/k norms the kernel's sum of squares runs in another order than torch's: a key element may land one
    int8 step away, and its row's scale differ in the last bits."""
    got, want, stored = written_int8_pools("qk_norm_rope_cache", 13, 2, 64, torch.float32, device, norm_offset=0.0)
    got_k = dequantize_rows(got[0][0], got[1], torch.float64).view(-1, 2, 64)[stored]
    want_k = dequantize_rows(want[0][0], want[1], torch.float64).view(-1, 2, 64)[stored]
    step = want[1].view(-1, 2)[stored].double()[..., None]
    assert ((got_k - want_k).abs() <= 1.01 * step + 1e-12).all()
    assert torch.equal(got[0][1], want[0][1]) and torch.equal(got[2], want[2])  # V is not normed


@pytest.mark.parametrize("qk_transform", ["none", pytest.param("rope", marks=interpret)])
def test_int8_triton_backend_matches_torch_backend(device, qk_transform):
    """A mixed step (decodes, a prefill, a chunk after a cached prefix) through both backends on an int8 pool with
    the layer's per-row scales, and through the Triton backend again padded to a full-step graph's fixed grid:
    the pools and scales written agree bit for bit (padding tokens store nothing), and so do the outputs."""
    from test_triton_backend import _layer, _make_step, _positions

    from tokenmill.attention.backend import BatchLayout, FixedShape
    from tokenmill.attention.torch_attn import TorchAttentionBackend
    from tokenmill.attention.triton_attn import TritonAttentionBackend

    rng = np.random.default_rng(0)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 64, 4, 2, 32
    layout = _make_step([1, 30, 1, 5], [40, 0, 100, 20], block_size, num_blocks, rng)
    n, size = int(layout.query_start_loc[-1]), 48
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((size, h, head_dim), generator=g).to(device) for h in (heads, kv_heads, kv_heads))
    layer = _layer(heads, kv_heads, head_dim, device, qk_transform).to(device)
    pool = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=g).to(device)
    (k_pool, k_scale), (v_pool, v_scale) = quantize_rows(pool[0]), quantize_rows(pool[1])
    pool = torch.stack([k_pool, v_pool])
    positions, dev = _positions(layout, device), torch.device(device)
    torch_backend, triton_backend = TorchAttentionBackend(), TritonAttentionBackend()

    def forward(backend, metadata, num_tokens=n):
        """(output, pool, k scales, v scales) of the step on copies of the pool and its scales."""
        layer.k_scale, layer.v_scale = k_scale.clone(), v_scale.clone()
        written = pool.clone()
        pos = torch.cat([positions, positions.new_zeros(num_tokens - n)])
        out = backend.forward(layer, pos, q[:num_tokens], k[:num_tokens], v[:num_tokens], written, metadata)
        return out[:n], written, layer.k_scale, layer.v_scale

    ref = forward(torch_backend, torch_backend.build_metadata(layout, dev))
    eager = forward(triton_backend, triton_backend.build_metadata(layout, dev))
    # As a graph captures it: an empty step at the full shape, the step's metadata copied in at its own width.
    empty = BatchLayout(np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros((0, 20), np.int32),
                        np.zeros(0, np.int64), block_size)
    static = triton_backend.build_metadata(empty, dev, padded_to=FixedShape(size, 8, 8, 20))
    triton_backend.copy_metadata(static, triton_backend.build_metadata(
        layout, dev, padded_to=FixedShape(size, 8, 8, layout.block_table.shape[1])))
    fixed = forward(triton_backend, static, size)
    for got in (eager, fixed):
        for a, b in zip(got[1:], ref[1:]):
            assert torch.equal(a, b)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-4)
