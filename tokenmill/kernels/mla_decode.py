"""Multi-head latent attention (MLA, absorbed form) over the latent KV cache: decode, verify steps, and the prefill
chunks that attention.mla_split keeps absorbed (short ones after a long prefix; the others run expanded).

The cache holds one row per token, [c_kv | k_pe] (kv_lora_rank + qk_rope_head_dim wide, 512 + 64 for the
released DeepSeek models), in a [num_blocks, block_size, latent_dim] pool: no separate V, since V is the
c_kv part of the same row. Each query head's query is [W_UK^T q_nope | q_pe] in the same space, and every
head attends to the one latent row per token (multi-query attention), so the output is the attention-weighted
sum of c_kv, [num_tokens, num_heads, kv_lora_rank] (W_UV and o_proj follow in the model).

One program takes BLOCK_T query tokens of one request and BLOCK_H of its heads: the tile's rows are the
(token, head) pairs, the M dimension of both dots, so every latent page is read once for all of them. The
row's c_kv part and k_pe part are separate tiles (512 and 64 wide, instead of one 576 padded to 1024), and
the c_kv tile is both K (scores = q_nope . c_kv^T + q_pe . k_pe^T) and V (acc += p . c_kv).
The latent loads are software-pipelined (num_stages - 1 tiles in flight per program), which is what makes
the kernel bandwidth-bound: the block table's entries are loaded a tile ahead by hand for that (see the loop).
- decode (one query token per request): BLOCK_T = 1, and the context may be split over programs
  (flash-decoding): each split writes its partial output and log-sum-exp and counts itself in on an arrival
  counter (kernels.arrivals) of its (token, head tile); the last to arrive combines them, in the same launch
  (as kernels.decode_attention does: a second launch would cost a few µs per layer). The split count depends
  on the batch shape only, so a CUDA graph captured for a batch size stays valid for any length.
- prefill chunks after a cached prefix, and speculative verification (1 + k tokens): BLOCK_T > 1, each
  row causal at its own position, no split.
An fp8 pool is widened in registers: the layer's k_scale multiplies the scores and the output (K and V are the
same stored values, so V's scale is k_scale too).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.arrivals import arrival_counters
from tokenmill.kernels.fused_moe import CONFIG_DIR, config_path, nearest_bucket
from tokenmill.kernels.kv_fp8 import is_fp8
from tokenmill.kernels.prefill_attention import dot_precision

MAX_SPLITS = 16


# num_splits and the block table's width change with the batch: one compiled variant for all their values.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _mla_attention_kernel(
    q_ptr, cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, arrivals_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, req_ids_ptr, k_scale_ptr,
    sm_scale, num_splits, num_heads, head_blocks, latent_dim, rope_dim,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_bt,
    LATENT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr,
):
    idx = tl.program_id(0)
    head_block = tl.program_id(1) % head_blocks
    tile = tl.num_programs(1) // head_blocks - 1 - tl.program_id(1) // head_blocks  # the heaviest tiles first
    split = tl.program_id(2)
    req = tl.load(req_ids_ptr + idx).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if tile * BLOCK_T >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    ROWS: tl.constexpr = BLOCK_T * BLOCK_H
    offs_r = tl.arange(0, ROWS)
    offs_t = tile * BLOCK_T + offs_r // BLOCK_H  # each row's query token, within the request
    heads = head_block * BLOCK_H + offs_r % BLOCK_H
    r_mask = (offs_t < q_len) & (heads < num_heads)
    tokens = (q_start + offs_t).to(tl.int64)
    # c_kv in two halves of columns: with k_pe, three independent chains of MMAs for the scores (an MMA waits for
    # the one before on its accumulator: one 576-deep chain, 36 MMAs, was the loop's critical path; now 16), and
    # two accumulators of the output.
    HALF: tl.constexpr = LATENT_PAD // 2
    offs_c = tl.arange(0, HALF)
    offs_p = tl.arange(0, ROPE_PAD)
    lo_mask = offs_c < latent_dim
    hi_mask = HALF + offs_c < latent_dim
    p_mask = offs_p < rope_dim
    q_rows = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
    q_lo = tl.load(q_rows + offs_c[None, :], mask=r_mask[:, None] & lo_mask[None, :], other=0.0)
    q_hi = tl.load(q_rows + HALF + offs_c[None, :], mask=r_mask[:, None] & hi_mask[None, :], other=0.0)
    q_pe = tl.load(q_rows + latent_dim + offs_p[None, :], mask=r_mask[:, None] & p_mask[None, :], other=0.0)
    if IS_FP8:  # q . (k * k_scale) = (q . k) * k_scale
        sm_scale = sm_scale * tl.load(k_scale_ptr)
    qk_scale = sm_scale * 1.4426950408889634

    # Keys up to the tile's last token (causal); this split's whole number of BLOCK_N tiles of them.
    kv_end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_T)
    chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(kv_end, start + chunk)
    last_key = context_len + offs_t  # each row's causal limit (inclusive)
    block_row = block_table_ptr + req * stride_bt

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc_lo = tl.zeros([ROWS, HALF], tl.float32)
    acc_hi = tl.zeros([ROWS, HALF], tl.float32)
    # The block table's entries for a tile are loaded one tile ahead, by hand: loaded in the tile's own step,
    # they make the latent loads indirect, which Triton's pipeliner spreads its stages over (triton 3.6, sm_90:
    # num_stages 4 kept a single c_kv buffer, each step waiting for its own load; now num_stages - 1 buffers).
    offs_b = tl.arange(0, BLOCK_N)
    page = tl.load(block_row + (start + offs_b) // BLOCK_SIZE, mask=start + offs_b < end, other=0)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_b
        n_mask = offs_n < end
        rows = cache_ptr + page.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct
        page = tl.load(block_row + (offs_n + BLOCK_N) // BLOCK_SIZE, mask=offs_n + BLOCK_N < end, other=0)
        # Masked rows read as 0: a never-written slot may hold NaN, and 0 * NaN would poison the output.
        c_lo = tl.load(rows[:, None] + offs_c[None, :], mask=n_mask[:, None] & lo_mask[None, :],
                       other=0.0).to(q_lo.dtype)
        c_hi = tl.load(rows[:, None] + HALF + offs_c[None, :], mask=n_mask[:, None] & hi_mask[None, :],
                       other=0.0).to(q_lo.dtype)
        k_pe = tl.load(rows[:, None] + latent_dim + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :],
                       other=0.0).to(q_pe.dtype)
        # Three independent chains, each scaled before the sum: Triton folds dot(a, b) + s into dot(a, b, s).
        s = (tl.dot(q_lo, tl.trans(c_lo), input_precision=DOT_PRECISION) * qk_scale
             + tl.dot(q_hi, tl.trans(c_hi), input_precision=DOT_PRECISION) * qk_scale
             + tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION) * qk_scale)
        visible = n_mask[None, :]
        if BLOCK_T > 1:
            visible = visible & (offs_n[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(c_lo.dtype)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(p, c_lo, input_precision=DOT_PRECISION)
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, c_hi, input_precision=DOT_PRECISION)
        m_i = m_new

    norm = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
    if IS_FP8:  # sum p (v * k_scale) = k_scale * sum p v: V is the stored K
        norm = norm * tl.load(k_scale_ptr)
    out_lo = acc_lo * norm[:, None]
    out_hi = acc_hi * norm[:, None]
    mask_lo = r_mask[:, None] & lo_mask[None, :]
    mask_hi = r_mask[:, None] & hi_mask[None, :]
    if IS_SPLIT:  # BLOCK_T = 1: the rows are one token's heads
        # part_out [num_decodes, num_heads, num_splits, LATENT_PAD], part_lse [num_decodes, num_heads, num_splits]
        part = (idx * num_heads + heads) * num_splits + split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=r_mask)
        part_row = part_out_ptr + part[:, None] * LATENT_PAD + offs_c[None, :]
        tl.store(part_row, out_lo, mask=mask_lo)
        tl.store(part_row + HALF, out_hi, mask=mask_hi)
        # Every split arrives, an empty one too. The barrier puts every warp's stores before the atomic, whose
        # release (acq_rel, gpu scope) publishes them; the last arrival's acquire makes them all visible to it.
        tl.debug_barrier()
        arrival = arrivals_ptr + idx * head_blocks + head_block
        if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            _combine_splits(out_ptr + q_start.to(tl.int64) * stride_ot, stride_oh, part_out_ptr, part_lse_ptr,
                            heads, (idx * num_heads + heads) * num_splits, r_mask, num_splits, latent_dim,
                            BLOCK_H, LATENT_PAD)
            tl.store(arrival, 0)  # every split has arrived: the counter is ready for the next launch
    else:
        out_row = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_c[None, :]
        tl.store(out_row, out_lo.to(out_ptr.dtype.element_ty), mask=mask_lo)
        tl.store(out_row + HALF, out_hi.to(out_ptr.dtype.element_ty), mask=mask_hi)


@triton.jit
def _combine_splits(out_row_ptr, stride_oh, part_out_ptr, part_lse_ptr, heads, parts, h_mask, num_splits,
                    latent_dim, BLOCK_H: tl.constexpr, LATENT_PAD: tl.constexpr):
    """One token's BLOCK_H `heads` (`parts`: each head's first split): each split's partial output weighted by
    exp2(lse - max lse), over the weights' sum. The loads are .cg (L2, not L1): other programs of this launch
    stored them."""
    offs_c = tl.arange(0, LATENT_PAD)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in range(num_splits):
        m = tl.maximum(m, tl.load(part_lse_ptr + parts + split, mask=h_mask, other=float("-inf"),
                                  cache_modifier=".cg"))
    m = tl.where(m == float("-inf"), 0.0, m)  # no context at all: every weight 0, the output 0
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT_PAD], tl.float32)
    for split in range(num_splits):
        w = tl.exp2(tl.load(part_lse_ptr + parts + split, mask=h_mask, other=float("-inf"), cache_modifier=".cg") - m)
        acc += w[:, None] * tl.load(part_out_ptr + (parts + split)[:, None] * LATENT_PAD + offs_c[None, :],
                                    mask=h_mask[:, None], other=0.0, cache_modifier=".cg")
        total += w
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_row_ptr + heads[:, None] * stride_oh + offs_c[None, :], out.to(out_row_ptr.dtype.element_ty),
             mask=h_mask[:, None] & (offs_c[None, :] < latent_dim))


@functools.cache
def _num_sms(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["multiprocessor_count"]


DecodeTiles = tuple[int, int, int, int]  # BLOCK_H, BLOCK_N, num_warps, num_stages


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles, and how many programs per SM the split count aims at (so the grid fills whole waves: the
    resident programs per SM follow from the tiles' registers and shared memory)."""

    tiles: DecodeTiles
    programs_per_sm: float

    def to_json(self) -> dict:
        return {"tiles": list(self.tiles), "programs_per_sm": self.programs_per_sm}

    @classmethod
    def from_json(cls, data: dict) -> DecodeConfig:
        return cls(tuple(map(int, data["tiles"])), float(data["programs_per_sm"]))


