"""Gemma 2: Llama-style attention and gated MLP, with Gemma's norms, scaling and soft-capping.

Differences from Llama: RMSNorm scales by (1 + weight); embeddings are multiplied by
sqrt(hidden_size); each sub-block is wrapped in a pre- and a post-norm; attention scores and
final logits are tanh soft-capped; the attention scale comes from query_pre_attn_scalar; and
the layers config.layer_types marks "sliding_attention" see only a local window.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.layers.norm import RMSNorm
from tokenmill.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, sliding_window_of
from tokenmill.model.stage import StageLayers, make_embedding, on_last_stage


@lru_cache
def _rounded_to(value: float, dtype: torch.dtype) -> float:
    """value as the activation dtype holds it: HF casts sqrt(hidden_size) to that dtype first
    (in bfloat16 sqrt(3072) becomes 55.5, not 55.43), so the checkpoint expects the rounded value."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    # Same op order as the reference (divide, tanh, multiply) so float32 results match bit for bit.
    return x if cap is None else torch.tanh(x / cap) * cap


class Gemma2Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        bias = getattr(config, "attention_bias", False)
        # Gemma scales by query_pre_attn_scalar (not head_dim) and soft-caps the scores.
        super().__init__(
            config,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=False,
            sliding_window=sliding_window_of(config, layer_idx),
            scale=config.query_pre_attn_scalar**-0.5,
            logits_soft_cap=config.attn_logit_softcapping,
        )


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Gemma2Attention(config, layer_idx)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(size, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(size, eps, offset=1.0)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is deferred into the next pre-norm (fused add + norm), as in Llama;
        # the post-norms apply to the sub-block output before it joins the residual.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma2Model(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_scale = config.hidden_size**0.5
        self.embed_tokens = make_embedding(config)
        self.stage = StageLayers(config, lambda i: Gemma2DecoderLayer(config, i))  # this pipeline stage's
        self.layers = self.stage.modules
        self.norm = on_last_stage(lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        return hidden_states * _rounded_to(self.embed_scale, hidden_states.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.stage.run(input_ids, positions, self.embed, self.norm)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Llama's wrapper (tied LM head, loading by name) around Gemma's stack, with soft-capped logits."""

    def make_model(self, config: PretrainedConfig) -> nn.Module:
        return Gemma2Model(config)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return soft_cap(super().compute_logits(hidden_states), self.config.final_logit_softcapping)
