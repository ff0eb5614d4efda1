"""Verification of draft tokens: keep what the target model would have produced, then one token more.

For a request with drafts x_1..x_d, the forward pass gives the target's logits at d + 1 positions. Draft
x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)), p_j the target's processed distribution
there (logit mask, temperature, min_p, top_k, top_p: what the sampler draws from) and q_j the draft's;
the first rejected position draws instead from the residual max(0, p_j - q_j), renormalised; when all d
are accepted, the token after them is the sampler's ordinary draw at the last position. The emitted
tokens then follow the target distribution exactly (Leviathan et al., 2023; Chen et al., 2023). The
n-gram proposer is deterministic (q_j is one-hot), so acceptance is p_j(x_j) and the residual is p_j
without x_j. Greedy requests accept a draft when it is the argmax and emit the argmax where it is not.

Unseeded requests only: a seeded request is never given drafts (scheduler/draft_budget.py says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels import triton_available
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import apply_min_p, apply_top_k_top_p, draw_from_probs, greedy_ids


@dataclass
class VerifyBatch:
    """The verifying requests of a step: `rows` index the step's sampled requests (the metadata's rows)."""

    rows: torch.Tensor  # [r] int64, on the device
    draft_token_ids: torch.Tensor  # [r, k] int64, padded past each row's count
    num_drafts: torch.Tensor  # [r] int64, >= 1
    logit_positions: torch.Tensor  # [r, k] index into the step's logits of each draft's target distribution
    is_greedy: torch.Tensor  # [r] bool
    all_greedy: bool  # known on the host: no device sync to find out


def plain_greedy(metadata: SamplingMetadata) -> bool:
    """Whether every row takes the argmax of its logits as they are (no mask, penalties, processors or logprobs):
    then a position's verdict and the sampler's token there are one argmax."""
    return (metadata.all_greedy and metadata.logit_mask is None and metadata.output_counts is None
            and not metadata.logits_processors and metadata.max_num_logprobs is None)


def verify_drafts(
    logits: torch.Tensor, bonus_token_ids: torch.Tensor, batch: VerifyBatch, metadata: SamplingMetadata,
    position_argmax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [positions, vocab]; `bonus_token_ids` [r] the sampler's tokens at each row's last position;
    `position_argmax` [positions]: every position's argmax, where the caller took it already (plain_greedy).
    Returns the emitted tokens [r, k + 1] (padded with -1) and how many each row emits [r]."""
    num_rows, k = batch.draft_token_ids.shape
    if position_argmax is not None:
        return _emitted(batch, position_argmax[batch.logit_positions.reshape(-1)], None, bonus_token_ids)
    target = logits[batch.logit_positions.reshape(-1)]  # [r * k, vocab]
    # Greedy rows without a mask take the argmax in the logits' dtype: the same token as in float32.
    if metadata.logit_mask is not None or not batch.all_greedy:
        target = target.float()
        per_position = batch.rows.repeat_interleave(k)
    if metadata.logit_mask is not None:
        target = target + metadata.logit_mask[per_position]
    drafts = batch.draft_token_ids.reshape(-1)
    argmax = greedy_ids(target)
    accepted, recovered = None, argmax  # None: the greedy verdicts, drafts == argmax
    if not batch.all_greedy:
        greedy = batch.is_greedy.repeat_interleave(k)
        probs = processed_probs(target, metadata, per_position)
        uniforms = torch.rand(num_rows * k, device=target.device)
        draft_probs = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
        accepted = torch.where(greedy, drafts == argmax, uniforms < draft_probs)
        # The residual of a one-hot draft: the target without the drafted token.
        residual = probs.scatter(1, drafts.unsqueeze(1), 0.0)
        residual_draw = draw_from_probs(residual)
        recovered = torch.where(greedy, argmax, residual_draw)
    return _emitted(batch, recovered, accepted, bonus_token_ids)


def _emitted(batch: VerifyBatch, recovered: torch.Tensor, accepted: torch.Tensor | None,
             bonus_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What each row emits from its drafts' verdicts (`accepted` [r * k]; None: greedy, a draft stands where it
    equals `recovered`, the target's token at its position [r * k])."""
    num_rows, k = batch.draft_token_ids.shape
    if recovered.device.type == "cuda" and triton_available():
        from tokenmill.kernels.draft_acceptance import MAX_DRAFTS, accept_drafts

        if k <= MAX_DRAFTS:  # one launch
            return accept_drafts(batch.draft_token_ids.contiguous(), recovered.contiguous(),
                                 None if accepted is None else accepted.contiguous(), batch.num_drafts.contiguous(),
                                 bonus_token_ids.contiguous())
    if accepted is None:
        accepted = batch.draft_token_ids.reshape(-1) == recovered
    positions = torch.arange(k, device=recovered.device)
    valid = positions[None, :] < batch.num_drafts[:, None]
    rejected = ~accepted.reshape(num_rows, k) & valid
    # Accepted drafts before the first rejection (all of them when none is rejected).
    num_accepted = torch.where(rejected.any(dim=1), rejected.int().argmax(dim=1), batch.num_drafts)
    out = torch.full((num_rows, k + 1), -1, dtype=torch.int64, device=recovered.device)
    out[:, :k] = torch.where(positions[None, :] < num_accepted[:, None], batch.draft_token_ids, -1)
    all_accepted = num_accepted == batch.num_drafts
    last = torch.where(all_accepted, bonus_token_ids,
                       recovered.reshape(num_rows, k).gather(1, num_accepted.clamp(max=k - 1)[:, None]).squeeze(1))
    out.scatter_(1, num_accepted[:, None], last[:, None])
    return out, num_accepted + 1


def processed_probs(logits: torch.Tensor, metadata: SamplingMetadata, rows: torch.Tensor) -> torch.Tensor:
    """The distribution the sampler draws from, for logits [m, vocab] (mask applied) of metadata rows
    `rows` [m]: temperature, then min_p, top_k and top_p, as in the sampler's stage 6."""
    temperature = metadata.temperature[rows]
    logits = logits / temperature.unsqueeze(1)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p[rows])
    top_k = None if metadata.top_k is None else metadata.top_k[rows]
    top_p = None if metadata.top_p is None else metadata.top_p[rows]
    if top_k is not None or top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)

