"""Logit mask and penalties in one pass: model logits in, float32 logits out; and, when the batch has no
top_k, the first Gumbel-max draw in the same pass, so the penalised logits are not read again for it.

Each row reads its seen-token mask (prompt or output tokens) and output-token counts straight from the
sampling state's [max_num_reqs, vocab] tensors through its state row, so nothing is gathered per step.
The counts are read only where a token was seen (a predicated load fetches only the sectors that hold
seen tokens), so a row costs its logits, one byte of mask per token and the float32 output. Rows
without penalties only convert (and add the mask). The arithmetic is the sampler's torch reference
(sample/sampler.py::apply_penalties): repetition (transformers' rule over prompt and output tokens),
then frequency and presence (OpenAI's formula over output tokens).

The draw is kernels/sampling.py's gumbel_argmax pass 1 (same tiles, same Philox counters, so the same
token), with one difference: min_p's floor needs the row's maximum, which is known only after the pass.
Each lane uses the maximum it has seen so far instead, a lower floor, so its candidates are a superset
of the row's; the row's winner is then the right token whenever it is above the true floor, which
`first_draw_tokens` checks, redrawing the rare rows where it is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.sampling import (
    LANES,
    U_MAX,
    U_MIN,
    _best_split,
    _gumbel,
    _split_tiles,
    gumbel_argmax,
    split_layout,
)

TILE = 4 * LANES  # the tiles of gumbel_argmax and candidate_floor, whose split layout the outputs follow
FLOOR_SLACK = tl.constexpr(2.0**-20)
"""The lanes' min_p floor is lowered by this much relative to its terms: float rounding (and whether the
compiler fuses a multiply-add) can then never leave out a token the exact floor keeps."""


@dataclass
class PenaltyDraw:
    """The first draw of every row, made by the penalty pass (only without top_k: its floor needs a pass
    of its own). `temperature`: 0 = greedy; `min_p`: None where no row has one."""
    temperature: torch.Tensor  # [num_rows] float32
    seeds: torch.Tensor  # [num_rows] int64 Philox key per row
    min_p: torch.Tensor | None  # [num_rows] float32, 0 = none


@triton.jit
def _penalised(logits_ptr, mask_ptr, out_ptr, counts_ptr, seen_ptr, row, stride_row, state, token, vocab_size,
               repetition, frequency, presence, penalized, HAS_MASK: tl.constexpr):
    """The tokens' logits with the mask and the row's penalties, stored to the output; -inf past the vocabulary."""
    valid = token < vocab_size
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token, mask=valid).to(tl.float32)
    if HAS_MASK:
        x += tl.load(mask_ptr + row.to(tl.int64) * vocab_size + token, mask=valid)
    if penalized:
        seen = tl.load(seen_ptr + state + token, mask=valid, other=0) != 0
        count = tl.load(counts_ptr + state + token, mask=seen, other=0)  # counted tokens are seen
        x = tl.where(seen, tl.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * count.to(tl.float32)
        x = x - presence * (count > 0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * vocab_size + token, x, mask=valid)
    return tl.where(valid, x, float("-inf"))


@triton.jit
def _penalty_tiles(logits_ptr, mask_ptr, out_ptr, counts_ptr, seen_ptr, row, stride_row, state, vocab_size,
                   first_tile, last_tile, repetition, frequency, presence, penalized, temperature, seed, min_p_term,
                   HAS_MASK: tl.constexpr, DRAW: tl.constexpr, NOISE: tl.constexpr, LANES: tl.constexpr):
    """(largest logit, best score, its token) over the tiles. A tile is a [4, LANES] block of 4 * LANES
    consecutive tokens: token part * LANES + lane takes value `part` of Philox counter `lane`, as in
    kernels/sampling.py::_sampled_best (the same noise per token)."""
    lanes = tl.arange(0, LANES)
    parts = tl.arange(0, 4)[:, None]
    offsets = parts * LANES + lanes[None, :]
    top = tl.full([4, LANES], float("-inf"), tl.float32)
    best = tl.full([4, LANES], float("-inf"), tl.float32)
    best_index = first_tile * 4 * LANES + offsets
    for tile in range(first_tile, last_tile):
        token = tile * 4 * LANES + offsets
        x = _penalised(logits_ptr, mask_ptr, out_ptr, counts_ptr, seen_ptr, row, stride_row, state, token, vocab_size,
                       repetition, frequency, presence, penalized, HAS_MASK)
        top = tl.maximum(top, x)
        if DRAW:
            if NOISE:
                r0, r1, r2, r3 = tl.randint4x(seed, tile * LANES + lanes)
                bits = tl.where(parts == 0, r0[None, :], tl.where(parts == 1, r1[None, :],
                                                                  tl.where(parts == 2, r2[None, :], r3[None, :])))
                u = tl.clamp(tl.random.uint_to_uniform_float(bits), U_MIN, U_MAX)
                # min_p's floor from this slot's largest logit so far (at most the row's): a superset
                floor = top + min_p_term - (tl.abs(top) + tl.abs(min_p_term)) * FLOOR_SLACK
                score = tl.where(x >= floor, x, float("-inf")) + temperature * _gumbel(u)
            else:
                score = x  # greedy: the plain argmax
            better = score > best  # strict: a slot keeps its earliest token on a tie
            best = tl.where(better, score, best)
            best_index = tl.where(better, token, best_index)
    value = tl.max(tl.max(best, 1), 0)
    index = tl.min(tl.min(tl.where(best == value, best_index, 2147483647), 1), 0)  # the lowest id among equals
    return tl.max(tl.max(top, 1), 0), value, index


@triton.jit(do_not_specialize=["tiles_per_split", "num_splits", "has_min_p"])  # they change with the batch
def _penalty_kernel(
    logits_ptr, stride_row, mask_ptr, out_ptr, state_row_ptr, counts_ptr, seen_ptr, stride_state,
    repetition_ptr, frequency_ptr, presence_ptr, max_ptr, temperature_ptr, seed_ptr, min_p_ptr, value_ptr, index_ptr,
    vocab_size, num_tiles, tiles_per_split, num_splits, has_min_p,
    HAS_MASK: tl.constexpr, DRAW: tl.constexpr, LANES: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    repetition = tl.load(repetition_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    presence = tl.load(presence_ptr + row)
    penalized = (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)
    state = tl.load(state_row_ptr + row).to(tl.int64) * stride_state
    first_tile, last_tile = _split_tiles(split, tiles_per_split, num_tiles)
    temperature = 0.0
    if DRAW:
        temperature = tl.load(temperature_ptr + row)
    if temperature > 0:
        # T * log(min_p): min_p's floor relative to the row's largest logit (min_p = 0: -inf, no floor)
        min_p_term = tl.where(has_min_p != 0, temperature * tl.log(tl.load(min_p_ptr + row)), float("-inf"))
        top, value, index = _penalty_tiles(
            logits_ptr, mask_ptr, out_ptr, counts_ptr, seen_ptr, row, stride_row, state, vocab_size, first_tile,
            last_tile, repetition, frequency, presence, penalized, temperature, tl.load(seed_ptr + row), min_p_term,
            HAS_MASK, DRAW, True, LANES)
    else:
        top, value, index = _penalty_tiles(
            logits_ptr, mask_ptr, out_ptr, counts_ptr, seen_ptr, row, stride_row, state, vocab_size, first_tile,
            last_tile, repetition, frequency, presence, penalized, temperature, 0, 0.0, HAS_MASK, DRAW, False, LANES)
    tl.store(max_ptr + row * num_splits + split, top)  # for min_p (kernels/sampling_floor.py) and top_p
    if DRAW:
        tl.store(value_ptr + row * num_splits + split, value)
        tl.store(index_ptr + row * num_splits + split, index)


def apply_penalties_fused(
    logits: torch.Tensor,  # [num_rows, vocab] any float dtype; any row stride
    logit_mask: torch.Tensor | None,  # [num_rows, vocab] float32 added first, or None
    state_rows: torch.Tensor,  # [num_rows] int64: each row's row in the state tensors
    output_counts: torch.Tensor,  # [max_num_reqs, vocab] int32
    seen_mask: torch.Tensor,  # [max_num_reqs, vocab] bool: prompt or output tokens (a superset of counts > 0)
    repetition_penalty: torch.Tensor,  # [num_rows] float32
    frequency_penalty: torch.Tensor,  # [num_rows] float32
    presence_penalty: torch.Tensor,  # [num_rows] float32
    draw: PenaltyDraw | None = None,
    tiles_per_split: int | None = None,  # the parallel layout (tests); never changes a token
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """[num_rows, vocab] float32: (logits + mask) with each row's penalties; [num_rows, num_splits] float32,
    the largest of each split of gumbel_argmax's layout (min_p and top_p need the row maxima); with `draw`,
    each split's best (score, token) for first_draw_tokens, else None."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    num_tiles, tiles_per_split, num_splits = split_layout(num_rows, vocab_size, TILE, tiles_per_split)
    device = logits.device
    out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    maxima = torch.empty(num_rows, num_splits, dtype=torch.float32, device=device)
    split_best = None
    if draw is not None:
        split_best = (torch.empty(num_rows, num_splits, dtype=torch.float32, device=device),
                      torch.empty(num_rows, num_splits, dtype=torch.int32, device=device))
    if num_rows == 0:
        return out, maxima, split_best
    placeholder = repetition_penalty  # an unused pointer of the right kind
    temperature, seeds, min_p = (draw.temperature, draw.seeds, draw.min_p) if draw is not None else (None,) * 3
    _penalty_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), logit_mask if logit_mask is not None else out, out, state_rows, output_counts,
        seen_mask.view(torch.uint8), output_counts.stride(0), repetition_penalty, frequency_penalty,
        presence_penalty, maxima, temperature if draw is not None else placeholder,
        seeds if draw is not None else state_rows, min_p if min_p is not None else placeholder,
        *(split_best if split_best is not None else (maxima, state_rows)),
        vocab_size, num_tiles, tiles_per_split, num_splits, int(min_p is not None),
        HAS_MASK=logit_mask is not None, DRAW=draw is not None, LANES=LANES,
    )
    return out, maxima, split_best


