"""The token budget from a step time: the prompt tokens the measured t(n) fits in the target, in whole GEMM
tiles, never below MIN_BUDGET nor above the budget it replaces; and t(n) measured on a real (CPU) worker."""

import pytest

from tokenmill import LLM
from tokenmill.scheduler.draft_budget import StepCost
from tokenmill.scheduler.token_budget import GRANULE, MIN_BUDGET, token_budget_for_step_time


@pytest.mark.parametrize(("per_token_us", "target_ms", "budget"), [
    (22.0, 20, 768),  # Llama-3.1-8B on an H200: (20 - 0.5) ms / 22 us = 886 tokens, 6 whole tiles of 128
    (1.5, 20, 8192),  # a small model: capped at the budget it replaces
    (200.0, 20, MIN_BUDGET),  # a slow device: never below the floor
    (0.0, 20, 8192),
])
def test_the_budget_is_the_tokens_that_fit_the_target(per_token_us, target_ms, budget):
    cost = StepCost(fixed_s=0.5e-3, per_token_s=per_token_us * 1e-6)
    got = token_budget_for_step_time(cost, target_ms / 1e3, 8192)
    assert got == budget and got % GRANULE == 0


def test_a_worker_measures_the_prefill_line_and_leaves_the_engine_as_it_was(tiny_llama):
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, dtype="float32", kv_cache_space=0.01, max_model_len=256)
    prompts = [{"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}]
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    cost = llm.engine.core.executor.measure_prefill_cost()
    assert cost.fixed_s > 0 and cost.per_token_s > 0
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.gpu
@pytest.mark.parametrize(("target_ms", "budget"), [(20.0, 8192), (0.01, MIN_BUDGET)])
def test_on_a_gpu_the_engine_takes_its_budget_from_the_step_time(tiny_llama, target_ms, budget):
    """The tiny model computes 8,192 tokens well within 20 ms: the whole default budget; no step fits 10 us."""
    import torch

    from tokenmill import SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, dtype="float32", device="cuda", kv_cache_space=0.01,
              max_model_len=256, target_step_ms=target_ms)
    assert llm.engine.core.scheduler.config.max_num_batched_tokens == budget
    outputs = llm.generate([{"prompt_token_ids": list(range(1, 200))}] * 4,
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
