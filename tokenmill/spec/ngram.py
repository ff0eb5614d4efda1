"""N-gram (prompt lookup) proposer: the request's own prompt and output predict its continuation.

If the last m tokens occurred before in the sequence, the tokens that followed them then are proposed
now. The longest m in [prompt_lookup_min, prompt_lookup_max] with a match wins, and among its matches
the most recent (the nearest context). Batched: one pass over the rows' padded tokens per suffix token,
each pass extending every row's matches by one token backwards.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, max_drafts: np.ndarray) -> list[np.ndarray]:
        """`token_ids` [n, >= max(num_tokens)] the rows' tokens; returns each row's drafts (maybe none)."""
        num_rows = len(num_tokens)
        drafts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_rows
        width = int(num_tokens.max()) if num_rows else 0
        if width < 2:
            return drafts
        tokens = token_ids[:, :width]
        last = num_tokens - 1
        ends = np.arange(width)
        # An earlier occurrence ends at p < last, so the token after it is known.
        matches = (ends[None, :] < last[:, None]) & (max_drafts > 0)[:, None]
        best_end = np.full(num_rows, -1)
        # An m-token suffix with an earlier occurrence needs m + 1 tokens; longer m would also slice past the
        # row's start (a negative end), so the longest sequence bounds m.
        for m in range(1, min(self.max_n, width - 1) + 1):
            # Matches of the last m tokens: token p - (m - 1) equals the row's token last - (m - 1).
            back = last - (m - 1)
            if m > 1:
                matches[:, : m - 1] = False
                wanted = tokens[np.arange(num_rows), np.maximum(back, 0)]
                matches[:, m - 1 :] &= tokens[:, : width - m + 1] == wanted[:, None]
                matches &= (back >= 0)[:, None]
            else:
                matches &= tokens == tokens[np.arange(num_rows), last][:, None]
            if m < self.min_n:
                continue
            found = matches.any(axis=1)
            if not found.any():
                break  # no row has a longer match either
            best_end[found] = width - 1 - np.argmax(matches[found, ::-1], axis=1)
        for row in np.flatnonzero(best_end >= 0).tolist():
            start = best_end[row] + 1
            drafts[row] = tokens[row, start : min(start + max_drafts[row], num_tokens[row])].copy()
        return drafts
