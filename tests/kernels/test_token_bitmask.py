"""The token bitmask kernel against its torch reference: random masks on chosen logits rows, logits wider than
the grammar's vocabulary and than the bitmask, every float dtype; the rows left with no token flagged."""

import pytest
import torch

interpret = pytest.mark.interpret


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_cols, vocab_size, words", [
    (200, 150, 5), (5000, 4500, 141),  # widths not whole words: the general kernel for every dtype
    # Whole words: 16-bit logits take the paired kernel. A vocabulary ending mid-pair and mid-word, masks
    # narrower than the logits; a mask wider than the vocabulary, several programs a row.
    (4096, 3001, 100), (1024, 1000, 32), (2048, 2048, 64)])
def test_kernel_masks_what_the_reference_masks(device, dtype, num_cols, vocab_size, words):
    from tokenmill.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref

    generator = torch.Generator().manual_seed(0)
    # 7 logits rows, 5 masked (out of order); the grammar knows fewer tokens than the logits have, the bitmask
    # covers some more (and several programs a row in the larger case).
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), generator=generator, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # every token allowed: only the columns past the vocabulary are masked
    bitmask[2, 1:3] = 0  # whole words forbidden (the paired kernel does not read them)
    bitmask[2, 3] = -(1 << 31)  # the last token of a word alone (the high half of a pair)
    bitmask[3] = 0  # nothing allowed
    bitmask[4] = 0
    for token in range(vocab_size, 32 * words):  # only tokens past the vocabulary: nothing left either
        bitmask[4, token // 32] |= (1 << (token % 32)) - (1 << 32 if token % 32 == 31 else 0)
    index = torch.tensor([4, 0, 2, 5, 6], dtype=torch.int32)
    logits = torch.randn(7, num_cols, generator=generator).to(dtype)
    expected = logits.clone()
    expected_empty = torch.tensor([0, 1, 1, 1, 1, 1, 1], dtype=torch.uint8)  # set by the caller on masked rows
    apply_token_bitmask_ref(expected, bitmask, index, vocab_size, expected_empty)
    got, empty = logits.to(device), torch.tensor([0, 1, 1, 1, 1, 1, 1], dtype=torch.uint8, device=device)
    apply_token_bitmask(got, bitmask.to(device), index.to(device), vocab_size, empty)
    assert torch.equal(got.cpu(), expected)
    assert empty.tolist() == expected_empty.tolist() == [0, 1, 0, 1, 0, 1, 1]
    assert torch.isinf(expected[5:]).all()
    assert torch.isinf(expected[0, vocab_size:]).all() and not torch.isinf(expected[0, :vocab_size]).any()
    assert not torch.isinf(expected[[1, 3]]).any()  # rows without a mask are untouched
    assert 0 < int(torch.isinf(expected[4, :vocab_size]).sum()) < vocab_size


@interpret
def test_logits_off_a_pair_boundary_take_the_general_kernel(device):
    """bfloat16 rows of whole words that start mid-pair (a view one element into its storage) cannot be viewed as
    int32 pairs: the general kernel masks them."""
    from tokenmill.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref

    generator = torch.Generator().manual_seed(1)
    storage = torch.randn(1 + 2 * 64, generator=generator).to(torch.bfloat16)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 2), generator=generator, dtype=torch.int64).to(torch.int32)
    index = torch.tensor([1, 0], dtype=torch.int32)
    expected = storage[1:].view(2, 64).clone()
    apply_token_bitmask_ref(expected, bitmask, index, 60)
    on_device = storage.to(device)
    got = on_device[1:].view(2, 64)
    assert got.storage_offset() == 1
    apply_token_bitmask(got, bitmask.to(device), index.to(device), 60)
    assert torch.equal(got.cpu(), expected)


def test_reference_matches_unpack_bitmask():
    """The reference is the CPU path's arithmetic (structured/matchers.py unpack_bitmask + masked_fill)."""
    pytest.importorskip("triton")
    from tokenmill.kernels.token_bitmask import apply_token_bitmask_ref
    from tokenmill.structured.matchers import unpack_bitmask

    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 4), dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, 128)
    expected = logits.clone()
    expected[[2, 1]] = expected[[2, 1]].masked_fill(~unpack_bitmask(bitmask, 128), float("-inf"))
    apply_token_bitmask_ref(logits, bitmask, torch.tensor([2, 1]), 128)
    assert torch.equal(logits, expected)
