"""Mixtral: Mistral's attention with a routed mixture of experts in every layer (top-k softmax, renormalised).

Hub checkpoints name the block `block_sparse_moe` and an expert's projections w1 (gate), w3 (up), w2 (down);
the block sits at `mlp` here (as in transformers 5), and the loader renames.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.layers.moe import FusedMoE, MoERouter, load_moe_weights
from tokenmill.model.base import LLAMA_STACKED_PARAMS
from tokenmill.model.llama import LlamaForCausalLM


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate = MoERouter(config.hidden_size, config.num_local_experts)
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, renormalize=True, checkpoint_names=("w1", "w3", "w2"),
                                hidden_act=config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))  # [num_tokens, hidden_size]


def _hf_name(name: str) -> str:
    return name.replace(".block_sparse_moe.", ".mlp.")


class MixtralForCausalLM(LlamaForCausalLM):
    qkv_bias = o_bias = mlp_bias = False

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module | None:
        return MixtralSparseMoeBlock(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("lm_head.",) if self.config.tie_word_embeddings else ()
        load_moe_weights(self, weights, LLAMA_STACKED_PARAMS, skip_prefixes=skip, rename=_hf_name)
