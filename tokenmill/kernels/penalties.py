"""Penalties: in a pass of their own (with the logit mask: model logits in, float32 logits out), or as the
draw kernels load each logit (`load_penalised`, kernels/sampling.py).

Each row reads its seen-token mask (prompt or output tokens) and output-token counts straight from the
sampling state's [max_num_reqs, vocab] tensors through its state row, so nothing is gathered per step.
The counts are read only where a token was seen (a predicated load fetches only the sectors that hold
seen tokens), so a row costs its logits, one byte of mask per token and the float32 output. Rows
without penalties only convert (and add the mask). The arithmetic is the sampler's torch reference
(sample/sampler.py::apply_penalties): repetition (transformers' rule over prompt and output tokens),
then frequency and presence (OpenAI's formula over output tokens).

Applied on load, a batch's penalties cost each pass that reads the logits one byte of mask per token
(and the counts of seen tokens), instead of a pass that writes float32 logits for the later passes to
read at twice the bytes: the sampler takes that path when no row needs the logits changed by anything
else (a logit mask, processors) or ranked (top_k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.sampling_layout import TILE, split_layout  # candidate_floor's, whose layout the maxima follow


@triton.jit
def penalise(x, seen, count, repetition, frequency, presence):
    """float32 logits x with the penalties of tokens `seen` (prompt or output) and `count`ed (int32, output)."""
    x = tl.where(seen, tl.where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * count.to(tl.float32)
    return x - presence * (count > 0).to(tl.float32)


@triton.jit
def row_penalties(row, state_row_ptr, counts_ptr, seen_ptr, stride_state, repetition_ptr, frequency_ptr,
                  presence_ptr):
    """Row `row`'s penalties for load_penalised: (its mask row, its counts row, whether it has any, repetition,
    frequency, presence)."""
    repetition = tl.load(repetition_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    presence = tl.load(presence_ptr + row)
    penalized = (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)
    state = tl.load(state_row_ptr + row).to(tl.int64) * stride_state
    return seen_ptr + state, counts_ptr + state, penalized, repetition, frequency, presence


@triton.jit
def load_penalised(row_ptr, token, vocab_size, penalties):
    """The row's logits at `token` (-inf past the vocabulary) in float32, penalised. The mask is read only in
    penalised rows and the counts only where a token was seen (predicated loads fetch nothing elsewhere)."""
    seen_row, counts_row, penalized, repetition, frequency, presence = penalties
    valid = token < vocab_size
    x = tl.load(row_ptr + token, mask=valid, other=float("-inf")).to(tl.float32)
    # tl.where, not `valid & penalized`: the interpreter cannot `&` this scalar with a tensor
    seen = tl.load(seen_row + token, mask=tl.where(penalized, valid, False), other=0) != 0
    count = tl.load(counts_row + token, mask=seen, other=0)  # counted tokens are seen
    return penalise(x, seen, count, repetition, frequency, presence)


@dataclass
class Penalties:
    """A batch's penalty tensors, for the draw kernels to apply as they load the logits."""

    state_rows: torch.Tensor  # [num_rows] int64: each row's row in the state tensors
    output_counts: torch.Tensor  # [max_num_reqs, vocab] int32
    seen_mask: torch.Tensor  # [max_num_reqs, vocab] bool: prompt or output tokens (a superset of counts > 0)
    repetition: torch.Tensor  # [num_rows] float32
    frequency: torch.Tensor  # [num_rows] float32
    presence: torch.Tensor  # [num_rows] float32

    def kernel_args(self) -> tuple:
        """row_penalties' arguments after `row`."""
        return (self.state_rows, self.output_counts, self.seen_mask.view(torch.uint8), self.output_counts.stride(0),
                self.repetition, self.frequency, self.presence)


def no_penalties_args(placeholder: torch.Tensor) -> tuple:
    """Stand-ins for Penalties.kernel_args in kernels compiled without penalties (fixed dtypes: one variant)."""
    return (placeholder, placeholder, placeholder, 0, placeholder, placeholder, placeholder)


@triton.jit(do_not_specialize=["tiles_per_split", "num_splits"])  # they change with the batch size
def _penalty_kernel(
    logits_ptr, stride_row, mask_ptr, out_ptr, state_row_ptr, counts_ptr, seen_ptr, stride_state,
    repetition_ptr, frequency_ptr, presence_ptr, max_ptr, vocab_size, num_tiles, tiles_per_split, num_splits,
    HAS_MASK: tl.constexpr, TILE: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    seen_row, counts_row, penalized, repetition, frequency, presence = row_penalties(
        row, state_row_ptr, counts_ptr, seen_ptr, stride_state, repetition_ptr, frequency_ptr, presence_ptr)
    # Four contiguous tokens per thread: the bf16 loads and the float32 stores then share one layout
    # (left alone, the loads take 8 and the stores 4, and every tile goes through shared memory between).
    cols = tl.max_contiguous(tl.arange(0, TILE), 4)
    top = tl.full([TILE], float("-inf"), tl.float32)
    first_tile = split * tiles_per_split
    for tile in range(first_tile, tl.minimum(first_tile + tiles_per_split, num_tiles)):
        token = tile * TILE + cols
        valid = token < vocab_size
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token, mask=valid).to(tl.float32)
        if HAS_MASK:
            x += tl.load(mask_ptr + row.to(tl.int64) * vocab_size + token, mask=valid)
        if penalized:
            seen = tl.load(seen_row + token, mask=valid, other=0) != 0
            count = tl.load(counts_row + token, mask=seen, other=0)  # counted tokens are seen
            x = penalise(x, seen, count, repetition, frequency, presence)
        tl.store(out_ptr + row.to(tl.int64) * vocab_size + token, x, mask=valid)
        top = tl.maximum(top, tl.where(valid, x, float("-inf")))
    tl.store(max_ptr + row * num_splits + split, tl.max(top, 0))  # for min_p (kernels/sampling_floor.py)


def apply_penalties_fused(
    logits: torch.Tensor,  # [num_rows, vocab] any float dtype; any row stride
    logit_mask: torch.Tensor | None,  # [num_rows, vocab] float32 added first, or None
    state_rows: torch.Tensor,  # [num_rows] int64: each row's row in the state tensors
    output_counts: torch.Tensor,  # [max_num_reqs, vocab] int32
    seen_mask: torch.Tensor,  # [max_num_reqs, vocab] bool: prompt or output tokens (a superset of counts > 0)
    repetition_penalty: torch.Tensor,  # [num_rows] float32
    frequency_penalty: torch.Tensor,  # [num_rows] float32
    presence_penalty: torch.Tensor,  # [num_rows] float32
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_rows, vocab] float32: (logits + mask) with each row's penalties; and [num_rows, num_splits]
    float32, the largest of each split of the candidate_floor layout (min_p needs the row maxima)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    num_tiles, tiles_per_split, num_splits = split_layout(num_rows, vocab_size, TILE)
    out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=logits.device)
    maxima = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out, maxima
    _penalty_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), logit_mask if logit_mask is not None else out, out, state_rows, output_counts,
        seen_mask.view(torch.uint8), output_counts.stride(0), repetition_penalty, frequency_penalty,
        presence_penalty, maxima, vocab_size, num_tiles, tiles_per_split, num_splits,
        HAS_MASK=logit_mask is not None, TILE=TILE, num_warps=num_warps,
    )
    return out, maxima


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
