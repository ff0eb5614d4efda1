"""SamplingMetadata: per-row sampling parameters of the requests sampled this step, as tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    all_greedy: bool
    temperature: torch.Tensor | None  # [num_reqs] float32; 1.0 in greedy rows
    top_k: torch.Tensor | None  # [num_reqs] int64; vocab size where disabled; None if none uses it
    top_p: torch.Tensor | None  # [num_reqs] float32; None if no request uses it
    is_greedy: torch.Tensor | None  # [num_reqs] bool
    generators: dict[int, torch.Generator]
    """Row -> the request's own generator, for seeded requests."""

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        if all(p.is_greedy for p in params):
            return cls(True, None, None, None, None, {})
        greedy = [p.is_greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        return cls(
            all_greedy=False,
            temperature=torch.tensor(temperature, dtype=torch.float32).to(device, non_blocking=True),
            top_k=torch.tensor(top_k).to(device, non_blocking=True) if min(top_k) < vocab_size else None,
            top_p=torch.tensor(top_p, dtype=torch.float32).to(device, non_blocking=True) if min(top_p) < 1.0 else None,
            is_greedy=torch.tensor(greedy).to(device, non_blocking=True) if any(greedy) else None,
            generators=generators,
        )
