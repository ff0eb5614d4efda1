"""DeepSeek-V2 (V2-Lite, V2.5) and DeepSeek-V3: multi-head latent attention (layers.mla) and mixture-of-experts
layers with shared experts.

The first `first_k_dense_replace` layers keep a dense gated MLP; the others route each token to
num_experts_per_tok of n_routed_experts experts (layers.moe.FusedMoE) and add the shared experts' output:
- V2: softmax scores, the top-k ("greedy") or the top-k inside the topk_group best of n_group groups
  ("group_limited_greedy", a group scoring as its best expert); weights not renormalised (transformers 5.24's
  DeepseekV2TopkRouter ignores norm_topk_prob), times routed_scaling_factor.
- V3: sigmoid scores; e_score_correction_bias moves the choice, not the weights; groups score as the sum of
  their two best; top-k weights renormalised when norm_topk_prob, times routed_scaling_factor.
The router runs in float32, as transformers keeps gate.weight (and the bias) in float32.

Module names mirror Hugging Face's so checkpoints load by name. DeepSeek-V3's multi-token-prediction
layers (model.layers.{num_hidden_layers}...) are skipped: the model predicts one token per position; the
speculative method 'mtp' loads the first of them beside it as a drafter (spec/mtp.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tokenmill.layers.mla import MultiHeadLatentAttention
from tokenmill.layers.moe import FusedMoE, load_moe_weights
from tokenmill.layers.norm import RMSNorm
from tokenmill.model.llama import LlamaMLP, PreNormDecoderLayer
from tokenmill.model.stage import StageLayers, make_embedding, make_lm_head, on_last_stage

# The dense MLPs' and shared experts' gate/up projections, fused (q/k/v are not: MLA has its own projections).
DEEPSEEK_STACKED_PARAMS: dict[str, tuple[str, str | int]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekRouter(nn.Module):
    """`mlp.gate`: one float32 logit per routed expert, plus V3's e_score_correction_bias."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states.float(), self.weight)  # [num_tokens, num_experts] float32


def mlp_bias_of(config: PretrainedConfig, is_v3: bool) -> bool:
    # transformers' V2 MLPs (dense and shared experts) read mlp_bias; V3's never have a bias.
    return not is_v3 and bool(getattr(config, "mlp_bias", False))


class DeepseekMoE(nn.Module):
    def __init__(self, config: PretrainedConfig, is_v3: bool) -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        self.gate = DeepseekRouter(config.hidden_size, num_experts, correction_bias=is_v3)
        if is_v3:
            routing = dict(renormalize=bool(config.norm_topk_prob), scoring="sigmoid",
                           num_expert_group=config.n_group, topk_group=config.topk_group)
        elif config.topk_method == "group_limited_greedy":
            routing = dict(renormalize=False, num_expert_group=config.n_group, topk_group=config.topk_group)
        elif config.topk_method == "greedy":
            routing = dict(renormalize=False)
        else:
            raise ValueError(f"DeepSeek-V2 routing {config.topk_method!r} is not supported "
                             "(greedy, group_limited_greedy)")
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, routed_scaling_factor=config.routed_scaling_factor,
                                hidden_act=config.hidden_act, **routing)
        num_shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = LlamaMLP(config.hidden_size, config.moe_intermediate_size * num_shared,
                                       config.hidden_act, mlp_bias_of(config, is_v3)) if num_shared else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        out = self.experts(hidden_states, self.gate(hidden_states), self.gate.e_score_correction_bias)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, layer_idx: int, is_v3: bool) -> None:
        super().__init__()
        # V2's reference rotates interleaved pairs always; V3's unless the config turns rope_interleave off.
        interleaved = not is_v3 or getattr(config, "rope_interleave", True)
        self.self_attn = MultiHeadLatentAttention(config, rope_interleaved=interleaved)
        if layer_idx >= (config.first_k_dense_replace or 0):
            self.mlp = DeepseekMoE(config, is_v3)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                                mlp_bias_of(config, is_v3))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)



class DeepseekV2Model(nn.Module):
    def __init__(self, config: PretrainedConfig, is_v3: bool) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config)
        self.stage = StageLayers(config, lambda i: DeepseekDecoderLayer(config, i, is_v3))  # this pipeline stage's
        self.layers = self.stage.modules
        self.norm = on_last_stage(lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.stage.run(input_ids, positions, self.embed_tokens, self.norm)


class DeepseekV2ForCausalLM(nn.Module):
    is_v3 = False
    stacked_params = DEEPSEEK_STACKED_PARAMS

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV2Model(config, self.is_v3)
        self.lm_head = make_lm_head(config, self.model.embed_tokens)  # the last pipeline stage's

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("lm_head.",) if self.config.tie_word_embeddings else ()
        load_moe_weights(self, weights, self.stacked_params, skip_prefixes=skip, rename=self._skip_extra_layers)

    def _skip_extra_layers(self, name: str) -> str | None:
        """None for the multi-token-prediction layers past num_hidden_layers (DeepSeek-V3 ships one)."""
        match = _LAYER_INDEX.match(name)
        if match is not None and int(match[1]) >= self.config.num_hidden_layers:
            return None
        return name


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    is_v3 = True
