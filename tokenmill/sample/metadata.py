"""SamplingMetadata: the sampled rows' parameters as batched tensors, None where no row needs a stage.

Every stage the sampler can skip is None when no request in the batch uses it, so the common
case (greedy or plain temperature sampling) pays for nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    all_greedy: bool
    temperature: torch.Tensor | None  # [num_reqs] float32; 1.0 in greedy rows
    top_k: torch.Tensor | None  # [num_reqs] int64; vocab size where disabled
    top_p: torch.Tensor | None  # [num_reqs] float32
    min_p: torch.Tensor | None  # [num_reqs] float32
    is_greedy: torch.Tensor | None  # [num_reqs] bool; None when no row or every row is greedy
    generators: dict[int, torch.Generator]
    """Row -> the request's own generator, for seeded requests."""
    logit_mask: torch.Tensor | None
    """[num_reqs, vocab] float32 added to the logits: logit_bias, -inf outside allowed_token_ids,
    on bad words and, before min_tokens, on EOS and stop tokens."""
    presence_penalty: torch.Tensor | None  # [num_reqs] float32
    frequency_penalty: torch.Tensor | None  # [num_reqs] float32
    repetition_penalty: torch.Tensor | None  # [num_reqs] float32
    output_counts: torch.Tensor | None  # [num_reqs, vocab] int32 occurrences in each row's output
    prompt_mask: torch.Tensor | None  # [num_reqs, vocab] bool tokens present in each row's prompt
    max_num_logprobs: int | None
    """Largest `logprobs` among the rows; None when no row wants logprobs."""
    logits_processors: dict[int, tuple[list, list[int]]]
    """Row -> (the request's processors, its output token ids); the slow path."""


def _tensor(values, dtype, device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


def build_sampling_metadata(
    params: list[SamplingParams],
    generators: dict[int, torch.Generator],
    vocab_size: int,
    device: torch.device,
    logit_mask: torch.Tensor | None = None,
    penalty_tensors: tuple[torch.Tensor, torch.Tensor] | None = None,
    logits_processors: dict[int, tuple[list, list[int]]] | None = None,
) -> SamplingMetadata:
    greedy = [p.is_greedy for p in params]
    all_greedy = all(greedy)
    sampled = [p for p, g in zip(params, greedy) if not g]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    want_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    has_penalties = penalty_tensors is not None
    return SamplingMetadata(
        all_greedy=all_greedy,
        temperature=None if all_greedy else _tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32, device),
        top_k=_tensor(top_k, torch.int64, device) if any(k < vocab_size for k in top_k) and sampled else None,
        top_p=_tensor([p.top_p for p in params], torch.float32, device)
        if any(p.top_p < 1.0 for p in sampled) else None,
        min_p=_tensor([p.min_p for p in params], torch.float32, device)
        if any(p.min_p > 0.0 for p in sampled) else None,
        is_greedy=_tensor(greedy, torch.bool, device) if any(greedy) and not all_greedy else None,
        generators=generators,
        logit_mask=logit_mask,
        presence_penalty=_tensor([p.presence_penalty for p in params], torch.float32, device)
        if has_penalties else None,
        frequency_penalty=_tensor([p.frequency_penalty for p in params], torch.float32, device)
        if has_penalties else None,
        repetition_penalty=_tensor([p.repetition_penalty for p in params], torch.float32, device)
        if has_penalties else None,
        output_counts=penalty_tensors[0] if has_penalties else None,
        prompt_mask=penalty_tensors[1] if has_penalties else None,
        max_num_logprobs=max(want_logprobs) if want_logprobs else None,
        logits_processors=logits_processors or {},
    )
