"""Pipeline parallelism's sampled tokens: the last stage samples, and every other rank takes the step's
tokens from the driver (tensor-parallel rank 0 of the last stage).

Every rank keeps its request rows exactly as the driver does, as under tensor parallelism: the first stage
embeds the tokens as the next step's inputs, and every stage must draft the same ngram drafts and settle the
same verified counts, since each builds the step's batch (its shape and positions) by itself. The other
ranks need no logprobs: only the driver's output reaches the engine.

The other stages do not wait for a step's tokens at its end: with micro-batches in flight they go on with
the next batches (other requests) while the last stage computes this one. Under gloo the receive runs in the
background and the step's output waits for it when read; NCCL's never blocks the host anyway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.distributed.pipeline import broadcast_from_driver, start_broadcast_from_driver
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.pending_output import VerifiedTokens

if TYPE_CHECKING:
    from torch.distributed import Work


def share_sampled_tokens(tokens: torch.Tensor | VerifiedTokens) -> None:
    """On the last stage's ranks: the driver's tokens go to every rank (the others' copies are the same)."""
    if isinstance(tokens, VerifiedTokens):
        packed = torch.cat([tokens.num_emitted.unsqueeze(1), tokens.token_ids], dim=1)  # [n, 2 + max_drafts]
    else:
        packed = tokens.to(torch.int64, copy=True)  # [n]; a copy: the broadcast writes into it
    broadcast_from_driver(packed.contiguous())


def receive_sampled_tokens(batch: InputBatch, device: torch.device) -> tuple[torch.Tensor | VerifiedTokens, Work]:
    """On the other stages: the step's tokens [n], or a verifying step's tokens and counts, and the receive
    filling them (wait() before reading them)."""
    num_drafts = batch.sampled_num_drafts
    num_rows = len(batch.sampled_rows)
    if not num_drafts.any():
        tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
        return tokens, start_broadcast_from_driver(tokens)
    packed = torch.empty((num_rows, 2 + int(num_drafts.max())), dtype=torch.int64, device=device)
    counts = 1 + num_drafts
    return (VerifiedTokens(packed[:, 1:], packed[:, 0], num_drafts, np.cumsum(counts) - counts),
            start_broadcast_from_driver(packed))
