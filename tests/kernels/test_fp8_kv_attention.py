"""The Triton kernels on an fp8 (float8_e4m3fn) KV pool: writers bit for bit against the torch quantization
(kernels.kv_fp8), attention against the float64 reference on the dequantized pool (fp8 * scale).

The cases marked `interpret` also run on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import cases  # noqa: E402

from tokenmill.kernels.kv_fp8 import FP8_DTYPE, FP8_MAX, dequantize_kv, quantize_kv  # noqa: E402

pytestmark = pytest.mark.gpu
interpret = pytest.mark.interpret

# The attention's error comes from the query's dtype alone: widening e4m3 to it is exact.
DTYPES = [pytest.param(torch.float32, marks=interpret), pytest.param(torch.float16, marks=interpret),
          torch.bfloat16]


def scales(device: str, k: float, v: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(k, device=device), torch.tensor(v, device=device)


def make_fp8_case(q_lens, context_lens, heads, head_dim, block_size, dtype, device, seed, k_scale, v_scale):
    """cases.make_paged_case's requests with a pool of N(0, 1) K/V quantized with the scales (about ±20 to
    ±50 in e4m3 units: normal numbers, some past ±448 for the v scale's tail)."""
    case = cases.make_paged_case(q_lens, context_lens, *heads, head_dim, block_size, torch.float32, device, seed)
    pool = case.kv_cache
    case.kv_cache = torch.stack([quantize_kv(pool[0], k_scale, FP8_DTYPE), quantize_kv(pool[1], v_scale, FP8_DTYPE)])
    case.query = case.query.to(dtype)
    return case


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(8, 2), pytest.param((4, 4), marks=interpret), (16, 1)], ids=["gqa4", "mha", "mqa"])
def test_fp8_paged_attention(device, dtype, heads):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter mishandles bfloat16")
    head_dim = 128 if device == "cuda" else 32
    k_scale, v_scale = scales(device, 0.05, 0.02)
    # Decodes (one split and several), a prefill, and chunks after a cached prefix, in one batch.
    case = make_fp8_case([1, 19, 1, 1, 40, 2], [63, 0, 1, 300, 35, 16], heads, head_dim, 16, dtype, device, 0,
                         k_scale, v_scale)
    for num_splits in (1, 3):
        assert cases.run_paged_attention(case, num_splits=num_splits, k_scale=k_scale,
                                         v_scale=v_scale) < cases.TOLERANCE[dtype]


@interpret
def test_fp8_attention_reads_the_scales_at_launch(device):
    """New scale values in the same tensors (what a captured CUDA graph sees) change the result accordingly;
    a wrong pair of scales does not pass for the right one."""
    dtype = torch.float16
    k_scale, v_scale = scales(device, 0.05, 0.02)
    case = make_fp8_case([1, 9, 1], [40, 5, 70], (8, 2), 32, 16, dtype, device, 1, k_scale, v_scale)
    args = dict(k_scale=k_scale, v_scale=v_scale)
    assert cases.run_paged_attention(case, **args) < cases.TOLERANCE[dtype]
    k_scale.mul_(3.0)
    v_scale.mul_(0.5)
    assert cases.run_paged_attention(case, **args) < cases.TOLERANCE[dtype]
    # The kernels against a reference dequantized with other scales: far off (the test can tell).
    from tokenmill.kernels.decode_attention import decode_attention
    from tokenmill.kernels.prefill_attention import paged_attention_ref, prefill_attention

    qsl, seq_lens = case.tensors()
    out = torch.full_like(case.query, float("nan"))
    ids = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)
    decode_attention(case.query, case.kv_cache, out, qsl, seq_lens, case.block_table, ids([0, 2]), case.scale,
                     **args)
    prefill_attention(case.query, case.kv_cache, out, qsl, seq_lens, case.block_table, ids([1]), 9, case.scale,
                      **args)
    wrong = paged_attention_ref(case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_table,
                                case.scale, k_scale=k_scale / 3.0, v_scale=v_scale * 2.0)
    assert cases.rel_error(out, wrong) > 0.2


