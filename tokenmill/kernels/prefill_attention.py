"""Paged attention for prefill and chunked prefill: varlen, causal, cached prefix before the new tokens.

One program computes one tile of BLOCK_M query tokens of one request for one query head, streaming
that request's K/V (cached prefix and this step's tokens alike, already in the pool) through its block
table with an online softmax. The grid is (tiles of the longest request, requests, heads); tiles past a
request's end return at once, and the heaviest (last) tiles are started first.

Under a full-step CUDA graph the grid cannot follow the batch: it is fixed by the captured shape (enough
tiles for any split of its tokens into requests) and each program finds its (request, tile) by walking the
requests' tile counts, read from the device; the programs past the last tile return at once.

An fp8 (float8_e4m3fn) pool is dequantized in registers, here and in the decode kernel: each K/V tile is
widened exactly (every e4m3 value is a float16, bfloat16 and float32 value), to float16 under a 16-bit query
(read as pairs of bytes, kernels.kv_widen) and to float32 under a float32 one, and the layer's scales, read
through pointers so that a CUDA graph sees their current values, multiply the scores (k_scale, folded into the
softmax scale) and the output (v_scale): the products of scaling every element, with one multiply per score or
output element instead of one per K/V element. An int8 pool is widened the same
way (exactly), each key's and value row's own scale (kernels.kv_int8, read beside the pool at the key's slot and
KV head) multiplying that key's scores and that row's softmax weights: one multiply per score, twice.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.attention_tile import accumulate_tile, attention_output, key_tile_scores, load_query
from tokenmill.kernels.kv_fp8 import is_fp8, kv_scales
from tokenmill.kernels.kv_int8 import dequantize_rows, is_int8
from tokenmill.kernels.kv_widen import as_pairs, head_dim_pad, reads_pairs

FIXED_GRID_EXTRA_TILES = 8
"""Programs per head beyond one per BLOCK_M tokens on a fixed grid. H200, Llama-3.1-8B heads, one 496-token
chunk after 528 cached tokens: a grid sized for 256 partial tiles took 70.5 us against 31.4 eagerly, one sized
for 8 took 32.7 us."""


@triton.jit
def _key_tile(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_row, kv_offset, start_n, hi,
    q_pos, cols, col_mask, sm_scale, softcap, qk_scale, window, tree_start, tree_bits,
    stride_cb, stride_ct, stride_sb, stride_st, kv_head, DOT_DTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr,
    IS_INT8: tl.constexpr, PAIRS: tl.constexpr, USE_ASM: tl.constexpr, USE_TREE: tl.constexpr,
):
    """The online softmax over keys [start_n, start_n + BLOCK_N) (those below `hi`); MASKED: some query of the
    tile must not see some of them (causality, the window, the tree)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    s, kv_ptrs, kv_mask, scale_ptrs, n_mask = key_tile_scores(
        q, k_cache_ptr, k_scale_ptr, block_row, offs_n, hi, kv_offset, kv_head, cols, col_mask, sm_scale, softcap,
        qk_scale, stride_cb, stride_ct, stride_sb, stride_st, BLOCK_SIZE, DOT_PRECISION, USE_SOFTCAP, IS_FP8, IS_INT8,
        PAIRS, USE_ASM,
    )
    if MASKED:
        mask = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if USE_WINDOW:
            mask = mask & (offs_n[None, :] > q_pos[:, None] - window)
        if USE_TREE:
            # Clamped to a shift within 64 bits (keys outside the nodes are decided by the other terms).
            node = tl.minimum(tl.maximum(offs_n - tree_start, 0), 63).to(tl.int64)
            is_ancestor = ((tree_bits[:, None] >> node[None, :]) & 1) != 0
            mask = mask & ((offs_n[None, :] < tree_start) | is_ancestor)
        s = tl.where(mask, s, float("-inf"))
    return accumulate_tile(s, m_i, l_i, acc, v_cache_ptr, kv_ptrs, cols, kv_mask, v_scale_ptr, scale_ptrs, n_mask,
                           DOT_DTYPE, DOT_PRECISION, IS_FP8, IS_INT8, PAIRS, USE_ASM)


