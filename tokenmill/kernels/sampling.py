"""Temperature + Gumbel-max draw over the whole vocabulary: one read of the logits, no [n, vocab] noise.

A draw from softmax(x / T) is argmax(x / T + G) with G i.i.d. standard Gumbel. The kernel takes
argmax(x + T * G), the same argmax for T > 0, so a row with T = 0 is the plain argmax: greedy and
sampled rows share one launch, and large logits never overflow a division by a tiny T.

Pass 1, grid (rows, splits): each program scans a contiguous run of tiles of its row and writes its
best (score, token) to a [rows, splits] buffer. Pass 2, one program per row: the best split. Ties
go to the lowest token id, as torch.argmax, so greedy rows equal torch.argmax exactly (NaN logits
aside: they never win here).

Noise: a tile is 4 * `lanes` tokens; Philox4x32-10 (triton's `randint4x`) keyed by the row's seed,
at counter (tile * lanes + lane, row offset), gives the 4 values of one lane: tokens
tile * 4 * lanes + k * lanes + lane for k = 0..3. So a token's noise depends only on (seed, offset,
token id), not on the split layout or the batch: a seeded request draws the same token in any batch.

A per-row floor (kernels/sampling_floor.py: top_k and min_p) limits a sampled row's candidates to
the logits at or above it. top_p_draw samples the candidates' top-p nucleus without sorting, by
rejection: gumbel_argmax's draw, a split pass for the softmax mass and the mass above the drawn token,
then redraws for the rows whose draw fell outside the nucleus (see its docstring).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys

LANES = 256
"""Philox counters per tile (each yields 4 noise values): a token's noise depends on it, keep it fixed."""
TARGET_PROGRAMS = 4096
"""Programs wanted in pass 1: enough to fill a large GPU several times over, with little tail."""
MAX_DRAWS = 64
"""Rejection rounds before top_p_draw gives up and takes the argmax (each rejection at least halves,
on average, the candidates' mass outside the nucleus)."""
PARALLEL_ROUNDS = 2
"""Redraws spread over vocabulary splits before the rows still rejected go on in one program each."""
U_MIN, U_MAX = tl.constexpr(1e-10), tl.constexpr(1.0 - 2.0**-24)
"""Uniforms are clamped into (0, 1) so that -log(-log(u)) is finite."""
LN2, LOG2_LN2 = tl.constexpr(math.log(2.0)), tl.constexpr(math.log2(math.log(2.0)))
FAST_LOG = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
"""On the GPU, log2 is the hardware's approximate instruction (relative error ~2^-22): libdevice's
exact logarithm costs several times more instructions, and the draw computes two per token. The
interpreter (CPU tests) has no inline assembly and takes tl.log2."""


@triton.jit
def _log2(x):
    if FAST_LOG:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _gumbel(u):
    """Standard Gumbel noise from a uniform: -ln(-ln(u)), in base-2 logarithms."""
    return -LN2 * (_log2(-_log2(u)) + LOG2_LN2)


@triton.jit
def _lane_argmax(best, best_index):
    """Best value over the lanes, and the lowest token id that has it."""
    value = tl.max(best, 0)
    return value, tl.min(tl.where(best == value, best_index, 2147483647), 0)


@triton.jit
def _greedy_best(row_ptr, vocab_size, first_tile, last_tile, TILE: tl.constexpr):
    cols = tl.arange(0, TILE)
    best = tl.full([TILE], float("-inf"), tl.float32)
    best_index = first_tile * TILE + cols
    for tile in range(first_tile, last_tile):
        token = tile * TILE + cols
        x = tl.load(row_ptr + token, mask=token < vocab_size, other=float("-inf")).to(tl.float32)
        better = x > best  # strict: the earliest token keeps a tie
        best = tl.where(better, x, best)
        best_index = tl.where(better, token, best_index)
    return _lane_argmax(best, best_index)


@triton.jit
def _gumbel_update(best, best_index, top, row_ptr, token, vocab_size, temperature, floor, pivot, bits):
    x = tl.load(row_ptr + token, mask=token < vocab_size, other=float("-inf")).to(tl.float32)
    # Only candidates compete: at least the row's floor (top_k, min_p) and above a rejected draw.
    x = tl.where((x >= floor) & (x > pivot), x, float("-inf"))
    u = tl.clamp(tl.random.uint_to_uniform_float(bits), U_MIN, U_MAX)
    score = x + temperature * _gumbel(u)
    better = score > best
    return tl.where(better, score, best), tl.where(better, token, best_index), tl.maximum(top, x)