def decode_shape_key(num_heads: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """bfloat16 and float16 share their tiles; an fp8 cache apart (half the bytes per tile)."""
    return f"H={num_heads},{dtype.itemsize * 8}bit" + (",e4m3" if is_fp8(cache_dtype) else "")


def decode_config_path(device_name: str, directory: Path = CONFIG_DIR) -> Path:
    return config_path(device_name, directory, kind="mla_decode")


def load_decode_configs(path: Path) -> dict[str, dict[int, DecodeConfig]]:
    """shape_key -> {batch: config}, as benchmarks/mla_decode.py --out writes them; {} without the file."""
    if not path.exists():
        return {}
    return {key: {int(batch): DecodeConfig.from_json(c) for batch, c in buckets.items()}
            for key, buckets in json.loads(path.read_text())["configs"].items()}


@functools.cache
def _tuned_decode_configs(device_name: str) -> dict[str, dict[int, DecodeConfig]]:
    return load_decode_configs(decode_config_path(device_name))


def default_decode_config(num_heads: int, dtype: torch.dtype) -> DecodeConfig:
    """Compiled for sm_90 at the real sizes (an AOT triton.compile, ptxas): 16 heads with (16, 32, 8, 3) take 128
    registers a thread and 91 KB of shared memory (two c_kv tiles: one in flight while one is used), so two
    programs per SM; V3's 128 heads take 4 programs of 32 heads, which read the same pages (mostly from L2), 168
    registers and 110 KB: one per SM. float32 (ieee dots, no tensor cores) keeps its tiles small (195 registers,
    72 KB). benchmarks/mla_decode.py sweeps the alternatives and writes the H200's table."""
    if dtype == torch.float32:
        return DecodeConfig((16, 16, 4, 1), 2.0)
    return DecodeConfig((32, 32, 8, 3), 1.0) if num_heads > 16 else DecodeConfig((16, 32, 8, 3), 2.0)


@functools.cache  # every MLA layer of every eager step asks: the same few questions
def decode_config(num_heads: int, dtype: torch.dtype, cache_dtype: torch.dtype, num_decodes: int,
                  device: torch.device) -> DecodeConfig:
    """The tuned config of the batch nearest num_decodes (log scale), else default_decode_config."""
    if device.type != "cuda":  # the interpreter
        return default_decode_config(num_heads, dtype)
    buckets = _tuned_decode_configs(torch.cuda.get_device_name(device)).get(
        decode_shape_key(num_heads, dtype, cache_dtype))
    return nearest_bucket(buckets, num_decodes) if buckets else default_decode_config(num_heads, dtype)


def splits_for(programs: int, slots: float) -> int:
    """As many splits of each of `programs` as fit in `slots` resident programs (rounded down: a partial
    extra wave would leave most SMs idle while it runs), 1 to MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, math.floor(slots / max(1, programs) + 1e-6)))


def choose_num_splits(num_decodes: int, head_blocks: int, device: torch.device, programs_per_sm: float) -> int:
    """A function of the batch shape only, so a CUDA graph captured for a batch size stays valid for any length."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return splits_for(num_decodes * head_blocks, programs_per_sm * sms)


def prefill_config(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_N, num_warps, num_stages) for several query tokens per request."""
    if dtype == torch.float32:
        return 1, 16, 16, 4, 1
    return 2, 16, 32, 8, 2


def latent_pad(latent_dim: int) -> int:
    """c_kv's columns padded: a power of 2, two halves of at least 16 (tl.dot's least K and N)."""
    return max(32, triton.next_power_of_2(latent_dim))


def _launch(query, cache, out, query_start_loc, seq_lens, block_table, req_ids, scale, k_scale, grid_t,
            num_splits, splits, block_t, block_h, block_n, num_warps, num_stages, latent_dim):
    """splits: (part_out, part_lse, arrivals) when num_splits > 1."""
    num_heads, width = query.shape[1], query.shape[2]
    head_blocks = triton.cdiv(num_heads, block_h)
    part_out, part_lse, arrivals = splits or (out, out, out)  # unused without splits
    _mla_attention_kernel[(req_ids.numel(), grid_t * head_blocks, num_splits)](
        query, cache, out, part_out, part_lse, arrivals,
        query_start_loc, seq_lens, block_table, req_ids, k_scale,
        scale, num_splits, num_heads, head_blocks, latent_dim, width - latent_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
        block_table.stride(0),
        LATENT_PAD=latent_pad(latent_dim),
        ROPE_PAD=max(16, triton.next_power_of_2(width - latent_dim)), BLOCK_SIZE=cache.shape[1],
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_N=block_n,
        IS_SPLIT=num_splits > 1, DOT_PRECISION=dot_precision(query.dtype), IS_FP8=is_fp8(cache.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )


def _check(query: torch.Tensor, cache: torch.Tensor, out: torch.Tensor, k_scale: torch.Tensor | None):
    assert cache.dim() == 3 and query.shape[2] == cache.shape[2] and cache.stride(2) == 1, (query.shape, cache.shape)
    assert out.shape[:2] == query.shape[:2] and out.stride(2) == 1
    if is_fp8(cache.dtype) and k_scale is None:
        raise ValueError("an fp8 latent cache needs its k_scale")
    return query if query.stride(2) == 1 else query.contiguous()


def mla_decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, latent_dim + rope_dim]: [W_UK^T q_nope | q_pe]
    cache: torch.Tensor,  # [num_blocks, block_size, latent_dim + rope_dim]: [c_kv | k_pe] per token
    out: torch.Tensor,  # [num_tokens, num_heads, latent_dim]; the rows of the requests in req_ids are written
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    req_ids: torch.Tensor,  # [num_decodes] int32: requests with exactly one query token
    scale: float,
    k_scale: torch.Tensor | None = None,  # [] float32: an fp8 cache's scale, unused otherwise
    num_splits: int | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> None:
    """config: (BLOCK_H, BLOCK_N, num_warps, num_stages), to override the tuned choice (benchmarks)."""
    num_decodes = req_ids.numel()
    if num_decodes == 0:
        return
    query = _check(query, cache, out, k_scale)
    num_heads, latent_dim = query.shape[1], out.shape[2]
    tuned = decode_config(num_heads, query.dtype, cache.dtype, num_decodes, query.device)
    block_h, block_n, num_warps, num_stages = config or tuned.tiles
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(num_decodes, head_blocks, query.device, tuned.programs_per_sm)
    assert 1 <= num_splits <= MAX_SPLITS and block_h >= 16
    splits = None
    if num_splits > 1:
        splits = (torch.empty((num_decodes, num_heads, num_splits, latent_pad(latent_dim)), dtype=torch.float32,
                              device=query.device),
                  torch.empty((num_decodes, num_heads, num_splits), dtype=torch.float32, device=query.device),
                  arrival_counters(query.device, num_decodes * head_blocks))
    _launch(query, cache, out, query_start_loc, seq_lens, block_table, req_ids, scale,
            cache if k_scale is None else k_scale, 1, num_splits, splits, 1, block_h, block_n,
            num_warps, num_stages, latent_dim)


def mla_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, latent_dim + rope_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, latent_dim + rope_dim]
    out: torch.Tensor,  # [num_tokens, num_heads, latent_dim]; the rows of the requests in req_ids are written
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    req_ids: torch.Tensor,  # [num_prefills] int32: requests with several query tokens
    max_query_len: int,  # host side: the grid's extent (no device sync)
    scale: float,
    k_scale: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> None:
    """Causal attention of each request's new tokens over its cached prefix and themselves (a prefill chunk,
    or the 1 + k tokens of speculative verification). config: (BLOCK_T, BLOCK_H, BLOCK_N, num_warps,
    num_stages)."""
    if req_ids.numel() == 0 or max_query_len == 0:
        return
    query = _check(query, cache, out, k_scale)
    block_t, block_h, block_n, num_warps, num_stages = config or prefill_config(query.dtype)
    _launch(query, cache, out, query_start_loc, seq_lens, block_table, req_ids, scale,
            cache if k_scale is None else k_scale, triton.cdiv(max_query_len, block_t), 1, None,
            block_t, block_h, block_n, num_warps, num_stages, out.shape[2])


def mla_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, latent_dim + rope_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, latent_dim + rope_dim]
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    scale: float,
    latent_dim: int,
    k_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:  # [num_tokens, num_heads, latent_dim]
    """Dense per-request causal attention in `dtype` (float64 by default), V the c_kv part of each cached row."""
    block_size = cache.shape[1]
    out = torch.zeros((*query.shape[:2], latent_dim), dtype=dtype, device=query.device)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end == start:
            continue
        blocks = block_table[i, : math.ceil(seq_len / block_size)].long()
        kv = cache[blocks].reshape(-1, cache.shape[2])[:seq_len].to(dtype)  # [seq_len, latent_dim + rope_dim]
        if is_fp8(cache.dtype):
            kv = kv * k_scale.to(dtype)
        scores = torch.einsum("qhd,kd->hqk", query[start:end].to(dtype), kv) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~mask, float("-inf"))
        out[start:end] = torch.einsum("hqk,kd->qhd", torch.softmax(scores, dim=-1), kv[:, :latent_dim])
    return out


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
