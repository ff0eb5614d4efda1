"""Fused mixture-of-experts MLP: each token through its top-k SiLU-gated experts, summed with the routing weights.

The reference is layers.moe_routing.fused_experts_torch (the CPU path). Four to six launches, none of which reads a
device value on the host, so a CUDA graph captures them at a fixed token count:

1. Alignment (one small kernel up to 128 assignments, three above): the T*K (token, expert) assignments
   sorted by expert, stable, each expert's run padded to a multiple of BLOCK_M with a sentinel, and the
   expert of every BLOCK_M row block. The padded length is only known on the device; the grids cover a
   static bound (max_row_blocks) and the blocks past the real length return at once.
2. Gate/up GEMM: a program owns BLOCK_M sorted rows (one expert) and BLOCK_N intermediate features, gathers
   the token rows, accumulates gate and up side by side and writes silu(gate) * up in sorted order.
3. Down GEMM: reads the intermediate rows contiguously, multiplies the routing weight in, and writes each
   assignment's [H] row at its (token, k) place.
4. A sum over k in torch: deterministic (no atomics: a run gives the same bits every time).

Tiles come per (E, H, I, dtype) and token bucket from configs/fused_moe_<device>.json, written by
benchmarks/fused_moe.py on the GPU; shapes it has no entry for use `default_config`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.prefill_attention import dot_precision

FP8 = torch.float8_e4m3fn
CHUNK = 128  # assignments per program of the alignment kernels
CONFIG_DIR = Path(__file__).parent / "configs"


# ----------------------------------------------------------------------------------------------- alignment


@triton.jit
def _expert_counts(ids, EXPERTS_POW2: tl.constexpr):
    """[EXPERTS_POW2]: how many of `ids` (-1: none) go to each expert."""
    return tl.histogram(ids, EXPERTS_POW2, mask=ids >= 0)


@triton.jit
def _lay_out_runs(totals, starts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_assignments,
                  num_experts, num_blocks, BLOCK_M: tl.constexpr, EXPERTS_POW2: tl.constexpr, ROWS: tl.constexpr):
    """From each expert's count: its run's start (stored), the sentinel in its padding slots,
    the total padded length, and the expert of every row block (-1 past the total)."""
    experts = tl.arange(0, EXPERTS_POW2)
    e_mask = experts < num_experts
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # 0 for the experts past num_experts
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(starts_ptr + experts, starts, mask=e_mask)
    tl.store(num_padded_ptr, total)
    sentinel = tl.full([EXPERTS_POW2, 16], 0, tl.int32) + num_assignments
    for first in tl.static_range(0, BLOCK_M, 16):  # 16 slots of every run at a time: a small register tile
        slot = totals[:, None] + first + tl.arange(0, 16)[None, :]
        where = starts[:, None] + slot
        in_buffer = (where >= 0) & (where < num_blocks * BLOCK_M)  # see _place: counts may be garbage
        tl.store(sorted_ptr + where, sentinel, mask=e_mask[:, None] & (slot < padded[:, None]) & in_buffer)
    for first in range(0, num_blocks, ROWS):
        blocks = first + tl.arange(0, ROWS)
        row = blocks * BLOCK_M
        # The expert whose run holds `row`: the number of runs that end at or before it (empty runs too).
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(row < total, expert, -1), mask=blocks < num_blocks)


@triton.jit
def _place(ids, offs, base, sorted_ptr, mask, num_slots, CHUNK: tl.constexpr):
    """sorted[base + rank among the chunk's earlier assignments to the same expert] = offs: stable. Masked
    assignments (the tail past the last, and those of no expert) have id -1, so they never count in a rank.

    Every store stays inside the num_slots of `sorted`, and the GEMMs check what they read from it: in the
    engine's kernel-recording run (kernels/precompile.py) a kernel that would compile is skipped while those
    already compiled run, so one of these kernels may read another's garbage output."""
    idx = tl.arange(0, CHUNK)
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (idx[None, :] < idx[:, None])).to(tl.int32), axis=1)
    where = base + rank
    tl.store(sorted_ptr + where, offs, mask=mask & (where >= 0) & (where < num_slots))


