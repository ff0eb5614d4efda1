"""N-gram (prompt lookup) proposer: the request's own prompt and output predict its continuation.

If the last m tokens occurred before in the sequence, the tokens that followed them then are proposed
now. The longest m in [prompt_lookup_min, prompt_lookup_max] with a match wins, and among its matches
the most recent (the nearest context). Each request's row keeps an index of its n-grams (every m) to where
each last ended, extended at each lookup by the tokens that arrived since the last one only: a step's cost
does not grow with the history (a request's first lookup indexes its prompt, once).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenmill.worker.request_state import RequestStates

NO_DRAFTS = np.empty(0, dtype=np.int64)


class RowIndex:
    __slots__ = ("generation", "num_indexed", "latest")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        """The row's generation (RequestStates.row_generation) whose tokens these are."""
        self.num_indexed = 0
        """The n-grams ending before this position are in `latest`."""
        self.latest: dict[bytes, int] = {}
        """An n-gram's tokens (int32 bytes: its length tells m) -> the position of its latest last token."""


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._rows: dict[int, RowIndex] = {}

    def drop(self, rows: Iterable[int]) -> None:
        """The rows' requests finished or were preempted (a resumed one is indexed again from its row's tokens)."""
        for row in rows:
            self._rows.pop(row, None)

    def propose(self, states: RequestStates, rows: np.ndarray, max_drafts: np.ndarray) -> list[np.ndarray]:
        """Each row's drafts, at most `max_drafts` of them, maybe none; the rows' first `num_tokens` are known."""
        num_tokens = states.num_tokens[rows]
        last = num_tokens - 1
        indexes = []
        for row, generation in zip(rows.tolist(), states.row_generation[rows].tolist()):
            index = self._rows.get(row)
            if index is None or index.generation != generation:  # the row serves another request now
                index = self._rows[row] = RowIndex(generation)
            indexes.append(index)
        num_indexed = np.fromiter((index.num_indexed for index in indexes), dtype=np.int64, count=len(indexes))
        best_end = [-1] * len(indexes)
        for m in range(self.min_n, self.max_n + 1):  # the longest m with a match wins: found last
            # The m-grams ending at first..last: the new ones to index, then the suffix to look up.
            first = np.maximum(num_indexed, m - 1)
            counts = np.maximum(last - first + 1, 0)
            keys = ngram_keys(states.token_ids, rows, first - (m - 1), counts, m)
            offset = 0
            for i, (index, start, count) in enumerate(zip(indexes, first.tolist(), counts.tolist())):
                if count == 0:
                    continue
                end = offset + count - 1
                index.latest.update(zip(keys[offset:end], range(start, start + count - 1)))
                found = index.latest.get(keys[end])
                if found is not None:
                    best_end[i] = found
                offset = end + 1
        for index, n in zip(indexes, last.tolist()):
            index.num_indexed = n
        drafts = [NO_DRAFTS] * len(indexes)
        for i, (row, end, n, k) in enumerate(zip(rows.tolist(), best_end, num_tokens.tolist(), max_drafts.tolist())):
            if end >= 0 and k > 0:
                drafts[i] = states.token_ids[row, end + 1 : min(end + 1 + k, n)].copy()
        return drafts


def ngram_keys(token_ids: np.ndarray, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, m: int) -> list[bytes]:
    """The m-grams of each row from its `starts` on, `counts` of them, each as its tokens' int32 bytes (token ids
    fit, and -1 too: a row that had no token left), all rows' in one list."""
    total = int(counts.sum())
    if total == 0:
        return []
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    columns = (np.repeat(starts, counts) + within)[:, None] + np.arange(m)
    windows = token_ids[np.repeat(rows, counts)[:, None], columns].astype(np.int32)
    return windows.view(np.dtype((np.void, 4 * m))).ravel().tolist()