@interpret
def test_scales_leave_a_model_dtype_pool_alone(device):
    """Checkpoint scales apply to fp8 pools only: a float16 pool read with scales is read as it is."""
    dtype = torch.float16
    case = cases.make_paged_case([1, 7], [30, 4], 8, 2, 32, 16, dtype, device, seed=2)
    k_scale, v_scale = scales(device, 4.0, 0.25)
    assert cases.run_paged_attention(case, k_scale=k_scale, v_scale=v_scale) < cases.TOLERANCE[dtype]


def written_pools(writer: str, num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
                  k_scale: torch.Tensor, v_scale: torch.Tensor, norm_offset: float | None = None):
    """(kernel's pool, torch reference's pool, stored slots): one writer on K/V of magnitude up to ~4, some
    tokens padding (slot -1)."""
    from types import SimpleNamespace

    from tokenmill.kernels.qk_norm_rope_cache import qk_norm_rope_cache, qk_norm_rope_cache_ref
    from tokenmill.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

    g = torch.Generator().manual_seed(0)
    block_size, num_heads = 16, 2 * num_kv_heads
    num_blocks = num_tokens // block_size + 4
    qkv = torch.randn((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), generator=g).to(dtype).to(device)
    q, k, v = cases.split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    slots = slots.to(device)
    pool = torch.zeros((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=FP8_DTYPE, device=device)
    got, want = pool.clone(), pool.clone()
    if writer == "reshape_and_cache":
        reshape_and_cache(k, v, got, slots.to(torch.int32), k_scale, v_scale)
        reshape_and_cache_ref(k, v, want, slots, k_scale, v_scale)
    else:
        positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(device)
        cos_sin = cases.rope_table(head_dim, device)
        norm = None
        if norm_offset is not None:
            norm = SimpleNamespace(weight=(1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(device),
                                   eps=1e-6, offset=norm_offset)
        qk_norm_rope_cache(positions, q, k, v, got, slots.to(torch.int32), cos_sin, norm, norm, k_scale, v_scale)
        qk_norm_rope_cache_ref(positions, q, k, v, want, slots, cos_sin, norm, norm, k_scale, v_scale)
    return got, want, slots[slots >= 0]


@pytest.mark.parametrize("writer", [pytest.param("reshape_and_cache", marks=interpret),
                                    pytest.param("qk_norm_rope_cache", marks=interpret)])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=interpret),
                                   pytest.param(torch.float16, marks=interpret), torch.bfloat16], ids=str)
def test_fp8_writers_store_the_torch_quantization_bit_for_bit(device, writer, dtype):
    """x / scale rounded to e4m3, saturated: the k scale is small enough that the largest keys saturate."""
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter truncates float32 to bfloat16 rather than rounding it")
    k_scale, v_scale = scales(device, 0.006, 0.03)
    got, want, stored = written_pools(writer, 37 if device == "cuda" else 13, 2, 64, dtype, device, k_scale, v_scale)
    assert (got.view(torch.uint8) != want.view(torch.uint8)).sum() == 0
    keys = got[0].view(-1, 2, 64)[stored].float()
    assert keys.abs().max() == FP8_MAX, "no key saturated: the case does not test saturation"
    assert torch.isfinite(got.float()).all()
    # Slots not written stay zero (padding tokens store nothing).
    assert got.view(2, -1, 2, 64).float().abs().sum(dim=(0, 2, 3)).count_nonzero() == len(stored)


