"""The oracle proposer of benchmarks/spec_decode.py: drafts the target's own greedy continuation of the current
context, so that every draft is accepted (benchmark only: never a user's choice).

In bfloat16 a verify step of 1 + k rows rounds differently from a one-row decode step, so a speculative run
may take the other side of a near-tie than plain decoding did; from there plain decoding's continuation is no
longer the target's continuation of the run's context. follow_target() learns it: it repeats the speculative
run and learns each run's own output, until a run stays within what the oracle knows (it then never lacked
drafts). A run's tokens after its divergence came from undrafted one-row steps of the same engine; the next run
verifies them in (1 + k)-row steps, so it can diverge only where those two round a near-tie apart, later on.
(A plain engine's continuation would not do: its prefill of the diverged context rounds differently again.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class OracleProposer:
    """Drafts from the known token sequences (prompt + continuation): of those that begin with a row's tokens,
    the one learnt last (it branched off where the last run left the others, so it knows the most)."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = [list(s) for s in sequences]
        self.misses = 0
        """Rows asked for drafts whose tokens no known sequence begins with: the run went on undrafted."""

    def learn(self, sequence: list[int]) -> None:
        self.sequences.append(list(sequence))

    def continuation(self, context: list[int], k: int) -> list[int] | None:
        """Up to k known tokens after `context`; None when no known sequence begins with it."""
        n = len(context)
        for sequence in reversed(self.sequences):
            if sequence[:n] == context:
                return sequence[n : n + k]
        return None

    def known_prefix(self, sequence: list[int]) -> int:
        """How many first tokens of `sequence` some known sequence has too."""
        return max(common_prefix_length(sequence, known) for known in self.sequences)

    def propose(self, states, rows: np.ndarray, max_drafts: np.ndarray) -> list[np.ndarray]:
        drafts = []
        for row, k in zip(rows.tolist(), max_drafts.tolist()):
            found = self.continuation(states.token_ids[row, : int(states.num_tokens[row])].tolist(), k)
            if found is None:
                self.misses += 1
            drafts.append(np.array(found or [], dtype=np.int64))
        return drafts


@dataclass
class Followed:
    output: list[int]
    """The last speculative run's output tokens."""
    divergences: list[int]
    """Output positions where a run's token was not what the oracle knew, one per run that diverged."""
    converged: bool
    """The last run stayed within what the oracle knew."""


def follow_target(oracle: OracleProposer, spec_run: Callable[[], list[int]], prompt: list[int],
                  max_rounds: int) -> Followed:
    """Teaches `oracle` the target's greedy continuation of the speculative run's own context.

    spec_run(): a speculative run's output tokens, drafted by `oracle`. Where a run leaves what the oracle
    knows, its token is the target's choice under the verify step's rounding: the run's output is learnt."""
    divergences: list[int] = []
    output: list[int] = []
    for _ in range(max_rounds):
        output = list(spec_run())
        sequence = prompt + output
        known = oracle.known_prefix(sequence)
        if known == len(sequence):
            return Followed(output, divergences, True)
        divergences.append(known - len(prompt))
        oracle.learn(sequence)
    return Followed(output, divergences, False)
