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
   third launch, and a run gives the same bits every time.

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
def _row_dots(w, x, s_ptrs, start, n_mask, hidden, stride_sk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SCALE_BLOCK: tl.constexpr):
    """[BLOCK_N]: the rows of w [BLOCK_N, BLOCK_K] (float32) dotted with x [BLOCK_K], the K-tile at `start`.
    With scale blocks (SCALE_BLOCK > 0; s_ptrs: each row's scale row) each block's part of a sum takes that
    block's scale: once per tile if the tile lies in one block, else per block of the tile, summed apart (wide
    K-tiles keep fewer steps in each program's loop, which is what keeps the weights streaming)."""
    prod = w * x[None, :]
    if SCALE_BLOCK == 0:
        return tl.sum(prod, axis=1)
    elif BLOCK_K <= SCALE_BLOCK:
        return tl.sum(prod, axis=1) * tl.load(s_ptrs + (start // SCALE_BLOCK) * stride_sk, mask=n_mask, other=0.0)
    else:
        parts = tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // SCALE_BLOCK, SCALE_BLOCK]), axis=2)
        blocks = start // SCALE_BLOCK + tl.arange(0, BLOCK_K // SCALE_BLOCK)
        mask = n_mask[:, None] & (blocks * SCALE_BLOCK < hidden)[None, :]
        scale = tl.load(s_ptrs[:, None] + blocks[None, :] * stride_sk, mask=mask, other=0.0)
        return tl.sum(parts * scale, axis=1)


@triton.jit(do_not_specialize=["num_assignments", "top_k"])
def _decode_gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, h_ptr, num_assignments, top_k, num_experts, inter, hidden,
    stride_xm, stride_we, stride_wn, stride_hm, s_ptr, stride_se, stride_sn, stride_sk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_W: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    """h[a, n] = silu(x[token] . gate[expert, n]) * (x[token] . up[expert, n]) for assignment a = token*K + k.
    FP8_W: w is e4m3 with scales s as kernels.fused_moe's (SCALE_BLOCK 0: per row, applied to the sums)."""
    pid = tl.program_id(0)
    a = pid % num_assignments
    pid_n = pid // num_assignments
    expert = tl.load(ids_ptr + a).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):  # another rank's expert (-1): the down kernel skips it too
        return
    token = (a // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_xm + offs_k
    gate_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + inter * stride_wn  # w13's rows are [gate | up]
    gate_s_ptrs = s_ptr + expert * stride_se + _scale_rows(offs_n, SCALE_BLOCK).to(tl.int64) * stride_sn
    up_s_ptrs = s_ptr + expert * stride_se + _scale_rows(inter + offs_n, SCALE_BLOCK).to(tl.int64) * stride_sn
    acc_gate = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - start
        w_mask = n_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        up = tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        acc_gate += _row_dots(gate, x, gate_s_ptrs, start, n_mask, hidden, stride_sk, BLOCK_N, BLOCK_K, SCALE_BLOCK)
        acc_up += _row_dots(up, x, up_s_ptrs, start, n_mask, hidden, stride_sk, BLOCK_N, BLOCK_K, SCALE_BLOCK)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if FP8_W and SCALE_BLOCK == 0:  # one scale per row: applied once, to the sums
        acc_gate *= tl.load(gate_s_ptrs, mask=n_mask, other=0.0)
        acc_up *= tl.load(up_s_ptrs, mask=n_mask, other=0.0)
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(h_ptr + a.to(tl.int64) * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _expert_dots(prod, s_ptrs, start, wn_mask, inter, stride_sk, BLOCK_N: tl.constexpr, TOPK_POW2: tl.constexpr,
                 BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """[BLOCK_N, TOPK_POW2]: prod [BLOCK_N, TOPK_POW2, BLOCK_K] summed over its K-tile at `start`, scaled as
    _row_dots scales (s_ptrs [BLOCK_N, TOPK_POW2]: each row's scale row in each expert)."""
    if SCALE_BLOCK == 0:
        return tl.sum(prod, axis=2)
    elif BLOCK_K <= SCALE_BLOCK:
        return tl.sum(prod, axis=2) * tl.load(s_ptrs + (start // SCALE_BLOCK) * stride_sk, mask=wn_mask, other=0.0)
    else:
        parts = tl.sum(tl.reshape(prod, [BLOCK_N, TOPK_POW2, BLOCK_K // SCALE_BLOCK, SCALE_BLOCK]), axis=3)
        blocks = start // SCALE_BLOCK + tl.arange(0, BLOCK_K // SCALE_BLOCK)
        mask = wn_mask[:, :, None] & (blocks * SCALE_BLOCK < inter)[None, None, :]
        scale = tl.load(s_ptrs[:, :, None] + blocks[None, None, :] * stride_sk, mask=mask, other=0.0)
        return tl.sum(parts * scale, axis=2)


@triton.jit(do_not_specialize=["num_tokens", "top_k"])
def _decode_down_kernel(
    h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, num_tokens, top_k, num_experts, hidden, inter,
    stride_hm, stride_we, stride_wn, stride_om, s_ptr, stride_se, stride_sn, stride_sk,
    TOPK_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_W: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """out[t, n] = sum_k weights[t, k] * (h[t*K + k] . w2[expert_k, n]), the K experts' tiles side by side."""
    pid = tl.program_id(0)
    token = pid % num_tokens
    pid_n = pid // num_tokens
    slots = tl.arange(0, TOPK_POW2)
    rows = token * top_k + slots  # the token's assignments
    experts = tl.load(ids_ptr + rows, mask=slots < top_k, other=-1).to(tl.int64)
    valid = (experts >= 0) & (experts < num_experts)  # -1: another rank's expert, h's row never written
    experts = tl.where(valid, experts, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_k[None, :]  # [TOPK_POW2, BLOCK_K]
    w_ptrs = (w_ptr + experts[None, :, None] * stride_we + offs_n[:, None, None].to(tl.int64) * stride_wn
              + offs_k[None, None, :])  # [BLOCK_N, TOPK_POW2, BLOCK_K]
    wn_mask = n_mask[:, None] & valid[None, :]
    s_ptrs = s_ptr + experts[None, :] * stride_se + _scale_rows(offs_n, SCALE_BLOCK)[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, TOPK_POW2], tl.float32)
    for start in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - start
        h = tl.load(h_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=wn_mask[:, :, None] & k_mask[None, None, :], other=0.0).to(tl.float32)
        acc += _expert_dots(w * h[None, :, :], s_ptrs, start, wn_mask, inter, stride_sk, BLOCK_N, TOPK_POW2, BLOCK_K,
                            SCALE_BLOCK)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if FP8_W and SCALE_BLOCK == 0:
        acc *= tl.load(s_ptrs, mask=wn_mask, other=0.0)
    routing = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    out = tl.sum(acc * routing[None, :], axis=1)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


# ---------------------------------------------------------------------------------------------- configs

GemvTiles = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages


@dataclass(frozen=True)
class DecodeConfig:
    gate_up: GemvTiles
    down: GemvTiles  # its BLOCK_K is per expert: the tile read per step is BLOCK_N x K x BLOCK_K

    def to_json(self) -> dict:
        return {"gate_up": list(self.gate_up), "down": list(self.down)}

    @classmethod
    def from_json(cls, data: dict) -> DecodeConfig:
        return cls(tuple(map(int, data["gate_up"])), tuple(map(int, data["down"])))


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
    """Wide K-tiles: the loops are not software-pipelined (no tl.dot), so a program has one step's loads in
    flight and the fewer its steps, the more of the weights are in flight at once (gate/up: 32 KB of 16-bit
    weights a step; down: 16 KB, its tile spanning the K experts)."""
    return DecodeConfig((8, 1024, 8, 3), (4, max(32, 2048 // triton.next_power_of_2(top_k)), 8, 3))


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
    SCALE_BLOCK. Unlike the grouped GEMMs, any BLOCK_K goes with any scale block (see _row_dots)."""
    if scale is None:
        return (w, 0, 0, 0), False, 0
    return (scale, *scale.stride()), True, scale_block


def decode_gate_up(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, top_k: int, tiles: GemvTiles,
                   scale: torch.Tensor | None = None, scale_block: int = 0) -> torch.Tensor:
    """[T*K, I] in (token, k) order: silu(x W_gate^T) * (x W_up^T) of each assignment of ids [T*K] (the rows
    of ids -1 unwritten)."""
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    num_assignments = ids.numel()
    h = torch.empty((num_assignments, inter), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = tiles
    scale_args, fp8, scale_block = _scale_args(w13, scale, scale_block)
    _decode_gate_up_kernel[(num_assignments * triton.cdiv(inter, block_n),)](
        x, w13, ids, h, num_assignments, top_k, num_experts, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), *scale_args,
        BLOCK_N=block_n, BLOCK_K=block_k, FP8_W=fp8, SCALE_BLOCK=scale_block, num_warps=warps, num_stages=stages,
    )
    return h


def decode_down(h: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, top_k: int,
                tiles: GemvTiles, scale: torch.Tensor | None = None, scale_block: int = 0) -> torch.Tensor:
    """[T, H]: each token's sum over its K assignments of weight * (h W2^T) (weights [T*K] float32)."""
    num_experts, hidden, inter = w2.shape
    num_tokens = ids.numel() // top_k
    out = torch.empty((num_tokens, hidden), dtype=h.dtype, device=h.device)
    block_n, block_k, warps, stages = tiles
    scale_args, fp8, scale_block = _scale_args(w2, scale, scale_block)
    _decode_down_kernel[(num_tokens * triton.cdiv(hidden, block_n),)](
        h, w2, ids, weights, out, num_tokens, top_k, num_experts, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *scale_args,
        TOPK_POW2=triton.next_power_of_2(top_k), BLOCK_N=block_n, BLOCK_K=block_k, FP8_W=fp8,
        SCALE_BLOCK=scale_block, num_warps=warps, num_stages=stages,
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
