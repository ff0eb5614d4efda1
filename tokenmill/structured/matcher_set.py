"""The rows' matchers (xgrammar's, or llguidance's behind the same calls: guidance.py): advanced through each row's
new tokens, and filling the rows' token bitmasks.

Plain numpy in, bitmasks out, so that it runs alike in the engine's process and in a grammar process of its own
(structured/grammar_process.py). The engine side (structured/matchers.py) decides which rows and tokens.

A row's drafts are a chain, or with draft trees (speculative_token_tree) the tree's first nodes: node i's
logits row follows the root's at 1 + i, and its mask is the grammar's after the path root -> i, filled by
walking the tree depth first (accept the node's token, fill, go on into its children, roll back to go up).
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np

from tokenmill.structured.guidance import GuidanceGrammar, GuidanceMatcher, fill_guidance

logger = logging.getLogger(__name__)

MAX_FILL_THREADS = 8
ROWS_PER_FILL_THREAD = 32
"""xgrammar starts its fill threads anew at every call (and joins them): a thread per 32 rows, at most 8."""


@functools.cache
def half_the_usable_cpus() -> int:
    """Half the CPUs this process may use, at least 1 (asked once: the fill runs every step)."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


def fill_threads(num_rows: int) -> int:
    """Threads for one batched fill. Not xgrammar's 'auto' (half of std::thread::hardware_concurrency()): that
    counts the host's CPUs, not this process's (a GPU lease may see 16 of a host's hundreds)."""
    return max(1, min(MAX_FILL_THREADS, half_the_usable_cpus(), num_rows // ROWS_PER_FILL_THREAD))


class TreeWalk:
    """A draft tree's nodes in depth-first order, as the grammar walks them (a row drafts the first nodes of the
    breadth-first order, which hold every ancestor of theirs: the walk skips the others)."""

    def __init__(self, parent: np.ndarray) -> None:
        parent = np.asarray(parent, dtype=np.int64)
        self.depth = np.zeros(len(parent), dtype=np.int64)
        for node, up in enumerate(parent.tolist()):  # breadth-first: a parent comes before its children
            self.depth[node] = 1 if up < 0 else self.depth[up] + 1
        children: dict[int, list[int]] = {}
        for node, up in enumerate(parent.tolist()):
            children.setdefault(up, []).append(node)
        order: list[int] = []
        stack = children.get(-1, [])[::-1]
        while stack:
            node = stack.pop()
            order.append(node)
            stack += children.get(node, [])[::-1]
        self.order = np.array(order, dtype=np.int64)
        """The nodes depth first, siblings in rank order."""
        self.subtree_end = np.array([next((k for k in range(at + 1, len(order))
                                           if self.depth[order[k]] <= self.depth[order[at]]), len(order))
                                     for at in range(len(order))], dtype=np.int64)
        """At each place of `order`, where the walk leaves that node's subtree."""


class MatcherSet:
    def __init__(self, tree_parent: np.ndarray | None = None) -> None:
        """`tree_parent`: the draft tree's parent of each node (spec/tree.py's TokenTree.parent); None: chains."""
        self._matchers: dict[int, object] = {}  # by row
        self._batches: dict[int, object] = {}  # xgrammar's BatchGrammarMatcher by its number of fill threads
        self._tree = None if tree_parent is None else TreeWalk(tree_parent)

    def add(self, row: int, compiled, stop_tokens: list[int]) -> None:
        """A fresh matcher for `row` (replacing the one of the row's last request)."""
        import xgrammar as xgr

        if isinstance(compiled, GuidanceGrammar):
            self._matchers[row] = GuidanceMatcher(compiled, stop_tokens)
        else:
            self._matchers[row] = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_tokens or None)

    def accept(self, rows: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        """Advance row `rows[i]` through its `counts[i]` next tokens in `tokens` (the rows' tokens one after the
        other). Not split over Python threads: xgrammar 0.2.9's calls (tvm-ffi bindings) did not run in parallel
        from two threads, and at the default GIL switch interval the same calls took 70-100x longer from two
        threads than from one (2-core machine)."""
        import xgrammar as xgr

        refused = []
        if (tokens < 0).any():  # rows that had no token to sample end now (sample/no_token.py): nothing to accept
            dead = np.zeros(len(rows), dtype=bool)
            dead[np.repeat(np.arange(len(rows)), counts)[tokens < 0]] = True
            keep = np.repeat(~dead, counts)
            rows, counts, tokens = rows[~dead], counts[~dead], tokens[keep]
        single = counts == 1  # the usual step: one new token per row, all in one call
        starts = np.cumsum(counts) - counts
        if single.all():
            one_rows, one_tokens = rows.tolist(), tokens.tolist()
        else:
            one_rows, one_tokens = rows[single].tolist(), tokens[starts[single]].tolist()
        matchers = [self._matchers[row] for row in one_rows]
        if matchers and not all(live := [not m.is_terminated() for m in matchers]):
            # A request that just stopped (its matcher took the stop token) had one more step launched under async
            # scheduling before its stop was seen: that step's token reaches the grammar process, and the scheduler
            # drops it. Not offered (a finished matcher refuses every token, and xgrammar warns of each).
            one_rows, one_tokens, matchers = ([x for x, ok in zip(xs, live) if ok]
                                              for xs in (one_rows, one_tokens, matchers))
        if one_rows:
            guided = [isinstance(m, GuidanceMatcher) for m in matchers]
            if any(guided):
                accepted = [m.accept_token(t) if g else None for m, t, g in zip(matchers, one_tokens, guided)]
                plain = [i for i, g in enumerate(guided) if not g]
                if plain:
                    batch = xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in plain],
                                                                       [one_tokens[i] for i in plain])
                    for i, ok in zip(plain, batch):
                        accepted[i] = ok
            else:
                accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, one_tokens)
            if not all(accepted):
                refused += [(row, t) for row, t, ok in zip(one_rows, one_tokens, accepted) if not ok]
        # A resumed request replays its output; after a verifying step a row may have emitted several.
        for i in np.flatnonzero(~single & (counts > 0)).tolist():
            row = int(rows[i])
            matcher = self._matchers[row]
            for token in tokens[starts[i] : starts[i] + counts[i]].tolist():
                if matcher.is_terminated():
                    break  # drafts verified past the stop token (its mask allows all): the request ends at it
                if not matcher.accept_token(token):
                    refused.append((row, token))
        for row, token in refused:
            logger.warning("grammar of row %d refused token %d it had allowed", row, token)

    def fill(self, rows: np.ndarray, num_drafts: np.ndarray, drafts: np.ndarray, bitmask: np.ndarray) -> None:
        """Row `rows[i]`'s masks for its `num_drafts[i]` draft positions and the one after, in order, into
        `bitmask` [sum(1 + num_drafts), words]; `drafts`: the rows' drafts one after the other. With a tree:
        its masks for the root, then for each of its first `num_drafts[i]` nodes."""
        matchers = [self._matchers[row] for row in rows.tolist()]
        if not num_drafts.any():
            self._fill(matchers, bitmask, range(len(matchers)))
        elif self._tree is not None:
            self._fill_tree(matchers, num_drafts, drafts, bitmask)
        else:
            self._fill_with_drafts(matchers, num_drafts, drafts, bitmask)

    def _fill(self, matchers: list, bitmask: np.ndarray, slots) -> None:
        """Each matcher's mask into its slot of `bitmask`: all in one call, but for terminated matchers."""
        live, live_slots, guided, guided_slots = [], [], [], []
        for matcher, slot in zip(matchers, slots):
            if matcher.is_terminated():
                # Past the stop token: a draft there is rejected by the position before, and a step that
                # async scheduling ran past its end is discarded, so any token will do.
                bitmask[slot] = -1
            elif isinstance(matcher, GuidanceMatcher):
                guided.append(matcher)
                guided_slots.append(slot)
            else:
                live.append(matcher)
                live_slots.append(slot)
        if guided:
            fill_guidance(guided, bitmask, guided_slots)
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

    def _fill_tree(self, matchers: list, num_nodes: np.ndarray, drafts: np.ndarray, bitmask: np.ndarray) -> None:
        """Draft trees: the roots' masks (one batched fill), then each node's, depth first (one batched fill per
        node across the rows that drafted it), each matcher rolled back to the node's parent before it accepts
        the node's token; then back to the known tokens."""
        walk = self._tree
        first_slot = np.cumsum(num_nodes + 1) - (num_nodes + 1)
        first_node = np.cumsum(num_nodes) - num_nodes
        self._fill(matchers, bitmask, first_slot.tolist())
        walked = np.zeros(len(matchers), dtype=np.int64)  # the drafts each matcher has accepted
        skip_until = np.zeros(len(matchers), dtype=np.int64)  # past a refused node: where its subtree ends
        drafting = np.flatnonzero(num_nodes)
        for at, node in enumerate(walk.order.tolist()):
            here = drafting[(num_nodes[drafting] > node) & (skip_until[drafting] <= at)]
            if not len(here):
                continue
            filling, slots = [], []
            for i in here.tolist():
                matcher = matchers[i]
                back = int(walked[i]) - (int(walk.depth[node]) - 1)
                if back:
                    matcher.rollback(back)
                    walked[i] -= back
                if matcher.is_terminated() or not matcher.accept_token(int(drafts[first_node[i] + node])):
                    # The parent's mask rejects this node: its subtree's logits rows are never used.
                    subtree = walk.order[at : walk.subtree_end[at]]
                    bitmask[first_slot[i] + 1 + subtree[subtree < num_nodes[i]]] = -1
                    skip_until[i] = walk.subtree_end[at]
                    continue
                walked[i] += 1
                filling.append(matcher)
                slots.append(int(first_slot[i]) + 1 + node)
            if filling:
                self._fill(filling, bitmask, slots)
        for i in np.flatnonzero(walked).tolist():
            matchers[i].rollback(int(walked[i]))  # back to the known tokens: the drafts may yet be rejected
