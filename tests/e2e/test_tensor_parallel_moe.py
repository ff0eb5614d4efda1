"""Mixture of experts under tensor parallelism on the CPU (gloo): each rank holds half of every expert's
intermediate features (and half the shared expert's and the dense layer's), and two ranks give
transformers' greedy tokens in float32, with async scheduling, chunked prefill and ngram drafts on.

Qwen2-MoE covers the most: a dense layer (mlp_only_layers), routed experts (top-2 of 4) and a shared expert
behind its sigmoid gate.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
              tensor_parallel_size=2, async_scheduling=True, max_num_batched_tokens=24,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(4 + 9 * i)] for i in range(3)] + [[9, 40, 41, 42] * 6]
MAX_TOKENS = 12


def build_model(folder):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, mlp_only_layers=[0],
                            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                            initializer_range=0.2)  # sharp routing and peaked logits: no near ties
    model = Qwen2MoeForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def engine_and_reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-moe-tp")
    hf_model = build_model(folder)
    expected = [hf_greedy(hf_model, p) for p in PROMPTS]
    llm = LLM(str(folder), **ENGINE)
    yield llm, expected
    llm.engine.core.shutdown()


def test_two_ranks_give_transformers_greedy_tokens(engine_and_reference, monkeypatch):
    llm, expected = engine_and_reference
    core = llm.engine.core
    assert core.executor.world_size == 2
    # Draft whenever the proposer finds a match (the CPU's measured step cost would rather not).
    monkeypatch.setattr(core.scheduler.draft_budget, "cost", None)
    monkeypatch.setattr(core.scheduler.draft_budget, "min_gain", 0.0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(out.outputs[0].token_ids) for out in outputs] == expected


def test_experts_the_ranks_cannot_split_are_refused():
    from transformers import Qwen3MoeConfig

    from tokenmill.executor.base import check_tensor_parallel

    config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                            moe_intermediate_size=30)
    check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="does not divide the model's moe_intermediate_size 30"):
        check_tensor_parallel(config, 4)