@triton.jit(do_not_specialize=["num_assignments", "num_blocks"])
def _align_one_chunk_kernel(ids_ptr, starts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                            num_assignments, num_experts, num_blocks, BLOCK_M: tl.constexpr,
                            EXPERTS_POW2: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """The whole alignment in one program, for up to CHUNK assignments (decode: one launch, not three)."""
    offs = tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_assignments, other=-1).to(tl.int32)
    mask = ids >= 0  # -1: no expert on this rank (expert parallelism), placed nowhere
    _lay_out_runs(_expert_counts(ids, EXPERTS_POW2), starts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                  num_assignments, num_experts, num_blocks, BLOCK_M, EXPERTS_POW2, ROWS)
    tl.debug_barrier()  # the starts, stored by other threads of this program, read back per assignment
    _place(ids, offs, tl.load(starts_ptr + ids, mask=mask, other=0), sorted_ptr, mask, num_blocks * BLOCK_M,
           CHUNK)


@triton.jit(do_not_specialize=["num_assignments"])
def _count_kernel(ids_ptr, counts_ptr, num_assignments, num_experts,
                  CHUNK: tl.constexpr, EXPERTS_POW2: tl.constexpr):
    """counts[chunk, e]: how many of this chunk's assignments go to expert e."""
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_assignments, other=-1).to(tl.int32)
    experts = tl.arange(0, EXPERTS_POW2)
    tl.store(counts_ptr + chunk * num_experts + experts, _expert_counts(ids, EXPERTS_POW2),
             mask=experts < num_experts)


@triton.jit(do_not_specialize=["num_assignments", "num_chunks", "num_blocks"])
def _offsets_kernel(counts_ptr, starts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                    num_assignments, num_chunks, num_experts, num_blocks,
                    BLOCK_M: tl.constexpr, EXPERTS_POW2: tl.constexpr, ROWS: tl.constexpr):
    """One program: turns counts into each chunk's exclusive prefix per expert (in place), then lays out
    the runs."""
    experts = tl.arange(0, EXPERTS_POW2)
    e_mask = experts < num_experts
    totals = tl.zeros([EXPERTS_POW2], tl.int32)
    for first in range(0, num_chunks, ROWS):
        rows = first + tl.arange(0, ROWS)
        mask = (rows < num_chunks)[:, None] & e_mask[None, :]
        ptrs = counts_ptr + rows[:, None] * num_experts + experts[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + totals[None, :], mask=mask)
        totals += tl.sum(counts, axis=0)
    _lay_out_runs(totals, starts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_assignments,
                  num_experts, num_blocks, BLOCK_M, EXPERTS_POW2, ROWS)


@triton.jit(do_not_specialize=["num_assignments"])
def _place_kernel(ids_ptr, prefix_ptr, starts_ptr, sorted_ptr, num_assignments, num_experts, num_slots,
                  CHUNK: tl.constexpr):
    """Each chunk's assignments at their expert's start + the earlier chunks' count + their rank."""
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_assignments, other=-1).to(tl.int32)
    mask = ids >= 0  # -1: no expert on this rank (expert parallelism), placed nowhere
    base = tl.load(starts_ptr + ids, mask=mask, other=0)
    base += tl.load(prefix_ptr + chunk * num_experts + ids, mask=mask, other=0)
    _place(ids, offs, base, sorted_ptr, mask, num_slots, CHUNK)


@dataclass
class Alignment:
    sorted_ids: torch.Tensor  # [max_padded] int32: assignment index t*K + k, or T*K in padding slots
    block_expert: torch.Tensor  # [num_blocks] int32: each BLOCK_M row block's expert, -1 past the used length
    num_padded: torch.Tensor  # [1] int32: the used (padded) length
    max_padded: int


def max_row_blocks(num_assignments: int, num_experts: int, block_m: int) -> int:
    """A static bound on the row blocks of the padded runs: sum over experts of cdiv(count, block_m) is at
    most floor(assignments / block_m) + the number of experts with a token. Tighter than
    cdiv(assignments + experts * (block_m - 1), block_m) at decode (1 token, top-8: 8 blocks, not 121), where
    the idle programs of the GEMMs' grids would each reserve their shared memory only to return."""
    return num_assignments // block_m + min(num_experts, num_assignments)


