"""thinking_token_budget: at most so many generated tokens inside a reasoning block, then its end marker forced.

A request's reasoning block runs from the start marker (`<think>`) to the end marker (`</think>`), both token
sequences of the engine's reasoning_config. Each row follows one small machine over its tokens:

    OUTSIDE --start marker--> THINKING --end marker--> OUTSIDE
                              THINKING --budget spent--> FORCING --end marker's last token--> OUTSIDE

In THINKING every generated token counts against the budget (the whole output's, over all its blocks); once it is
spent, each step's logits keep only the end marker's next token, until the marker is complete. The prompt's tokens
move the machine without counting: a prompt that ends inside a block (DeepSeek-R1's template writes `<think>\\n`)
starts the row in THINKING, one whose template closed the block (thinking turned off) OUTSIDE.

The rows' states live on the device and are advanced there from each step's sampled tokens, so the host never waits
for them: async scheduling keeps the next step queued behind the last one's draw. The host only computes a row's
state when it is (re)added, by scanning its tokens (`scan`, also the tests' reference for `advance`). A marker is
matched as a token sequence that does not restart inside itself (true of every think marker: a mismatch restarts the
match at the marker's first token).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.device_copy import to_device

OUTSIDE, THINKING, FORCING = 0, 1, 2
PHASE, LEFT, START_MATCHED, END_MATCHED = range(4)
"""Columns of a row's state: its phase; the budget left; the start marker's and the end marker's tokens matched so
far (in FORCING, END_MATCHED is the end marker's tokens emitted so far)."""


def _matched(marker: list[int], matched: int, token: int) -> int:
    if token == marker[matched]:
        return matched + 1
    return 1 if token == marker[0] else 0


def step(state: list[int], token: int, start: list[int], end: list[int], counting: bool = True) -> None:
    """Advance a row's state (PHASE, LEFT, START_MATCHED, END_MATCHED) in place by one token; `counting`: an output
    token (a prompt token moves the machine without spending the budget, nor forcing anything)."""
    phase = state[PHASE]
    if phase == OUTSIDE:
        state[START_MATCHED] = _matched(start, state[START_MATCHED], token)
        if state[START_MATCHED] == len(start):
            state[PHASE], state[START_MATCHED], state[END_MATCHED] = THINKING, 0, 0
    elif phase == THINKING:
        state[END_MATCHED] = _matched(end, state[END_MATCHED], token)
        if state[END_MATCHED] == len(end):
            state[PHASE], state[END_MATCHED] = OUTSIDE, 0
        elif counting:
            state[LEFT] -= 1
    else:  # FORCING: the token was the end marker's next one
        state[END_MATCHED] += 1
        if state[END_MATCHED] == len(end):
            state[PHASE], state[END_MATCHED] = OUTSIDE, 0
    if counting:
        _force_if_spent(state)


def _force_if_spent(state: list[int]) -> None:
    if state[PHASE] == THINKING and state[LEFT] <= 0:
        state[PHASE] = FORCING  # from the end marker's tokens already written, if any


def scan(token_ids: list[int], num_prompt_tokens: int, budget: int, start: list[int], end: list[int]) -> list[int]:
    """A row's state after its prompt and output so far. The prompt is read from its last end marker on (where
    every block is closed, when no token is in both markers): a long prompt costs one pass of numpy."""
    state = [OUTSIDE, budget, 0, 0]
    first = 0 if set(start) & set(end) else _after_last(np.asarray(token_ids[:num_prompt_tokens]), end)
    for i in range(first, num_prompt_tokens):
        step(state, token_ids[i], start, end, counting=False)
    _force_if_spent(state)
    for token in token_ids[num_prompt_tokens:]:
        step(state, token, start, end)
    return state


class ReasoningTokenCount:
    """How many output tokens lie inside reasoning blocks, the markers' own tokens not counted (a response's
    usage.completion_tokens_details.reasoning_tokens): the machine above with a budget never spent, fed the output's
    tokens as they come."""

    NEVER_SPENT = 1 << 62

    def __init__(self, start: list[int], end: list[int], state: list[int]) -> None:
        self._start, self._end, self._state = start, end, state
        self._closed = 0
        """Blocks the output closed: each end marker's tokens but its last were counted before it was complete."""

    @classmethod
    def after_prompt(cls, prompt_token_ids: list[int], start: list[int], end: list[int]) -> ReasoningTokenCount:
        """Outside a block, or inside one where the prompt ends inside it (a template that opens it)."""
        return cls(start, end, scan(prompt_token_ids, len(prompt_token_ids), cls.NEVER_SPENT, start, end))

    @classmethod
    def inside(cls, start: list[int], end: list[int]) -> ReasoningTokenCount:
        return cls(start, end, [THINKING, cls.NEVER_SPENT, 0, 0])

    def copy(self) -> ReasoningTokenCount:
        twin = ReasoningTokenCount(self._start, self._end, list(self._state))
        twin._closed = self._closed
        return twin

    @property
    def is_inside(self) -> bool:
        return self._state[PHASE] == THINKING

    def feed(self, token_ids: list[int]) -> None:
        for token in token_ids:
            was_inside = self._state[PHASE] == THINKING
            step(self._state, token, self._start, self._end)
            self._closed += was_inside and self._state[PHASE] == OUTSIDE

    @property
    def count(self) -> int:
        return self.NEVER_SPENT - self._state[LEFT] - self._closed * (len(self._end) - 1)


def _after_last(tokens: np.ndarray, marker: list[int]) -> int:
    """The index after the last occurrence of `marker` in `tokens` (0: none)."""
    if len(tokens) < len(marker):
        return 0
    windows = np.lib.stride_tricks.sliding_window_view(tokens, len(marker))
    hits = np.flatnonzero((windows == np.asarray(marker)).all(axis=1))
    return int(hits[-1]) + len(marker) if len(hits) else 0


class ThinkingBudgets:
    """The rows' reasoning-block states on the device: `force` before a step's draw, `advance` after it."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.device = device
        self.active = np.zeros(max_num_reqs, dtype=bool)
        """Rows with a budget (host copy: a batch without any skips both calls)."""
        self._states = torch.zeros(max_num_reqs, 4, dtype=torch.int64, device=device)
        self._markers: tuple[list[int], list[int]] | None = None
        """The (start, end) marker ids: the engine's reasoning_config's, the same for every request."""
        self._marker_tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, row: int, budget: int | None, start: list[int], end: list[int], token_ids: list[int],
            num_prompt_tokens: int) -> None:
        """A request took `row`: its state from its tokens (a resumed one's output included); None: no budget."""
        self.active[row] = budget is not None
        if budget is None:
            return
        if self._markers is None:
            self._markers = (start, end)
            self._marker_tensors = tuple(torch.tensor(m, dtype=torch.int64, device=self.device) for m in (start, end))
        assert self._markers == (start, end), "an engine's requests share its reasoning markers"
        state = scan(token_ids, num_prompt_tokens, budget, start, end)
        # Queued behind the steps before: the updates of the row's last request may still be in flight.
        self._states[row] = to_device(np.array(state, dtype=np.int64), self.device)

    def force(self, logits: torch.Tensor, rows: np.ndarray, logit_rows: np.ndarray | None = None) -> None:
        """Keep only the end marker's next token in the logits of the rows whose budget is spent. `logit_rows`: each
        row's logits row where a step has several per row (drafts verified); None: row i's is logits row i."""
        if self._markers is None:  # no request has had a budget: nothing to look up in the step
            return
        used = self.active[rows]
        if not used.any():
            return
        index, where = self._rows(rows, used, logit_rows)
        state = self._states[index]
        start, end = self._marker_tensors
        forcing = state[:, PHASE] == FORCING
        forced = end[state[:, END_MATCHED].clamp(max=len(end) - 1)]
        picked = logits[where]
        kept = picked.gather(1, forced[:, None])
        # Every other token -inf in the forcing rows; the forced one keeps its logit (0 where a mask took it: the
        # marker must still come out).
        picked.masked_fill_(forcing[:, None], float("-inf"))
        picked.scatter_(1, forced[:, None], torch.where(forcing[:, None] & kept.isneginf(), 0.0, kept))
        logits[where] = picked

    def advance(self, rows: np.ndarray, token_ids: torch.Tensor) -> None:
        """Move the rows' machines by the tokens they sampled (token_ids [len(rows)], on the device)."""
        if self._markers is None:
            return
        used = self.active[rows]
        if not used.any():
            return
        index, where = self._rows(rows, used, None)
        tokens = token_ids[where]
        state = self._states[index]
        start, end = self._marker_tensors
        phase, left = state[:, PHASE], state[:, LEFT]
        start_matched, end_matched = state[:, START_MATCHED], state[:, END_MATCHED]
        new_start = _matched_on_device(start, start_matched, tokens)
        new_end = _matched_on_device(end, end_matched, tokens)
        outside, thinking, forcing = phase == OUTSIDE, phase == THINKING, phase == FORCING
        opened = outside & (new_start == len(start))
        closed = (thinking & (new_end == len(end))) | (forcing & (end_matched + 1 == len(end)))
        left = left - (thinking & ~closed).long()
        start_matched = torch.where(outside & ~opened, new_start, 0)
        end_matched = torch.where(closed | opened, 0, torch.where(forcing, end_matched + 1,
                                                                   torch.where(thinking, new_end, end_matched)))
        phase = torch.where(opened, THINKING, torch.where(closed, OUTSIDE, phase))
        phase = torch.where((phase == THINKING) & (left <= 0), FORCING, phase)
        self._states[index] = torch.stack([phase, left, start_matched, end_matched], dim=1)

    def _rows(self, rows: np.ndarray, used: np.ndarray, logit_rows: np.ndarray | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows with a budget and their places in the step's logits (or tokens), on the device."""
        chosen = np.flatnonzero(used)
        where = chosen if logit_rows is None else logit_rows[chosen]
        both = to_device(np.stack([rows[chosen], where]).astype(np.int64), self.device)
        return both[0], both[1]


def _matched_on_device(marker: torch.Tensor, matched: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`_matched` for many rows: the marker's tokens matched after each row's token."""
    expected = marker[matched.clamp(max=len(marker) - 1)]
    return torch.where(tokens == expected, matched + 1, (tokens == marker[0]).long())
