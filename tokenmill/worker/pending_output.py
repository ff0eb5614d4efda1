"""PendingOutput: a launched step's sampled tokens on their way to the host.

The model runner returns as soon as a step's kernels are queued; the tokens (and logprobs) are
copied to pinned host memory behind them on the same stream. `result()` waits for that copy only
when the engine needs the tokens, which with async scheduling is after the next step is queued, so
the host's scheduling and bookkeeping overlap the GPU's work.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.sample.logprobs import to_token_logprobs
from tokenmill.sample.sampler import LogprobsTensors
from tokenmill.scheduler.output import ModelRunnerOutput, TokenLogprobs
from tokenmill.worker.request_state import RequestStates


class PendingOutput:
    def __init__(
        self,
        states: RequestStates,
        request_ids: list[str],
        rows: np.ndarray,
        positions: np.ndarray,
        token_ids: torch.Tensor,
        logprobs: LogprobsTensors | None = None,
        num_logprobs: list[int | None] | None = None,
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
        host_buffer: torch.Tensor | None = None,
    ) -> None:
        """`token_ids` [n] on the device; `host_buffer`, pinned and at least n long, receives them."""
        self._states = states
        self._request_ids = request_ids
        self._rows = rows
        self._generations = states.row_generation[rows]  # [n] a copy: fancy indexing
        self._positions = positions
        self._num_logprobs = num_logprobs
        self._prompt_logprobs = prompt_logprobs or {}
        self._output: ModelRunnerOutput | None = None
        self._event = None
        if token_ids.is_cuda:
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

    def result(self) -> ModelRunnerOutput:
        """Wait for the copy, store the tokens in the worker's rows, and return the step's output."""
        if self._output is not None:
            return self._output
        if self._event is not None:
            self._event.synchronize()
        token_ids = self._host_tokens.tolist()
        self._write_host_tokens(token_ids)
        logprobs = {}
        if self._logprobs is not None:
            entries = to_token_logprobs(self._logprobs, [k or 0 for k in self._num_logprobs])
            logprobs = {rid: e for rid, e, k in zip(self._request_ids, entries, self._num_logprobs) if k is not None}
        self._output = ModelRunnerOutput(dict(zip(self._request_ids, token_ids)), logprobs, self._prompt_logprobs)
        return self._output

    def _write_host_tokens(self, token_ids: list[int]) -> None:
        # Skip rows whose request left since the launch (the row may serve another request now).
        kept = self._states.row_generation[self._rows] == self._generations
        if kept.all():
            self._states.token_ids[self._rows, self._positions] = token_ids
        elif kept.any():
            self._states.token_ids[self._rows[kept], self._positions[kept]] = np.asarray(token_ids)[kept]


class ReadyOutput:
    """The output of a step that sampled nothing: there is nothing to wait for."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output
