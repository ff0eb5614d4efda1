"""The verification's last stage in one launch: from each draft's verdict, what a verifying row emits.

spec/rejection.verify_drafts decides per draft position whether the draft stands (greedy: it is the target's argmax;
sampled: the accept/reject draw) and what the target would emit there instead. What a row emits follows from those
alone: its drafts up to the first rejected one, then the replacement there, or after all its drafts the sampler's
token at its last position. In torch that took ~15 small launches a step (comparisons, an argmax, gathers, a
scatter), which the host, not the GPU, paid for: an EAGLE-3 step at batch 1 was bound by its host (BENCHMARKS.md,
issue 17). Here one program per row does it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys

MAX_DRAFTS = 31
"""Drafts per row the kernel takes (one block of 32 lanes with the bonus slot); more go the torch way."""


@triton.jit(do_not_specialize=["k"])
def _accept_kernel(drafts_ptr, recovered_ptr, accepted_ptr, num_drafts_ptr, bonus_ptr, out_ptr, emitted_ptr, k,
                   HAS_ACCEPTED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK).to(tl.int64)
    in_drafts = j < k
    num_drafts = tl.load(num_drafts_ptr + row)
    drafts = tl.load(drafts_ptr + row * k + j, mask=in_drafts, other=-1)
    recovered = tl.load(recovered_ptr + row * k + j, mask=in_drafts, other=-1)
    if HAS_ACCEPTED:
        accepted = tl.load(accepted_ptr + row * k + j, mask=in_drafts, other=0) != 0
    else:  # greedy: a draft stands where it is the target's argmax (`recovered`)
        accepted = drafts == recovered
    rejected = (~accepted) & (j < num_drafts)
    num_accepted = tl.min(tl.where(rejected, j, num_drafts), axis=0)
    replacement = tl.sum(tl.where(j == num_accepted, recovered, 0), axis=0)  # read only where a draft fell
    last = tl.where(num_accepted == num_drafts, tl.load(bonus_ptr + row), replacement)
    out = tl.where(j < num_accepted, drafts, -1)
    out = tl.where(j == num_accepted, last, out)
    tl.store(out_ptr + row * (k + 1) + j, out, mask=j < k + 1)
    tl.store(emitted_ptr + row, num_accepted + 1)


def accept_drafts(drafts: torch.Tensor, recovered: torch.Tensor, accepted: torch.Tensor | None,
                  num_drafts: torch.Tensor, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [r, k] int64 (padded past each row's count); recovered [r * k] int64, the target's token at each
    draft position (what is emitted where that draft falls); accepted [r * k] bool, each draft's verdict (None:
    greedy, a draft stands where it equals `recovered`); num_drafts [r] int64 >= 1; bonus [r] int64, the
    sampler's token after a row's last draft. Returns the emitted tokens [r, k + 1] (-1 past them) and their
    counts [r], as verify_drafts does. k <= MAX_DRAFTS; CUDA tensors."""
    num_rows, k = drafts.shape
    out = torch.empty((num_rows, k + 1), dtype=torch.int64, device=drafts.device)
    num_emitted = torch.empty(num_rows, dtype=torch.int64, device=drafts.device)
    if num_rows:
        _accept_kernel[(num_rows,)](drafts, recovered, recovered if accepted is None else accepted, num_drafts,
                                    bonus, out, num_emitted, k, HAS_ACCEPTED=accepted is not None, BLOCK=32)
    return out, num_emitted


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