@triton.jit
def _attend_tile(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, seq_lens_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr,
    tree_lens_ptr, tree_bits_ptr,
    req, tile, head, q_start, q_len,
    sm_scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt, stride_sb, stride_st,
    head_dim,
    QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr,
    IS_INT8: tl.constexpr, PAIRS: tl.constexpr, USE_ASM: tl.constexpr, USE_TREE: tl.constexpr,
):
    """Query rows [tile * BLOCK_M, (tile + 1) * BLOCK_M) of request `req` for one query head. Under USE_TREE the
    request's last tree_lens[req] keys are draft-tree nodes: a query sees those of them its bitmask names."""
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_pos = context_len + offs_m  # absolute position of each query token
    rows = (q_start + offs_m).to(tl.int64)
    q_rows = q_ptr + rows[:, None] * stride_qt + head * stride_qh
    # Under PAIRS q and acc are pairs of tiles, (even columns, odd columns): see kernels.attention_tile.
    q, acc, cols, col_mask = load_query(q_rows, m_mask, offs_d, d_mask, head_dim, BLOCK_M, HEAD_DIM_PAD, PAIRS)
    tree_start = seq_len
    tree_bits = tl.zeros([BLOCK_M], tl.int64)
    if USE_TREE:
        tree_start = seq_len - tl.load(tree_lens_ptr + req)
        tree_bits = tl.load(tree_bits_ptr + rows, mask=m_mask, other=0)  # [BLOCK_M] int64 ancestor bitmasks

    kv_head = head // QUERIES_PER_KV
    hi = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, context_len + tile * BLOCK_M - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    block_row = block_table_ptr + req * stride_bt
    kv_offset = kv_head * stride_ch
    if IS_FP8:  # q . (k * k_scale) = (q . k) * k_scale: the scale goes on the scores
        sm_scale = sm_scale * tl.load(k_scale_ptr)
    qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    # The key tiles that every query of the tile sees whole (causally before its first query; no window, no tree)
    # need no mask: only the last tiles, along the diagonal, build and apply one.
    full_hi = lo
    if not USE_WINDOW and not USE_TREE:
        full_hi = tl.minimum(hi, tl.maximum(lo, (context_len + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N))
    for masked in tl.static_range(2):  # the whole tiles, then the diagonal's
        for start_n in range(full_hi if masked else lo, hi if masked else full_hi, BLOCK_N):
            acc, m_i, l_i = _key_tile(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_row, kv_offset, start_n,
                hi, q_pos, cols, col_mask, sm_scale, softcap, qk_scale, window, tree_start, tree_bits,
                stride_cb, stride_ct, stride_sb, stride_st, kv_head, q_ptr.dtype.element_ty,
                BLOCK_SIZE, BLOCK_N, masked == 1, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION, IS_FP8, IS_INT8, PAIRS,
                USE_ASM, USE_TREE,
            )
    out = attention_output(acc, l_i, v_scale_ptr, IS_FP8, IS_INT8, PAIRS)
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])




@triton.jit
def _find_tile(slot, query_start_loc_ptr, req_ids_ptr, num_reqs, BLOCK_M: tl.constexpr):
    """The request and tile of the slot-th tile in request order, each request's last (heaviest) tile first."""
    req = -1
    tile = 0
    first = 0
    for i in range(num_reqs):
        r = tl.load(req_ids_ptr + i)
        n = tl.cdiv(tl.load(query_start_loc_ptr + r + 1) - tl.load(query_start_loc_ptr + r), BLOCK_M)
        hit = (slot >= first) & (slot < first + n)
        req = tl.where(hit, r, req)
        tile = tl.where(hit, first + n - 1 - slot, tile)
        first += n
    return req.to(tl.int64), tile


# The block table's width changes with the batch: one compiled variant for all its values.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, req_ids_ptr, num_reqs_ptr, k_scale_ptr, v_scale_ptr,
    tree_lens_ptr, tree_bits_ptr,
    sm_scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt, stride_sb, stride_st,
    head_dim,
    QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr,
    IS_INT8: tl.constexpr, PAIRS: tl.constexpr, USE_ASM: tl.constexpr, USE_TREE: tl.constexpr,
    FIXED_GRID: tl.constexpr,
):
    head = tl.program_id(2)
    if FIXED_GRID:
        # The programs take the step's tiles in turns: slots p, p + G, p + 2G, ... of G programs per head.
        num_reqs = tl.load(num_reqs_ptr)
        num_slots = 0
        for i in range(num_reqs):
            r = tl.load(req_ids_ptr + i)
            num_slots += tl.cdiv(tl.load(query_start_loc_ptr + r + 1) - tl.load(query_start_loc_ptr + r), BLOCK_M)
        first_slot = tl.program_id(0)
        slot_step = tl.num_programs(0)
    else:  # one tile, of the grid's own request
        num_reqs = 0
        num_slots = 1
        first_slot = 0
        slot_step = 1
    for slot in range(first_slot, num_slots, slot_step):
        if FIXED_GRID:
            req, tile = _find_tile(slot, query_start_loc_ptr, req_ids_ptr, num_reqs, BLOCK_M)
        else:
            req = tl.load(req_ids_ptr + tl.program_id(1)).to(tl.int64)
            tile = tl.num_programs(0) - 1 - tl.program_id(0)
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        if tile * BLOCK_M < q_len:  # a tile past its request's end (the eager grid's) does nothing
            _attend_tile(
                q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, seq_lens_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr,
                tree_lens_ptr, tree_bits_ptr, req, tile, head, q_start, q_len, sm_scale, softcap, window,
                stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt, stride_sb,
                stride_st, head_dim,
                QUERIES_PER_KV, BLOCK_SIZE, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION,
                IS_FP8, IS_INT8, PAIRS, USE_ASM, USE_TREE,
            )


