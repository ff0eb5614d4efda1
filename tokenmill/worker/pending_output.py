"""PendingOutput: a launched step's sampled tokens on their way to the host.

The model runner returns as soon as a step's kernels are queued; the tokens (and logprobs) are
copied to pinned host memory behind them on the same stream. `result()` waits for that copy only
when the engine needs the tokens, which with async scheduling is after the next step is queued, so
the host's scheduling and bookkeeping overlap the GPU's work.

A step that verified drafts emits a varying number of tokens per request: its tokens come as [n, k + 1]
with a count per row, and the row's token count and KV count are settled when they arrive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.sample.logprobs import to_token_logprobs
from tokenmill.sample.sampler import LogprobsTensors
from tokenmill.scheduler.output import ModelRunnerOutput, TokenLogprobs
from tokenmill.worker.request_state import RequestStates

if TYPE_CHECKING:
    from torch.distributed import Work


@dataclass
class VerifiedTokens:
    """What a step that verified drafts emits: tokens [n, k + 1] and their count per row [n], on the device."""

    token_ids: torch.Tensor
    num_emitted: torch.Tensor
    num_drafts: np.ndarray
    """[n] drafts verified per row (0 for rows that only sampled)."""
    logprob_starts: np.ndarray
    """[n] each row's first entry in the step's logprobs, which has one entry per verified position."""
    num_positions: np.ndarray | None = None
    """[n] draft positions verified per row, where they differ from num_drafts: a draft tree's depth (its nodes
    are num_drafts); the step's logprobs have 1 + this many entries per row, and its metrics count these."""

    @property
    def num_draft_positions(self) -> np.ndarray:
        return self.num_drafts if self.num_positions is None else self.num_positions


