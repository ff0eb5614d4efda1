"""Each sampled row's candidate floor: the smallest logit its top_k and min_p keep, without a sort.

min_p keeps p >= min_p * p_max, that is x >= max(x) + T * log(min_p). top_k keeps the logits at least
as large as the k-th largest (ties with it are kept, as the torch full-vocabulary path does). The
draw kernels (kernels/sampling.py) then sample among the logits >= floor.

The k-th largest logit, for k up to MAX_FAST_K (256), takes three passes:
  1. per (row, split), the k-th largest of the split's lane maxima (a sort of TILE values): the split
     has k distinct tokens at least that large, so the largest of these over the splits, L, is at most
     the row's k-th largest;
  2. the tokens >= L (typically a few times k) are gathered into CANDIDATES slots per row;
  3. one program per row sorts them: the k-th is exact. Asked to (`CandidateDraw`), it also draws the
     row's token among them, with the full-vocabulary draw's uniforms and rejection rounds.
When the caller knows every sampled row's k is that small, the rows whose candidates overflow take one
program each instead (the radix select below and the draw, whole-row). Otherwise, rows whose candidates
overflow, and larger k, take a radix select on an order-preserving integer key
of each logit (float32 bits, sign-folded): round by round, a histogram of the next digit (DIGIT_BITS
bits) of the keys that share the prefix found so far, over vocabulary splits in parallel; then one
program per row sums the splits and picks the digit at which the count from the top reaches k.
(About 90 us a round at batch 256 over 151,936 tokens on an H200, against 150 us for all three passes.)
The keys of bfloat16 and float16 logits differ only in their high 16 and 19 bits, so fewer rounds
find the exact value than for float32. Its launches run for every batch with a top_k; rows that do
not need them leave at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.sampling import MAX_DRAWS, candidate_draw, row_draw
from tokenmill.kernels.sampling_layout import TILE, split_layout

DIGIT_BITS = 8
"""Radix digit: 8 bits, 2 rounds for 16-bit logits. 4-bit digits cost the same in all (a 16-bin round
costs half a 256-bin one: Triton's histogram takes a warp ballot per bin) but need twice the launches."""
CANDIDATES = 2048
"""Slots per row for the tokens >= L; a row with more takes the radix select."""
BOUND_SPLITS = 4
"""Splits per row in pass 1: more splits, more programs but a looser L (about BOUND_SPLITS * k candidates)."""
SMALL_SLOTS = tl.constexpr(256)
"""Rows with at most this many candidates sort and draw over these slots only (k <= MAX_FAST_K fits)."""
MAX_FAST_K = CANDIDATES // BOUND_SPLITS // 2
"""Largest k of the three-pass path: about half the slots filled (at most TILE, the lane maxima sorted)."""
KEY_BITS = {torch.bfloat16: 16, torch.float16: 19, torch.float32: 32}
"""The high bits of the float32 key in which two values of the logits dtype can differ."""


def radix_rounds(dtype: torch.dtype, digit_bits: int) -> int:
    """Rounds of the radix select that pin down a logit of this dtype exactly."""
    return -(-KEY_BITS[dtype] // digit_bits)


@triton.jit
def _order_key(x):
    """float32 -> uint32 with the floats' order (NaN above +inf): flip every bit of a negative, set the sign
    bit of a positive."""
    bits = x.to(tl.uint32, bitcast=True)
    return bits ^ tl.where((bits >> 31) != 0, tl.full(bits.shape, 0xFFFFFFFF, tl.uint32),
                           tl.full(bits.shape, 0x80000000, tl.uint32))


@triton.jit
def _key_value(key):
    """The float32 whose key is `key` (an int64 in [0, 2^32): the inverse of _order_key)."""
    bits = tl.where(key >= 2147483648, key - 2147483648, -1 - key)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _pick_digit(counts, wanted, NUM_BINS: tl.constexpr):
    """counts[i]: the keys whose digit is NUM_BINS - 1 - i. The digit at which the count from the top
    reaches `wanted`, and how many keys have a larger digit."""
    at_or_above = tl.cumsum(counts, 0)
    i = tl.min(tl.where(at_or_above >= wanted, tl.arange(0, NUM_BINS), NUM_BINS), 0)
    return NUM_BINS - 1 - i, tl.sum(tl.where(tl.arange(0, NUM_BINS) == i, at_or_above - counts, 0), 0)


@triton.jit(do_not_specialize=["tiles_per_split", "num_splits", "shift", "has_select", "need_max"])
def _radix_histogram_kernel(
    logits_ptr, stride_row, temperature_ptr, select_ptr, prefix_ptr, hist_ptr, max_ptr,
    vocab_size, num_tiles, tiles_per_split, num_splits, shift, has_select, need_max,
    DIGIT_BITS: tl.constexpr, TILE: tl.constexpr,
):
    """Per (row, split) of the rows flagged in `select_ptr`: counts of the next digit (bits shift ..
    shift + DIGIT_BITS - 1 of the key) among the keys whose higher bits equal the row's prefix; with
    `need_max` (the first round) the split's largest logit too, for min_p."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    selects = (has_select != 0) & (tl.load(select_ptr + row) != 0)
    if (tl.load(temperature_ptr + row) > 0) & (selects | (need_max != 0)):
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        first_round = shift == 32 - DIGIT_BITS
        prefix = tl.where(first_round, 0, tl.load(prefix_ptr + row)).to(tl.uint32)  # unset before round 1
        cols = tl.arange(0, TILE)
        top = tl.full([TILE], float("-inf"), tl.float32)
        NUM_BINS: tl.constexpr = 1 << DIGIT_BITS
        counts = tl.zeros([NUM_BINS], tl.int32)
        first_tile = split * tiles_per_split
        for tile in range(first_tile, tl.minimum(first_tile + tiles_per_split, num_tiles)):
            token = tile * TILE + cols
            valid = token < vocab_size
            x = tl.load(row_ptr + token, mask=valid, other=float("-inf")).to(tl.float32)
            top = tl.maximum(top, x)
            if selects:
                key = _order_key(x)
                # Two shifts: one by 32 (the first round's) is undefined for a 32-bit key.
                match = valid & (((key >> (shift + DIGIT_BITS - 1)) >> 1) == prefix)
                if tl.max(match.to(tl.int32), 0) > 0:
                    counts += tl.histogram(((key >> shift) & (NUM_BINS - 1)).to(tl.int32), NUM_BINS, mask=match)
        if selects:
            tl.store(hist_ptr + (row * num_splits + split) * NUM_BINS + tl.arange(0, NUM_BINS), counts)
        if need_max != 0:
            tl.store(max_ptr + row * num_splits + split, tl.max(top, 0))


@triton.jit(do_not_specialize=["num_splits", "shift", "has_select", "last_round", "has_min_p"])
def _radix_select_kernel(
    temperature_ptr, top_k_ptr, select_ptr, min_p_ptr, prefix_ptr, remaining_ptr, hist_ptr, max_ptr, floor_ptr,
    num_splits, shift, has_select, last_round, has_min_p, DIGIT_BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per row: the next digit of the k-th largest key (rows flagged in `select_ptr`); after the last round,
    the row's floor: the k-th largest (or the floor the fast path left), raised to min_p's bound."""
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0:
        floor = tl.load(floor_ptr + row)
        if (has_select != 0) & (tl.load(select_ptr + row) != 0):
            k = tl.load(top_k_ptr + row)
            if shift == 32 - DIGIT_BITS:  # the first round
                prefix = tl.zeros([], tl.int64)
                wanted = k.to(tl.int32)
            else:
                prefix = tl.load(prefix_ptr + row)
                wanted = tl.load(remaining_ptr + row)
            # Digits from the top down: counts[i] is the count of digit NUM_BINS - 1 - i.
            NUM_BINS: tl.constexpr = 1 << DIGIT_BITS
            down = NUM_BINS - 1 - tl.arange(0, NUM_BINS)
            counts = tl.zeros([NUM_BINS], tl.int32)
            for split in range(num_splits):
                counts += tl.load(hist_ptr + (row * num_splits + split) * NUM_BINS + down)
            digit, above = _pick_digit(counts, wanted, NUM_BINS)
            prefix = (prefix << DIGIT_BITS) | digit
            tl.store(prefix_ptr + row, prefix)
            tl.store(remaining_ptr + row, wanted - above)
            # Lower bits zero: for a negative value the key's zeros are the float's trailing ones, so the
            # floor lies between the k-th value and the next lower value of the logits' dtype.
            floor = _key_value(prefix << shift)
        if last_round != 0:
            splits = tl.arange(0, BLOCK)
            row_max = tl.max(tl.load(max_ptr + row * num_splits + splits, mask=(splits < num_splits) & (has_min_p != 0),
                                     other=float("-inf")), 0)
            tl.store(floor_ptr + row, _with_min_p(floor, row_max, temperature, min_p_ptr, row, has_min_p))


@triton.jit
def _with_min_p(floor, row_max, temperature, min_p_ptr, row, has_min_p):
    """The floor raised to min_p's bound, max(x) + T * log(min_p), where the row has a min_p."""
    if has_min_p != 0:
        min_p = tl.load(min_p_ptr + row)
        if min_p > 0:
            floor = tl.maximum(floor, row_max + temperature * tl.log(min_p))
    return floor


@triton.jit
def _fast_path_row(temperature_ptr, top_k_ptr, row, vocab_size, MAX_K: tl.constexpr):
    k = tl.load(top_k_ptr + row)
    return (tl.load(temperature_ptr + row) > 0) & (k < vocab_size) & (k <= MAX_K), k


@triton.jit(do_not_specialize=["tiles_per_split", "num_splits"])
def _lane_bound_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, bound_ptr, vocab_size, num_tiles, tiles_per_split,
    num_splits, MAX_K: tl.constexpr, TILE: tl.constexpr,
):
    """Pass 1, per (row, split): the k-th largest of the split's lane maxima."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    fast, k = _fast_path_row(temperature_ptr, top_k_ptr, row, vocab_size, MAX_K)
    if fast:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        cols = tl.arange(0, TILE)
        lane_top = tl.full([TILE], float("-inf"), tl.float32)
        first_tile = split * tiles_per_split
        for tile in range(first_tile, tl.minimum(first_tile + tiles_per_split, num_tiles)):
            token = tile * TILE + cols
            lane_top = tl.maximum(lane_top, tl.load(row_ptr + token, mask=token < vocab_size,
                                                    other=float("-inf")).to(tl.float32))
        ordered = tl.sort(lane_top, descending=True)
        tl.store(bound_ptr + row * num_splits + split, tl.max(tl.where(cols == k - 1, ordered, float("-inf")), 0))


@triton.jit(do_not_specialize=["tiles_per_split", "bound_splits"])
def _gather_candidates_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, bound_ptr, count_ptr, candidate_ptr, id_ptr, vocab_size,
    num_tiles, tiles_per_split, bound_splits, MAX_K: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr,
    CAPACITY: tl.constexpr,
):
    """Pass 2, per (row, split): the logits >= L into the row's slots (in any order; a count past CAPACITY
    marks an overflow)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    fast, _ = _fast_path_row(temperature_ptr, top_k_ptr, row, vocab_size, MAX_K)
    if fast:
        splits = tl.arange(0, BLOCK)
        bound = tl.max(tl.load(bound_ptr + row * bound_splits + splits, mask=splits < bound_splits,
                               other=float("-inf")), 0)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        cols = tl.arange(0, TILE)
        first_tile = split * tiles_per_split
        for tile in range(first_tile, tl.minimum(first_tile + tiles_per_split, num_tiles)):
            token = tile * TILE + cols
            valid = token < vocab_size
            x = tl.load(row_ptr + token, mask=valid, other=float("-inf")).to(tl.float32)
            kept = valid & (x >= bound)
            # One slot per kept token from the row's counter (few tokens pass: few atomics).
            slot = tl.atomic_add(count_ptr + row + tl.zeros_like(cols), 1, mask=kept)
            tl.store(candidate_ptr + row * CAPACITY + slot, x, mask=kept & (slot < CAPACITY))
            tl.store(id_ptr + row * CAPACITY + slot, token, mask=kept & (slot < CAPACITY))