@interpret
def test_fp8_qk_norm_rope_cache_with_norms_is_within_one_e4m3_step(device):
    """With q/k norms the kernel's sum of squares runs in another order than torch's: a key at a rounding
    boundary of e4m3 may land one step away, never more (2^-3 relative)."""
    k_scale, v_scale = scales(device, 0.02, 0.03)
    got, want, stored = written_pools("qk_norm_rope_cache", 13, 2, 64, torch.float32, device, k_scale, v_scale,
                                      norm_offset=0.0)
    got_kv = dequantize_kv(got, k_scale, torch.float64).view(2, -1, 2, 64)[:, stored]
    want_kv = dequantize_kv(want, k_scale, torch.float64).view(2, -1, 2, 64)[:, stored]
    assert ((got_kv - want_kv).abs() <= want_kv.abs() * 2**-3 + 1e-12).all()
    assert cases.rel_error(got_kv, want_kv) < 1e-2


@interpret
def test_fp8_store_rounds_like_torch_at_every_e4m3_boundary(device):
    """Every e4m3 value, every midpoint between neighbours (ties go to even), a float32 step either side of each
    midpoint, and values past ±448, subnormals included: the kernel's bits are torch's."""
    from tokenmill.kernels.reshape_and_cache import reshape_and_cache

    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    values = values[torch.isfinite(values)].unique()  # sorted, -448 .. 448, one zero
    mids = (values[1:] + values[:-1]) / 2
    probes = torch.cat([values, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                        torch.tensor([449.0, 463.9, 464.0, 1e6, -500.0, 3e-5, -1e-9])])
    head_dim = 64
    probes = torch.cat([probes, probes.new_zeros(-len(probes) % head_dim)]).view(-1, 1, head_dim).to(device)
    num_tokens = probes.shape[0]
    pool = torch.zeros((2, -(-num_tokens // 16), 16, 1, head_dim), dtype=FP8_DTYPE, device=device)
    one = torch.tensor(1.0, device=device)
    reshape_and_cache(probes, probes, pool, torch.arange(num_tokens, dtype=torch.int32, device=device), one, one)
    want = quantize_kv(probes, one, FP8_DTYPE)
    got = pool[0].view(-1, 1, head_dim)[:num_tokens]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@interpret
@pytest.mark.parametrize("qk_transform", ["none", "rope", "qk_norm+partial_rope"])
def test_fp8_triton_backend_matches_torch_backend(device, qk_transform):
    """A mixed step (decodes, a prefill, a chunk after a cached prefix) through both backends on an fp8 pool
    with the layer's own scales: the writers' bits agree, and so do the outputs."""
    from test_triton_backend import _layer, _make_step, _positions

    from tokenmill.attention.torch_attn import TorchAttentionBackend
    from tokenmill.attention.triton_attn import TritonAttentionBackend

    rng = np.random.default_rng(0)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 64, 8, 2, 64
    layout = _make_step([1, 30, 1, 5], [40, 0, 100, 20], block_size, num_blocks, rng)
    num_tokens = int(layout.query_start_loc[-1])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((num_tokens, n, head_dim), generator=g).to(device) for n in (heads, kv_heads, kv_heads))
    layer = _layer(heads, kv_heads, head_dim, device, qk_transform).to(device)  # its scale buffers too
    layer.k_scale.fill_(0.05)
    layer.v_scale.fill_(0.02)
    pool = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=g).to(device)
    pool = torch.stack([quantize_kv(pool[0], layer.k_scale, FP8_DTYPE), quantize_kv(pool[1], layer.v_scale, FP8_DTYPE)])
    positions, dev = _positions(layout, device), torch.device(device)

    torch_backend, triton_backend = TorchAttentionBackend(), TritonAttentionBackend()
    pool_ref = pool.clone()
    ref = torch_backend.forward(layer, positions, q, k, v, pool_ref, torch_backend.build_metadata(layout, dev))
    out = triton_backend.forward(layer, positions, q, k, v, pool, triton_backend.build_metadata(layout, dev))
    if qk_transform in ("none", "rope"):
        assert torch.equal(pool.view(torch.uint8), pool_ref.view(torch.uint8))
    else:  # a key whose last float32 bit differs may round to the neighbouring e4m3 value
        got, want = pool.float(), pool_ref.float()
        assert ((got - want).abs() <= want.abs() * 2**-3).all()
        assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
