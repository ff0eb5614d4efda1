"""The worker's grammar state: one xgrammar matcher per constrained row, and each step's token bitmask.

A row's matcher is advanced with the tokens its request emitted since the last step (on the host: the
runner waits for the last step's tokens before sampling a constrained row), then fills the row's bitmask
of allowed next tokens (packed int32, 32 tokens a word), which is applied to the logits on the device
before anything else of sampling. A request resumed after preemption gets a fresh matcher that replays
its output so far. With speculative decoding the matcher walks through the step's drafts to mask every
draft position (the rejection sampler then sees the constrained distribution there too), and rolls back.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.worker.request_state import RequestStates

logger = logging.getLogger(__name__)


class GrammarRows:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, device: torch.device) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.device = device
        self._rows: dict[int, tuple[int, object, int]] = {}
        """row -> (the row's generation, its matcher, output tokens it has accepted)."""

    def add(self, row: int, states: RequestStates, eos_token_ids: frozenset[int]) -> None:
        import xgrammar as xgr

        params = states.sampling_params[row].structured_outputs
        matcher = xgr.GrammarMatcher(self.compiler.get(params), override_stop_tokens=sorted(eos_token_ids) or None)
        self._rows[row] = (int(states.row_generation[row]), matcher, 0)

    def constrained(self, rows: np.ndarray, states: RequestStates) -> list[int]:
        """Indices into `rows` of the rows under a grammar (a row reused by another request is dropped)."""
        found = []
        for i, row in enumerate(rows.tolist()):
            entry = self._rows.get(row)
            if entry is not None:
                if entry[0] == states.row_generation[row]:
                    found.append(i)
                else:
                    del self._rows[row]
        return found

    def apply(self, logits: torch.Tensor, rows: np.ndarray, first_logit_rows: np.ndarray, num_drafts: np.ndarray,
              states: RequestStates, constrained: list[int]) -> None:
        """Mask the tokens the grammar of row `rows[i]` (i in `constrained`) forbids, in its logits rows
        `first_logit_rows[i]` .. `+ num_drafts[i]`: one per draft position (the grammar having accepted the
        drafts before it), then the position after the drafts. The rows' tokens must be on the host."""
        import xgrammar as xgr

        num_masks = sum(int(num_drafts[i]) + 1 for i in constrained)
        bitmask = xgr.allocate_token_bitmask(num_masks, self.vocab_size)
        index, j = [], 0
        for i in constrained:
            row = int(rows[i])
            matcher = self._advance(row, states)
            length, d = int(states.num_tokens[row]), int(num_drafts[i])
            drafts = states.token_ids[row, length : length + d].tolist()
            num_accepted = 0
            for position in range(d + 1):
                index.append(int(first_logit_rows[i]) + position)
                if matcher.is_terminated():
                    # Past the stop token: a draft there is rejected by the position before, and a step that
                    # async scheduling ran past its end is discarded, so any token will do.
                    bitmask[j] = -1
                else:
                    matcher.fill_next_token_bitmask(bitmask, j)
                j += 1
                if position < d:
                    if matcher.is_terminated() or not matcher.accept_token(drafts[position]):
                        # The mask rejects this draft: the positions after it are never used.
                        bitmask[j : j + d - position] = -1
                        index.extend(int(first_logit_rows[i]) + p for p in range(position + 1, d + 1))
                        j += d - position
                        break
                    num_accepted += 1
            if num_accepted:
                matcher.rollback(num_accepted)  # back to the known tokens: the drafts may yet be rejected
        index_t = torch.tensor(index, dtype=torch.int64).to(self.device)
        allowed = unpack_bitmask(bitmask.to(self.device), logits.shape[-1])
        logits[index_t] = logits[index_t].masked_fill(~allowed, float("-inf"))

    def _advance(self, row: int, states: RequestStates):
        """The row's matcher, having accepted every token its request emitted so far."""
        generation, matcher, accepted = self._rows[row]
        start = int(states.num_prompt_tokens[row]) + accepted
        new_tokens = states.token_ids[row, start : states.num_tokens[row]].tolist()
        for token in new_tokens:
            if not matcher.accept_token(token):
                logger.warning("grammar of row %d refused token %d it had allowed", row, token)
        self._rows[row] = (generation, matcher, accepted + len(new_tokens))
        return matcher


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, words] int32, bit b of word w = token 32 w + b allowed -> [n, vocab_size] bool."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
