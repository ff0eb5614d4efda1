"""Logprobs as the engine returns them: sampled-token and prompt logprobs turned into lists.

Prompt logprobs are computed chunk by chunk as the prompt is prefilled and handed out with the
request's first sampled token, so a chunked prompt still yields one complete list.
"""

from __future__ import annotations

import torch

from tokenmill.sample.sampler import LogprobsTensors, gather_logprobs
from tokenmill.scheduler.output import TokenLogprobs


def to_token_logprobs(tensors: LogprobsTensors, num_top: list[int]) -> list[TokenLogprobs]:
    """One entry per row, keeping the row's own top-k (rows share a padded k)."""
    ids, values, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.sampled_ranks.tolist()
    return [TokenLogprobs(i[: 1 + k], v[: 1 + k], r) for i, v, r, k in zip(ids, values, ranks, num_top)]


class PromptLogprobsCollector:
    def __init__(self) -> None:
        self.pending: dict[str, list[TokenLogprobs]] = {}

    def start(self, request_id: str) -> None:
        self.pending[request_id] = []

    def drop(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def collect(
        self,
        request_id: str,
        hidden_states: torch.Tensor,  # [n, hidden] of this request's tokens in this step
        next_token_ids: list[int],  # the prompt token that follows each of those positions
        num_top: int,
        compute_logits,
    ) -> None:
        if not next_token_ids:
            return
        logprobs = compute_logits(hidden_states).float().log_softmax(dim=-1)
        targets = torch.tensor(next_token_ids, device=logprobs.device)
        tensors = gather_logprobs(logprobs, targets, num_top)
        self.pending[request_id].extend(to_token_logprobs(tensors, [num_top] * len(next_token_ids)))

    def take(self, request_id: str) -> list[TokenLogprobs] | None:
        return self.pending.pop(request_id, None)

