"""Fused mixture-of-experts MLP at decode (T <= 4 tokens): each (token, expert) assignment a GEMV on the CUDA cores.

At one token the grouped GEMM of kernels.fused_moe pads each of the 8 assignments to a 16-row tensor-core tile
and spends launches on sorting them; here every program takes its assignments straight from topk_ids:

1. Gate/up: a program owns one assignment and BLOCK_N intermediate features, reads the gate and the up rows
   of those features (both halves of w13) and writes silu(gate) * up: [T*K, I] in the activations' dtype.
   Assignments vary fastest across programs, so the tokens that chose the same expert read the same weight
   tile at about the same time and all but the first find it in L2.
2. Down: a program owns one token and BLOCK_N output features, and reads the tiles of all its K experts at
   once ([BLOCK_N, K, BLOCK_K]: contiguous along I within each expert). Each assignment's sum takes its
   routing weight, and the K weighted sums are added in registers: the top-k sum needs no atomics and no
   third launch, and a run gives the same bits every time. With SPLIT_K > 1 the intermediate features are
   split over as many programs, whose partials the last of them to finish adds in a fixed order.

Both loops keep their sums per thread (each thread's 16 bytes of weights a step, no shuffle or barrier in the
loop; the sums across threads once at the end), and with PREFETCH load the next K-tile before the math of
this one, by hand (Triton pipelines only the loads that feed tl.dot): two steps of weights in flight.

A token's arithmetic does not depend on the other tokens or on T (one config per shape for every T <= 4), so
the result of a token is the same at T = 1..4; it differs in rounding from the grouped GEMM's (the float32
tests that need batch invariance keep that path: this one is for 16-bit activations only).
E4m3 experts (W8A16, as kernels.fused_moe) are widened in registers, each scale block's partial sums scaled.
Tiles per shape come from configs/fused_moe_decode_<device>.json (benchmarks/fused_moe.py --decode), else
`default_decode_config`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.fused_moe import (
    CONFIG_DIR,
    _check,
    _scale_rows,
    config_path,
    fused_experts,
    shape_key,
)

DECODE_MAX_TOKENS = 4
DECODE_MAX_TOP_K = 16  # the down kernel holds all K experts' tiles of a token at once


@triton.jit
def _group_dots(w, x, s_ptrs, start, row_mask, k_end, stride_sk, offs_g, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                SCALE_BLOCK: tl.constexpr):
    """[R, G]: w [R, G, VEC] (R rows) times x (broadcast to it) summed within each group of VEC features of the K-tile
    at `start` (G = BLOCK_K // VEC). A group is one thread's 16 bytes of weights, so the sum stays in the thread:
    the sums across threads wait for the end of the loop instead of costing shuffles (and, where warps share a
    row, a barrier) every step. With scale blocks (SCALE_BLOCK > 0; s_ptrs [R]: each row's scale row) each
    group takes its block's scale: once per tile if the tile lies in one block, else gathered per group."""
    dots = tl.sum(w.to(tl.float32) * x, axis=2)
    if SCALE_BLOCK == 0:
        return dots
    elif BLOCK_K <= SCALE_BLOCK:
        return dots * tl.load(s_ptrs + (start // SCALE_BLOCK) * stride_sk, mask=row_mask, other=0.0)[:, None]
    else:
        blocks = (start + offs_g * VEC) // SCALE_BLOCK
        mask = row_mask[:, None] & (blocks * SCALE_BLOCK < k_end)[None, :]
        return dots * tl.load(s_ptrs[:, None] + blocks[None, :] * stride_sk, mask=mask, other=0.0)


@triton.jit
def _gate_up_loads(gate_ptrs, up_ptrs, start, n_mask, offs_k, hidden):
    """The gate and the up tiles [BLOCK_N, G, VEC] of the K-tile at `start` (past `hidden`: all masked off, no
    memory traffic)."""
    w_mask = n_mask[:, None, None] & (offs_k < hidden - start)[None, :, :]
    return tl.load(gate_ptrs + start, mask=w_mask, other=0.0), tl.load(up_ptrs + start, mask=w_mask, other=0.0)


@triton.jit(do_not_specialize=["num_assignments", "top_k"])
def _decode_gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, h_ptr, num_assignments, top_k, num_experts, inter, hidden,
    stride_xm, stride_we, stride_wn, stride_hm, s_ptr, stride_se, stride_sn, stride_sk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, FP8_W: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """h[a, n] = silu(x[token] . gate[expert, n]) * (x[token] . up[expert, n]) for assignment a = token*K + k.
    FP8_W: w is e4m3 with scales s as kernels.fused_moe's (SCALE_BLOCK 0: per row, applied to the sums).
    VEC: weights per 16 bytes. PREFETCH: the next K-tile's weights are loaded before this one's math (by hand:
    Triton pipelines only the loads that feed tl.dot), two steps of weight bytes in flight instead of one."""
    pid = tl.program_id(0)
    a = pid % num_assignments
    pid_n = pid // num_assignments
    expert = tl.load(ids_ptr + a).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):  # another rank's expert (-1): the down kernel skips it too
        return
    token = (a // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_g = tl.arange(0, BLOCK_K // VEC)
    offs_k = offs_g[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [G, VEC]
    # x as the weights' shape (the same address for each row): loaded straight into their layout, not moved
    # there through shared memory (two barriers) every step; the repeats hit L1
    x_ptrs = x_ptr + token * stride_xm + offs_k[None, :, :] + 0 * offs_n[:, None, None]
    gate_ptrs = w_ptr + expert * stride_we + offs_n[:, None, None].to(tl.int64) * stride_wn + offs_k[None, :, :]
    up_ptrs = gate_ptrs + inter * stride_wn  # w13's rows are [gate | up]
    gate_s_ptrs = s_ptr + expert * stride_se + _scale_rows(offs_n, SCALE_BLOCK).to(tl.int64) * stride_sn
    up_s_ptrs = s_ptr + expert * stride_se + _scale_rows(inter + offs_n, SCALE_BLOCK).to(tl.int64) * stride_sn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    if PREFETCH:
        next_gate, next_up = _gate_up_loads(gate_ptrs, up_ptrs, 0, n_mask, offs_k, hidden)
    for start in range(0, hidden, BLOCK_K):
        if PREFETCH:
            gate, up = next_gate, next_up
            next_gate, next_up = _gate_up_loads(gate_ptrs, up_ptrs, start + BLOCK_K, n_mask, offs_k, hidden)
        else:
            gate, up = _gate_up_loads(gate_ptrs, up_ptrs, start, n_mask, offs_k, hidden)
        x = tl.load(x_ptrs + start, mask=(offs_k < hidden - start)[None, :, :], other=0.0).to(tl.float32)
        acc_gate += _group_dots(gate, x, gate_s_ptrs, start, n_mask, hidden, stride_sk, offs_g, BLOCK_K, VEC,
                                SCALE_BLOCK)
        acc_up += _group_dots(up, x, up_s_ptrs, start, n_mask, hidden, stride_sk, offs_g, BLOCK_K, VEC, SCALE_BLOCK)
    gate_sum = tl.sum(acc_gate, axis=1)
    up_sum = tl.sum(acc_up, axis=1)
    if FP8_W and SCALE_BLOCK == 0:  # one scale per row: applied once, to the sums
        gate_sum *= tl.load(gate_s_ptrs, mask=n_mask, other=0.0)
        up_sum *= tl.load(up_s_ptrs, mask=n_mask, other=0.0)
    h = gate_sum / (1.0 + tl.exp(-gate_sum)) * up_sum
    tl.store(h_ptr + a.to(tl.int64) * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_loads(h_ptrs, w_ptrs, start, wn_mask, offs_k, k_end):
    """The K experts' h rows (repeated for each of the BLOCK_N rows) and weight tiles, [BLOCK_N, TOPK_POW2, G, VEC],
    of the K-tile at `start` (past `k_end`: masked off, no memory traffic)."""
    mask = wn_mask[:, :, None, None] & (offs_k < k_end - start)[None, None, :, :]
    return tl.load(h_ptrs + start, mask=mask, other=0.0), tl.load(w_ptrs + start, mask=mask, other=0.0)


@triton.jit
def _split_sum(out_ptrs, part_ptr, count_ptr, out, n_mask, offs_n, token, num_tokens, hidden, split,
               SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store this split's partial [BLOCK_N] (float32); the split that arrives last at the tile's counter adds
    all SPLIT_K partials in split order (the same bits whichever arrives last), stores the sum and resets the
    counter for the next launch."""
    tl.store(part_ptr + (split * num_tokens + token).to(tl.int64) * hidden + offs_n, out, mask=n_mask)
    tl.debug_barrier()  # every warp's partial stored before the counter releases them
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.zeros([BLOCK_N], tl.float32)
        for s in tl.static_range(SPLIT_K):  # .cg: from L2, where the other SMs' partials are
            total += tl.load(part_ptr + (s * num_tokens + token).to(tl.int64) * hidden + offs_n, mask=n_mask,
                             other=0.0, cache_modifier=".cg")
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=n_mask)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["num_tokens", "top_k"])
def _decode_down_kernel(
    h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, num_tokens, top_k, num_experts, hidden, inter,
    stride_hm, stride_we, stride_wn, stride_om, s_ptr, stride_se, stride_sn, stride_sk, part_ptr, count_ptr,
    TOPK_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, FP8_W: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, PREFETCH: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """out[t, n] = sum_k weights[t, k] * (h[t*K + k] . w2[expert_k, n]), the K experts' tiles side by side.
    PREFETCH: as the gate/up kernel's. SPLIT_K > 1: the intermediate features cut into SPLIT_K ranges of whole
    K-tiles, each summed by its own program into part [SPLIT_K, T, H] float32 and added in a fixed order by
    _split_sum (count: an int32 per (BLOCK_N, token) tile, zero between launches): more programs with fewer
    steps each for a small T, and a token's bits still independent of T."""
    pid = tl.program_id(0)
    token = pid % num_tokens
    split = (pid // num_tokens) % SPLIT_K
    pid_n = pid // (num_tokens * SPLIT_K)
    slots = tl.arange(0, TOPK_POW2)
    rows = token * top_k + slots  # the token's assignments
    experts = tl.load(ids_ptr + rows, mask=slots < top_k, other=-1).to(tl.int64)
    valid = (experts >= 0) & (experts < num_experts)  # -1: another rank's expert, h's row never written
    experts = tl.where(valid, experts, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_g = tl.arange(0, BLOCK_K // VEC)
    offs_k = offs_g[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [G, VEC]
    # h as the weights' shape, as the gate/up kernel loads x: [BLOCK_N, TOPK_POW2, G, VEC]
    h_ptrs = (h_ptr + rows[None, :, None, None].to(tl.int64) * stride_hm + offs_k[None, None, :, :]
              + 0 * offs_n[:, None, None, None])
    w_ptrs = (w_ptr + experts[None, :, None, None] * stride_we + offs_n[:, None, None, None].to(tl.int64) * stride_wn
              + offs_k[None, None, :, :])  # [BLOCK_N, TOPK_POW2, G, VEC]
    wn_mask = n_mask[:, None] & valid[None, :]
    s_ptrs = s_ptr + experts[None, :] * stride_se + _scale_rows(offs_n, SCALE_BLOCK)[:, None].to(tl.int64) * stride_sn
    if SPLIT_K == 1:
        k_begin = 0
        k_end = inter
    else:
        k_split = tl.cdiv(tl.cdiv(inter, SPLIT_K), BLOCK_K) * BLOCK_K
        k_begin = split * k_split
        k_end = tl.minimum(inter, k_begin + k_split)
    acc = tl.zeros([BLOCK_N * TOPK_POW2, BLOCK_K // VEC], tl.float32)  # (row, expert) pairs as the rows
    if PREFETCH:
        next_h, next_w = _down_loads(h_ptrs, w_ptrs, k_begin, wn_mask, offs_k, k_end)
    for start in range(k_begin, k_end, BLOCK_K):
        if PREFETCH:
            h, w = next_h, next_w
            next_h, next_w = _down_loads(h_ptrs, w_ptrs, start + BLOCK_K, wn_mask, offs_k, k_end)
        else:
            h, w = _down_loads(h_ptrs, w_ptrs, start, wn_mask, offs_k, k_end)
        prod_w = tl.reshape(w.to(tl.float32) * h.to(tl.float32),
                            [BLOCK_N * TOPK_POW2, BLOCK_K // VEC, VEC])
        acc += _group_dots(prod_w, 1.0, tl.reshape(s_ptrs, [BLOCK_N * TOPK_POW2]), start,
                           tl.reshape(wn_mask, [BLOCK_N * TOPK_POW2]), inter, stride_sk, offs_g, BLOCK_K, VEC,
                           SCALE_BLOCK)
    acc = tl.reshape(tl.sum(acc, axis=1), [BLOCK_N, TOPK_POW2])
    if FP8_W and SCALE_BLOCK == 0:
        acc *= tl.load(s_ptrs, mask=wn_mask, other=0.0)
    routing = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    out = tl.sum(acc * routing[None, :], axis=1)
    out_ptrs = out_ptr + token.to(tl.int64) * stride_om + offs_n
    if SPLIT_K == 1:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        _split_sum(out_ptrs, part_ptr, count_ptr + pid_n * num_tokens + token, out, n_mask, offs_n, token,
                   num_tokens, hidden, split, SPLIT_K, BLOCK_N)


# ---------------------------------------------------------------------------------------------- configs

class GemvTiles(NamedTuple):
    """One GEMV launch's tiles; a JSON list, the last two fields optional (files written before they existed)."""
    block_n: int
    block_k: int  # the down kernel's is per expert: the tile read per step is BLOCK_N x K x BLOCK_K
    num_warps: int
    num_stages: int  # passed on; Triton pipelines only the loads that feed tl.dot, so little effect here
    prefetch: int = 0  # 1: the next K-tile's weights loaded before this one's math (PREFETCH)
    split_k: int = 1  # the down kernel's SPLIT_K (gate/up: 1)


@dataclass(frozen=True)
class DecodeConfig:
    gate_up: GemvTiles
    down: GemvTiles

    def __post_init__(self):  # plain tuples / lists accepted
        object.__setattr__(self, "gate_up", GemvTiles(*map(int, self.gate_up)))
        object.__setattr__(self, "down", GemvTiles(*map(int, self.down)))
        if self.gate_up.split_k != 1:
            raise ValueError(f"the gate/up GEMV does not split K: {self.gate_up}")

    def to_json(self) -> dict:
        return {"gate_up": list(self.gate_up), "down": list(self.down)}

    @classmethod
    def from_json(cls, data: dict) -> DecodeConfig:
        return cls(data["gate_up"], data["down"])


def decode_config_path(device_name: str, directory: Path = CONFIG_DIR) -> Path:
    """fused_moe_decode_<device>.json, next to the grouped GEMM's fused_moe_<device>.json."""
    return config_path(device_name, directory, kind="fused_moe_decode")


def load_decode_configs(path: Path) -> dict[str, DecodeConfig]:
    """shape_key -> config, as benchmarks/fused_moe.py --decode writes them; {} without the file."""
    if not path.exists():
        return {}
    return {key: DecodeConfig.from_json(c) for key, c in json.loads(path.read_text())["configs"].items()}


@functools.cache
def _tuned_decode_configs(device_name: str) -> dict[str, DecodeConfig]:
    return load_decode_configs(decode_config_path(device_name))


def default_decode_config(top_k: int) -> DecodeConfig:
    """Wide K-tiles, the next one prefetched: a program keeps two steps of weights in flight (gate/up: 2 x 16
    KB of 16-bit weights; down: 2 x 8 KB, its tile spanning the K experts)."""
    return DecodeConfig((4, 1024, 4, 3, 1), (4, max(32, 1024 // triton.next_power_of_2(top_k)), 8, 3, 1))


def decode_shape_key(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, scale_block: int | None) -> str:
    """The grouped GEMMs' shape_key; e4m3 experts (scale_block not None: 0 per row, else the block) apart."""
    key = shape_key(num_experts, hidden, inter, dtype)
    return key if scale_block is None else f"{key},e4m3,block={scale_block}"


@functools.cache
def get_decode_config(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                      scale_block: int | None, device: torch.device) -> DecodeConfig:
    """The tuned config of the shape (scale_block: as decode_shape_key's), else default_decode_config."""
    if device.type != "cuda":  # the interpreter
        return default_decode_config(top_k)
    tuned = _tuned_decode_configs(torch.cuda.get_device_name(device))
    return tuned.get(decode_shape_key(num_experts, hidden, inter, dtype, scale_block)) or default_decode_config(top_k)


# ---------------------------------------------------------------------------------------------- wrapper


def _scale_args(w: torch.Tensor, scale: torch.Tensor | None, scale_block: int):
    """The kernels' scale pointer and strides (the weight as an unused pointer when 16-bit), FP8_W and
    SCALE_BLOCK. Unlike the grouped GEMMs, any BLOCK_K goes with any scale block (see _group_dots)."""
    if scale is None:
        return (w, 0, 0, 0), False, 0
    return (scale, *scale.stride()), True, scale_block


def _vec(w: torch.Tensor, block_k: int) -> int:
    """The kernels' VEC: weights per 16-byte load (a K-tile narrower than that: the whole tile)."""
    return min(block_k, 16 // w.element_size())


_SPLIT_COUNTS: dict[torch.device, torch.Tensor] = {}


def _split_counts(device: torch.device, size: int) -> torch.Tensor:
    """The split-K down kernel's counters (int32, one per output tile), zero between launches: the kernel resets
    each one it uses, so one buffer per device serves every launch, graph replays included (the launches of a
    stream run one after another; the engine runs its layers on one stream)."""
    counts = _SPLIT_COUNTS.get(device)
    if counts is None or counts.numel() < size:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K MoE decode kernel's counters must be allocated before graph capture "
                               "(run the shape once outside it)")
        counts = torch.zeros(max(size, 1 << 14), dtype=torch.int32, device=device)
        _SPLIT_COUNTS[device] = counts
    return counts


def decode_gate_up(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, top_k: int, tiles: GemvTiles,
                   scale: torch.Tensor | None = None, scale_block: int = 0) -> torch.Tensor:
    """[T*K, I] in (token, k) order: silu(x W_gate^T) * (x W_up^T) of each assignment of ids [T*K] (the rows
    of ids -1 unwritten)."""
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    num_assignments = ids.numel()
    h = torch.empty((num_assignments, inter), dtype=x.dtype, device=x.device)
    tiles = GemvTiles(*tiles)
    scale_args, fp8, scale_block = _scale_args(w13, scale, scale_block)
    _decode_gate_up_kernel[(num_assignments * triton.cdiv(inter, tiles.block_n),)](
        x, w13, ids, h, num_assignments, top_k, num_experts, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), *scale_args,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, VEC=_vec(w13, tiles.block_k), FP8_W=fp8,
        SCALE_BLOCK=scale_block, PREFETCH=bool(tiles.prefetch), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return h


def decode_down(h: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, top_k: int,
                tiles: GemvTiles, scale: torch.Tensor | None = None, scale_block: int = 0) -> torch.Tensor:
    """[T, H]: each token's sum over its K assignments of weight * (h W2^T) (weights [T*K] float32)."""
    num_experts, hidden, inter = w2.shape
    num_tokens = ids.numel() // top_k
    out = torch.empty((num_tokens, hidden), dtype=h.dtype, device=h.device)
    tiles = GemvTiles(*tiles)
    scale_args, fp8, scale_block = _scale_args(w2, scale, scale_block)
    n_tiles = num_tokens * triton.cdiv(hidden, tiles.block_n)
    if tiles.split_k > 1:
        part = torch.empty((tiles.split_k, num_tokens, hidden), dtype=torch.float32, device=h.device)
        count = _split_counts(h.device, n_tiles)
    else:  # unused
        part, count = out, ids
    _decode_down_kernel[(n_tiles * tiles.split_k,)](
        h, w2, ids, weights, out, num_tokens, top_k, num_experts, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *scale_args, part, count,
        TOPK_POW2=triton.next_power_of_2(top_k), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        VEC=_vec(w2, tiles.block_k), FP8_W=fp8,
        SCALE_BLOCK=scale_block, PREFETCH=bool(tiles.prefetch), SPLIT_K=tiles.split_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def fused_experts_decode(
    hidden_states: torch.Tensor,  # [T <= 4, H], 16-bit
    w13: torch.Tensor,  # [E, 2I, H]: [gate | up] rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K], each in [0, E) or -1 (another rank's expert: contributes nothing)
    config: DecodeConfig | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: int = 0,
) -> torch.Tensor:
    """[T, H], as kernels.fused_moe.fused_experts (its arguments, ids of -1 always skipped): two launches."""
    _check(hidden_states, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, scale_block)
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if not 0 < num_tokens <= DECODE_MAX_TOKENS or top_k > DECODE_MAX_TOP_K:
        raise ValueError(f"the decode path takes 1..{DECODE_MAX_TOKENS} tokens and top-k <= {DECODE_MAX_TOP_K}, "
                         f"got {num_tokens} tokens, top-{top_k}")
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()  # no copy for parameters
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    cfg = config or get_decode_config(num_experts, hidden, two_inter // 2, top_k, x.dtype,
                                      None if w13_scale is None else scale_block, x.device)
    h = decode_gate_up(x, w13, ids, top_k, cfg.gate_up, w13_scale, scale_block)
    return decode_down(h, w2, ids, weights, top_k, cfg.down, w2_scale, scale_block)


def decode_applies(hidden_states: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """The decode path on CUDA for 1..4 tokens of 16-bit activations (float32 keeps the batch-invariant GEMMs)."""
    return (hidden_states.is_cuda and 0 < hidden_states.shape[0] <= DECODE_MAX_TOKENS
            and hidden_states.dtype in (torch.float16, torch.bfloat16) and topk_ids.shape[-1] <= DECODE_MAX_TOP_K)


def fused_experts_any_size(hidden_states, w13, w2, topk_weights, topk_ids, skip_negative_ids: bool = False,
                           w13_scale=None, w2_scale=None, scale_block: int = 0) -> torch.Tensor:
    """The engine's entry: fused_experts_decode where decode_applies, else kernels.fused_moe.fused_experts."""
    if decode_applies(hidden_states, topk_ids):
        return fused_experts_decode(hidden_states, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                                    w2_scale=w2_scale, scale_block=scale_block)
    return fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, skip_negative_ids=skip_negative_ids,
                         w13_scale=w13_scale, w2_scale=w2_scale, scale_block=scale_block)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