class PendingOutput:
    def __init__(
        self,
        states: RequestStates,
        request_ids: list[str],
        rows: np.ndarray,
        positions: np.ndarray,
        token_ids: torch.Tensor | VerifiedTokens,
        logprobs: LogprobsTensors | None = None,
        num_logprobs: list[int | None] | None = None,
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
        host_buffer: torch.Tensor | None = None,
        arrival: Work | None = None,
        none_left: torch.Tensor | None = None,
        ahead_of: tuple[PendingOutput, np.ndarray] | None = None,
    ) -> None:
        """`token_ids` [n] on the device (one per row) or a verifying step's tokens; `host_buffer`, pinned
        and long enough, receives them; `arrival` is the receive still filling them (another pipeline stage's);
        `none_left` [n] bool marks the rows that had no token to sample: -1 reaches the host for them (the
        device keeps the drawn token, which the next step may read as its input and then discards); `ahead_of`:
        the verifying step this one was launched before the tokens of (worker/verify_ahead.py), and each row's index
        there: the rows' token counts did not hold that step's accepted drafts yet, nor did `positions`."""
        self._states = states
        self._request_ids = request_ids
        self._rows = rows
        self._generations = states.row_generation[rows]  # [n] a copy: fancy indexing
        self._positions = positions
        self._num_logprobs = num_logprobs
        self._prompt_logprobs = prompt_logprobs or {}
        self._output: ModelRunnerOutput | None = None
        self._event = None
        self._arrival = arrival
        self.verified = token_ids if isinstance(token_ids, VerifiedTokens) else None
        if self.verified is not None:
            self.wait_for_tokens()  # read right here (the next step waits for a verifying step's anyway)
            emitted = self.verified.token_ids
            if none_left is not None:  # such a row verified nothing: its one token is column 0 (only the host's -1)
                # ([n, columns]: the tokens before a marked one stand; the scheduler ends the request at the -1.)
                emitted = torch.where(none_left.unsqueeze(1) if none_left.dim() == 1 else none_left, -1, emitted)
            # One copy: the counts as column 0, the tokens after them.
            token_ids = torch.cat([self.verified.num_emitted.unsqueeze(1), emitted], dim=1).flatten()
        elif none_left is not None:
            token_ids = torch.where(none_left, -1, token_ids)
        if token_ids.is_cuda:
            self.wait_for_tokens()  # NCCL: the copy below queues behind the receive; the host does not wait
            self._host_tokens = host_buffer[: len(token_ids)]
            self._host_tokens.copy_(token_ids, non_blocking=True)
            if logprobs is not None:
                logprobs = LogprobsTensors(*(t.to("cpu", non_blocking=True) for t in
                                             (logprobs.token_ids, logprobs.logprobs, logprobs.sampled_ranks)))
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host_tokens = token_ids
        self._logprobs = logprobs
        self._next_drafts = None
        self._ahead_of = ahead_of
        self._when_tokens: list[Callable[[], None]] = []
        self.num_emitted: np.ndarray | None = None
        """[n] the tokens each row emitted, once result() has them (a verifying step)."""

    def add_next_drafts(self, indices: np.ndarray, drafts: torch.Tensor, host_buffer: torch.Tensor | None) -> None:
        """The next step's drafts [len(indices), k] of the step's rows `indices`, drafted after its tokens were
        queued for the host (SpeculativeDecoding.draft_next): copied behind them, waited for only when the next
        step looks at them on the host, so that the host takes this step's tokens while the device drafts (and
        the next step can read them on the device without waiting: RequestStates.next_drafts_on_device)."""
        event, host = None, drafts
        if drafts.is_cuda:
            host = host_buffer[: drafts.numel()].view(drafts.shape)
            host.copy_(drafts, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._next_drafts = (indices, drafts, host, event)

    def _expect_next_drafts(self) -> None:
        indices, drafts, host, event = self._next_drafts
        kept = self._kept_rows()[indices]
        rows = self._rows[indices[kept]]
        at = np.stack([self._states.row_generation[rows], self._states.num_tokens[rows]], axis=1)

        def land() -> None:
            if event is not None:
                event.synchronize()
            self._states.keep_next_drafts(rows, at, host.numpy()[kept])

        self._states.expect_next_drafts(land, (rows, at, np.flatnonzero(kept), drafts))

    @property
    def next_drafts(self) -> tuple[np.ndarray, torch.Tensor] | None:
        """The rows (indices in this step's) and their next drafts [n, k] on the device, if add_next_drafts gave any."""
        return None if self._next_drafts is None else self._next_drafts[:2]

    @property
    def generations(self) -> np.ndarray:
        """[n] each row's generation when the step was launched."""
        return self._generations

    @property
    def is_done(self) -> bool:
        return self._output is not None

    @property
    def rows(self) -> np.ndarray:
        """[n] the rows that sampled in this step."""
        return self._rows

    def has_tokens(self) -> bool:
        """Whether the tokens are on the host already (result() would not wait); never blocks."""
        if self._output is not None:
            return True
        return self._arrival is None and (self._event is None or self._event.query())

    def when_tokens(self, call: Callable[[], None]) -> None:
        """Call `call` once result() has the tokens in the worker's rows (at once if it has)."""
        if self._output is not None:
            call()
        else:
            self._when_tokens.append(call)

    def result(self) -> ModelRunnerOutput:
        """Wait for the copy, store the tokens in the worker's rows, and return the step's output."""
        if self._output is not None:
            return self._output
        if self._ahead_of is not None:  # that step's accepted drafts first: then this one's positions
            (last, index), self._ahead_of = self._ahead_of, None
            last.result()
            self._positions = self._positions + last.num_emitted[index] - 1
        self.wait_for_tokens()
        if self._event is not None:
            self._event.synchronize()
        num_drafts = {}
        if self.verified is None:
            flat = self._host_tokens.tolist()
            self._write_host_tokens(flat)
            token_ids = [[t] for t in flat]
            logprob_slices = [slice(i, i + 1) for i in range(len(flat))]
        else:
            packed = self._host_tokens.numpy().reshape(len(self._rows), -1)
            counts = self.num_emitted = packed[:, 0]
            token_ids = [packed[i, 1 : 1 + c].tolist() for i, c in enumerate(counts.tolist())]
            self._write_verified_tokens(token_ids, counts)
            if self._next_drafts is not None:
                self._expect_next_drafts()
            starts = self.verified.logprob_starts
            logprob_slices = [slice(s, s + c) for s, c in zip(starts.tolist(), counts.tolist())]
            num_drafts = {rid: d for rid, d in zip(self._request_ids, self.verified.num_draft_positions.tolist()) if d}
        logprobs = {}
        if self._logprobs is not None:
            entries = to_token_logprobs(self._logprobs, self._num_top_per_entry())
            logprobs = {rid: entries[where] for rid, where, k
                        in zip(self._request_ids, logprob_slices, self._num_logprobs) if k is not None}
        self._output = ModelRunnerOutput(dict(zip(self._request_ids, token_ids)), logprobs, self._prompt_logprobs,
                                         num_drafts)
        calls, self._when_tokens = self._when_tokens, []
        for call in calls:
            call()
        return self._output

    def wait_for_tokens(self) -> None:
        """Until the tokens are on their device (received from the last pipeline stage)."""
        if self._arrival is not None:
            self._arrival.wait()
            self._arrival = None

    def _num_top_per_entry(self) -> list[int]:
        per_row = [k or 0 for k in self._num_logprobs]
        if self.verified is None:
            return per_row
        return np.repeat(per_row, 1 + self.verified.num_draft_positions).tolist()

    def _kept_rows(self) -> np.ndarray:
        # Rows whose request left since the launch may serve another request now: never write there.
        return self._states.row_generation[self._rows] == self._generations

    def _write_host_tokens(self, token_ids: list[int]) -> None:
        kept = self._kept_rows()
        if kept.all():
            self._states.token_ids[self._rows, self._positions] = token_ids
        elif kept.any():
            self._states.token_ids[self._rows[kept], self._positions[kept]] = np.asarray(token_ids)[kept]

    def _write_verified_tokens(self, token_ids: list[list[int]], counts: np.ndarray) -> None:
        """The emitted tokens replace the drafts in the rows; rejected drafts leave the KV count."""
        states = self._states
        for i in np.flatnonzero(self._kept_rows()).tolist():
            row, position, count = self._rows[i], self._positions[i], counts[i]
            states.token_ids[row, position : position + count] = token_ids[i]
            states.num_tokens[row] += count - 1  # the launch counted one
            states.num_computed_tokens[row] -= 1 + self.verified.num_drafts[i] - count


class DeferredSample:
    """A step whose sampler waits for its grammar masks, which a grammar process fills while the engine updates,
    outputs and schedules: launched first thing in the runner's next step, or by result() if that comes first
    (without async scheduling, at once). Where the masks' request itself waited for the last step's tokens, that
    step's result() comes first (`before`)."""

    def __init__(self, launch: Callable[[], PendingOutput], before: Callable[[], object] | None = None) -> None:
        """`before`: called first at the launch (the last step's result(), whose tokens begin the masks)."""
        self._launch = launch
        self._before = before
        self._pending: PendingOutput | None = None

    def launch(self) -> PendingOutput:
        if self._pending is None:
            if self._before is not None:
                self._before, before = None, self._before
                before()
            self._pending, self._launch = self._launch(), None
        return self._pending

    def result(self) -> ModelRunnerOutput:
        return self.launch().result()


class ReadyOutput:
    """The output of a step that sampled nothing: there is nothing to wait for."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output
