"""Temperature + categorical draw over the whole vocabulary by inverse CDF: no sort, no per-token noise.

A draw from softmax(x / T) picks the token at which the running sum of exp(x / T) over the vocabulary,
in token-id order, first exceeds u * (the whole sum), u one uniform per row. One launch, grid (rows,
splits): each program scans a contiguous run of tiles of its row and keeps, per lane, the largest
y = x / T (in base 2) and the sum of 2^(y - largest), rescaled online (one exp2 per token); it stores
the split's largest y and its mass relative to it. The row's last program to arrive (an atomic counter)
puts the splits' masses on a common scale, finds the split in which u * total falls, and scans that
split's tiles again with a running sum (tl.cumsum) until it passes the remainder. The logits are read
once, with little arithmetic per token, so the pass runs near the memory bandwidth; one split per row
is read again. (The Gumbel-max draw that this replaces cost a Philox call and two logarithms per token,
and was bound by instruction issue at 4x this pass's time.) One launch matters as much as its GPU time:
the host spends 20-50 us launching a Triton kernel, and a decode step at batch 256 has ~3 ms for all of it.

The split layout depends only on the vocabulary size (DRAW_SPLITS), not on the batch: a row's masses,
so its token, are the same bits in any batch. u comes from Philox4x32-10 (triton's randint) keyed by
the row's seed at counter `draw` (0 for the first draw, k for the k-th top-p redraw), so a seeded
request draws the same token in any batch. Greedy rows (T = 0) take the argmax in the same launch
(ties: the lowest token id, as torch.argmax; NaN never wins).

A per-row floor (kernels/sampling_floor.py: top_k and min_p) limits a sampled row's candidates to
the logits at or above it. top_p_draw samples the candidates' top-p nucleus without sorting, by
rejection: the draw above, then a split pass for the mass above the drawn token whose last program per
row redraws the rows whose draw fell outside the nucleus (see its docstring).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.arrivals import arrival_counters
from tokenmill.kernels.penalties import Penalties, load_penalised, no_penalties_args, row_penalties
from tokenmill.kernels.sampling_layout import TILE, draw_layout, split_layout

MAX_DRAWS = 64
"""Rejection rounds before top_p_draw gives up and takes the argmax (each rejection at least halves,
on average, the candidates' mass outside the nucleus)."""
PARALLEL_ROUNDS = 2
"""Redraws spread over vocabulary splits before the rows still rejected go on in one program each."""
U_MAX = tl.constexpr(1.0 - 2.0**-24)
"""The largest float32 below 1: u * total stays below the total."""
LOG2E = tl.constexpr(1.0 / math.log(2.0))
NO_TOP = tl.constexpr(-3.4028234663852886e38)
"""The largest y of a lane or split without candidates: finite, so that 2^(y - top) never sees inf - inf."""
STATS = tl.constexpr(4)
"""Per (row, split): the largest candidate y, the candidates' mass 2^(y - largest) summed, and the mass
above the row's current draw in two slots, one per top-p round parity."""


@triton.jit
def _load_logits(row_ptr, token, vocab_size, penalties, PENALTIES: tl.constexpr):
    """The row's logits at `token` (-inf past the vocabulary) in float32, penalised in kernels compiled with
    PENALTIES (`penalties`: kernels/penalties.py's row_penalties)."""
    if PENALTIES:
        return load_penalised(row_ptr, token, vocab_size, penalties)
    else:
        return tl.load(row_ptr + token, mask=token < vocab_size, other=float("-inf")).to(tl.float32)


@triton.jit
def _penalties(row, pen_rows, pen_counts, pen_seen, pen_stride, pen_repetition, pen_frequency, pen_presence,
               PENALTIES: tl.constexpr):
    """The row's penalties from the kernel's penalty arguments (Penalties.kernel_args); without PENALTIES, a
    placeholder that nothing reads (a jit function cannot return None)."""
    if PENALTIES:
        return row_penalties(row, pen_rows, pen_counts, pen_seen, pen_stride, pen_repetition, pen_frequency,
                             pen_presence)
    else:
        return pen_rows


@triton.jit
def _uniform(seed, draw):
    """The row's uniform in [0, 1) for its draw number `draw`."""
    counter = tl.zeros([], tl.int32) + draw  # a tensor also when `draw` is a literal
    return tl.minimum(tl.random.uint_to_uniform_float(tl.randint(seed, counter)), U_MAX)


@triton.jit
def _lane_argmax(best, best_index):
    """Best value over the lanes, and the lowest token id that has it."""
    value = tl.max(best, 0)
    return value, tl.min(tl.where(best == value, best_index, 2147483647), 0)


@triton.jit
def _greedy_best(row_ptr, vocab_size, first_tile, last_tile, pen, TILE: tl.constexpr, PENALTIES: tl.constexpr):
    cols = tl.arange(0, TILE)
    best = tl.full([TILE], float("-inf"), tl.float32)
    best_index = first_tile * TILE + cols
    for tile in range(first_tile, last_tile):
        token = tile * TILE + cols
        x = _load_logits(row_ptr, token, vocab_size, pen, PENALTIES)
        better = x > best  # strict: the earliest token keeps a tie
        best = tl.where(better, x, best)
        best_index = tl.where(better, token, best_index)
    return _lane_argmax(best, best_index)


@triton.jit
def _split_stats(row_ptr, vocab_size, first_tile, last_tile, scale, floor, pen, TILE: tl.constexpr,
                 PENALTIES: tl.constexpr):
    """Over the candidates (x >= floor) of the tiles, y = x * scale: (largest y, sum of 2^(y - largest)),
    (NO_TOP, 0) without candidates. Online per lane: one exp2 per token, 2^-|y - m|, which either scales
    the sum down to a new maximum or is the token's own term."""
    cols = tl.arange(0, TILE)
    top = tl.full([TILE], NO_TOP, tl.float32)
    mass = tl.zeros([TILE], tl.float32)
    for tile in range(first_tile, last_tile):
        x = _load_logits(row_ptr, tile * TILE + cols, vocab_size, pen, PENALTIES)
        y = tl.where(x >= floor, x * scale, float("-inf"))  # NaN is no candidate either
        d = y - top
        e = tl.exp2(-tl.abs(d))
        up = d > 0
        mass = tl.where(up, mass * e + 1.0, mass + e)
        top = tl.where(up, y, top)
    split_top = tl.max(top, 0)
    return split_top, tl.sum(mass * tl.exp2(top - split_top), 0)


@triton.jit
def _mass_above(row_ptr, vocab_size, first_tile, last_tile, pivot, top, scale, pen, TILE: tl.constexpr,
                PENALTIES: tl.constexpr):
    """sum(2^(x * scale - top)) over the tiles' tokens above `pivot` (a candidate: those above it are too)."""
    cols = tl.arange(0, TILE)
    total = tl.zeros([TILE], tl.float32)
    for tile in range(first_tile, last_tile):
        x = _load_logits(row_ptr, tile * TILE + cols, vocab_size, pen, PENALTIES)
        total += tl.where(x > pivot, tl.exp2(x * scale - top), 0.0)
    return tl.sum(total, 0)


@triton.jit
def _pick(row_ptr, vocab_size, first_tile, last_tile, scale, floor, pivot, top, target, pen, TILE: tl.constexpr,
          PENALTIES: tl.constexpr):
    """The first token of the tiles at which the running sum of 2^(x * scale - top) over the candidates
    (x >= floor and x > pivot), in token order, exceeds `target`; the last candidate when rounding left
    the target at or above their whole sum."""
    cols = tl.arange(0, TILE)
    running = tl.zeros([], tl.float32)
    token = tl.full([], 2147483647, tl.int32)
    last = tl.full([], 0, tl.int32)
    tile = first_tile
    while (tile < last_tile) & (token == 2147483647):
        ids = tile * TILE + cols
        x = _load_logits(row_ptr, ids, vocab_size, pen, PENALTIES)
        p = tl.where((x >= floor) & (x > pivot), tl.exp2(x * scale - top), 0.0)
        cumulative = tl.cumsum(p, 0) + running
        token = tl.min(tl.where(cumulative > target, ids, 2147483647), 0)
        last = tl.maximum(last, tl.max(tl.where(p > 0, ids, 0), 0))
        running = tl.max(cumulative, 0)
        tile += 1
    return tl.where(token == 2147483647, last, token)


@triton.jit
def _row_floor(floor_ptr, row, has_floor):
    """The row's floor, or -inf without one (a runtime flag: one compiled variant serves both)."""
    return tl.where(has_floor != 0, tl.load(floor_ptr + row), float("-inf"))


@triton.jit
def _split_tiles(split, tiles_per_split, num_tiles):
    """The tiles [first, last) of a split."""
    first_tile = split * tiles_per_split
    return first_tile, tl.minimum(first_tile + tiles_per_split, num_tiles)


# The verdicts and draws that need all of a row's splits are made by the last of the row's split programs
# to arrive (an atomic counter per row), in the same launch: a plain draw is one launch, and top-p's rounds
# one launch each. The other programs' stores of the launch are read through L2 (.cg), and the counter is
# left at zero for the next launch.
@triton.jit
def _last_to_arrive(arrival_ptr, row, num_splits):
    """After a split program stored its statistics: whether it is the row's last (it then sees every program's
    stores: the atomic is acq_rel); the last one resets the counter for the next launch."""
    last = tl.atomic_add(arrival_ptr + row, 1) == num_splits - 1
    if last:
        tl.store(arrival_ptr + row, 0)
    return last


@triton.jit
def _best_split(value_ptr, index_ptr, row, num_splits, BLOCK: tl.constexpr):
    """The token of the row's best pass-1 partial (the lowest token id among equals)."""
    splits = tl.arange(0, BLOCK)
    mask = splits < num_splits
    value = tl.load(value_ptr + row * num_splits + splits, mask=mask, other=float("-inf"), cache_modifier=".cg")
    index = tl.load(index_ptr + row * num_splits + splits, mask=mask, other=2147483647, cache_modifier=".cg")
    _, best = _lane_argmax(value, index)
    return best


@triton.jit
def _draw_over_splits(row_ptr, stats_ptr, row, num_splits, slot, u, scale, floor, pivot, vocab_size, num_tiles,
                      tiles_per_split, pen, BLOCK: tl.constexpr, TILE: tl.constexpr, PENALTIES: tl.constexpr):
    """The inverse-CDF draw of uniform `u` over the row's candidates above `pivot`, whose mass per split is
    in the stats' column `slot` (1: all candidates; 2, 3: those above the current draw)."""
    splits = tl.arange(0, BLOCK)
    valid = splits < num_splits
    entry = stats_ptr + (row * num_splits + splits) * STATS
    tops = tl.load(entry, mask=valid, other=NO_TOP, cache_modifier=".cg")
    row_top = tl.max(tops, 0)
    weights = tl.load(entry + slot, mask=valid, other=0.0, cache_modifier=".cg") * tl.exp2(tops - row_top)
    cumulative = tl.cumsum(weights, 0)
    target = u * tl.max(cumulative, 0)
    chosen = tl.min(tl.where(cumulative > target, splits, BLOCK), 0)
    chosen = tl.where(chosen == BLOCK, tl.max(tl.where(weights > 0, splits, 0), 0), chosen)  # rounding, or no mass
    before = tl.max(tl.where(splits < chosen, cumulative, 0.0), 0)
    top = tl.max(tl.where(splits == chosen, tops, NO_TOP), 0)
    first_tile, last_tile = _split_tiles(chosen, tiles_per_split, num_tiles)
    return _pick(row_ptr, vocab_size, first_tile, last_tile, scale, floor, pivot, top,
                 (target - before) * tl.exp2(row_top - top), pen, TILE, PENALTIES)


# The split layout of greedy batches changes with the batch size: one compiled variant for all of it
# (Triton would otherwise compile one per divisibility class of these ints, mid-run, ~1 s each).
@triton.jit(do_not_specialize=["tiles_per_split", "num_splits", "has_floor"])
def _draw_kernel(
    logits_ptr, stride_row, temperature_ptr, seed_ptr, floor_ptr, stats_ptr, value_ptr, index_ptr, arrival_ptr,
    token_ptr, vocab_size, num_tiles, tiles_per_split, num_splits, has_floor,
    pen_rows, pen_counts, pen_seen, pen_stride, pen_repetition, pen_frequency, pen_presence,
    BLOCK: tl.constexpr, TILE: tl.constexpr, PENALTIES: tl.constexpr,
):
    """Per (row, split): the split's largest candidate y and mass (sampled rows), or its argmax (greedy rows);
    then the row's last program draws its token over the splits, or takes the best split's."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    pen = _penalties(row, pen_rows, pen_counts, pen_seen, pen_stride, pen_repetition, pen_frequency,
                     pen_presence, PENALTIES)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    first_tile, last_tile = _split_tiles(split, tiles_per_split, num_tiles)
    temperature = tl.load(temperature_ptr + row)
    floor = _row_floor(floor_ptr, row, has_floor)
    if temperature > 0:
        scale = LOG2E / temperature
        top, mass = _split_stats(row_ptr, vocab_size, first_tile, last_tile, scale, floor, pen, TILE, PENALTIES)
        entry = stats_ptr + (row * num_splits + split) * STATS
        tl.store(entry, top)
        tl.store(entry + 1, mass)
        if _last_to_arrive(arrival_ptr, row, num_splits):
            token = _draw_over_splits(row_ptr, stats_ptr, row, num_splits, 1, _uniform(tl.load(seed_ptr + row), 0),
                                      scale, floor, float("-inf"), vocab_size, num_tiles, tiles_per_split, pen, BLOCK,
                                      TILE, PENALTIES)
            tl.store(token_ptr + row, token.to(tl.int64))
    elif temperature == 0:  # greedy rows: no exp at all
        value, index = _greedy_best(row_ptr, vocab_size, first_tile, last_tile, pen, TILE, PENALTIES)
        tl.store(value_ptr + row * num_splits + split, value)
        tl.store(index_ptr + row * num_splits + split, index)
        if _last_to_arrive(arrival_ptr, row, num_splits):
            tl.store(token_ptr + row, _best_split(value_ptr, index_ptr, row, num_splits, BLOCK).to(tl.int64))


# top-p. Each launch of the mass kernel serves one draw of the rows still undecided: each split program
# stores the mass above the draw, and the row's last program judges it: kept, or (rejected) redrawn among
# the tokens above it, which the next launch judges; after the last parallel round, that program goes on
# alone until a draw is kept.
@triton.jit
def _nucleus_verdict(stats_ptr, row, num_splits, top_p, slot, BLOCK: tl.constexpr):
    """(rejected, row top, candidates' mass): rejected when the mass above the draw (column 2 + slot) is at
    least top_p of the candidates' (the draw is outside the nucleus)."""
    splits = tl.arange(0, BLOCK)
    mask = splits < num_splits
    stats = stats_ptr + (row * num_splits + splits) * STATS
    tops = tl.load(stats, mask=mask, other=NO_TOP, cache_modifier=".cg")
    row_top = tl.max(tops, 0)
    scale = tl.exp2(tops - row_top)
    total = tl.sum(tl.load(stats + 1, mask=mask, other=0.0, cache_modifier=".cg") * scale, 0)
    mass = tl.sum(tl.load(stats + 2 + slot, mask=mask, other=0.0, cache_modifier=".cg") * scale, 0)
    limit = top_p * total
    return (mass >= limit) & (limit > 0), row_top, total


@triton.jit(do_not_specialize=["tiles_per_split", "num_splits", "draw", "last_round", "has_floor"])
def _nucleus_mass_kernel(
    logits_ptr, stride_row, temperature_ptr, top_p_ptr, seed_ptr, floor_ptr, token_ptr, stats_ptr, arrival_ptr,
    rejected_ptr, vocab_size, num_tiles, tiles_per_split, num_splits, draw, last_round, has_floor,
    pen_rows, pen_counts, pen_seen, pen_stride, pen_repetition, pen_frequency, pen_presence,
    BLOCK: tl.constexpr, TILE: tl.constexpr, MAX_DRAWS: tl.constexpr, PENALTIES: tl.constexpr,
):
    """Per (row, split) of the top-p rows (draw 0) or of the rows redrawn (draw > 0): the mass above the row's
    draw `draw` into slot draw % 2; then the row's last program judges the draw, and redraws a rejected one
    (draw + 1) or, in the last round, finishes the row alone."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    if draw == 0:
        active = (temperature > 0) & (top_p < 1.0)
    else:
        active = tl.load(rejected_ptr + row) != 0  # read before this program arrives, so before it changes
    if active:
        pen = _penalties(row, pen_rows, pen_counts, pen_seen, pen_stride, pen_repetition, pen_frequency,
                         pen_presence, PENALTIES)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        first_tile, last_tile = _split_tiles(split, tiles_per_split, num_tiles)
        entry = stats_ptr + (row * num_splits + split) * STATS
        scale = LOG2E / temperature
        token = tl.load(token_ptr + row)
        pivot = _load_logits(row_ptr, token, vocab_size, pen, PENALTIES)
        above = _mass_above(row_ptr, vocab_size, first_tile, last_tile, pivot, tl.load(entry), scale, pen, TILE,
                            PENALTIES)
        tl.store(entry + 2 + draw % 2, above)
        if _last_to_arrive(arrival_ptr, row, num_splits):
            rejected, row_top, total = _nucleus_verdict(stats_ptr, row, num_splits, top_p, draw % 2, BLOCK)
            if rejected:
                seed = tl.load(seed_ptr + row)
                floor = _row_floor(floor_ptr, row, has_floor)
                if last_round != 0:  # rare: the rows still rejected go on in this one program
                    redrawn = _row_top_p_rounds(row_ptr, vocab_size, num_tiles, scale, seed, floor, top_p,
                                                token.to(tl.int32), row_top, total, draw + 1, pen, TILE, MAX_DRAWS,
                                                PENALTIES)
                else:
                    redrawn = _draw_over_splits(row_ptr, stats_ptr, row, num_splits, 2 + draw % 2,
                                                _uniform(seed, draw + 1), scale, floor, pivot, vocab_size, num_tiles,
                                                tiles_per_split, pen, BLOCK, TILE, PENALTIES)
                tl.store(token_ptr + row, redrawn.to(tl.int64))
            # the next launch serves the rows redrawn here; after the last round, none
            tl.store(rejected_ptr + row, tl.where(last_round == 0, rejected.to(tl.int32), 0))


@triton.jit
def _row_top_p_rounds(row_ptr, vocab_size, num_tiles, scale, seed, floor, top_p, token, top, total, draws, pen,
                      TILE: tl.constexpr, MAX_DRAWS: tl.constexpr, PENALTIES: tl.constexpr):
    """The rejection rounds of one row in one program, from its draw `token` (draw number draws - 1); `top`
    and `total`: the row's largest candidate y and its candidates' mass relative to it."""
    limit = top_p * total
    pivot = _load_logits(row_ptr, token, vocab_size, pen, PENALTIES)
    mass = _mass_above(row_ptr, vocab_size, 0, num_tiles, pivot, top, scale, pen, TILE, PENALTIES)
    while (mass >= limit) & (limit > 0) & (draws < MAX_DRAWS):
        token = _pick(row_ptr, vocab_size, 0, num_tiles, scale, floor, pivot, top, _uniform(seed, draws) * mass, pen,
                      TILE, PENALTIES)
        pivot = _load_logits(row_ptr, token, vocab_size, pen, PENALTIES)
        mass = _mass_above(row_ptr, vocab_size, 0, num_tiles, pivot, top, scale, pen, TILE, PENALTIES)
        draws += 1
    if (mass >= limit) & (limit > 0):  # out of draws (practically never): the most likely token is in every nucleus
        _, token = _greedy_best(row_ptr, vocab_size, 0, num_tiles, pen, TILE, PENALTIES)
    return token


@triton.jit
def row_draw(row_ptr, vocab_size, num_tiles, temperature, seed, floor, top_p, TILE: tl.constexpr,
             MAX_DRAWS: tl.constexpr):
    """top_p_draw's whole algorithm for one row in one program (a slow path: the program reads the row a
    few times): the same uniforms, so the same token as over splits, up to float rounding in the masses."""
    scale = LOG2E / temperature
    top, total = _split_stats(row_ptr, vocab_size, 0, num_tiles, scale, floor, None, TILE, False)
    token = _pick(row_ptr, vocab_size, 0, num_tiles, scale, floor, float("-inf"), top, _uniform(seed, 0) * total, None,
                  TILE, False)
    if top_p < 1.0:
        token = _row_top_p_rounds(row_ptr, vocab_size, num_tiles, scale, seed, floor, top_p, token, top, total,
                                  tl.full([], 1, tl.int32), None, TILE, MAX_DRAWS, False)
    return token


@triton.jit
def _candidate_pick(p, ids, target, vocab_size):
    """The inverse CDF over gathered candidates in token-id order, by bisection over the ids: the smallest
    id t with sum(p of the ids <= t) > target; the largest id with p > 0 when rounding left none."""
    lo = tl.zeros([], tl.int32)
    hi = vocab_size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        enough = tl.sum(tl.where(ids <= mid, p, 0.0), 0) > target
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    found = tl.sum(tl.where(ids <= lo, p, 0.0), 0) > target
    return tl.where(found, lo, tl.max(tl.where(p > 0, ids, 0), 0))


@triton.jit
def candidate_draw(x, ids, seed, temperature, top_p, row_max, vocab_size, MAX_DRAWS: tl.constexpr):
    """top_p_draw's draw and rejection rounds over gathered candidates (x: their logits, -inf in empty slots;
    ids: their token ids), in one program, with the same uniforms: its token, up to float rounding in the
    masses."""
    scale = LOG2E / temperature
    p = tl.exp2(x * scale - row_max * scale)
    token = _candidate_pick(p, ids, _uniform(seed, 0) * tl.sum(p, 0), vocab_size)
    if top_p < 1.0:
        limit = top_p * tl.sum(p, 0)
        draws = tl.full([], 1, tl.int32)
        above = tl.where(x > tl.max(tl.where(ids == token, x, float("-inf")), 0), p, 0.0)
        mass = tl.sum(above, 0)
        while (mass >= limit) & (limit > 0) & (draws < MAX_DRAWS):
            token = _candidate_pick(above, ids, _uniform(seed, draws) * mass, vocab_size)
            above = tl.where(x > tl.max(tl.where(ids == token, x, float("-inf")), 0), p, 0.0)
            mass = tl.sum(above, 0)
            draws += 1
        if (mass >= limit) & (limit > 0):  # out of draws: the most likely token, as top_p_draw
            token = tl.min(tl.where(x == row_max, ids, 2147483647), 0)
    return token


def categorical_draw(
    logits: torch.Tensor,  # [num_rows, vocab] float32/float16/bfloat16; any row stride
    temperature: torch.Tensor,  # [num_rows] float32; 0 = greedy (the plain argmax); < 0: skip the row
    seeds: torch.Tensor,  # [num_rows] int64 Philox key per row
    floor: torch.Tensor | None = None,  # [num_rows] float32: sampled rows draw among logits >= floor
    tile: int = TILE,
    tiles_per_split: int | None = None,
    out: torch.Tensor | None = None,  # [num_rows] int64: the tokens go here (skipped rows keep theirs)
    penalties: Penalties | None = None,  # applied to each logit as it is loaded
    num_warps: int = 4,
) -> torch.Tensor:
    """One token per row from softmax(logits / T) over its candidates, no host sync. Returns [num_rows] int64.

    `tile` and `tiles_per_split` (tests use small ones) change only the order in which the masses are
    summed, so a token only where u falls within float rounding of a boundary between two tokens.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows > 0:
        _draw(logits, temperature, seeds, floor, draw_layout(vocab_size, tile, tiles_per_split), tile, out, penalties,
              num_warps=num_warps)
    return out


