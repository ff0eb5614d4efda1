"""Random inputs for the Triton kernels and their errors against the float64 references.

Shared by the pytest files here and by benchmarks/gpu_check.py (which prints the errors). Every case
draws fresh random data, scatters each request's blocks over a shuffled pool, and poisons the output
with NaN first, so an unwritten element fails the check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Relative error bounds (‖out - ref‖ / ‖ref‖ against float64): float32 runs without tf32.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    query_start_loc: list[int]
    seq_lens: list[int]
    scale: float

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.query.device
        return (torch.tensor(self.query_start_loc, dtype=torch.int32, device=device),
                torch.tensor(self.seq_lens, dtype=torch.int32, device=device))


def make_paged_case(
    q_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> PagedCase:
    """Requests with `context_lens` cached tokens before their `q_lens` new ones, K/V already in the pool."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, q_lens)]
    blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    max_blocks = max(blocks_needed) + 1
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.randint(0, num_blocks, (len(q_lens), max_blocks), generator=g, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_needed):
        block_table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    kv_cache = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=g).to(dtype)
    query = torch.randn((sum(q_lens), num_heads, head_dim), generator=g).to(dtype)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    return PagedCase(query.to(device), kv_cache.to(device), block_table.to(device), qsl, seq_lens,
                     head_dim**-0.5)


def run_paged_attention(
    case: PagedCase,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> float:
    """Decode kernel for the one-token requests, prefill kernel for the rest; relative error of all rows.
    k_scale / v_scale: an fp8 pool's scales (the reference dequantizes with them)."""
    from tokenmill.kernels.decode_attention import decode_attention
    from tokenmill.kernels.prefill_attention import paged_attention_ref, prefill_attention

    qsl, seq_lens = case.tensors()
    q_lens = [b - a for a, b in zip(case.query_start_loc, case.query_start_loc[1:])]
    device = case.query.device
    decode_ids = torch.tensor([i for i, n in enumerate(q_lens) if n == 1], dtype=torch.int32, device=device)
    prefill_ids = torch.tensor([i for i, n in enumerate(q_lens) if n > 1], dtype=torch.int32, device=device)
    out = torch.full_like(case.query, float("nan"))
    args = dict(scale=case.scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, k_scale=k_scale,
                v_scale=v_scale)
    decode_attention(case.query, case.kv_cache, out, qsl, seq_lens, case.block_table, decode_ids,
                     num_splits=num_splits, **args)
    max_prefill = max([n for n in q_lens if n > 1], default=0)
    prefill_attention(case.query, case.kv_cache, out, qsl, seq_lens, case.block_table, prefill_ids, max_prefill,
                      **args)
    ref = paged_attention_ref(case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_table,
                              **args)
    return rel_error(out, ref)


def run_reshape_and_cache(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                          device: str, seed: int) -> float:
    """Max abs difference between the kernel's pool and the reference's (exact copy expected)."""
    from tokenmill.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

    g = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 4
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.1] = -1  # padding tokens: nothing stored
    # K and V as strided views of one fused qkv tensor, as the model produces them.
    qkv = torch.randn((num_tokens, 3 * num_kv_heads * head_dim), generator=g).to(dtype).to(device)
    key = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    pool = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=g).to(dtype).to(device)
    expected = pool.clone()
    slots = slots.to(device)
    reshape_and_cache(key, value, pool, slots.to(torch.int32))
    reshape_and_cache_ref(key, value, expected, slots)
    return (pool.double() - expected.double()).abs().max().item()