@triton.jit
def _sampled_best(row_ptr, vocab_size, first_tile, last_tile, temperature, seed, counter_hi, floor, pivot,
                  LANES: tl.constexpr):
    """(best score, its token, the largest candidate logit) over the tiles."""
    lanes = tl.arange(0, LANES)
    best = tl.full([LANES], float("-inf"), tl.float32)
    top = tl.full([LANES], float("-inf"), tl.float32)
    best_index = first_tile * 4 * LANES + lanes
    for tile in range(first_tile, last_tile):
        r0, r1, r2, r3 = tl.randint4x(seed, counter_hi + tile * LANES + lanes)
        token = tile * 4 * LANES + lanes
        best, best_index, top = _gumbel_update(best, best_index, top, row_ptr, token, vocab_size, temperature,
                                               floor, pivot, r0)
        best, best_index, top = _gumbel_update(best, best_index, top, row_ptr, token + LANES, vocab_size,
                                               temperature, floor, pivot, r1)
        best, best_index, top = _gumbel_update(best, best_index, top, row_ptr, token + 2 * LANES, vocab_size,
                                               temperature, floor, pivot, r2)
        best, best_index, top = _gumbel_update(best, best_index, top, row_ptr, token + 3 * LANES, vocab_size,
                                               temperature, floor, pivot, r3)
    value, index = _lane_argmax(best, best_index)
    return value, index, tl.max(top, 0)


@triton.jit
def _candidate_best(x, ids, seed, draw, temperature, pivot, LANES: tl.constexpr):
    """_sampled_best over gathered candidates (x: their logits, -inf in empty slots; ids: their token ids),
    with each token's noise from the same Philox counter as over the whole row: the same draw."""
    tile = ids // (4 * LANES)
    part = (ids - tile * 4 * LANES) // LANES
    lane = ids - tile * 4 * LANES - part * LANES
    r0, r1, r2, r3 = tl.randint4x(seed, (draw.to(tl.int64) << 32) + tile * LANES + lane)
    bits = tl.where(part == 0, r0, tl.where(part == 1, r1, tl.where(part == 2, r2, r3)))
    u = tl.clamp(tl.random.uint_to_uniform_float(bits), U_MIN, U_MAX)
    score = tl.where(x > pivot, x, float("-inf")) + temperature * _gumbel(u)
    return tl.min(tl.where(score == tl.max(score, 0), ids, 2147483647), 0)


@triton.jit
def candidate_draw(x, ids, seed, temperature, top_p, row_max, LANES: tl.constexpr, MAX_DRAWS: tl.constexpr):
    """top_p_draw's rejection rounds over gathered candidates (x: their logits, -inf in empty slots),
    with its noise streams, in one program: its token, up to float rounding in the masses."""
    draws = tl.zeros([], tl.int32)
    token = _candidate_best(x, ids, seed, draws, temperature, float("-inf"), LANES)
    if top_p < 1.0:
        p = tl.exp((x - row_max) / temperature)
        limit = top_p * tl.sum(p, 0)
        pivot = tl.max(tl.where(ids == token, x, float("-inf")), 0)
        mass = tl.sum(tl.where(x > pivot, p, 0.0), 0)
        draws += 1
        while (mass >= limit) & (draws < MAX_DRAWS):
            token = _candidate_best(x, ids, seed, draws, temperature, pivot, LANES)
            pivot = tl.max(tl.where(ids == token, x, float("-inf")), 0)
            mass = tl.sum(tl.where(x > pivot, p, 0.0), 0)
            draws += 1
        if mass >= limit:  # out of draws: the most likely token, as top_p_draw
            token = tl.min(tl.where(x == row_max, ids, 2147483647), 0)
    return token


@triton.jit
def _row_floor(floor_ptr, row, has_floor):
    """The row's floor, or -inf without one (a runtime flag: one compiled variant serves both)."""
    return tl.where(has_floor != 0, tl.load(floor_ptr + row), float("-inf"))