def dot_precision(dtype: torch.dtype) -> str:
    """float32 attention runs in full float32 (no tf32); the option does not apply to 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if dtype == torch.float32:
        return (32, 32, 4, 1) if head_dim > 128 else (64, 32, 4, 1)
    if head_dim > 128:
        return 64, 32, 4, 2
    # H200, Llama-3.1-8B heads, TFLOP/s with the unmasked tiles apart: 8 x 1024 causal 241, 4 x 512 after 1,536
    # cached 310, 1 x 8,192 388 (the best or within 8% of it among 9 configs; 128 x 32, 4 warps, 3 stages: 242,
    # 291, 332).
    return 128, 128, 8, 2


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; rows of the requests in req_ids are written
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    req_ids: torch.Tensor,  # [num_prefills] int32: the requests to compute
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    config: tuple[int, int, int, int] | None = None,
    k_scale: torch.Tensor | None = None,  # an fp8 pool's scales ([] float32) or an int8 pool's (kernels.kv_int8)
    v_scale: torch.Tensor | None = None,
    num_reqs: torch.Tensor | None = None,  # [1] int32: how many of req_ids count, for a fixed grid
    tree_lens: torch.Tensor | None = None,  # [num_reqs] int32: draft-tree nodes ending each request's keys
    tree_bits: torch.Tensor | None = None,  # [num_tokens] int64: the tree nodes each query sees, bit i: node i
) -> None:
    """config: (BLOCK_M, BLOCK_N, num_warps, num_stages), to override the tuned choice (benchmarks).

    With `num_reqs` the grid is fixed by the shapes alone (a CUDA graph's step): req_ids is padded, only its
    first num_reqs entries are requests, and max_query_len is not read.

    With `tree_lens` (speculative tree drafts, spec/tree.py) a request's last tree_lens[r] keys are tree nodes,
    node i at key seq_len - tree_lens[r] + i, and a query sees node i only where bit i of its tree_bits is set
    (its ancestors and itself); the keys before them causally, as always."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    fixed_grid = num_reqs is not None
    if req_ids.numel() == 0 or (max_query_len == 0 and not fixed_grid):
        return
    if query.stride(-1) != 1:
        query = query.contiguous()
    block_m, block_n, num_warps, num_stages = config or _config(head_dim, query.dtype)
    scales = kv_scales(kv_cache, k_scale, v_scale)
    pairs = reads_pairs(scales, query.dtype)
    k_cache, v_cache = (as_pairs(kv_cache[0]), as_pairs(kv_cache[1])) if pairs else (kv_cache[0], kv_cache[1])
    if fixed_grid:
        # A tile per BLOCK_M tokens and a few for the requests' partial tiles; more tiles take turns.
        grid = (triton.cdiv(query.shape[0], block_m) + FIXED_GRID_EXTRA_TILES, 1, num_heads)
    else:
        grid = (triton.cdiv(max_query_len, block_m), req_ids.numel(), num_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out,
        query_start_loc, seq_lens, block_table, req_ids, req_ids if num_reqs is None else num_reqs,
        scales.k, scales.v,
        seq_lens if tree_lens is None else tree_lens, seq_lens if tree_bits is None else tree_bits,
        scale, logits_soft_cap or 1.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0), scales.stride_b,
        scales.stride_t,
        head_dim,
        QUERIES_PER_KV=num_heads // num_kv_heads, BLOCK_SIZE=block_size,
        HEAD_DIM_PAD=head_dim_pad(head_dim, pairs),
        BLOCK_M=block_m, BLOCK_N=block_n,
        USE_SOFTCAP=logits_soft_cap is not None, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(query.dtype), IS_FP8=scales.is_fp8, IS_INT8=scales.is_int8,
        PAIRS=pairs, USE_ASM=query.device.type == "cuda", USE_TREE=tree_lens is not None,
        FIXED_GRID=fixed_grid,
        num_warps=num_warps, num_stages=num_stages,
    )


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    dtype: torch.dtype = torch.float64,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tree_lens: list[int] | None = None,
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense per-request attention in `dtype` (float64 by default): the reference for both kernels. An fp8
    pool's K and V are dequantized first (fp8 * scale, in `dtype`), an int8 pool's each row times its scale.
    `tree_lens`, `tree_bits`: draft-tree masks, as prefill_attention takes them."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    groups = query.shape[1] // num_kv_heads
    out = torch.zeros(query.shape, dtype=dtype, device=query.device)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end == start:
            continue
        blocks = block_table[i, : math.ceil(seq_len / block_size)].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].to(dtype)
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].to(dtype)
        if is_fp8(kv_cache.dtype):
            k, v = k * k_scale.to(dtype), v * v_scale.to(dtype)
        elif is_int8(kv_cache.dtype):
            k = dequantize_rows(k, k_scale[blocks].reshape(-1, num_kv_heads)[:seq_len].to(dtype), dtype)
            v = dequantize_rows(v, v_scale[blocks].reshape(-1, num_kv_heads)[:seq_len].to(dtype), dtype)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        q = query[start:end].to(dtype)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        if tree_lens is not None and tree_lens[i]:
            from tokenmill.spec.tree import tree_mask

            mask &= tree_mask(tree_bits[start:end], seq_len, tree_lens[i])
        scores = scores.masked_fill(~mask, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
