"""Structured outputs' token bitmask applied to the logits in place: -inf where the grammar forbids a token.

The bitmask is packed int32, bit b of word w = token 32 w + b allowed, one row per masked logits row
(`index[i]` is the logits row of bitmask row i). Logits columns past `vocab_size` (a model vocabulary padded
past the one the grammar was compiled for) and past the bitmask are forbidden too. Each program covers
WORDS words (32 WORDS tokens) of one row: it reads only the bitmask and writes -inf where a bit is clear,
never reading the logits, so a step costs the bitmask plus the forbidden logits' bytes (at 256 x 151,936
bfloat16, about 78 MB of writes: tens of microseconds on an H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys

WORDS = 64
"""Bitmask words per program: 2,048 tokens."""


# The masks' width and the grammars' vocabulary are not specialised on: they are the tokenizer's, which the
# sampler's warm-up (worker/sampler_warmup.py, at the model's vocabulary) does not know, and a specialisation of
# its own would compile at the first structured step.
@triton.jit(do_not_specialize=["stride_bitmask", "num_words", "vocab_size"])
def _apply_token_bitmask(logits_ptr, stride_logits, bitmask_ptr, stride_bitmask, index_ptr, num_cols, num_words,
                         vocab_size, WORDS: tl.constexpr):
    mask_row = tl.program_id(0)
    row = tl.load(index_ptr + mask_row).to(tl.int64)
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    packed = tl.load(bitmask_ptr + mask_row.to(tl.int64) * stride_bitmask + words, mask=words < num_words, other=0)
    bits = tl.arange(0, 32)
    cols = words[:, None] * 32 + bits[None, :]
    allowed = ((packed[:, None] >> bits[None, :]) & 1) != 0
    forbidden = (cols < num_cols) & ~(allowed & (cols < vocab_size))
    tl.store(logits_ptr + row * stride_logits + cols, float("-inf"), mask=forbidden)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor, vocab_size: int) -> None:
    """logits [rows, cols] (any float dtype, rows contiguous), bitmask [n, words] int32, index [n] int32/int64
    (distinct logits rows): logits[index[i], t] = -inf where bit t of bitmask[i] is clear or t >= vocab_size."""
    n = bitmask.shape[0]
    if n == 0:
        return
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and bitmask.dtype == torch.int32
    num_cols = logits.shape[1]
    grid = (n, triton.cdiv(triton.cdiv(num_cols, 32), WORDS))
    _apply_token_bitmask[grid](logits, logits.stride(0), bitmask, bitmask.stride(0), index, num_cols,
                               bitmask.shape[1], vocab_size, WORDS=WORDS, num_warps=4)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor, vocab_size: int) -> None:
    """The torch reference (and the CPU path)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).reshape(bitmask.shape[0], -1).bool()
    allowed = allowed[:, : min(vocab_size, logits.shape[1])]
    if allowed.shape[1] < logits.shape[1]:
        allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]), value=False)
    index = index.long()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


fix_cache_keys(globals())
