"""The proposer of each speculative method: what drafts the tokens a step verifies.

A proposer sees the verifying rows' known tokens (prompt and output, on the host) and returns up to
`max_drafts` tokens per row. A new method is one more entry here and one more file beside this one.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tokenmill.config import SpeculativeConfig
from tokenmill.spec.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, max_drafts: np.ndarray) -> list[np.ndarray]:
        """`token_ids` [n, width] the rows' tokens (the first `num_tokens` of each are real); returns each
        row's drafts, at most `max_drafts` of them, maybe none."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"no proposer for speculative method {config.method!r}")