@triton.jit
def _split_tiles(split, tiles_per_split, num_tiles):
    """The tiles [first, last) of a pass-1 program."""
    first_tile = split * tiles_per_split
    return first_tile, tl.minimum(first_tile + tiles_per_split, num_tiles)


# The split layout changes with the batch size: one compiled variant for all of it (Triton would
# otherwise compile one per divisibility class of these ints, mid-run, ~1 s each).
@triton.jit(do_not_specialize=["tiles_per_split", "num_splits", "has_floor"])
def _gumbel_argmax_split_kernel(
    logits_ptr, stride_row, temperature_ptr, seed_ptr, offset_ptr, floor_ptr, value_ptr, index_ptr, max_ptr,
    vocab_size, num_tiles, tiles_per_split, num_splits, has_floor,
    HAS_OFFSETS: tl.constexpr, LANES: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    first_tile, last_tile = _split_tiles(split, tiles_per_split, num_tiles)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0:
        if HAS_OFFSETS:
            # The row offset is the high word of the 64-bit Philox counter (randint4x's c1).
            counter_hi = (tl.load(offset_ptr + row).to(tl.int64) & 0xFFFFFFFF) << 32
        else:
            counter_hi = 0
        value, index, top = _sampled_best(row_ptr, vocab_size, first_tile, last_tile, temperature,
                                          tl.load(seed_ptr + row), counter_hi, _row_floor(floor_ptr, row, has_floor),
                                          float("-inf"), LANES)
        tl.store(max_ptr + row * num_splits + split, top)  # the nucleus pass's softmax reference
        tl.store(value_ptr + row * num_splits + split, value)
        tl.store(index_ptr + row * num_splits + split, index)
    elif temperature == 0:  # greedy rows skip the noise altogether
        value, index = _greedy_best(row_ptr, vocab_size, first_tile, last_tile, 4 * LANES)
        tl.store(value_ptr + row * num_splits + split, value)
        tl.store(index_ptr + row * num_splits + split, index)


@triton.jit
def _best_split(value_ptr, index_ptr, row, num_splits, BLOCK: tl.constexpr):
    """The token of the row's best pass-1 partial (the lowest token id among equals)."""
    splits = tl.arange(0, BLOCK)
    mask = splits < num_splits
    value = tl.load(value_ptr + row * num_splits + splits, mask=mask, other=float("-inf"))
    index = tl.load(index_ptr + row * num_splits + splits, mask=mask, other=2147483647)
    _, best = _lane_argmax(value, index)
    return best


@triton.jit(do_not_specialize=["num_splits"])
def _best_split_kernel(temperature_ptr, value_ptr, index_ptr, out_ptr, num_splits, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(temperature_ptr + row) >= 0:  # a negative temperature: the row's token is already drawn
        tl.store(out_ptr + row, _best_split(value_ptr, index_ptr, row, num_splits, BLOCK).to(tl.int64))


# top-p. Per (row, split) the nucleus pass keeps 4 floats: the split's largest candidate logit / T
# ("top"), its softmax mass relative to that top, and the mass above the row's current draw in two
# slots, one per round parity. The verdict on a row's draw (rejected or not) is made once, by the last
# of the row's split programs to store its statistics, and kept in a per-row flag: the next launch's
# programs read one flag, and those of accepted rows exit at once.
STATS = tl.constexpr(4)


@triton.jit
def _candidate_mass(row_ptr, vocab_size, first_tile, last_tile, inv_temperature, floor, pivot, top,
                    TILE: tl.constexpr):
    """Over the candidates (x >= floor) of the tiles: sum(exp(x / T - top)), and that sum over the tokens
    above `pivot`; `top` is their largest x / T (the draw pass found it), so one exp per token."""
    cols = tl.arange(0, TILE)
    total = tl.zeros([TILE], tl.float32)
    above = tl.zeros([TILE], tl.float32)
    for tile in range(first_tile, last_tile):
        token = tile * TILE + cols
        x = tl.load(row_ptr + token, mask=token < vocab_size, other=float("-inf")).to(tl.float32)
        p = tl.where(x >= floor, tl.exp(x * inv_temperature - top), 0.0)  # a split without candidates: NaN unused
        total += p
        above += tl.where(x > pivot, p, 0.0)
    return tl.sum(total, 0), tl.sum(above, 0)


@triton.jit
def _mass_above(row_ptr, vocab_size, first_tile, last_tile, pivot, top, inv_temperature, TILE: tl.constexpr):
    """sum(exp(x / T - top)) over the tiles' tokens above `pivot`."""
    cols = tl.arange(0, TILE)
    total = tl.zeros([TILE], tl.float32)
    for tile in range(first_tile, last_tile):
        token = tile * TILE + cols
        x = tl.load(row_ptr + token, mask=token < vocab_size, other=float("-inf")).to(tl.float32)
        total += tl.where(x > pivot, tl.exp(x * inv_temperature - top), 0.0)
    return tl.sum(total, 0)


@triton.jit
def _nucleus_verdict(stats_ptr, row, num_splits, top_p, slot, BLOCK: tl.constexpr):
    """(rejected, row top, limit, mass) of the row's current draw: rejected when the mass above it is at
    least top_p of the candidates' mass (the draw is outside the nucleus)."""
    splits = tl.arange(0, BLOCK)
    mask = splits < num_splits
    stats = stats_ptr + (row * num_splits + splits) * STATS
    # .cg (L2, not L1): in _arrive these are other programs' stores of the same launch
    tops = tl.load(stats, mask=mask, other=float("-inf"), cache_modifier=".cg")
    row_top = tl.max(tops, 0)
    scale = tl.exp(tops - row_top)  # an all -inf row gives NaN here: never rejected
    limit = top_p * tl.sum(tl.load(stats + 1, mask=mask, other=0.0, cache_modifier=".cg") * scale, 0)
    mass = tl.sum(tl.load(stats + 2 + slot, mask=mask, other=0.0, cache_modifier=".cg") * scale, 0)
    return mass >= limit, row_top, limit, mass


@triton.jit
def _arrive(arrival_ptr, rejected_ptr, stats_ptr, row, num_splits, top_p, slot, BLOCK: tl.constexpr):
    """After a split program stored its statistics: the row's last one to arrive judges the draw."""
    arrived = tl.atomic_add(arrival_ptr + row, 1)  # acq_rel: the last one sees every program's stores
    if arrived == num_splits - 1:
        rejected, _, _, _ = _nucleus_verdict(stats_ptr, row, num_splits, top_p, slot, BLOCK)
        tl.store(rejected_ptr + row, rejected.to(tl.int32))
        tl.store(arrival_ptr + row, 0)  # the whole row has arrived: the counter serves the next round


@triton.jit(do_not_specialize=["tiles_per_split", "num_splits", "has_floor"])
def _nucleus_split_kernel(
    logits_ptr, stride_row, temperature_ptr, top_p_ptr, floor_ptr, token_ptr, max_ptr, stats_ptr, arrival_ptr,
    rejected_ptr, vocab_size, num_tiles, tiles_per_split, num_splits, has_floor, BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    """Per (row, split) of the top-p rows: the candidates' softmax max and mass, and the mass above the
    first draw (slot 0); then the verdict on the first draw."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    if (temperature > 0) & (top_p < 1.0):
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        pivot = tl.load(row_ptr + tl.load(token_ptr + row)).to(tl.float32)
        first_tile, last_tile = _split_tiles(split, tiles_per_split, num_tiles)
        inv_temperature = 1.0 / temperature
        top = tl.load(max_ptr + row * num_splits + split) * inv_temperature
        total, above = _candidate_mass(row_ptr, vocab_size, first_tile, last_tile, inv_temperature,
                                       _row_floor(floor_ptr, row, has_floor), pivot, top, TILE)
        out = stats_ptr + (row * num_splits + split) * STATS
        tl.store(out, top)
        tl.store(out + 1, total)
        tl.store(out + 2, above)
        _arrive(arrival_ptr, rejected_ptr, stats_ptr, row, num_splits, top_p, 0, BLOCK)


@triton.jit(do_not_specialize=["tiles_per_split", "num_splits", "draw", "has_floor"])
def _redraw_split_kernel(
    logits_ptr, stride_row, temperature_ptr, floor_ptr, seed_ptr, token_ptr, rejected_ptr, value_ptr, index_ptr,
    vocab_size, num_tiles, tiles_per_split, num_splits, draw, has_floor, LANES: tl.constexpr,
):
    """Redraw `draw`, per (row, split) of the rows whose last draw was rejected: the best candidate
    above the rejected token, with the draw's own Philox stream (counter word c1 = draw)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    if tl.load(rejected_ptr + row) != 0:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        pivot = tl.load(row_ptr + tl.load(token_ptr + row)).to(tl.float32)
        first_tile, last_tile = _split_tiles(split, tiles_per_split, num_tiles)
        value, index, _ = _sampled_best(row_ptr, vocab_size, first_tile, last_tile, tl.load(temperature_ptr + row),
                                        tl.load(seed_ptr + row), draw.to(tl.int64) << 32,
                                        _row_floor(floor_ptr, row, has_floor), pivot, LANES)
        tl.store(value_ptr + row * num_splits + split, value)
        tl.store(index_ptr + row * num_splits + split, index)


@triton.jit(do_not_specialize=["tiles_per_split", "num_splits", "draw"])
def _redraw_mass_kernel(
    logits_ptr, stride_row, temperature_ptr, top_p_ptr, token_ptr, stats_ptr, arrival_ptr, rejected_ptr, value_ptr,
    index_ptr, vocab_size, num_tiles, tiles_per_split, num_splits, draw, BLOCK: tl.constexpr, TILE: tl.constexpr,
):
    """After redraw `draw`, in the rows it served: its token becomes the row's draw, each split's mass
    above it goes to the round's slot, and the row's last program judges it."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    if tl.load(rejected_ptr + row) != 0:  # read before this program arrives, so before the verdict changes
        token = _best_split(value_ptr, index_ptr, row, num_splits, BLOCK)
        if split == 0:
            tl.store(token_ptr + row, token.to(tl.int64))
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        first_tile, last_tile = _split_tiles(split, tiles_per_split, num_tiles)
        entry = stats_ptr + (row * num_splits + split) * STATS
        above = _mass_above(row_ptr, vocab_size, first_tile, last_tile, tl.load(row_ptr + token).to(tl.float32),
                            tl.load(entry), 1.0 / tl.load(temperature_ptr + row), TILE)
        tl.store(entry + 2 + draw % 2, above)
        _arrive(arrival_ptr, rejected_ptr, stats_ptr, row, num_splits, tl.load(top_p_ptr + row), draw % 2, BLOCK)


@triton.jit
def _nucleus_redraw(row_ptr, vocab_size, num_tiles, temperature, seed, floor, token, row_top, limit, mass, first_draw,
                    LANES: tl.constexpr, MAX_DRAWS: tl.constexpr):
    """The rejection rounds left after the parallel ones, in one program (`mass`, above `token`, is >= `limit`)."""
    inv_temperature = 1.0 / temperature
    x_token = tl.load(row_ptr + token).to(tl.float32)
    draws = first_draw
    while (mass >= limit) & (draws < MAX_DRAWS):
        _, token, _ = _sampled_best(row_ptr, vocab_size, 0, num_tiles, temperature, seed,
                                    draws.to(tl.int64) << 32, floor, x_token, LANES)
        x_token = tl.load(row_ptr + token).to(tl.float32)
        mass = _mass_above(row_ptr, vocab_size, 0, num_tiles, x_token, row_top, inv_temperature, 4 * LANES)
        draws += 1
    if mass >= limit:  # out of draws (practically never): the most likely token is in every nucleus
        _, token = _greedy_best(row_ptr, vocab_size, 0, num_tiles, 4 * LANES)
    return token


@triton.jit
def row_draw(row_ptr, vocab_size, num_tiles, temperature, seed, floor, top_p, LANES: tl.constexpr,
             MAX_DRAWS: tl.constexpr):
    """top_p_draw's whole algorithm for one row in one program (a slow path: the program reads the row a
    few times): the first draw, the nucleus mass, the redraws. The same token as over vocabulary splits,
    up to float rounding in the masses."""
    _, token, top = _sampled_best(row_ptr, vocab_size, 0, num_tiles, temperature, seed, 0, floor, float("-inf"),
                                  LANES)
    if top_p < 1.0:
        inv_temperature = 1.0 / temperature
        row_top = top * inv_temperature
        total, mass = _candidate_mass(row_ptr, vocab_size, 0, num_tiles, inv_temperature, floor,
                                      tl.load(row_ptr + token).to(tl.float32), row_top, 4 * LANES)
        limit = top_p * total
        if mass >= limit:
            token = _nucleus_redraw(row_ptr, vocab_size, num_tiles, temperature, seed, floor, token, row_top, limit,
                                    mass, tl.full([], 1, tl.int32), LANES, MAX_DRAWS)
    return token


@triton.jit(do_not_specialize=["num_splits", "first_draw", "has_floor"])
def _nucleus_finish_kernel(
    logits_ptr, stride_row, temperature_ptr, top_p_ptr, floor_ptr, seed_ptr, token_ptr, stats_ptr, rejected_ptr,
    vocab_size, num_tiles, num_splits, first_draw, has_floor,
    BLOCK: tl.constexpr, LANES: tl.constexpr, MAX_DRAWS: tl.constexpr,
):
    """Per top-p row: keep the current draw, or (rarely) go on redrawing in this one program."""
    row = tl.program_id(0)
    if tl.load(rejected_ptr + row) != 0:
        _, row_top, limit, mass = _nucleus_verdict(stats_ptr, row, num_splits, tl.load(top_p_ptr + row),
                                                   (first_draw - 1) % 2, BLOCK)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        token = _nucleus_redraw(row_ptr, vocab_size, num_tiles, tl.load(temperature_ptr + row),
                                tl.load(seed_ptr + row), _row_floor(floor_ptr, row, has_floor),
                                tl.load(token_ptr + row).to(tl.int32), row_top, limit, mass, first_draw, LANES,
                                MAX_DRAWS)
        tl.store(token_ptr + row, token.to(tl.int64))


def split_layout(num_rows: int, vocab_size: int, tile: int, tiles_per_split: int | None = None) -> tuple[int, int, int]:
    """(num_tiles, tiles_per_split, num_splits) of a pass over [num_rows, vocab_size] by `tile`-token tiles."""
    num_tiles = triton.cdiv(vocab_size, tile)
    if tiles_per_split is None:
        tiles_per_split = max(1, num_rows * num_tiles // TARGET_PROGRAMS)
    return num_tiles, tiles_per_split, triton.cdiv(num_tiles, tiles_per_split)


def gumbel_argmax(
    logits: torch.Tensor,  # [num_rows, vocab] float32/float16/bfloat16; any row stride
    temperature: torch.Tensor,  # [num_rows] float32; 0 = greedy (the plain argmax); < 0: skip the row
    seeds: torch.Tensor,  # [num_rows] int64 Philox key per row
    offsets: torch.Tensor | None = None,  # [num_rows] int64 Philox stream per row (low 32 bits); None = 0
    floor: torch.Tensor | None = None,  # [num_rows] float32: sampled rows draw among logits >= floor
    lanes: int = LANES,
    tiles_per_split: int | None = None,
    maxima: torch.Tensor | None = None,  # [num_rows, num_splits] float32 out: each split's largest candidate
    out: torch.Tensor | None = None,  # [num_rows] int64: the tokens go here (skipped rows keep theirs)
    num_warps: int = 2,  # sampled rows: 81 us against 85 with 4 warps at [256, 151936] bf16 (H200)
) -> torch.Tensor:
    """One token per row: argmax(logits + T * Gumbel noise), no host sync. Returns [num_rows] int64.

    `lanes` changes the noise of every token (tests use small tiles); `tiles_per_split` only the
    parallel layout, never the result.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_tiles, tiles_per_split, num_splits = split_layout(num_rows, vocab_size, 4 * lanes, tiles_per_split)
    values = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    indices = torch.empty(num_rows, num_splits, dtype=torch.int32, device=logits.device)
    if maxima is None:
        maxima = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    _gumbel_argmax_split_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), temperature, seeds, offsets if offsets is not None else seeds,
        floor if floor is not None else temperature, values, indices, maxima, vocab_size, num_tiles, tiles_per_split,
        num_splits, int(floor is not None), HAS_OFFSETS=offsets is not None, LANES=lanes,
        num_warps=num_warps,
    )
    _best_split_kernel[(num_rows,)](temperature, values, indices, out, num_splits,
                                    BLOCK=triton.next_power_of_2(num_tiles))
    return out


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dimension (the lowest index among equal maxima; NaN never wins), through
    gumbel_argmax's greedy path, which reads the logits once at full bandwidth."""
    num_rows, device = logits.shape[0], logits.device
    zeros = torch.zeros(num_rows, dtype=torch.float32, device=device)
    # The draw's launch configuration (2 warps: 26 us here against 24 with 4), so that greedy and sampled
    # batches share one compiled kernel per dtype: each variant costs seconds of cold start-up.
    return gumbel_argmax(logits, zeros, torch.zeros(num_rows, dtype=torch.int64, device=device))


