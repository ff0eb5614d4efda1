"""Structured outputs' token bitmask applied to the logits in place: -inf where the grammar forbids a token.

The bitmask is packed int32, bit b of word w = token 32 w + b allowed, one row per masked logits row
(`index[i]` is the logits row of bitmask row i). Logits columns past `vocab_size` (a model vocabulary padded
past the one the grammar was compiled for) and past the bitmask are forbidden too. Each program also clears
`empty[index[i]]` (one byte per logits row, set by the caller) where its words allow a token: a row still set
afterwards had nothing left to sample (its grammar reached a state no token continues).

16-bit logits (bfloat16, float16) whose rows are whole words (32 columns) take _apply_token_bitmask_pairs: it
handles two logits as one int32 (keep, or replace a half with -inf's bits), so that every load and store is a
whole vector, and reads only the words with a token allowed: a step costs the bitmask, the logits' bytes
written, and the few words read (256 x 151,936 bfloat16: 78 MB of writes). The general kernel, for other
dtypes and widths, writes -inf element by element where a bit is clear (never reading the logits), and its
per-element masked stores split into narrow writes: 130-210 us for the same 78 MB on an H100, against 63.
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
def _apply_token_bitmask(logits_ptr, stride_logits, bitmask_ptr, stride_bitmask, index_ptr, empty_ptr, num_cols,
                         num_words, vocab_size, WORDS: tl.constexpr):
    mask_row = tl.program_id(0)
    row = tl.load(index_ptr + mask_row).to(tl.int64)
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    packed = tl.load(bitmask_ptr + mask_row.to(tl.int64) * stride_bitmask + words, mask=words < num_words, other=0)
    bits = tl.arange(0, 32)
    cols = words[:, None] * 32 + bits[None, :]
    allowed = ((packed[:, None] >> bits[None, :]) & 1) != 0
    kept = allowed & (cols < vocab_size) & (cols < num_cols)
    tl.store(logits_ptr + row * stride_logits + cols, float("-inf"), mask=(cols < num_cols) & ~kept)
    tl.store(empty_ptr + row, tl.full([], 0, tl.uint8), mask=tl.max(kept.to(tl.int32)) != 0)


PAIR_WORDS = 32
"""Bitmask words per program of the paired kernel: 1,024 tokens, 512 int32 pairs of logits."""

NEG_INF_PAIRS = {dtype: torch.full((2,), float("-inf"), dtype=dtype).view(torch.int32).item()
                 for dtype in (torch.bfloat16, torch.float16)}
"""Two -inf of the dtype as one int32 (bits 0xFF80FF80, 0xFC00FC00)."""


@triton.jit(do_not_specialize=["stride_bitmask", "num_pairs", "num_words", "vocab_size"])
def _apply_token_bitmask_pairs(pairs_ptr, stride_pairs, bitmask_ptr, stride_bitmask, index_ptr, empty_ptr,
                               num_pairs, num_words, vocab_size, NEG_INF_PAIR: tl.constexpr, WORDS: tl.constexpr):
    mask_row = tl.program_id(0)
    row = tl.load(index_ptr + mask_row).to(tl.int64)
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    packed = tl.load(bitmask_ptr + mask_row.to(tl.int64) * stride_bitmask + words, mask=words < num_words, other=0)
    lanes = tl.arange(0, 16)
    pairs = words[:, None] * 16 + lanes[None, :]  # int32 pair p holds columns 2p (low half) and 2p + 1
    in_row = pairs < tl.multiple_of(num_pairs, 16)  # whole words: constant over each word's 16 pairs
    two_bits = (packed[:, None] >> (lanes[None, :] * 2)) & 3
    cols = pairs * 2
    two_bits &= (cols < vocab_size).to(tl.int32) | ((cols + 1 < vocab_size).to(tl.int32) << 1)
    ptrs = pairs_ptr + row * stride_pairs + pairs
    # A word without an allowed token is not read: all of its pairs become -inf.
    value = tl.load(ptrs, mask=in_row & (packed[:, None] != 0), other=0)
    keep = (two_bits & 1) * 0xFFFF | (two_bits >> 1) * -65536  # -65536: the high half, 0xFFFF0000
    tl.store(ptrs, (value & keep) | (NEG_INF_PAIR & ~keep), mask=in_row)
    tl.store(empty_ptr + row, tl.full([], 0, tl.uint8), mask=tl.max(tl.where(in_row, two_bits, 0)) != 0)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor, vocab_size: int,
                        empty: torch.Tensor | None = None) -> None:
    """logits [rows, cols] (any float dtype, rows contiguous), bitmask [n, words] int32, index [n] int32/int64
    (distinct logits rows): logits[index[i], t] = -inf where bit t of bitmask[i] is clear or t >= vocab_size.
    `empty` [rows] uint8 (or bool): cleared at index[i] where bitmask[i] leaves a token; the rest is untouched."""
    n = bitmask.shape[0]
    if n == 0:
        return
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and bitmask.dtype == torch.int32
    if empty is None:
        empty = torch.empty(logits.shape[0], dtype=torch.uint8, device=logits.device)
    empty = empty.view(torch.uint8)
    num_cols = logits.shape[1]
    aligned = logits.stride(0) % 2 == 0 and logits.storage_offset() % 2 == 0  # rows of whole int32 pairs
    if logits.dtype in NEG_INF_PAIRS and num_cols % 32 == 0 and aligned:
        pairs = logits.view(torch.int32)
        grid = (n, triton.cdiv(num_cols // 32, PAIR_WORDS))
        _apply_token_bitmask_pairs[grid](pairs, pairs.stride(0), bitmask, bitmask.stride(0), index, empty,
                                         num_cols // 2, bitmask.shape[1], vocab_size,
                                         NEG_INF_PAIR=NEG_INF_PAIRS[logits.dtype], WORDS=PAIR_WORDS, num_warps=4)
        return
    grid = (n, triton.cdiv(triton.cdiv(num_cols, 32), WORDS))
    _apply_token_bitmask[grid](logits, logits.stride(0), bitmask, bitmask.stride(0), index, empty, num_cols,
                               bitmask.shape[1], vocab_size, WORDS=WORDS, num_warps=4)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor, vocab_size: int,
                            empty: torch.Tensor | None = None) -> None:
    """The torch reference (and the CPU path's arithmetic)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).reshape(bitmask.shape[0], -1).bool()
    allowed = allowed[:, : min(vocab_size, logits.shape[1])]
    if allowed.shape[1] < logits.shape[1]:
        allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]), value=False)
    index = index.long()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    if empty is not None:
        empty[index[allowed.any(dim=1)]] = 0


fix_cache_keys(globals())
