"""The verification's acceptance kernel (kernels/draft_acceptance.py) against verify_drafts' torch path, which it
replaces on CUDA: greedy verdicts (drafts against the argmax) and given ones, rows with fewer drafts than the
step's widest, every draft standing and the first falling."""

from __future__ import annotations

import pytest
import torch

from tokenmill.sample.metadata import build_sampling_metadata
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.rejection import VerifyBatch, verify_drafts

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: under the interpreter


@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize("greedy", [True, False])
def test_kernel_emits_what_the_torch_path_emits(k, greedy):
    from tokenmill.kernels.draft_acceptance import accept_drafts

    generator = torch.Generator().manual_seed(k)
    rows, vocab = 6, 11
    logits = torch.randn(rows * (k + 1), vocab, generator=generator)
    argmax = logits.argmax(dim=-1).view(rows, k + 1)
    num_drafts = torch.randint(1, k + 1, (rows,), generator=generator)
    # Drafts that match the argmax for a random stretch, then differ: every row's first rejection somewhere.
    agree = torch.rand(rows, k, generator=generator) < 0.7
    drafts = torch.where(agree, argmax[:, :k], (argmax[:, :k] + 1) % vocab)
    drafts[0, :] = argmax[0, :k]  # a row whose drafts all stand
    positions = (torch.arange(rows)[:, None] * (k + 1) + torch.arange(k)[None, :])
    bonus = torch.randint(0, vocab, (rows,), generator=generator)
    batch = VerifyBatch(torch.arange(rows), drafts, num_drafts, positions, torch.ones(rows, dtype=torch.bool), True)
    metadata = build_sampling_metadata([SamplingParams(temperature=0.0)] * rows, {}, vocab, torch.device("cpu"))
    expected, expected_counts = verify_drafts(logits, bonus, batch, metadata)  # the CPU: torch's path
    recovered = logits[positions.reshape(-1)].argmax(dim=-1)
    accepted = None
    if not greedy:  # given verdicts: the kernel must not look at the drafts' equality
        accepted = torch.rand(rows * k, generator=generator) < 0.6
        expected, expected_counts = reference(drafts, recovered, accepted, num_drafts, bonus)
    on = device()
    out, counts = accept_drafts(drafts.to(on), recovered.to(on), None if accepted is None else accepted.to(on),
                                num_drafts.to(on), bonus.to(on))
    assert torch.equal(counts.cpu(), expected_counts) and torch.equal(out.cpu(), expected)


def reference(drafts, recovered, accepted, num_drafts, bonus):
    """What a row emits, written out per row: drafts up to the first rejected one, then its replacement, or the
    bonus token after all of them."""
    rows, k = drafts.shape
    out = torch.full((rows, k + 1), -1, dtype=torch.int64)
    counts = torch.empty(rows, dtype=torch.int64)
    for r in range(rows):
        n = 0
        while n < num_drafts[r] and accepted[r * k + n]:
            n += 1
        out[r, :n] = drafts[r, :n]
        out[r, n] = bonus[r] if n == num_drafts[r] else recovered[r * k + n]
        counts[r] = n + 1
    return out, counts
