"""Persistent per-request state on the worker, kept in fixed numpy rows and updated from diffs.

Each live request owns one row of the token and block-table buffers until it finishes or is
preempted, so building a step's inputs is array indexing rather than a rebuild per request.
"""

from __future__ import annotations

import numpy as np

from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import NewRequestData, SchedulerOutput


def index_among(values: np.ndarray, among: np.ndarray, size: int) -> np.ndarray:
    """Each of `values`' index in `among` (distinct integers below `size`), -1 where it is not there."""
    where = np.full(size, -1, dtype=np.int64)
    where[among] = np.arange(len(among))
    return where[values]


class RequestStates:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        """Tokens of each row, counting the one a step still in flight is sampling for it."""
        self.last_step_index = np.full(max_num_reqs, -1, dtype=np.int64)
        """Index of each row in the last launched step's sampled tokens, -1 if not sampled there:
        that token may not be on the host yet, so the next step reads it on the device."""
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        """Tokens with KV in the cache, as this worker knows it: advanced by each launched step, and taken
        back by the drafts its verification rejected (the scheduler's own count may be ahead of that
        while a step is in flight)."""
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        self.row_generation = np.zeros(max_num_reqs, dtype=np.int64)
        """Bumped each time a row is given to a request: a step's late host write checks it, so it cannot
        land in a row that now serves another request, even one with the same id (an id may be reused
        as soon as it is aborted, while its last step still runs)."""
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.next_drafts = np.zeros((max_num_reqs, 0), dtype=np.int64)
        """Drafts a verifying step already made for each row's next one (spec/eagle.py drafts right after its
        verification), valid while the row's generation and token count are those of next_drafts_at."""
        self.next_drafts_at = np.full((max_num_reqs, 2), -1, dtype=np.int64)

        self._landing_drafts = None
        """A callable that waits for drafts on their way to the host and keeps them (expect_next_drafts)."""
        self._drafts_on_device = None
        """The same drafts where they were made: (rows, at [n, 2], each row's index in the tensor, tensor [m, k])."""

    def keep_next_drafts(self, rows: np.ndarray, at: np.ndarray, drafts: np.ndarray) -> None:
        """`drafts` [len(rows), k]: the rows' next drafts, for the generations and token counts `at` [len(rows), 2]."""
        if self.next_drafts.shape[1] < drafts.shape[1]:
            self.next_drafts = np.zeros((len(self.num_tokens), drafts.shape[1]), dtype=np.int64)
        self.next_drafts[rows, : drafts.shape[1]] = drafts
        self.next_drafts_at[rows] = at

    def expect_next_drafts(self, land, on_device: tuple | None = None) -> None:
        """`land()` calls keep_next_drafts once its drafts are on the host: done when they are first looked at.
        `on_device`: (rows, at, index, drafts) as keep_next_drafts takes them, but `drafts` [m, k] where they were
        made and `index` [len(rows)] each row's in it: next_drafts_on_device reads them without waiting."""
        self.land_next_drafts()
        self._landing_drafts = land
        self._drafts_on_device = on_device

    def next_drafts_on_device(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, object] | None:
        """Without waiting for the drafts on their way to the host: which rows they still fit [len(rows)] bool,
        each such row's index in the drafts, and the drafts [m, k] where they were made; None without any."""
        if self._drafts_on_device is None or len(self._drafts_on_device[0]) == 0:
            return None
        drafted_rows, at, index_of, drafts = self._drafts_on_device
        found = index_among(rows, drafted_rows, len(self.num_tokens))
        ready = found >= 0
        at = at[found]
        ready &= (at[:, 0] == self.row_generation[rows]) & (at[:, 1] == self.num_tokens[rows])
        return ready, index_of[found], drafts

    def land_next_drafts(self) -> None:
        if self._landing_drafts is not None:
            self._landing_drafts, land = None, self._landing_drafts
            land()

    def has_next_drafts(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows)] bool: whether keep_next_drafts' drafts still fit each row."""
        self.land_next_drafts()
        at = self.next_drafts_at[rows]
        return (at[:, 0] == self.row_generation[rows]) & (at[:, 1] == self.num_tokens[rows])

    def apply(self, scheduler_output: SchedulerOutput) -> list[tuple[int, NewRequestData]]:
        """Bring the rows up to date with what the scheduler decided for this step; returns the
        rows given to new requests."""
        added = []
        for request_id in scheduler_output.finished_request_ids:
            row = self.row_of.pop(request_id, None)
            if row is not None:
                self.sampling_params[row] = None
                self._free_rows.append(row)
        for new in scheduler_output.new_requests:
            row = self._free_rows.pop()
            self.row_of[new.request_id] = row
            self.row_generation[row] += 1
            n = len(new.token_ids)
            self.token_ids[row, :n] = new.token_ids
            self.num_tokens[row] = n
            self.last_step_index[row] = -1
            self.num_prompt_tokens[row] = new.num_prompt_tokens
            self.num_computed_tokens[row] = new.num_computed_tokens
            self.num_blocks[row] = 0
            self._append_blocks(row, new.block_ids)
            self.sampling_params[row] = new.sampling_params
            added.append((row, new))
        for cached in scheduler_output.cached_requests:
            self._append_blocks(self.row_of[cached.request_id], cached.new_block_ids)
        return added

    def input_ids(self, token_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The tokens at `positions` of rows `token_rows`, as a model's input ids. A row whose constraints left no
        token holds -1 there (sample/no_token.py) until its request ends; a step scheduled before that (async
        scheduling) computes the row for nothing, but an embedding must not read -1: it reads token 0."""
        return np.maximum(self.token_ids[token_rows, positions], 0)

    def output_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()

    def reserve_sampled_tokens(self, rows: np.ndarray) -> np.ndarray:
        """Count one token being sampled on the device for each of these (distinct) rows; returns
        the positions where the host copies will go once they arrive. (A verifying row may emit more:
        its output adds them when it arrives, before the next step reads the row.)"""
        positions = self.num_tokens[rows].copy()
        self.num_tokens[rows] += 1
        self.last_step_index.fill(-1)
        self.last_step_index[rows] = np.arange(len(rows))
        return positions

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = self.num_blocks[row]
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)
