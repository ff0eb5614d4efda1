"""How many draft tokens each decoding request may have verified this step (speculative decoding).

Speculation trades compute for steps: verifying k drafts makes a request's step cost as much as k + 1
tokens, and pays off only while the forward pass is bound by reading the weights rather than by the
tokens (vLLM issue #8439: at large batch it loses). The budget picks, each step, the k that maximises
expected emitted tokens per unit of step cost, if that beats plain decoding by MIN_GAIN, else 0:

  expected tokens of one request with k drafts, each accepted with probability a:  (1 - a^(k+1)) / (1 - a)
  step cost for B requests of 1 + k tokens, relative to a plain step:  t(B (1 + k)) / t(B)

Lookahead has a price of its own even when nothing is drafted: the worker must have the last step's
tokens on the host to draft, so the step cannot overlap the one before it (async scheduling). When a step
with lookahead gains less than MIN_GAIN accepted tokens per request (random text gives the n-gram
proposer nothing to match), lookahead pauses for 1, 2, 4, ... up to MAX_PAUSE steps, then probes again.

`t(n) = fixed + per_token * n` is measured by the worker on this device at start-up (StepCost), and
`a` is the running acceptance rate of the drafts verified so far. A step verifies at most
`max_tokens_per_step` tokens (on the GPU: the largest decode CUDA graph, which then runs it). Torch-free:
the scheduler owns it.

With a draft tree (speculative_token_tree) k is the tree's depth: a request's step computes the tree's nodes
down to that depth, and `a` is the rate at which a verification reaches one level further.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.sampling_params import SamplingParams

# Prior belief about the acceptance rate, worth this many drafts: speculation starts, and the measured
# rate takes over within a few steps.
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 16
MIN_GAIN = 0.1
MAX_PAUSE = 64
# The running rate forgets old drafts at this rate per verified draft token, so it follows the workload,
# and drifts back to the prior at RELAX per step, so a rate that stopped all drafting is tried again later.
DECAY = 0.999
RELAX = 0.995


@dataclass(frozen=True)
class StepCost:
    """Forward-pass time for n tokens, t(n) = fixed_s + per_token_s * n, measured on the device."""

    fixed_s: float
    per_token_s: float

    def __call__(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens


def can_draft(params: SamplingParams) -> bool:
    """Whether a request may have drafts verified. Penalties, bad words and logits processors depend on the
    tokens before each position, which the verification does not model; a seeded request's draws are keyed
    by its seed and position, so with drafts its tokens would depend on how many each step had (and so on
    the batch). Those requests decode one token per step: exactly, and with the same tokens as without
    speculation, but without its speed-up. (Requests under a grammar do draft: structured/matchers.py masks
    every draft position; but not with bans of their own, which may leave a position no token, as only a
    one-token step detects: sample/no_token.py. Nor with a thinking budget, whose machine moves one sampled token
    at a time: sample/thinking_budget.py.)"""
    return not (params.has_penalties or params.bad_words_token_ids or params.logits_processors
                or params.thinking_token_budget is not None
                or (params.seed is not None and not params.is_greedy)
                or (params.structured_outputs is not None and params.bans_tokens))


class DraftBudget:
    def __init__(self, num_speculative_tokens: int, cost: StepCost | None,
                 disable_by_batch_size: int | None = None, max_tokens_per_step: int = 1 << 30,
                 tree_level_sizes: tuple[int, ...] | None = None, slots_ahead: int = 0) -> None:
        """`slots_ahead`: KV slots past a verifying step's own that its proposer writes (drafting the next step's
        chain right after verifying: SpeculativeConfig.drafts_after_verify)."""
        self.max_drafts = num_speculative_tokens
        self.slots_ahead = slots_ahead
        self.tree_level_sizes = tree_level_sizes
        sizes = tree_level_sizes or (1,) * num_speculative_tokens
        self._slots_by_depth = [sum(sizes[:d]) for d in range(len(sizes) + 1)]
        """Draft tokens a request computes for each depth of drafts (a chain: the depth itself)."""
        self.max_tokens_per_step = max_tokens_per_step
        self.cost = cost
        self.disable_by_batch_size = disable_by_batch_size
        self._accepted = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
        self._drafted = float(PRIOR_WEIGHT)
        self.min_gain = MIN_GAIN
        self._pause = 0
        """Steps left without lookahead."""
        self._next_pause = 1

    @property
    def acceptance_rate(self) -> float:
        return self._accepted / self._drafted

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            decay = DECAY**num_drafted
            self._accepted = self._accepted * decay + num_accepted
            self._drafted = self._drafted * decay + num_drafted

    def record_step(self, num_requests: int, num_accepted: int) -> None:
        """One step's outcome: `num_requests` were given lookahead, and `num_accepted` drafts were accepted."""
        if num_requests == 0:
            return
        if num_accepted < self.min_gain * num_requests:
            self._pause = self._next_pause
            self._next_pause = min(2 * self._next_pause, MAX_PAUSE)
        else:
            self._next_pause = 1

    def drafts_per_request(self, num_requests: int) -> int:
        """k for a step of `num_requests` decoding requests."""
        self._accepted = self._accepted * RELAX + PRIOR_ACCEPTANCE * PRIOR_WEIGHT * (1 - RELAX)
        self._drafted = self._drafted * RELAX + PRIOR_WEIGHT * (1 - RELAX)
        if self._pause:
            self._pause -= 1
            return 0
        if num_requests == 0 or (self.disable_by_batch_size is not None and num_requests > self.disable_by_batch_size):
            return 0
        max_slots = self.max_tokens_per_step // num_requests - 1
        max_drafts = max((d for d in range(self.max_drafts + 1) if self._slots_by_depth[d] <= max_slots), default=0)
        if self.cost is None:
            return max_drafts
        a = min(self.acceptance_rate, 0.999)
        plain = self.cost(num_requests)
        # Drafting must promise MIN_GAIN more tokens per second than plain decoding: it also costs the overlap.
        best_k, best_rate = 0, (1 + self.min_gain) / plain
        for k in range(1, max_drafts + 1):
            rate = (1 - a ** (k + 1)) / (1 - a) / self.cost(num_requests * (1 + self._slots_by_depth[k]))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def num_slots(self, depth: int) -> int:
        """Lookahead tokens for drafts of `depth` (a tree's nodes down to it; a chain's `depth`)."""
        return self._slots_by_depth[min(max(depth, 0), self.max_drafts)]
