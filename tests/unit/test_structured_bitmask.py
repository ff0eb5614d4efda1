"""The token bitmask as tokenmill applies it equals xgrammar's own application, bit for bit."""

import torch
import xgrammar as xgr

from tokenmill.structured.matchers import unpack_bitmask


def test_unpacked_bitmask_masks_what_xgrammar_masks():
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    generator = torch.Generator().manual_seed(0)
    bitmask = xgr.allocate_token_bitmask(3, vocab)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=generator, dtype=torch.int64).int())
    logits = torch.randn(3, vocab, generator=generator)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    allowed = unpack_bitmask(bitmask, vocab)
    got = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got[~torch.isinf(got)], expected[~torch.isinf(expected)])
    assert 0 < int(allowed.sum()) < 3 * vocab