def _penalty_args(penalties: Penalties | None, placeholder: torch.Tensor) -> tuple[tuple, bool]:
    """(the kernels' penalty arguments, PENALTIES)."""
    return (no_penalties_args(placeholder), False) if penalties is None else (penalties.kernel_args(), True)


def _zeroed_counters(num_rows: int, count: int, device: torch.device) -> torch.Tensor:
    """[count, num_rows] of kernels.arrivals' zeroed int32 counters, each row 16-byte aligned whatever num_rows
    (one compiled variant). The kernels leave them at zero: the last program of a row to arrive resets its
    arrival counter, and a top-p row's last round clears its rejected flag."""
    padded = -(-num_rows // 4) * 4
    return arrival_counters(device, count * padded)[: count * padded].view(count, padded)[:, :num_rows]


def _draw(logits, temperature, seeds, floor, layout, tile, out, penalties, stats=None, arrivals=None, num_warps=4
          ) -> torch.Tensor:
    """_draw_kernel's launch; returns the greedy rows' per-split maxima."""
    num_rows, vocab_size = logits.shape
    num_tiles, tiles_per_split, num_splits = layout
    device = logits.device
    pen_args, has_penalties = _penalty_args(penalties, temperature)
    values = torch.empty(num_rows, num_splits, dtype=torch.float32, device=device)
    indices = torch.empty(num_rows, num_splits, dtype=torch.int32, device=device)
    if stats is None:
        stats = torch.empty(num_rows, num_splits, STATS.value, dtype=torch.float32, device=device)
    if arrivals is None:
        arrivals = _zeroed_counters(num_rows, 1, device)[0]
    has_floor = int(floor is not None)
    # BLOCK from the tile count (>= any split count of this vocabulary): one variant for every layout.
    _draw_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), temperature, seeds, floor if has_floor else temperature, stats, values, indices,
        arrivals, out, vocab_size, num_tiles, tiles_per_split, num_splits, has_floor, *pen_args,
        BLOCK=triton.next_power_of_2(num_tiles), TILE=tile, PENALTIES=has_penalties, num_warps=num_warps,
    )
    return values