@triton.jit(do_not_specialize=["has_min_p", "has_top_p", "draw_here"])
def _select_candidates_kernel(
    temperature_ptr, top_k_ptr, min_p_ptr, top_p_ptr, seed_ptr, count_ptr, candidate_ptr, id_ptr, floor_ptr,
    select_ptr, token_ptr, skip_ptr, vocab_size, has_min_p, has_top_p, draw_here,
    MAX_K: tl.constexpr, CAPACITY: tl.constexpr, MAX_DRAWS: tl.constexpr,
):
    """Pass 3, per row: the k-th largest candidate is the floor; rows that overflowed (or have a k above
    MAX_K) are flagged for the radix select. With `draw_here`, the row's token is drawn here too, among
    the candidates above its floor (min_p included), and the row's draw temperature becomes -1 so that
    the full-vocabulary draw skips it."""
    row = tl.program_id(0)
    fast, k = _fast_path_row(temperature_ptr, top_k_ptr, row, vocab_size, MAX_K)
    temperature = tl.load(temperature_ptr + row)
    radix = ((temperature > 0) & (k < vocab_size)).to(tl.int32)
    if fast:
        count = tl.load(count_ptr + row)
        if count <= CAPACITY:
            radix = radix * 0
        # The sort and the draw cost with the slots they cover: most rows fill few.
        if count <= SMALL_SLOTS:
            _floor_and_draw(row, k, count, temperature, min_p_ptr, top_p_ptr, seed_ptr, candidate_ptr, id_ptr,
                            floor_ptr, token_ptr, skip_ptr, vocab_size, has_min_p, has_top_p, draw_here, CAPACITY,
                            SMALL_SLOTS, MAX_DRAWS)
        elif count <= CAPACITY:
            _floor_and_draw(row, k, count, temperature, min_p_ptr, top_p_ptr, seed_ptr, candidate_ptr, id_ptr,
                            floor_ptr, token_ptr, skip_ptr, vocab_size, has_min_p, has_top_p, draw_here, CAPACITY,
                            CAPACITY, MAX_DRAWS)
    tl.store(select_ptr + row, radix)


