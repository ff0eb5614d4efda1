"""Penalties applied in place to float32 logits, touching only the tokens a row has seen.

Each row reads its seen-token mask (prompt or output tokens) and output-token counts straight from the
sampling state's [max_num_reqs, vocab] tensors through its state row, so nothing is gathered per step.
Only the mask is read in full (one byte per token); the logits and counts are loaded and the logits
stored only where a token was seen (predicated accesses fetch only the sectors that hold seen tokens).
So a penalised row costs a fraction of one pass over its logits, where converting the model's bf16 logits
to float32 (the pass this replaces) read 2 and wrote 4 bytes per token: the LM head writes float32
logits instead when a batch has penalties. The arithmetic is the sampler's torch reference
(sample/sampler.py::apply_penalties): repetition (transformers' rule over prompt and output tokens),
then frequency and presence (OpenAI's formula over output tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.sampling import split_layout

TILE = 4096
"""Tokens per loop iteration: 32 per thread at 4 warps, so the mask comes in two 16-byte loads per thread."""


@triton.jit(do_not_specialize=["tiles_per_split"])  # it changes with the batch size
def _penalty_kernel(
    logits_ptr, stride_row, state_row_ptr, counts_ptr, seen_ptr, stride_state,
    repetition_ptr, frequency_ptr, presence_ptr, vocab_size, num_tiles, tiles_per_split,
    TILE: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    repetition = tl.load(repetition_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    presence = tl.load(presence_ptr + row)
    if (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0):
        state = tl.load(state_row_ptr + row).to(tl.int64) * stride_state
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        cols = tl.arange(0, TILE)
        first_tile = split * tiles_per_split
        for tile in range(first_tile, tl.minimum(first_tile + tiles_per_split, num_tiles)):
            token = tile * TILE + cols
            seen = tl.load(seen_ptr + state + token, mask=token < vocab_size, other=0) != 0
            x = tl.load(row_ptr + token, mask=seen)
            count = tl.load(counts_ptr + state + token, mask=seen, other=0)  # counted tokens are seen
            x = tl.where(x > 0, x / repetition, x * repetition)
            x = x - frequency * count.to(tl.float32)
            x = x - presence * (count > 0).to(tl.float32)
            tl.store(row_ptr + token, x, mask=seen)


def apply_penalties_in_place(
    logits: torch.Tensor,  # [num_rows, vocab] float32, changed in place; any row stride
    state_rows: torch.Tensor,  # [num_rows] int64: each row's row in the state tensors
    output_counts: torch.Tensor,  # [max_num_reqs, vocab] int32
    seen_mask: torch.Tensor,  # [max_num_reqs, vocab] bool: prompt or output tokens (a superset of counts > 0)
    repetition_penalty: torch.Tensor,  # [num_rows] float32
    frequency_penalty: torch.Tensor,  # [num_rows] float32
    presence_penalty: torch.Tensor,  # [num_rows] float32
) -> torch.Tensor:
    """Each row's penalties on its seen tokens; rows without penalties are left alone. Returns `logits`."""
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError("penalties apply in place to float32 logits with contiguous rows")
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return logits
    num_tiles, tiles_per_split, num_splits = split_layout(num_rows, vocab_size, TILE)
    _penalty_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), state_rows, output_counts, seen_mask.view(torch.uint8), output_counts.stride(0),
        repetition_penalty, frequency_penalty, presence_penalty, vocab_size, num_tiles, tiles_per_split,
        TILE=TILE, num_warps=4,
    )
    return logits
