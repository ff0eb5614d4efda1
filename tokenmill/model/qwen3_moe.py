"""Qwen3-MoE and Qwen2-MoE (Qwen1.5-MoE): Qwen attention (q/k RMSNorm in Qwen3, q/k/v bias in Qwen2) with
routed experts in place of the MLP; Qwen2-MoE adds a shared expert behind a sigmoid gate.

A layer is sparse unless it is listed in `mlp_only_layers` or falls between `decoder_sparse_step` steps;
dense layers keep the gated MLP with `intermediate_size`. Module names mirror Hugging Face's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.layers.moe import FusedMoE, MoERouter, load_moe_weights
from tokenmill.model.base import LLAMA_STACKED_PARAMS
from tokenmill.model.llama import LlamaForCausalLM, LlamaMLP, LlamaModel


def num_experts_of(config: PretrainedConfig) -> int:
    # transformers 5.24 maps num_experts to num_local_experts; older versions keep num_experts.
    return getattr(config, "num_experts", None) or config.num_local_experts


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """As transformers decides it: experts unless listed dense, every decoder_sparse_step-th layer."""
    if layer_idx in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return num_experts_of(config) > 0 and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        num_experts = num_experts_of(config)
        self.gate = MoERouter(config.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=config.norm_topk_prob,
                                hidden_act=config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))  # [num_tokens, hidden_size]


class Qwen2MoeSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    """The routed experts plus a shared expert that every token passes, scaled by sigmoid(shared_expert_gate)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.shared_expert = LlamaMLP(config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act)
        self.shared_expert_gate = MoERouter(config.hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        routed = super().forward(hidden_states)
        shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return routed + shared


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True
    mlp_bias = False  # q/k/v/o follow attention_bias
    sparse_block = Qwen3MoeSparseMoeBlock

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module | None:
        if is_sparse_layer(config, layer_idx):
            return self.sparse_block(config)
        return None  # a dense layer: the gated MLP with intermediate_size

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("lm_head.",) if self.config.tie_word_embeddings else ()
        load_moe_weights(self, weights, LLAMA_STACKED_PARAMS, skip_prefixes=skip)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    qk_norm = False
    sparse_block = Qwen2MoeSparseMoeBlock

    def make_model(self, config: PretrainedConfig) -> nn.Module:
        # q/k/v carry a bias unless the config says otherwise (qkv_bias, transformers >= 5.x); o_proj none.
        return LlamaModel(config, qkv_bias=getattr(config, "qkv_bias", True), o_bias=False, qk_norm=False,
                          make_mlp=self.make_mlp, mlp_bias=False)