def top_p_draw(
    logits: torch.Tensor,  # [num_rows, vocab] float32/float16/bfloat16; any row stride
    temperature: torch.Tensor,  # [num_rows] float32; 0 = greedy (the plain argmax); < 0: skip the row
    top_p: torch.Tensor,  # [num_rows] float32 in (0, 1]; 1 = the whole row
    seeds: torch.Tensor,  # [num_rows] int64 Philox key per row
    floor: torch.Tensor | None = None,  # [num_rows] float32: the nucleus of the logits >= floor
    lanes: int = LANES,
    tiles_per_split: int | None = None,
    parallel_rounds: int = PARALLEL_ROUNDS,
    out: torch.Tensor | None = None,  # [num_rows] int64: the tokens go here (skipped rows keep theirs)
) -> torch.Tensor:
    """One token per row from softmax(logits / T) restricted to its top-p nucleus, without a sort; no host sync.

    The nucleus is the set of candidates whose strictly more likely candidates hold less than top_p of
    the candidates' probability, so tokens tied with its least likely member are all in it (a sort keeps
    an arbitrary subset of them). Rejection sampling: gumbel_argmax's draw over the candidates (so rows
    with top_p = 1 get its token), then a split pass for the softmax mass and the mass above the draw.
    A draw with top_p or more above it is outside the nucleus (probability about 1 - top_p), and so is
    every token at most as likely: the row redraws among the tokens above it, until a draw is inside.
    The candidates always hold the whole nucleus, so the accepted draw is exactly a draw from the
    renormalised nucleus. The first `parallel_rounds` redraws run over vocabulary splits, two launches
    each; rows still rejected after them (rare: each round leaves about 1 - top_p of the rows) go on in
    one program per row. The draws are the same either way, only their layout differs.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    num_tiles, tiles_per_split, num_splits = split_layout(num_rows, vocab_size, 4 * lanes, tiles_per_split)
    maxima = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    tokens = gumbel_argmax(logits, temperature, seeds, floor=floor, lanes=lanes, tiles_per_split=tiles_per_split,
                           maxima=maxima, out=out)
    if num_rows == 0:
        return tokens
    device, has_floor, block = logits.device, int(floor is not None), triton.next_power_of_2(num_tiles)
    floor = floor if has_floor else temperature
    stats = torch.empty(num_rows, num_splits, STATS.value, dtype=torch.float32, device=device)
    # Rows skipped are never rejected. Both start 16-byte aligned whatever num_rows (one compiled variant).
    arrivals, rejected = torch.zeros(2, -(-num_rows // 4) * 4, dtype=torch.int32, device=device)[:, :num_rows]
    grid = (num_rows, num_splits)
    _nucleus_split_kernel[grid](
        logits, logits.stride(0), temperature, top_p, floor, tokens, maxima, stats, arrivals, rejected, vocab_size,
        num_tiles, tiles_per_split, num_splits, has_floor, BLOCK=block, TILE=4 * lanes,
    )
    values = torch.empty(num_rows, num_splits, dtype=torch.float32, device=device)
    indices = torch.empty(num_rows, num_splits, dtype=torch.int32, device=device)
    for draw in range(1, parallel_rounds + 1):
        _redraw_split_kernel[grid](
            logits, logits.stride(0), temperature, floor, seeds, tokens, rejected, values, indices, vocab_size,
            num_tiles, tiles_per_split, num_splits, draw, has_floor, LANES=lanes,
        )
        _redraw_mass_kernel[grid](
            logits, logits.stride(0), temperature, top_p, tokens, stats, arrivals, rejected, values, indices,
            vocab_size, num_tiles, tiles_per_split, num_splits, draw, BLOCK=block, TILE=4 * lanes,
        )
    _nucleus_finish_kernel[(num_rows,)](
        logits, logits.stride(0), temperature, top_p, floor, seeds, tokens, stats, rejected, vocab_size, num_tiles,
        num_splits, parallel_rounds + 1, has_floor, BLOCK=block, LANES=lanes, MAX_DRAWS=MAX_DRAWS, num_warps=8,
    )
    return tokens


def philox_uniform_ref(seeds: np.ndarray, counters: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Triton's randint4x + uint_to_uniform_float in numpy: [rows] keys x [cols] counters -> [4, rows, cols]."""
    mask = np.uint64(0xFFFFFFFF)
    seeds = seeds.astype(np.uint64)[:, None]
    k0, k1 = seeds & mask, seeds >> np.uint64(32)
    c0 = np.broadcast_to(counters.astype(np.uint64)[None, :], (len(seeds), len(counters)))
    c1 = np.broadcast_to(offsets.astype(np.uint64)[:, None] & mask, c0.shape)
    c2 = c3 = np.zeros_like(c0)
    round_a, round_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        hi_b, hi_a = (round_b * c2) >> np.uint64(32), (round_a * c0) >> np.uint64(32)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, (round_b * c2) & mask, hi_a ^ c3 ^ k1, (round_a * c0) & mask
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    signed = np.stack([c0, c1, c2, c3]).astype(np.int64)
    signed = np.where(signed >= 2**31, signed - 2**32, signed)  # the int32 bitcast
    folded = np.where(signed < 0, -signed - 1, signed)
    return folded.astype(np.float32) * np.float32(4.6566127342e-10)


