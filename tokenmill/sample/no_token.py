"""Rows whose constraints leave no token to sample.

A grammar allows a different set of tokens at every position, so a request's own bans (allowed_token_ids,
bad_words, a -inf logit_bias, the EOS ban before min_tokens) may exclude all of them somewhere mid-generation.
The draw would then return an arbitrary token outside every constraint; the runner marks such rows instead
(request.NO_TOKEN_LEFT) and the scheduler ends them there.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.device_copy import to_device
from tokenmill.sample.metadata import SamplingMetadata


def rows_without_token(logits: torch.Tensor, metadata: SamplingMetadata,
                       logit_rows: np.ndarray | None = None) -> torch.Tensor | None:
    """[rows] bool on the device: the rows whose logits (grammar masks applied) are all -inf once the logit mask
    is added; None when no row bans anything. Reads only the banning rows, on the device (no host sync).
    `logit_rows`: each row's logits row where a step has several per row (drafts verified: the row's last, where
    it samples); None: row i's is logits row i."""
    if metadata.banning_rows is None:
        return None
    banning = metadata.banning_rows
    num_rows = len(logits) if logit_rows is None else len(logit_rows)
    where = banning if logit_rows is None else logit_rows[banning]
    index, where = (to_device(a, logits.device) for a in (banning, where))
    masked = logits[where].float() + metadata.logit_mask[index]
    none_left = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
    none_left[index] = torch.isneginf(masked.amax(dim=-1))
    return none_left