def greedy_argmax(logits: torch.Tensor, penalties: Penalties | None = None) -> torch.Tensor:
    """torch.argmax over the last dimension (the lowest index among equal maxima; NaN never wins), through
    categorical_draw's greedy path, which reads the logits once at full bandwidth over a layout as wide as
    the batch needs (an argmax does not depend on it)."""
    return _greedy(logits, penalties)[0]


def split_maxima(logits: torch.Tensor, penalties: Penalties | None = None) -> torch.Tensor:
    """[num_rows, num_splits] float32: the largest (penalised) logit of each split of split_layout, as
    candidate_floor's `maxima` (min_p), from greedy_argmax's pass."""
    return _greedy(logits, penalties)[1]


def _greedy(logits: torch.Tensor, penalties: Penalties | None) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    device = logits.device
    # One zero-fill: the greedy rows' zero temperatures and seeds, and the output, so that it holds valid ids when a
    # recording run skips the launch (kernels/precompile.py: a drafter's graph feeds its argmax back as input ids).
    zeros = torch.zeros(3, num_rows, dtype=torch.int64, device=device)
    out, seeds, temperature = zeros[0], zeros[1], zeros[2].view(torch.float32)[:num_rows]
    layout = split_layout(num_rows, vocab_size, TILE)
    if num_rows == 0:
        return out, torch.empty(0, layout[2], dtype=torch.float32, device=device)
    maxima = _draw(logits, temperature, seeds, None, layout, TILE, out, penalties)
    return out, maxima


