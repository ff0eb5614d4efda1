"""The device's forward-pass time as a function of the step's token count, measured once at start-up.

Speculative decoding's draft budget (scheduler/draft_budget.py) weighs the tokens a draft may save
against what verifying it costs on this device: t(n) = fixed + per_token * n, fitted to two timed
steps of n one-token requests, the layout (and, on the GPU, the CUDA graphs) that plain decode and
draft-verification steps run. The token budget from a step time (scheduler/token_budget.py) fits the
same line to two steps of one prompt of n tokens.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING

from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.draft_budget import StepCost
from tokenmill.scheduler.output import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner
    from tokenmill.worker.worker import Worker

logger = logging.getLogger(__name__)

REPEATS = 5


def measure_step_cost(worker: Worker, max_tokens: int) -> StepCost:
    """Times steps on the worker's own runner before any request arrives: one KV block per timed
    request, blocks the scheduler has not handed out yet, and every row freed afterwards."""
    runner = worker.model_runner
    # Never more requests than the runner has rows for, nor than the pool has blocks (max_tokens is both).
    large = min(max_tokens, 256 if worker.device.type == "cuda" else 32)
    small = max(1, large // 16)
    times = {n: _time_step(runner, n, worker.hf_config.vocab_size) for n in (small, large)}
    cost = _fit_line(times, small, large)
    logger.info("step cost for speculative decoding: %.2f ms + %.1f us per token", cost.fixed_s * 1e3,
                cost.per_token_s * 1e6)
    return cost


def measure_prefill_cost(worker: Worker, max_tokens: int) -> StepCost:
    """t(n) of a step that computes one prompt of n tokens (n up to `max_tokens`), on blocks the scheduler has
    not handed out yet, freed afterwards."""
    runner, block_size = worker.model_runner, worker.config.cache_config.block_size
    large = min(max_tokens, 2048)
    small = max(1, large // 8)
    times = {n: _time_step(runner, n, worker.hf_config.vocab_size, prompt_len=n, block_size=block_size)
             for n in (small, large)}
    cost = _fit_line(times, small, large)
    logger.info("prefill step cost: %.2f ms + %.1f us per prompt token", cost.fixed_s * 1e3, cost.per_token_s * 1e6)
    return cost


def _fit_line(times: dict[int, float], small: int, large: int) -> StepCost:
    """t(n) = fixed + per_token * n through the two timed sizes (never negative)."""
    per_token = max(0.0, (times[large] - times[small]) / (large - small)) if large > small else 0.0
    return StepCost(fixed_s=max(1e-6, times[small] - per_token * small), per_token_s=per_token)


def _time_step(runner: ModelRunner, num_tokens: int, vocab_size: int, prompt_len: int = 1,
               block_size: int = 1) -> float:
    """The median time of a step of `num_tokens` tokens: one-token requests, or prompts of `prompt_len`."""
    params = SamplingParams(temperature=0, max_tokens=1)
    blocks_per_request = -(-prompt_len // block_size)
    samples = []
    for repeat in range(REPEATS + 1):  # the first one warms up
        requests = [NewRequestData(f"step-cost-{repeat}-{i}",
                                   [(7 * (i + j) + repeat) % vocab_size for j in range(prompt_len)], prompt_len,
                                   params, list(range(i * blocks_per_request, (i + 1) * blocks_per_request)), 0)
                    for i in range(num_tokens // prompt_len)]
        ids = {r.request_id for r in requests}
        start = time.perf_counter()
        runner.execute_model(SchedulerOutput(requests, [], {r: prompt_len for r in ids}, num_tokens)).result()
        samples.append(time.perf_counter() - start)
        runner.execute_model(SchedulerOutput([], [], {}, 0, finished_request_ids=ids))
    return statistics.median(samples[1:])