@triton.jit
def _floor_and_draw(row, k, count, temperature, min_p_ptr, top_p_ptr, seed_ptr, candidate_ptr, id_ptr, floor_ptr,
                    token_ptr, skip_ptr, vocab_size, has_min_p, has_top_p, draw_here, CAPACITY: tl.constexpr,
                    SLOTS: tl.constexpr, MAX_DRAWS: tl.constexpr):
    """Pass 3 for a row whose `count` candidates fit in its first SLOTS slots: the floor, and the draw."""
    slots = tl.arange(0, SLOTS)
    values = tl.load(candidate_ptr + row * CAPACITY + slots, mask=slots < count, other=float("-inf"))
    ordered = tl.sort(values, descending=True)
    floor = _with_min_p(tl.max(tl.where(slots == k - 1, ordered, float("-inf")), 0), tl.max(values, 0),
                        temperature, min_p_ptr, row, has_min_p)
    tl.store(floor_ptr + row, floor)
    if draw_here != 0:
        row_max = tl.max(values, 0)
        top_p = tl.where(has_top_p != 0, tl.load(top_p_ptr + row), 1.0)
        ids = tl.load(id_ptr + row * CAPACITY + slots, mask=slots < count, other=0)
        token = candidate_draw(tl.where(values >= floor, values, float("-inf")), ids, tl.load(seed_ptr + row),
                               temperature, top_p, row_max, vocab_size, MAX_DRAWS)
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(skip_ptr + row, -1.0)