def top_p_draw(
    logits: torch.Tensor,  # [num_rows, vocab] float32/float16/bfloat16; any row stride
    temperature: torch.Tensor,  # [num_rows] float32; 0 = greedy (the plain argmax); < 0: skip the row
    top_p: torch.Tensor,  # [num_rows] float32 in (0, 1]; 1 = the whole row
    seeds: torch.Tensor,  # [num_rows] int64 Philox key per row
    floor: torch.Tensor | None = None,  # [num_rows] float32: the nucleus of the logits >= floor
    tile: int = TILE,
    tiles_per_split: int | None = None,
    parallel_rounds: int = PARALLEL_ROUNDS,
    out: torch.Tensor | None = None,  # [num_rows] int64: the tokens go here (skipped rows keep theirs)
    penalties: Penalties | None = None,  # applied to each logit as it is loaded
) -> torch.Tensor:
    """One token per row from softmax(logits / T) restricted to its top-p nucleus, without a sort; no host sync.

    The nucleus is the set of candidates whose strictly more likely candidates hold less than top_p of
    the candidates' probability, so tokens tied with its least likely member are all in it (a sort keeps
    an arbitrary subset of them). Rejection sampling: categorical_draw's draw over the candidates (so rows
    with top_p = 1 get its token), then a split pass for the mass above the draw. A draw with top_p or
    more above it is outside the nucleus (probability about 1 - top_p), and so is every token at most as
    likely: the row redraws among the tokens above it (their mass per split is what the pass found), until
    a draw is inside. The candidates always hold the whole nucleus, so the accepted draw is exactly a draw
    from the renormalised nucleus. The first `parallel_rounds` redraws are judged over vocabulary splits,
    one launch each; rows still rejected after them (rare: each round leaves about 1 - top_p of the rows)
    go on in one program per row. 1 + parallel_rounds + 1 launches in all.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    device = logits.device
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return out
    num_tiles, tiles_per_split, num_splits = layout = draw_layout(vocab_size, tile, tiles_per_split)
    stats = torch.empty(num_rows, num_splits, STATS.value, dtype=torch.float32, device=device)
    arrivals, rejected = _zeroed_counters(num_rows, 2, device)  # rows skipped are never rejected
    _draw(logits, temperature, seeds, floor, layout, tile, out, penalties, stats=stats, arrivals=arrivals)
    pen_args, has_penalties = _penalty_args(penalties, temperature)
    has_floor = int(floor is not None)
    for draw in range(parallel_rounds + 1):
        _nucleus_mass_kernel[(num_rows, num_splits)](
            logits, logits.stride(0), temperature, top_p, seeds, floor if has_floor else temperature, out, stats,
            arrivals, rejected, vocab_size, num_tiles, tiles_per_split, num_splits, draw,
            int(draw == parallel_rounds), has_floor, *pen_args, BLOCK=triton.next_power_of_2(num_tiles), TILE=tile,
            MAX_DRAWS=MAX_DRAWS, PENALTIES=has_penalties,
        )
    return out


def philox_uniform_ref(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Triton's randint4x + uint_to_uniform_float in numpy: [rows] keys x [cols] 32-bit counters ->
    [4, rows, cols]."""
    mask = np.uint64(0xFFFFFFFF)
    seeds = seeds.astype(np.uint64)[:, None]
    k0, k1 = seeds & mask, seeds >> np.uint64(32)
    c0 = np.broadcast_to(counters.astype(np.uint64)[None, :], (len(seeds), len(counters)))
    c1 = c2 = c3 = np.zeros_like(c0)
    round_a, round_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        hi_b, hi_a = (round_b * c2) >> np.uint64(32), (round_a * c0) >> np.uint64(32)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, (round_b * c2) & mask, hi_a ^ c3 ^ k1, (round_a * c0) & mask
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    signed = np.stack([c0, c1, c2, c3]).astype(np.int64)
    signed = np.where(signed >= 2**31, signed - 2**32, signed)  # the int32 bitcast
    folded = np.where(signed < 0, -signed - 1, signed)
    return folded.astype(np.float32) * np.float32(4.6566127342e-10)