def align_assignments(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the assignments of topk_ids [T, K] by expert, each expert's run padded to a multiple of block_m;
    ids of -1 are left out."""
    ids = topk_ids.reshape(-1)
    num_assignments = ids.numel()
    num_blocks = max_row_blocks(num_assignments, num_experts, block_m)
    max_padded = num_blocks * block_m
    num_chunks = triton.cdiv(num_assignments, CHUNK)
    device = ids.device
    experts_pow2 = triton.next_power_of_2(num_experts)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    warps = 4 if experts_pow2 <= 128 else 8
    if num_chunks == 1:
        _align_one_chunk_kernel[(1,)](ids, starts, sorted_ids, block_expert, num_padded, num_assignments,
                                      num_experts, num_blocks, BLOCK_M=block_m, EXPERTS_POW2=experts_pow2,
                                      ROWS=16, CHUNK=CHUNK, num_warps=warps)
        return Alignment(sorted_ids, block_expert, num_padded, max_padded)
    counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=device)  # [num_chunks, E]
    _count_kernel[(num_chunks,)](ids, counts, num_assignments, num_experts,
                                 CHUNK=CHUNK, EXPERTS_POW2=experts_pow2, num_warps=warps)
    _offsets_kernel[(1,)](counts, starts, sorted_ids, block_expert, num_padded, num_assignments, num_chunks,
                          num_experts, num_blocks, BLOCK_M=block_m, EXPERTS_POW2=experts_pow2, ROWS=16,
                          num_warps=warps)
    _place_kernel[(num_chunks,)](ids, counts, starts, sorted_ids, num_assignments, num_experts, max_padded,
                                 CHUNK=CHUNK, num_warps=warps)
    return Alignment(sorted_ids, block_expert, num_padded, max_padded)


# ------------------------------------------------------------------------------------------------ GEMMs


@triton.jit
def _tile_of(num_blocks, num_n, GROUP_M: tl.constexpr):
    """(row block, column block) of this program, GROUP_M row blocks sweeping the columns together: they
    share the expert's weight tiles in L2."""
    pid = tl.program_id(0)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    size_m = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    return pid_m, pid_n


@triton.jit
def _scale_rows(offs_n, SCALE_BLOCK: tl.constexpr):
    """The scale row of each weight row: its block's (SCALE_BLOCK > 0), else its own."""
    if SCALE_BLOCK > 0:
        return offs_n // SCALE_BLOCK
    else:
        return offs_n


@triton.jit
def _fp8_partial(x, w, scale_ptrs, start, n_mask, stride_sk, SCALE_BLOCK: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """x [M, K] times an e4m3 weight tile [N, K] widened to x's dtype (exact: e4m3 fits in 16 bits); with
    block scales, the K-tile lies in one block and its partial sums take that block's scale per row."""
    part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    if SCALE_BLOCK > 0:
        scale = tl.load(scale_ptrs + (start // SCALE_BLOCK) * stride_sk, mask=n_mask, other=0.0)
        part = part * scale[None, :]
    return part


@triton.jit(do_not_specialize=["num_assignments", "top_k", "num_blocks"])
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_assignments, top_k, num_blocks, num_experts, inter, hidden, stride_xm, stride_we, stride_wn, stride_om,
    s_ptr, stride_se, stride_sn, stride_sk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_W: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    """FP8_W: w is e4m3 with scales s [E, N / SCALE_BLOCK, K / SCALE_BLOCK] (or [E, N, 1] per row, SCALE_BLOCK
    0); otherwise w has x's dtype and s is unused."""
    pid_m, pid_n = _tile_of(num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):  # only ever garbage (see _place)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m)  # assignment t*K + k, or the sentinel num_assignments
    row_mask = (rows >= 0) & (rows < num_assignments)
    tokens = tl.where(row_mask, rows // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    gate_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + inter * stride_wn  # w13's rows are [gate | up]
    gate_s_ptrs = s_ptr + expert * stride_se + _scale_rows(offs_n, SCALE_BLOCK).to(tl.int64) * stride_sn
    up_s_ptrs = s_ptr + expert * stride_se + _scale_rows(inter + offs_n, SCALE_BLOCK).to(tl.int64) * stride_sn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - start
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        gate = tl.load(gate_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        up = tl.load(up_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if FP8_W:
            acc_gate += _fp8_partial(x, gate, gate_s_ptrs, start, n_mask, stride_sk, SCALE_BLOCK, DOT_PRECISION)
            acc_up += _fp8_partial(x, up, up_s_ptrs, start, n_mask, stride_sk, SCALE_BLOCK, DOT_PRECISION)
        else:
            acc_gate = tl.dot(x, tl.trans(gate), acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(x, tl.trans(up), acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if FP8_W and SCALE_BLOCK == 0:  # one scale per row: applied once, to the sums
        acc_gate *= tl.load(gate_s_ptrs, mask=n_mask, other=0.0)[None, :]
        acc_up *= tl.load(up_s_ptrs, mask=n_mask, other=0.0)[None, :]
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_assignments", "num_blocks"])
def _down_kernel(
    h_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_assignments, num_blocks, num_experts, hidden, inter, stride_hm, stride_we, stride_wn, stride_om,
    s_ptr, stride_se, stride_sn, stride_sk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_W: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    """FP8_W, s: as _gate_up_kernel's."""
    pid_m, pid_n = _tile_of(num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):  # only ever garbage (see _place)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m)
    row_mask = (rows >= 0) & (rows < num_assignments)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    # The gate/up kernel left the padding rows unwritten: masked to zero here, and never stored.
    h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    s_ptrs = s_ptr + expert * stride_se + _scale_rows(offs_n, SCALE_BLOCK).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - start
        h = tl.load(h_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if FP8_W:
            acc += _fp8_partial(h, w, s_ptrs, start, n_mask, stride_sk, SCALE_BLOCK, DOT_PRECISION)
        else:
            acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if FP8_W and SCALE_BLOCK == 0:
        acc *= tl.load(s_ptrs, mask=n_mask, other=0.0)[None, :]
    routing = tl.load(weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * routing[:, None]
    safe_rows = tl.where(row_mask, rows, 0).to(tl.int64)
    out_ptrs = out_ptr + safe_rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# ---------------------------------------------------------------------------------------------- configs

GemmTiles = tuple[int, int, int, int, int]  # BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # rows per block: each expert's run is padded to a multiple of it
    gate_up: GemmTiles
    down: GemmTiles

    def to_json(self) -> dict:
        return {"block_m": self.block_m, "gate_up": list(self.gate_up), "down": list(self.down)}

    @classmethod
    def from_json(cls, data: dict) -> MoeConfig:
        return cls(int(data["block_m"]), tuple(map(int, data["gate_up"])), tuple(map(int, data["down"])))


def shape_key(num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> str:
    """bfloat16 and float16 share their tiles (the same bytes and tensor-core rate)."""
    return f"E={num_experts},H={hidden},I={inter},{dtype.itemsize * 8}bit"


def config_path(device_name: str, directory: Path = CONFIG_DIR, kind: str = "fused_moe") -> Path:
    """<kind>_<device>.json: the grouped GEMMs' tiles (fused_moe), or the decode path's (fused_moe_decode)."""
    return directory / f"{kind}_{re.sub(r'[^A-Za-z0-9]+', '_', device_name).strip('_')}.json"


def load_configs(path: Path) -> dict[str, dict[int, MoeConfig]]:
    """shape_key -> {tokens: config}, as benchmarks/fused_moe.py writes them; {} without the file."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {key: {int(tokens): MoeConfig.from_json(c) for tokens, c in buckets.items()}
            for key, buckets in data["configs"].items()}


@functools.cache
def _tuned_configs(device_name: str) -> dict[str, dict[int, MoeConfig]]:
    return load_configs(config_path(device_name))


def nearest_bucket(buckets: dict[int, MoeConfig], num_tokens: int) -> MoeConfig:
    """The config tuned for the token count nearest num_tokens on a log scale (the smaller one on a tie)."""
    return buckets[min(buckets, key=lambda b: (abs(math.log2(b) - math.log2(max(num_tokens, 1))), b))]


def default_config(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype) -> MoeConfig:
    """Tiles by the average rows per expert, for shapes the tuning has not covered."""
    if dtype == torch.float32:  # no 16-bit tensor cores: small tiles keep the registers in bounds
        return MoeConfig(16, (32, 32, 1, 4, 2), (32, 32, 1, 4, 2))
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:  # decode: one 16-row block per expert streams the expert's weights once
        return MoeConfig(16, (32, 128, 1, 4, 4), (64, 128, 1, 4, 4))
    if rows_per_expert <= 96:
        return MoeConfig(64, (64, 64, 8, 4, 3), (64, 64, 8, 4, 3))
    return MoeConfig(128, (64, 64, 8, 8, 3), (128, 64, 8, 8, 3))


@functools.cache  # every MoE layer of every eager step asks: the same few questions
def get_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
               device: torch.device) -> MoeConfig:
    """The tuned config of the token bucket nearest num_tokens (log scale), else default_config."""
    if device.type != "cuda":  # the interpreter
        return default_config(num_tokens, num_experts, top_k, dtype)
    buckets = _tuned_configs(torch.cuda.get_device_name(device)).get(shape_key(num_experts, hidden, inter, dtype))
    if not buckets:
        return default_config(num_tokens, num_experts, top_k, dtype)
    return nearest_bucket(buckets, num_tokens)


# ---------------------------------------------------------------------------------------------- wrapper


def _check(hidden_states, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, scale_block=0) -> None:
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, w13_hidden = w13.shape
    if w13_hidden != hidden or two_inter % 2 or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"expert weights do not match: hidden_states {tuple(hidden_states.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens or topk_ids.dim() != 2:
        raise ValueError(f"routing shapes do not match: topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)}, {num_tokens} tokens")
    if w13_scale is not None:
        _check_fp8(w13, w2, w13_scale, w2_scale, scale_block)
    elif w13.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype:
        raise ValueError(f"expert weights in {w13.dtype}/{w2.dtype}, activations in {hidden_states.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")


def _check_fp8(w13, w2, w13_scale, w2_scale, scale_block) -> None:
    if w13.dtype != FP8 or w2.dtype != FP8 or w2_scale is None:
        raise ValueError(f"scales given with expert weights in {w13.dtype}/{w2.dtype}: they must be e4m3, both scaled")
    experts, two_inter, hidden = w13.shape
    b = scale_block or 1
    if scale_block and (scale_block < 16 or scale_block & (scale_block - 1) or hidden % b or two_inter % (2 * b)):
        raise ValueError(f"fp8 scale blocks of {scale_block}: a power of two >= 16 dividing the hidden size "
                         f"{hidden} and the intermediate size {two_inter // 2}")
    want13 = (experts, two_inter // b, hidden // b if scale_block else 1)
    want2 = (experts, hidden // b, two_inter // 2 // b if scale_block else 1)
    if tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
        raise ValueError(f"fp8 expert scales {tuple(w13_scale.shape)}/{tuple(w2_scale.shape)}, "
                         f"expected {want13}/{want2}")


def _scale_args(w: torch.Tensor, scale: torch.Tensor | None, scale_block: int, block_k: int):
    """The kernels' scale arguments (the weight itself as an unused pointer when 16-bit) and BLOCK_K, at most
    one scale block so that every K-tile lies inside one."""
    if scale is None:
        return (w, 0, 0, 0), block_k, False
    return (scale, *scale.stride()), min(block_k, scale_block) if scale_block else block_k, True


def gate_up_gemm(x: torch.Tensor, w13: torch.Tensor, align: Alignment, top_k: int, block_m: int,
                 tiles: GemmTiles, scale: torch.Tensor | None = None, scale_block: int = 0) -> torch.Tensor:
    """[max_padded, I] in sorted order: silu(x W_gate^T) * (x W_up^T) for each assignment's row (padding
    rows unwritten). scale: e4m3 w13's [E, 2I / b, H / b] block scales (scale_block b) or [E, 2I, 1]."""
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    num_blocks = align.block_expert.numel()
    h = torch.empty((align.max_padded, inter), dtype=x.dtype, device=x.device)
    block_n, block_k, group_m, warps, stages = tiles
    scale_args, block_k, fp8 = _scale_args(w13, scale, scale_block, block_k)
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, block_n),)](
        x, w13, h, align.sorted_ids, align.block_expert, align.num_padded,
        x.shape[0] * top_k, top_k, num_blocks, w13.shape[0], inter, hidden, x.stride(0), w13.stride(0), w13.stride(1),
        h.stride(0), *scale_args, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        DOT_PRECISION=dot_precision(x.dtype), FP8_W=fp8, SCALE_BLOCK=scale_block, num_warps=warps,
        num_stages=stages,
    )
    return h


def down_gemm(h: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, align: Alignment, block_m: int,
              tiles: GemmTiles, zero_unplaced: bool = False, scale: torch.Tensor | None = None,
              scale_block: int = 0) -> torch.Tensor:
    """[T*K, H] in (token, k) order: each assignment's h W2^T times its routing weight (weights [T*K] fp32).
    The rows of assignments the alignment left out are zero with zero_unplaced, else unwritten.
    scale: e4m3 w2's [E, H / b, I / b] block scales (scale_block b) or [E, H, 1]."""
    num_experts, hidden, inter = w2.shape
    num_blocks = align.block_expert.numel()
    y = (torch.zeros if zero_unplaced else torch.empty)((weights.numel(), hidden), dtype=h.dtype, device=h.device)
    block_n, block_k, group_m, warps, stages = tiles
    scale_args, block_k, fp8 = _scale_args(w2, scale, scale_block, block_k)
    _down_kernel[(num_blocks * triton.cdiv(hidden, block_n),)](
        h, w2, y, weights, align.sorted_ids, align.block_expert, align.num_padded,
        weights.numel(), num_blocks, w2.shape[0], hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        *scale_args, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        DOT_PRECISION=dot_precision(h.dtype), FP8_W=fp8, SCALE_BLOCK=scale_block, num_warps=warps,
        num_stages=stages,
    )
    return y


def fused_experts(
    hidden_states: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: [gate | up] rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int32/int64, each in [0, E) (or -1 with skip_negative_ids)
    config: MoeConfig | None = None,
    skip_negative_ids: bool = False,
    w13_scale: torch.Tensor | None = None,  # e4m3 weights: [E, 2I / b, H / b] (scale_block b) or [E, 2I, 1]
    w2_scale: torch.Tensor | None = None,  # [E, H / b, I / b] or [E, H, 1]
    scale_block: int = 0,
) -> torch.Tensor:
    """[T, H]: sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t]), as fused_experts_torch.
    config overrides the tuned tiles (the tuning script). skip_negative_ids: ids of -1 (another rank's expert,
    under expert parallelism) contribute nothing; the alignment leaves them out, so they cost no GEMM rows,
    only the zeroing of their output rows (which is why it is not always on).
    With scales, w13 and w2 are e4m3 (layers.quant.fp8_moe): W8A16, the weight tiles widened in registers,
    against fused_experts_torch on the dequantized weights; 16-bit tiles (no tuned fp8 entries yet)."""
    _check(hidden_states, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, scale_block)
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(hidden_states)
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()  # no copy for parameters
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*K]
    cfg = config or get_config(num_tokens, num_experts, hidden, two_inter // 2, top_k, x.dtype, x.device)
    align = align_assignments(topk_ids.contiguous(), num_experts, cfg.block_m)
    h = gate_up_gemm(x, w13, align, top_k, cfg.block_m, cfg.gate_up, w13_scale, scale_block)  # [padded rows, I]
    y = down_gemm(h, w2, weights, align, cfg.block_m, cfg.down, skip_negative_ids, w2_scale, scale_block)  # [T*K, H]
    if top_k == 1:
        return y
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