@triton.jit
def _row_kth(row_ptr, vocab_size, num_tiles, k, ROUNDS: tl.constexpr, DIGIT_BITS: tl.constexpr, TILE: tl.constexpr):
    """The radix select of one row in one program: (the floor of its k-th largest logit, its largest)."""
    NUM_BINS: tl.constexpr = 1 << DIGIT_BITS
    cols = tl.arange(0, TILE)
    prefix = tl.zeros([], tl.int64)
    wanted = k.to(tl.int32)
    top = tl.full([TILE], float("-inf"), tl.float32)
    for r in tl.static_range(ROUNDS):
        shift = 32 - DIGIT_BITS * (r + 1)  # constexpr: r is
        counts = tl.zeros([NUM_BINS], tl.int32)
        for tile in range(0, num_tiles):
            token = tile * TILE + cols
            valid = token < vocab_size
            x = tl.load(row_ptr + token, mask=valid, other=float("-inf")).to(tl.float32)
            if r == 0:
                top = tl.maximum(top, x)
            key = _order_key(x)
            match = valid & (((key >> (shift + DIGIT_BITS - 1)) >> 1) == prefix.to(tl.uint32))
            # Digits counted from the top: bin i holds digit NUM_BINS - 1 - i.
            counts += tl.histogram((NUM_BINS - 1 - ((key >> shift) & (NUM_BINS - 1))).to(tl.int32), NUM_BINS,
                                   mask=match)
        digit, above = _pick_digit(counts, wanted, NUM_BINS)
        prefix = (prefix << DIGIT_BITS) | digit
        wanted = wanted - above
    return _key_value(prefix << (32 - DIGIT_BITS * ROUNDS)), tl.max(top, 0)


