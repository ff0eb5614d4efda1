"""Paged attention for decode (one query token per request), with a split-KV (flash-decoding) variant.

One program handles one request, one KV head and one split of its context: the query heads that share
the KV head are the rows of the tile (padded to 16 for the tensor cores), so each K/V page is read
once per KV head. With num_splits > 1 each split writes its partial output and log-sum-exp, then counts
itself in on an arrival counter of its (request, KV head); the last split to arrive combines the partials
of that KV head's query heads and resets the counter, all in the same launch (a second, combining launch
cost ~1.7 µs per layer at batch 1, mostly launch and tail). Split-KV keeps the GPU busy at small batch
sizes and long contexts. The split count depends only on the batch shape (not on the lengths), so a CUDA
graph captured for a batch size stays valid for any context length.

The arrival counters are kernels.arrivals' persistent, zeroed buffer (each launch resets what it used).
An fp8 or int8 pool is dequantized in registers as in kernels.prefill_attention, read as pairs of bytes
(kernels.kv_widen) under a 16-bit query.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.arrivals import arrival_counters
from tokenmill.kernels.attention_tile import accumulate_tile, attention_output, key_tile_scores, load_query
from tokenmill.kernels.kv_fp8 import kv_scales
from tokenmill.kernels.kv_widen import as_pairs, head_dim_pad, reads_pairs
from tokenmill.kernels.pdl import pdl_launch, pdl_start
from tokenmill.kernels.prefill_attention import dot_precision

MAX_SPLITS = 16


# num_splits and the block table's width change with the batch: one compiled variant for all their
# values (Triton would otherwise compile one per divisibility class, mid-run, ~1 s each).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, arrivals_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, req_ids_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale, softcap, window, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt, stride_sb, stride_st,
    head_dim,
    IS_SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_POW2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr,
    IS_INT8: tl.constexpr, PAIRS: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)  # kernels.pdl
    idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(req_ids_ptr + idx).to(tl.int64)
    if req < 0:  # padding of a fixed grid (a full-step CUDA graph)
        return
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
    q_rows = q_ptr + token * stride_qt + heads[:, None] * stride_qh
    # Under PAIRS q and acc are pairs of tiles, (even columns, odd columns): see kernels.attention_tile.
    q, acc, cols, col_mask = load_query(q_rows, g_mask, offs_d, d_mask, head_dim, GROUP_PAD, HEAD_DIM_PAD, PAIRS)
    block_row = block_table_ptr + req * stride_bt
    kv_offset = kv_head * stride_ch
    if IS_FP8:  # q . (k * k_scale) = (q . k) * k_scale: the scale goes on the scores
        sm_scale = sm_scale * tl.load(k_scale_ptr)
    qk_scale = sm_scale * 1.4426950408889634

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, kv_ptrs, kv_mask, scale_ptrs, n_mask = key_tile_scores(
            q, k_cache_ptr, k_scale_ptr, block_row, offs_n, end, kv_offset, kv_head, cols, col_mask, sm_scale,
            softcap, qk_scale, stride_cb, stride_ct, stride_sb, stride_st, BLOCK_SIZE, DOT_PRECISION, USE_SOFTCAP,
            IS_FP8, IS_INT8, PAIRS, USE_ASM,
        )
        s = tl.where(n_mask[None, :], s, float("-inf"))
        acc, m_i, l_i = accumulate_tile(s, m_i, l_i, acc, v_cache_ptr, kv_ptrs, cols, kv_mask, v_scale_ptr, scale_ptrs,
                                        n_mask, q_ptr.dtype.element_ty, DOT_PRECISION, IS_FP8, IS_INT8, PAIRS, USE_ASM)

    # An fp8 pool's v_scale is on the output: the splits' combine is linear in it too.
    out = attention_output(acc, l_i, v_scale_ptr, IS_FP8, IS_INT8, PAIRS)
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
        # Every split arrives, an empty one too. The barrier puts every warp's stores before the atomic, whose
        # release (acq_rel, gpu scope) publishes them; the last arrival's acquire makes them all visible to it.
        tl.debug_barrier()
        arrival = arrivals_ptr + idx * tl.num_programs(1) + kv_head
        if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            _combine_splits(out_ptr + token * stride_ot, stride_oh, part_out_ptr, part_lse_ptr,
                            idx * num_heads * num_splits, kv_head, num_splits, head_dim,
                            QUERIES_PER_KV, GROUP_POW2, SPLITS_PAD, HEAD_DIM_PAD)
            tl.store(arrival, 0)  # every split has arrived: the counter is ready for the next launch


@triton.jit
def _combine_splits(
    out_row_ptr, stride_oh, part_out_ptr, part_lse_ptr, first_part, kv_head, num_splits, head_dim,
    QUERIES_PER_KV: tl.constexpr, GROUP_POW2: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """The outputs of one KV head's query heads: their splits' partials, each weighted by exp2(lse - max lse),
    over the weights' sum. The splits are unrolled and combined element-wise (no cross-thread reduction, so
    no barrier), which lets all their loads be in flight at once. The loads are .cg (L2, not L1): they read
    other programs' stores of the same launch."""
    offs_g = tl.arange(0, GROUP_POW2)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = offs_g < QUERIES_PER_KV
    d_mask = offs_d < head_dim
    heads = kv_head * QUERIES_PER_KV + offs_g
    parts = first_part + heads * num_splits  # each head's first split
    m = tl.full([GROUP_POW2], float("-inf"), tl.float32)
    for split in tl.static_range(SPLITS_PAD):
        lse = tl.load(part_lse_ptr + parts + split, mask=g_mask & (num_splits > split), other=float("-inf"),
                      cache_modifier=".cg")
        m = tl.maximum(m, lse)
    m = tl.where(m == float("-inf"), 0.0, m)  # no context at all: every weight 0, the output 0
    total = tl.zeros([GROUP_POW2], tl.float32)
    acc = tl.zeros([GROUP_POW2, HEAD_DIM_PAD], tl.float32)
    for split in tl.static_range(SPLITS_PAD):
        split_mask = g_mask & (num_splits > split)
        w = tl.exp2(tl.load(part_lse_ptr + parts + split, mask=split_mask, other=float("-inf"),
                            cache_modifier=".cg") - m)
        part = tl.load(part_out_ptr + (parts + split)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                       mask=split_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
        total += w
        acc += part * w[:, None]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_row_ptr + heads[:, None] * stride_oh + offs_d[None, :], out.to(out_row_ptr.dtype.element_ty),
             mask=g_mask[:, None] & d_mask[None, :])


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
    req_ids: torch.Tensor,  # [num_decodes] int32: requests with exactly one query token; -1 entries are skipped
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    config: tuple[int, int, int] | None = None,
    k_scale: torch.Tensor | None = None,  # an fp8 pool's scales ([] float32) or an int8 pool's (kernels.kv_int8)
    v_scale: torch.Tensor | None = None,
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
    group_pow2 = triton.next_power_of_2(group)  # the combine's rows; padded to 16 for the attention's dots
    scales = kv_scales(kv_cache, k_scale, v_scale)
    pairs = reads_pairs(scales, query.dtype)  # a one-byte pool under a 16-bit query (kernels.kv_widen)
    dim_pad = head_dim_pad(head_dim, pairs)
    block_n, num_warps, num_stages = config or _config(head_dim, query.dtype)
    if num_splits > 1:
        part_out = torch.empty((num_decodes, num_heads, num_splits, dim_pad), dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty((num_decodes, num_heads, num_splits), dtype=torch.float32, device=query.device)
        arrivals = arrival_counters(query.device, num_decodes * num_kv_heads)
    else:
        part_out = part_lse = arrivals = out  # unused
    k_cache, v_cache = (as_pairs(kv_cache[0]), as_pairs(kv_cache[1])) if pairs else (kv_cache[0], kv_cache[1])
    _decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_out, part_lse, arrivals,
        query_start_loc, seq_lens, block_table, req_ids, scales.k, scales.v,
        scale, logits_soft_cap or 1.0, sliding_window or 0, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0), scales.stride_b,
        scales.stride_t,
        head_dim,
        IS_SPLIT=num_splits > 1, SPLITS_PAD=MAX_SPLITS,
        QUERIES_PER_KV=group, GROUP_PAD=max(16, group_pow2), GROUP_POW2=group_pow2,
        BLOCK_SIZE=block_size, HEAD_DIM_PAD=dim_pad, BLOCK_N=block_n,
        USE_SOFTCAP=logits_soft_cap is not None, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(query.dtype), IS_FP8=scales.is_fp8, IS_INT8=scales.is_int8,
        PAIRS=pairs, USE_ASM=query.device.type == "cuda",
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(query.device),
    )


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