def run_rms_norm(num_rows: int, hidden: int, dtype: torch.dtype, device: str, seed: int, residual: bool,
                 offset: float = 0.0, heads: int = 0) -> float:
    """Relative error against the torch layer's arithmetic (run in the same dtype)."""
    from tokenmill.kernels.rms_norm import rms_norm, rms_norm_ref

    g = torch.Generator().manual_seed(seed)
    shape = (num_rows, heads, hidden) if heads else (num_rows, hidden)
    x = torch.randn(shape, generator=g).to(dtype).to(device)
    if heads:  # a strided view, like q out of the fused qkv projection
        x = torch.cat([x, x], dim=1)[:, :heads]
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    r = torch.randn(shape, generator=g).to(dtype).to(device) if residual else None
    got = rms_norm(x, w, 1e-6, offset, r)
    ref = rms_norm_ref(x, w, 1e-6, offset, r)
    if residual:
        return max(rel_error(got[0], ref[0]), rel_error(got[1], ref[1]))
    return rel_error(got, ref)


def rope_table(rotary_dim: int, device: str, max_position: int = 4096) -> torch.Tensor:
    """[max_position, rotary_dim] float32 cos | sin, as layers.rotary builds it."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """q, k, v as strided [num_tokens, heads, head_dim] views of the fused projection's output."""
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)


def run_rotary(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
               dtype: torch.dtype, device: str, seed: int) -> float:
    from tokenmill.kernels.rotary import rotary_embedding, rotary_embedding_ref

    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), generator=g).to(dtype).to(device)
    q, k, _ = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(device)
    cache = rope_table(rotary_dim, device)
    got_q, got_k = rotary_embedding(positions, q, k, cache)
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cache)
    return max(rel_error(got_q, ref_q), rel_error(got_k, ref_k))


def run_qk_norm_rope_cache(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                           norm_offset: float | None, dtype: torch.dtype, device: str, seed: int,
                           heads_per_program: int | None = None) -> tuple[int, float]:
    """The fused kernel on q/k/v views of one qkv tensor, some tokens padding (slot -1); norm_offset None: no
    q/k norms. Returns the number of elements of q and of the pool whose bits differ from the composed torch
    reference (rms_norm_ref -> rotary_embedding_ref -> reshape_and_cache_ref), and the relative error of q and
    of the stored K/V against it."""
    from types import SimpleNamespace

    from tokenmill.kernels.qk_norm_rope_cache import qk_norm_rope_cache, qk_norm_rope_cache_ref

    g = torch.Generator().manual_seed(seed)
    block_size = 16
    num_blocks = num_tokens // block_size + 4
    qkv = torch.randn((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), generator=g).to(dtype).to(device)
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1  # padding tokens: q produced, nothing stored
    slots = slots.to(device)
    cos_sin = rope_table(rotary_dim, device)
    q_norm = k_norm = None
    if norm_offset is not None:
        q_norm, k_norm = (SimpleNamespace(weight=(1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(device),
                                          eps=1e-6, offset=norm_offset) for _ in range(2))
    pool = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=g).to(dtype).to(device)

    fused_pool, ref_pool = pool.clone(), pool.clone()
    fused_q = qk_norm_rope_cache(positions, q, k, v, fused_pool, slots.to(torch.int32), cos_sin, q_norm, k_norm,
                                 heads_per_program=heads_per_program)
    ref_q = qk_norm_rope_cache_ref(positions, q, k, v, ref_pool, slots, cos_sin, q_norm, k_norm)

    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    pairs = ((fused_q, ref_q), (fused_pool, ref_pool))
    mismatches = sum(int((fused.view(bits) != ref.view(bits)).sum()) for fused, ref in pairs)
    stored = slots[slots >= 0]
    stored_kv = lambda p: p.view(2, -1, num_kv_heads, head_dim)[:, stored]
    return mismatches, max(rel_error(fused_q, ref_q), rel_error(stored_kv(fused_pool), stored_kv(ref_pool)))


def run_silu_and_mul(num_rows: int, d: int, dtype: torch.dtype, device: str, seed: int) -> float:
    from tokenmill.kernels.activation import silu_and_mul, silu_and_mul_ref

    g = torch.Generator().manual_seed(seed)
    x = torch.randn((num_rows, 2 * d), generator=g).to(dtype).to(device)
    return rel_error(silu_and_mul(x), silu_and_mul_ref(x))