@triton.jit(do_not_specialize=["num_tiles", "has_min_p", "has_top_p", "draw_here"])
def _overflow_rows_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, min_p_ptr, top_p_ptr, seed_ptr, select_ptr, floor_ptr,
    token_ptr, skip_ptr, vocab_size, num_tiles, has_min_p, has_top_p, draw_here,
    ROUNDS: tl.constexpr, DIGIT_BITS: tl.constexpr, TILE: tl.constexpr, MAX_DRAWS: tl.constexpr,
):
    """Per row whose candidates overflowed (flagged by pass 3): the radix select over the whole row and the
    row's draw, each in this one program. Slow for the row, rare, and one launch instead of the split
    passes' several when every sampled row's top_k is small."""
    row = tl.program_id(0)
    if tl.load(select_ptr + row) != 0:
        temperature = tl.load(temperature_ptr + row)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        floor, row_max = _row_kth(row_ptr, vocab_size, num_tiles, tl.load(top_k_ptr + row), ROUNDS, DIGIT_BITS,
                                  TILE)
        floor = _with_min_p(floor, row_max, temperature, min_p_ptr, row, has_min_p)
        tl.store(floor_ptr + row, floor)
        if draw_here != 0:
            top_p = tl.where(has_top_p != 0, tl.load(top_p_ptr + row), 1.0)
            token = row_draw(row_ptr, vocab_size, num_tiles, temperature, tl.load(seed_ptr + row), floor, top_p,
                             TILE, MAX_DRAWS)
            tl.store(token_ptr + row, token.to(tl.int64))
            tl.store(skip_ptr + row, -1.0)


@dataclass
class CandidateDraw:
    """Asks candidate_floor to draw the tokens of the rows its three-pass path serves (kernels/sampling.py's
    rejection rounds over their few candidates, with the same uniforms), instead of leaving them to the
    full-vocabulary draw. The drawn rows get their token in `tokens` and -1 in `temperature`, which the
    full-vocabulary draw then skips."""

    top_p: torch.Tensor | None  # [num_rows] float32
    seeds: torch.Tensor  # [num_rows] int64
    tokens: torch.Tensor  # [num_rows] int64, written
    temperature: torch.Tensor  # [num_rows] float32, a copy of the draw temperature, written


