"""The paged attention kernels' shared steps (kernels.prefill_attention, kernels.decode_attention): the query tile,
a tile of keys' scores, the online softmax's update with its values, and the output.

Under PAIRS (a one-byte pool read as float16 pairs, kernels.kv_widen) the query and the accumulator are pairs of
tiles, (even columns, odd columns), each half the head dim wide, and a K/V tile is read at the pairs' columns;
otherwise they are plain tiles, read at the head dim's columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.kv_widen import V_WEIGHT_GAIN, as_float16, widen_pairs


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at both ends (exp overflow gives 1, underflow -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def load_query(q_rows, row_mask, offs_d, d_mask, head_dim,
               ROWS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAIRS: tl.constexpr):
    """q_rows [ROWS, 1]: each row's first column. -> (the query tile, its zero accumulator, the columns a K/V tile
    is read at and their mask)."""
    if PAIRS:  # a one-byte pool's float16 pairs view (kernels.kv_widen), the strides in pairs; float16 dots
        offs_h = tl.arange(0, HEAD_DIM_PAD // 2)
        h_mask = offs_h < head_dim // 2
        rh_mask = row_mask[:, None] & h_mask[None, :]
        q = (as_float16(tl.load(q_rows + 2 * offs_h[None, :], mask=rh_mask, other=0.0)),
             as_float16(tl.load(q_rows + 2 * offs_h[None, :] + 1, mask=rh_mask, other=0.0)))
        acc = (tl.zeros([ROWS, HEAD_DIM_PAD // 2], tl.float32), tl.zeros([ROWS, HEAD_DIM_PAD // 2], tl.float32))
        cols, col_mask = offs_h, h_mask
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
        cols, col_mask = offs_d, d_mask
    return q, acc, cols, col_mask


@triton.jit
def tile_scores(
    q, k_cache_ptr, kv_ptrs, cols, kv_mask,
    DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr, PAIRS: tl.constexpr, USE_ASM: tl.constexpr,
):
    """q . k [rows, keys] for a tile of keys; kv_ptrs [keys]: each key's first column in the pool."""
    if PAIRS:  # q . k = q_even . k_even + q_odd . k_odd
        k_e, k_o = widen_pairs(tl.load(k_cache_ptr + kv_ptrs[:, None] + cols[None, :], mask=kv_mask, other=0.0),
                               IS_FP8, USE_ASM)
        s = tl.dot(q[1], tl.trans(k_o), tl.dot(q[0], tl.trans(k_e)))
    else:
        k = tl.load(k_cache_ptr + kv_ptrs[:, None] + cols[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    return s


@triton.jit
def scale_scores(s, k_scale_ptr, scale_ptrs, key_mask, sm_scale, softcap, qk_scale,
                 USE_SOFTCAP: tl.constexpr, IS_INT8: tl.constexpr):
    """The scores softcapped and scaled for a base-2 softmax; scale_ptrs [keys]: an int8 pool's scales, read only
    for one."""
    if IS_INT8:  # q . (k * scale) = (q . k) * scale: each key's own scale goes on its scores
        s = s * tl.load(k_scale_ptr + scale_ptrs, mask=key_mask, other=0.0)[None, :]
    if USE_SOFTCAP:
        s = softcap * _tanh(s * (sm_scale / softcap)) * 1.4426950408889634
    else:
        s = s * qk_scale
    return s


@triton.jit
def key_tile_scores(
    q, k_cache_ptr, k_scale_ptr, block_row, offs_n, end, kv_offset, kv_head, cols, col_mask,
    sm_scale, softcap, qk_scale, stride_cb, stride_ct, stride_sb, stride_st,
    BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_SOFTCAP: tl.constexpr, IS_FP8: tl.constexpr,
    IS_INT8: tl.constexpr, PAIRS: tl.constexpr, USE_ASM: tl.constexpr,
):
    """The keys offs_n (those below `end`) of one request's KV head, through its block table row: their scaled
    scores, and what accumulate_tile reads their values with: (s, kv_ptrs, kv_mask, scale_ptrs, n_mask)."""
    n_mask = offs_n < end
    page = tl.load(block_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    kv_ptrs = page * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + kv_offset
    kv_mask = n_mask[:, None] & col_mask[None, :]
    s = tile_scores(q, k_cache_ptr, kv_ptrs, cols, kv_mask, DOT_PRECISION, IS_FP8, PAIRS, USE_ASM)
    # An int8 pool's scales (compiled away for others); int32 offsets (a layer's scales are far fewer than
    # 2^31): cheaper than the pool's int64 ones.
    scale_ptrs = page.to(tl.int32) * stride_sb + (offs_n % BLOCK_SIZE) * stride_st + kv_head
    s = scale_scores(s, k_scale_ptr, scale_ptrs, n_mask, sm_scale, softcap, qk_scale, USE_SOFTCAP, IS_INT8)
    return s, kv_ptrs, kv_mask, scale_ptrs, n_mask


@triton.jit
def accumulate_tile(
    s, m_i, l_i, acc, v_cache_ptr, kv_ptrs, cols, kv_mask, v_scale_ptr, scale_ptrs, key_mask,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr, IS_INT8: tl.constexpr,
    PAIRS: tl.constexpr, USE_ASM: tl.constexpr,
):
    """The online softmax's step over a tile of keys, from their masked scores s: (acc, m_i, l_i) with their values
    added (pointers as in tile_scores and scale_scores). DOT_DTYPE: the query's, which the plain path's dot takes."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IS_INT8:  # sum p (v * scale) = sum (p * scale) v: each value row's scale goes on its weights
        v_scales = tl.load(v_scale_ptr + scale_ptrs, mask=key_mask, other=0.0)
        if PAIRS:  # float16 weights, times V_WEIGHT_GAIN (kernels.kv_widen) and saturated
            p = tl.minimum(p * (v_scales * V_WEIGHT_GAIN)[None, :], 65504.0)
        else:
            p = p * v_scales[None, :]
    if PAIRS:  # p @ v: its even and its odd columns
        v_e, v_o = widen_pairs(tl.load(v_cache_ptr + kv_ptrs[:, None] + cols[None, :], mask=kv_mask, other=0.0),
                               IS_FP8, USE_ASM)
        p = p.to(tl.float16)
        acc = (acc[0] * alpha[:, None] + tl.dot(p, v_e), acc[1] * alpha[:, None] + tl.dot(p, v_o))
    else:
        v = tl.load(v_cache_ptr + kv_ptrs[:, None] + cols[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def attention_output(acc, l_i, v_scale_ptr, IS_FP8: tl.constexpr, IS_INT8: tl.constexpr, PAIRS: tl.constexpr):
    """The output rows (float32) from the accumulator and the softmax's sums; a row without keys is 0."""
    if PAIRS:  # the columns back in order: 2j even, 2j + 1 odd
        acc_e, acc_o = acc
        acc = tl.reshape(tl.join(acc_e, acc_o), (acc_e.shape[0], 2 * acc_e.shape[1]))
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if IS_INT8 and PAIRS:
        out = out * (1.0 / V_WEIGHT_GAIN)
    if IS_FP8:  # sum p (v * v_scale) = v_scale * sum p v
        out = out * tl.load(v_scale_ptr)
    return out


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