def uniform_ref(seeds: torch.Tensor, draw: int) -> np.ndarray:
    """The kernels' uniform of each row's draw number `draw` (float32, as they compute it), as float64."""
    seeds = seeds.cpu().numpy()
    u = philox_uniform_ref(seeds, np.array([draw]))[0, :, 0]
    return np.minimum(u, np.float32(U_MAX.value)).astype(np.float64)


def below_floor_ref(logits: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor | None) -> torch.Tensor:
    """float32 logits on the CPU, -inf where a sampled row's logit is below its floor (greedy rows keep theirs)."""
    x = logits.float().cpu()
    if floor is None:
        return x
    below = (x < floor.cpu()[:, None]) & (temperature.cpu() > 0)[:, None]
    return x.masked_fill(below, float("-inf"))


def _inverse_cdf_ref(weights: torch.Tensor, u: float) -> int:
    """The first index at which the running sum of `weights` (float64) exceeds u * their sum."""
    cumulative = weights.cumsum(0)
    return int(min(torch.searchsorted(cumulative, u * float(cumulative[-1]), right=True), len(weights) - 1))


def categorical_draw_ref(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, floor: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's draw in float64 on the CPU, with its uniforms."""
    x = below_floor_ref(logits, temperature, floor).double()
    u = uniform_ref(seeds, 0)
    tokens = x.argmax(dim=-1)  # greedy rows
    for row in range(len(x)):
        t = float(temperature[row])
        if t > 0:
            tokens[row] = _inverse_cdf_ref(((x[row] - x[row].max()) / t).exp(), u[row])
    return tokens.to(logits.device)


def top_p_draw_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
    floor: torch.Tensor | None = None,
) -> torch.Tensor:
    """top_p_draw's rejection rounds on categorical_draw_ref (draw k: the row's k-th uniform), in float64."""
    x = below_floor_ref(logits, temperature, floor).double()
    tokens = categorical_draw_ref(logits, temperature, seeds, floor).cpu()
    for row in range(len(x)):
        t, p = float(temperature[row]), float(top_p[row])
        if t <= 0 or p >= 1:
            continue
        probs = ((x[row] - x[row].max()) / t).exp()
        for k in range(1, MAX_DRAWS + 1):
            above = probs * (x[row] > x[row, tokens[row]])
            if above.sum() < p * probs.sum():
                break
            tokens[row] = _inverse_cdf_ref(above, float(uniform_ref(seeds[row : row + 1], k)[0]))
    return tokens.to(logits.device)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