def candidate_floor(
    logits: torch.Tensor,  # [num_rows, vocab] float32/float16/bfloat16; any row stride
    temperature: torch.Tensor,  # [num_rows] float32; 0 = greedy (no floor)
    top_k: torch.Tensor | None,  # [num_rows] int64; >= vocab = no top_k
    min_p: torch.Tensor | None,  # [num_rows] float32; 0 = no min_p
    tiles_per_split: int | None = None,
    digit_bits: int = DIGIT_BITS,
    maxima: torch.Tensor | None = None,
    fast_top_k: bool = True,
    draw: CandidateDraw | None = None,
    small_top_k: bool = False,
) -> torch.Tensor:
    """[num_rows] float32: the sampled rows' smallest kept logit (-inf: all kept; undefined in greedy rows).

    `maxima`: [num_rows, num_splits] of this layout, each split's largest logit, when a pass that wrote
    the logits found them (kernels/penalties.py): min_p alone then reads no logit. `fast_top_k=False`
    sends every top_k row to the radix select (tests and benchmarks). `small_top_k`: the caller knows
    that every sampled row has a top_k of at most MAX_FAST_K; the rows whose candidates overflow then
    take one program each (a single launch) instead of the radix select's split passes.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    device = logits.device
    floor = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=device)
    if num_rows == 0:
        return floor
    num_tiles, tiles_per_split, num_splits = split_layout(num_rows, vocab_size, TILE, tiles_per_split)
    prefix = torch.empty(num_rows, dtype=torch.int64, device=device)
    remaining = torch.empty(num_rows, dtype=torch.int32, device=device)
    # Without a top_k, placeholders of the same dtypes: one compiled variant of each kernel.
    select, top_k_or_placeholder = remaining, prefix
    if top_k is not None:
        top_k_or_placeholder = top_k
        if fast_top_k:
            select = _fast_top_k(logits, temperature, top_k, min_p, floor, num_tiles, tiles_per_split, num_splits,
                                 draw)
            if small_top_k:
                _overflow_rows(logits, temperature, top_k, min_p, select, floor, num_tiles, digit_bits, draw)
                return floor
        else:
            select = ((top_k < vocab_size) & (temperature > 0)).to(torch.int32)
    need_max = min_p is not None and maxima is None
    if maxima is None:
        maxima = torch.empty(num_rows, num_splits, dtype=torch.float32, device=device)
    rounds = radix_rounds(logits.dtype, digit_bits) if top_k is not None else 1
    hist = torch.empty(num_rows, num_splits, 1 << digit_bits, dtype=torch.int32, device=device)
    has_select = int(top_k is not None)
    for r in range(rounds):
        shift = 32 - digit_bits * (r + 1)
        if has_select or need_max:
            _radix_histogram_kernel[(num_rows, num_splits)](
                logits, logits.stride(0), temperature, select, prefix, hist, maxima, vocab_size, num_tiles,
                tiles_per_split, num_splits, shift, has_select, int(need_max and r == 0), DIGIT_BITS=digit_bits,
                TILE=TILE,
            )
        # BLOCK (>= the split count) from the tile count, which the batch size does not change: one variant.
        _radix_select_kernel[(num_rows,)](
            temperature, top_k_or_placeholder, select, min_p if min_p is not None else temperature,
            prefix, remaining, hist, maxima, floor, num_splits, shift, has_select, int(r == rounds - 1),
            int(min_p is not None), DIGIT_BITS=digit_bits, BLOCK=triton.next_power_of_2(num_tiles),
        )
    return floor


def _fast_top_k(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor | None,
    floor: torch.Tensor, num_tiles: int, tiles_per_split: int, num_splits: int, draw: CandidateDraw | None,
) -> torch.Tensor:
    """The three passes: the k-th largest into `floor` where they find it; returns [num_rows] int32, 1 for
    the rows left to the radix select."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    bound_tiles = triton.cdiv(num_tiles, BOUND_SPLITS)
    bound_splits = triton.cdiv(num_tiles, bound_tiles)
    bounds = torch.empty(num_rows, bound_splits, dtype=torch.float32, device=device)
    _lane_bound_kernel[(num_rows, bound_splits)](
        logits, logits.stride(0), temperature, top_k, bounds, vocab_size, num_tiles, bound_tiles, bound_splits,
        MAX_K=MAX_FAST_K, TILE=TILE,
    )
    counts = torch.zeros(num_rows, dtype=torch.int32, device=device)
    candidates = torch.empty(num_rows, CANDIDATES, dtype=torch.float32, device=device)
    ids = torch.empty(num_rows, CANDIDATES, dtype=torch.int32, device=device)
    _gather_candidates_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), temperature, top_k, bounds, counts, candidates, ids, vocab_size, num_tiles,
        tiles_per_split, bound_splits, MAX_K=MAX_FAST_K, TILE=TILE, BLOCK=triton.next_power_of_2(bound_splits),
        CAPACITY=CANDIDATES,
    )
    select = torch.empty(num_rows, dtype=torch.int32, device=device)
    top_p, seeds, tokens, skip, has_top_p, draw_here = _draw_args(draw, temperature, top_k, floor)
    _select_candidates_kernel[(num_rows,)](
        temperature, top_k, min_p if min_p is not None else temperature, top_p, seeds, counts, candidates, ids,
        floor, select, tokens, skip, vocab_size, int(min_p is not None), has_top_p, draw_here,
        MAX_K=MAX_FAST_K, CAPACITY=CANDIDATES, MAX_DRAWS=MAX_DRAWS, num_warps=8,
    )
    return select


