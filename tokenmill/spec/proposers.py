"""The proposer of each speculative method: what drafts the tokens a step verifies.

A proposer sees the verifying rows of the worker's RequestStates (tokens known on the host, block
tables) and returns up to `max_drafts` tokens per row; one that keeps state per request may have a
`drop(rows)`, called when the rows' requests finish or are preempted. A new method is one more entry here
and one more file beside this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from tokenmill.config import SpeculativeConfig
from tokenmill.spec.ngram import NgramProposer

if TYPE_CHECKING:
    from tokenmill.worker.request_state import RequestStates


class Proposer(Protocol):
    def propose(self, states: RequestStates, rows: np.ndarray, max_drafts: np.ndarray) -> list[np.ndarray]:
        """Each row's drafts, at most `max_drafts` of them, maybe none; the rows' first `num_tokens` are known."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposers that need nothing of the worker; draft models are built by the worker (it owns the device)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"no proposer for speculative method {config.method!r}")
