"""Sampler: logits -> one token per request, batched with per-request parameters.

Order: temperature -> top-k -> top-p -> Gumbel-max draw (argmax of probs / Exp(1) noise, which
needs no host sync). Greedy rows take the argmax of the raw logits; when every row is greedy
the whole pipeline is skipped. Seeded requests draw their noise from their own generator, so a
seed gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.sample.metadata import SamplingMetadata


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [num_reqs, vocab] -> token ids [num_reqs] int64."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        sampled = (probs / exponential_noise(probs, metadata.generators)).argmax(dim=-1)
        if metadata.is_greedy is not None:
            sampled = torch.where(metadata.is_greedy, greedy, sampled)
        return sampled


def exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return noise


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus; one sort serves both."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # Keep the last top_k entries of the ascending sort.
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