def _draw_args(draw: CandidateDraw | None, temperature: torch.Tensor, top_k: torch.Tensor, floor: torch.Tensor):
    """A CandidateDraw as kernel arguments: (top_p, seeds, tokens, skip temperatures, has_top_p, draw_here),
    with unused tensors of the right dtypes in place of what is missing (one compiled variant for all)."""
    if draw is None:
        return temperature, top_k, top_k, floor, 0, 0
    has_top_p = draw.top_p is not None
    return draw.top_p if has_top_p else temperature, draw.seeds, draw.tokens, draw.temperature, int(has_top_p), 1


def _overflow_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor | None,
    select: torch.Tensor, floor: torch.Tensor, num_tiles: int, digit_bits: int, draw: CandidateDraw | None,
) -> None:
    num_rows, vocab_size = logits.shape
    top_p, seeds, tokens, skip, has_top_p, draw_here = _draw_args(draw, temperature, top_k, floor)
    _overflow_rows_kernel[(num_rows,)](
        logits, logits.stride(0), temperature, top_k, min_p if min_p is not None else temperature, top_p, seeds,
        select, floor, tokens, skip, vocab_size, num_tiles, int(min_p is not None), has_top_p, draw_here,
        ROUNDS=radix_rounds(logits.dtype, digit_bits), DIGIT_BITS=digit_bits, TILE=TILE, MAX_DRAWS=MAX_DRAWS,
        num_warps=8,
    )


def candidate_floor_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    """The floors in torch, from a sort and a softmax-free min_p bound (float32)."""
    x = logits.float().cpu()
    t = temperature.float().cpu()
    floor = torch.full((len(x),), float("-inf"))
    if top_k is not None:
        k = top_k.cpu()
        kth = x.sort(dim=-1, descending=True).values.gather(1, (k.clamp(max=x.shape[1]) - 1).unsqueeze(1)).squeeze(1)
        floor = torch.where(k < x.shape[1], kth, floor)
    if min_p is not None:
        p = min_p.float().cpu()
        bound = x.amax(dim=-1) + t * p.clamp(min=1e-30).log()
        floor = torch.where(p > 0, torch.maximum(floor, bound), floor)
    return torch.where(t > 0, floor, float("-inf"))


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