def below_floor_ref(logits: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor | None) -> torch.Tensor:
    """float32 logits on the CPU, -inf where a sampled row's logit is below its floor (greedy rows keep theirs)."""
    x = logits.float().cpu()
    if floor is None:
        return x
    below = (x < floor.cpu()[:, None]) & (temperature.cpu() > 0)[:, None]
    return x.masked_fill(below, float("-inf"))


def gumbel_argmax_ref(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor | None = None,
    floor: torch.Tensor | None = None, lanes: int = LANES,
) -> torch.Tensor:
    """The kernel's draw in numpy, float32 throughout: the same noise for every token."""
    x = below_floor_ref(logits, temperature, floor).numpy()
    num_rows, vocab_size = x.shape
    token = np.arange(vocab_size)
    tile, within = np.divmod(token, 4 * lanes)
    k, lane = np.divmod(within, lanes)
    offsets = np.zeros(num_rows, np.int64) if offsets is None else offsets.cpu().numpy()
    uniforms = philox_uniform_ref(seeds.cpu().numpy(), tile * lanes + lane, offsets)
    u = np.clip(uniforms[k, :, token].T, np.float32(U_MIN.value), np.float32(U_MAX.value))
    ln2, log2_ln2 = np.float32(LN2.value), np.float32(LOG2_LN2.value)
    gumbel = -ln2 * (np.log2(-np.log2(u)) + log2_ln2)
    t = temperature.cpu().numpy().astype(np.float32)[:, None]
    scores = np.where(t > 0, x + t * gumbel, x)
    return torch.from_numpy(scores.argmax(axis=1)).to(logits.device)


def top_p_draw_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
    floor: torch.Tensor | None = None, lanes: int = LANES,
) -> torch.Tensor:
    """top_p_draw's rejection rounds on gumbel_argmax_ref (draw k: offset k), masses in float64."""
    x = below_floor_ref(logits, temperature, floor)
    tokens = gumbel_argmax_ref(x, temperature, seeds, lanes=lanes)
    for row in range(len(x)):
        t, p = float(temperature[row]), float(top_p[row])
        if t <= 0 or p >= 1:
            continue
        probs = (x[row].double() / t).softmax(-1)
        for k in range(1, MAX_DRAWS + 1):
            pivot = x[row, tokens[row]]
            if probs[x[row] > pivot].sum() < p:
                break
            candidates = x[row : row + 1].masked_fill(x[row : row + 1] <= pivot, float("-inf"))
            tokens[row] = gumbel_argmax_ref(candidates, temperature[row : row + 1].cpu(), seeds[row : row + 1].cpu(),
                                            torch.tensor([k]), lanes=lanes)[0]
    return tokens.to(logits.device)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
