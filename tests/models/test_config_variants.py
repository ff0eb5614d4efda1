"""Config variants real checkpoints carry that the tiny models in conftest.py do not: tokenmill's greedy tokens
equal transformers' on one engine setting (test_models_vs_hf.py runs every schedule on the tiny models)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.models.conftest import COMMON, TinyModel, build_tiny_model, greedy_hf
from tokenmill import LLM, SamplingParams
from tokenmill.layers.rotary import RotaryEmbedding

BASE_ARGS = {"skip_tokenizer_init": True, "device": "cpu", "dtype": "float32", "kv_cache_space": 0.01}

VARIANTS: dict[str, TinyModel] = {
    # transformers' Llama (and every family here but Phi-3) ignores partial_rotary_factor: the whole head rotates.
    "llama-partial-rotary-ignored": TinyModel("LlamaConfig", {"partial_rotary_factor": 0.5}),
    # An activation without a kernel here: transformers' own function.
    "llama-quick-gelu": TinyModel("LlamaConfig", {"hidden_act": "quick_gelu"}),
    # Bias flags (as Llama's config has them) that these families' references never read: no such tensors load.
    "mistral-bias-flags-ignored": TinyModel("MistralConfig", {"attention_bias": True, "mlp_bias": True}),
    "phi3-bias-flags-ignored": TinyModel("Phi3Config", {"attention_bias": True, "mlp_bias": True}),
    "mixtral-bias-flags-ignored": TinyModel("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                              "attention_bias": True}),
    "qwen2-mlp-bias-flag-ignored": TinyModel("Qwen2Config", {"attention_bias": True, "mlp_bias": True}),
    "qwen3-moe-mlp-bias-flag-ignored": TinyModel("Qwen3MoeConfig", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0],
        "mlp_bias": True}),
    "deepseek-v3-mlp-bias-flag-ignored": TinyModel("DeepseekV3Config", {
        "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16, "v_head_dim": 24, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "mlp_bias": True}),
    # A sliding_window (as Mistral's config has it) that transformers' Llama attention never reads; its generate()
    # does, cutting its cache to the window (a full-attention prefill, then windowed steps): the reference runs
    # without a cache.
    "llama-sliding-window-ignored": TinyModel("LlamaConfig", {"sliding_window": 8}),
    # Qwen2's window on the layers from max_window_layers up, where use_sliding_window turns it on.
    "qwen2-window-above-max-window-layers": TinyModel("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8,
                                                                     "max_window_layers": 1}),
    # RoPE scalings stretch the context past max_position_embeddings (32 here; the longer prompt and its output
    # take 47 positions), as Qwen2.5 configs given yarn x4 do: transformers computes those positions.
    "llama-yarn-past-max-positions": TinyModel("LlamaConfig", {"max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 32}}),
    "qwen2-linear-past-max-positions": TinyModel("Qwen2Config", {"max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
    "deepseek-v3-yarn-past-max-positions": TinyModel("DeepseekV3Config", {
        "max_position_embeddings": 32, "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
        "topk_group": 1, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                             "original_max_position_embeddings": 32, "mscale": 1.0,
                                             "mscale_all_dim": 0.8}}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_hf(tmp_path, variant: str):
    hf_model = build_tiny_model(VARIANTS[variant], tmp_path)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf_model.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 23)]
    expected = [greedy_hf(hf_model, p, use_cache=hf_model.config.model_type != "llama") for p in prompts]
    llm = LLM(str(tmp_path), **BASE_ARGS)
    params = SamplingParams(temperature=0, max_tokens=len(expected[0]), ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == expected


def test_scaled_rope_of_part_of_a_head_is_refused_where_the_whole_head_rotates():
    # transformers' linear initialiser applies the factor, its Llama attention then fails on the shapes.
    config = transformers.LlamaConfig(**COMMON, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="gives 8 rotary dimensions; this model rotates 16"):
        RotaryEmbedding(config, 16, 64, rotary_dim=16)
