"""Paged attention for decode (one query token per request), with a split-KV (flash-decoding) variant.

One program handles one request, one KV head and one split of its context: the query heads that share
the KV head are the rows of the tile (padded to 16 for the tensor cores), so each K/V page is read
once per KV head. With num_splits > 1 each split writes its partial output and log-sum-exp, and a
second kernel combines them; that keeps the GPU busy at small batch sizes and long contexts.
The split count depends only on the batch shape (not on the lengths), so a CUDA graph captured for a
batch size stays valid for any context length.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenmill.kernels.prefill_attention import _tanh, dot_precision

MAX_SPLITS = 16


# num_splits and the block table's width change with the batch: one compiled variant for all their
# values (Triton would otherwise compile one per divisibility class, mid-run, ~1 s each).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, req_ids_ptr,
    sm_scale, softcap, window, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt,
    head_dim,
    IS_SPLIT: tl.constexpr, QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(req_ids_ptr + idx).to(tl.int64)
    token = tl.load(query_start_loc_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)

    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, seq_len - window)
    # Each split takes a whole number of BLOCK_N tiles; the last splits may get nothing.
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(seq_len, start + chunk)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = offs_g < QUERIES_PER_KV
    d_mask = offs_d < head_dim
    heads = kv_head * QUERIES_PER_KV + offs_g
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    block_row = block_table_ptr + req * stride_bt
    kv_offset = kv_head * stride_ch
    qk_scale = sm_scale * 1.4426950408889634

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(block_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_ptrs = page * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + kv_offset
        k = tl.load(k_cache_ptr + kv_ptrs[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if USE_SOFTCAP:
            s = softcap * _tanh(s * (sm_scale / softcap)) * 1.4426950408889634
        else:
            s = s * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_ptrs[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if not IS_SPLIT:
        tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # part_out [num_decodes, num_heads, num_splits, HEAD_DIM_PAD], part_lse [num_decodes, num_heads, num_splits]
        num_heads = tl.num_programs(1) * QUERIES_PER_KV
        part = (idx * num_heads + heads) * num_splits + split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=g_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, req_ids_ptr,
    stride_ot, stride_oh, head_dim, num_splits,
    SPLITS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    idx = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(req_ids_ptr + idx).to(tl.int64)
    token = tl.load(query_start_loc_ptr + req).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits
    part = (idx * tl.num_programs(1) + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


@functools.cache
def _num_sms(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["multiprocessor_count"]


def choose_num_splits(num_decodes: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough splits for about two programs per SM; a function of the batch shape only."""
    if device.type != "cuda":
        return 1
    target = 2 * _num_sms(device.index or 0)
    return max(1, min(MAX_SPLITS, triton.cdiv(target, max(1, num_decodes * num_kv_heads))))


def _config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages)."""
    if dtype == torch.float32:
        return (32, 4, 1) if head_dim > 128 else (64, 4, 1)
    if head_dim > 128:
        return 32, 4, 2
    return 64, 4, 3


def decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; the rows of the requests in req_ids are written
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    req_ids: torch.Tensor,  # [num_decodes] int32: requests with exactly one query token
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    config: tuple[int, int, int] | None = None,
) -> None:
    """config: (BLOCK_N, num_warps, num_stages), to override the tuned choice (benchmarks)."""
    num_decodes = req_ids.numel()
    if num_decodes == 0:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if num_splits is None:
        num_splits = choose_num_splits(num_decodes, num_kv_heads, query.device)
    assert 1 <= num_splits <= MAX_SPLITS
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_n, num_warps, num_stages = config or _config(head_dim, query.dtype)
    if num_splits > 1:
        part_out = torch.empty((num_decodes, num_heads, num_splits, head_dim_pad), dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty((num_decodes, num_heads, num_splits), dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_out, part_lse,
        query_start_loc, seq_lens, block_table, req_ids,
        scale, logits_soft_cap or 1.0, sliding_window or 0, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        head_dim,
        IS_SPLIT=num_splits > 1, QUERIES_PER_KV=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=block_n,
        USE_SOFTCAP=logits_soft_cap is not None, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(query.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _combine_kernel[(num_decodes, num_heads)](
            out, part_out, part_lse, query_start_loc, req_ids,
            out.stride(0), out.stride(1), head_dim, num_splits,
            SPLITS_PAD=MAX_SPLITS, HEAD_DIM_PAD=head_dim_pad,
            num_warps=4 if head_dim_pad >= 128 else 2,
        )
