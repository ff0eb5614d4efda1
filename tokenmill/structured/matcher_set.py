"""The rows' xgrammar matchers: advanced through each row's new tokens, and filling the rows' token bitmasks.

Plain numpy in, bitmasks out, so that it runs alike in the engine's process and in a grammar process of its own
(structured/grammar_process.py). The engine side (structured/matchers.py) decides which rows and tokens.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np

logger = logging.getLogger(__name__)

MAX_FILL_THREADS = 8
ROWS_PER_FILL_THREAD = 32
"""xgrammar starts its fill threads anew at every call (and joins them): a thread per 32 rows, at most 8."""


@functools.cache
def _usable_fill_threads() -> int:
    """Half the CPUs this process may use (asked once: the fill runs every step)."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


def fill_threads(num_rows: int) -> int:
    """Threads for one batched fill. Not xgrammar's 'auto' (half of std::thread::hardware_concurrency()): that
    counts the host's CPUs, not this process's (a GPU lease may see 16 of a host's hundreds)."""
    return max(1, min(MAX_FILL_THREADS, _usable_fill_threads(), num_rows // ROWS_PER_FILL_THREAD))


class MatcherSet:
    def __init__(self) -> None:
        self._matchers: dict[int, object] = {}  # by row
        self._batches: dict[int, object] = {}  # xgrammar's BatchGrammarMatcher by its number of fill threads

    def add(self, row: int, compiled, stop_tokens: list[int]) -> None:
        """A fresh matcher for `row` (replacing the one of the row's last request)."""
        import xgrammar as xgr

        self._matchers[row] = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_tokens or None)

    def accept(self, rows: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        """Advance row `rows[i]` through its `counts[i]` next tokens in `tokens` (the rows' tokens one after the
        other). Not split over Python threads: xgrammar 0.2.9's calls (tvm-ffi bindings) did not run in parallel
        from two threads, and at the default GIL switch interval the same calls took 70-100x longer from two
        threads than from one (2-core machine)."""
        import xgrammar as xgr

        refused = []
        single = counts == 1  # the usual step: one new token per row, all in one call
        starts = np.cumsum(counts) - counts
        if single.all():
            one_rows, one_tokens = rows.tolist(), tokens.tolist()
        else:
            one_rows, one_tokens = rows[single].tolist(), tokens[starts[single]].tolist()
        if one_rows:
            matchers = [self._matchers[row] for row in one_rows]
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, one_tokens)
            if not all(accepted):
                refused += [(row, t) for row, t, ok in zip(one_rows, one_tokens, accepted) if not ok]
        # A resumed request replays its output; after a verifying step a row may have emitted several.
        for i in np.flatnonzero(~single & (counts > 0)).tolist():
            row = int(rows[i])
            for token in tokens[starts[i] : starts[i] + counts[i]].tolist():
                if not self._matchers[row].accept_token(token):
                    refused.append((row, token))
        for row, token in refused:
            logger.warning("grammar of row %d refused token %d it had allowed", row, token)

    def fill(self, rows: np.ndarray, num_drafts: np.ndarray, drafts: np.ndarray, bitmask: np.ndarray) -> None:
        """Row `rows[i]`'s masks for its `num_drafts[i]` draft positions and the one after, in order, into
        `bitmask` [sum(1 + num_drafts), words]; `drafts`: the rows' drafts one after the other."""
        matchers = [self._matchers[row] for row in rows.tolist()]
        if not num_drafts.any():
            self._fill(matchers, bitmask, range(len(matchers)))
        else:
            self._fill_with_drafts(matchers, num_drafts, drafts, bitmask)

    def _fill(self, matchers: list, bitmask: np.ndarray, slots) -> None:
        """Each matcher's mask into its slot of `bitmask`: all in one call, but for terminated matchers."""
        live, live_slots = [], []
        for matcher, slot in zip(matchers, slots):
            if matcher.is_terminated():
                # Past the stop token: a draft there is rejected by the position before, and a step that
                # async scheduling ran past its end is discarded, so any token will do.
                bitmask[slot] = -1
            else:
                live.append(matcher)
                live_slots.append(slot)
        if live:
            self._batch(len(live)).batch_fill_next_token_bitmask(live, bitmask, live_slots)

    def _batch(self, num_rows: int):
        import xgrammar as xgr

        threads = fill_threads(num_rows)
        if threads not in self._batches:
            self._batches[threads] = xgr.BatchGrammarMatcher(threads)
        return self._batches[threads]

    def _fill_with_drafts(self, matchers: list, num_drafts: np.ndarray, drafts: np.ndarray,
                          bitmask: np.ndarray) -> None:
        """Speculation: a row's masks for its draft positions and the one after, walking the drafts (one
        batched fill per position across the rows), then back to the known tokens."""
        first_slot = np.cumsum(num_drafts + 1) - (num_drafts + 1)
        first_draft = np.cumsum(num_drafts) - num_drafts
        num_accepted = np.zeros(len(matchers), dtype=np.int64)
        alive = list(range(len(matchers)))
        for position in range(int(num_drafts.max()) + 1):
            self._fill([matchers[i] for i in alive], bitmask, [int(first_slot[i]) + position for i in alive])
            walking = []
            for i in alive:
                if position == num_drafts[i]:
                    continue
                matcher = matchers[i]
                draft = int(drafts[first_draft[i] + position])
                if matcher.is_terminated() or not matcher.accept_token(draft):
                    # The mask rejects this draft: the positions after it are never used.
                    bitmask[first_slot[i] + position + 1 : first_slot[i] + num_drafts[i] + 1] = -1
                    continue
                num_accepted[i] += 1
                walking.append(i)
            alive = walking
        for i in np.flatnonzero(num_accepted).tolist():
            matchers[i].rollback(int(num_accepted[i]))  # back to the known tokens: the drafts may yet be rejected
