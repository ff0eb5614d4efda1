"""Rows whose constraints leave no token to sample.

A grammar allows a different set of tokens at every position, so a request's own bans (allowed_token_ids,
bad_words, a -inf logit_bias, the EOS ban before min_tokens) may exclude all of them somewhere mid-generation.
The draw would then return an arbitrary token outside every constraint; the runner marks such rows instead
(request.NO_TOKEN_LEFT) and the scheduler ends them there. A grammar's own dead end (a state no token continues)
is flagged by the mask kernel per logits row (kernels/token_bitmask.py); `emitted_from_nothing` maps those flags
onto a verifying step's emitted tokens.
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


def emitted_from_nothing(left_none: torch.Tensor, num_drafts: np.ndarray, num_emitted: torch.Tensor, width: int,
                         tree: bool) -> torch.Tensor:
    """[rows, width] bool of a verifying step's emitted tokens: the last token a row emitted where it was drawn
    from a grammar mask that allowed nothing (`left_none`, per logits row), so that the tokens before it stand
    and the request ends there. A chain's column j was drawn at the row's logits row j; a tree's columns follow
    a path through its nodes' rows, so there only rows without drafts (their one column) are checked."""
    counts = 1 + num_drafts
    starts = to_device(np.cumsum(counts) - counts, left_none.device)
    columns = torch.arange(width, device=left_none.device)
    if tree:
        undrafted = to_device(num_drafts == 0, left_none.device)
        return (left_none[starts] & undrafted).unsqueeze(1) & (columns == 0)
    drawn_at = (starts.unsqueeze(1) + columns).clamp(max=len(left_none) - 1)
    return left_none[drawn_at] & (columns == (num_emitted - 1).unsqueeze(1))
