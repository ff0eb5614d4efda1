"""The token budget of a step from a step time (SchedulerConfig.target_step_ms).

A prompt chunk computed beside decoding requests lengthens their step, and so the gap between two of their
tokens, by its tokens' compute: on an H200, Llama-3.1-8B prefills ~45 tokens a millisecond, so a budget of
8,192 tokens can hold the decoding requests for ~180 ms when a burst of prompts arrives (S1's inter-token
p99 at 16 requests a second: 34 ms at 8,192, 21 ms at 768). The budget is instead what this device computes in
the target time, from t(n) = fixed + per_token * n measured on one prompt at start-up.
"""

from __future__ import annotations

from tokenmill.scheduler.draft_budget import StepCost

MIN_BUDGET = 512
"""Below this a prompt takes many steps, each paying the step's fixed costs."""
GRANULE = 128
"""The budget is a multiple of this (the GEMM tiles')."""


def token_budget_for_step_time(prefill_cost: StepCost, target_s: float, max_budget: int) -> int:
    """The most prompt tokens a step computes within `target_s`, in MIN_BUDGET..max_budget."""
    fits = (target_s - prefill_cost.fixed_s) / prefill_cost.per_token_s if prefill_cost.per_token_s > 0 else max_budget
    return int(min(max_budget, max(MIN_BUDGET, fits // GRANULE * GRANULE)))