@triton.jit(do_not_specialize=["num_splits", "has_floor"])
def _first_draw_kernel(logits_ptr, temperature_ptr, value_ptr, index_ptr, floor_ptr, token_ptr, retry_ptr,
                       vocab_size, num_splits, has_floor, BLOCK: tl.constexpr):
    """The row's token: its best split's. A sampled row whose winner lies below its floor (the pass's
    lanes used a lower one) is redrawn: its retry temperature is its own, else -1 (skip)."""
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    token = _best_split(value_ptr, index_ptr, row, num_splits, BLOCK)
    tl.store(token_ptr + row, token.to(tl.int64))
    floor = tl.where(has_floor != 0, tl.load(floor_ptr + row), float("-inf"))
    below = tl.load(logits_ptr + row.to(tl.int64) * vocab_size + token) < floor
    tl.store(retry_ptr + row, tl.where((temperature > 0) & below, temperature, -1.0))


def first_draw_tokens(
    logits: torch.Tensor,  # [num_rows, vocab] float32: apply_penalties_fused's output
    draw: PenaltyDraw,
    split_best: tuple[torch.Tensor, torch.Tensor],
    floor: torch.Tensor | None,  # [num_rows] float32: min_p's floor (candidate_floor), or None
) -> torch.Tensor:
    """[num_rows] int64: the tokens of the draw the penalty pass made, the same as gumbel_argmax over its
    output with `floor` (rows whose winner fell below the floor are redrawn by it)."""
    num_rows, vocab_size = logits.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return tokens
    values, indices = split_best
    retry = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    _first_draw_kernel[(num_rows,)](
        logits, draw.temperature, values, indices, floor if floor is not None else retry, tokens, retry, vocab_size,
        values.shape[1], int(floor is not None), BLOCK=triton.next_power_of_2(values.shape[1]),
    )
    if floor is not None:
        gumbel_argmax(logits, retry, draw.seeds, floor=floor, out=tokens)
    return tokens
