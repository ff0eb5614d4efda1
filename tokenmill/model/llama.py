"""Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 (qkv bias) and Qwen3 (q/k RMSNorm).

Module names mirror Hugging Face's so checkpoints load by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.distributed.parallel_state import get_tp_size
from tokenmill.layers.activation import get_gated_activation
from tokenmill.layers.attention import Attention
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quant.fp8 import Fp8Activation
from tokenmill.layers.rotary import RotaryEmbedding, max_rope_positions
from tokenmill.model.base import LLAMA_STACKED_PARAMS, load_weights_by_name
from tokenmill.model.cpu_layer_step import CpuLayerStep
from tokenmill.model.stage import StageLayers, make_embedding, make_lm_head, on_last_stage

# Of the families built on LlamaAttention only transformers' Phi-3 rotates just the first partial_rotary_factor of
# each head; the others' rotary embeddings ignore the field (a config may still carry it) and rotate all of it.
_PARTIAL_ROTARY_MODEL_TYPES = ("phi3",)
# transformers' Llama attends to every earlier position whatever the config carries (a sliding_window copied from
# a Mistral config, a layer_types list); the other families here honour their window.
_FULL_ATTENTION_MODEL_TYPES = ("llama",)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = get_gated_activation(hidden_act)

    @property
    def input_projection(self) -> nn.Module:
        """The one layer that reads this block's input (PreNormDecoderLayer: the norm's consumer)."""
        return self.gate_up_proj

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        # The activation may hand an FP8 down_proj its input quantized (layers.quant.fp8.Fp8Activation).
        return self.down_proj(self.act_fn(self.gate_up_proj(x), consumer=self.down_proj))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        sliding_window: int | None = None,
        scale: float | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        tp_size = get_tp_size()
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=qkv_bias
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        rotary_dim = None if config.model_type in _PARTIAL_ROTARY_MODEL_TYPES else self.head_dim
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, max_rope_positions(config), rotary_dim)
        # The attention layer applies q_norm, k_norm and the rotary embedding (on GPU, fused with its KV write).
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            self.num_kv_heads,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            rotary_emb=self.rotary_emb,
            q_norm=self.q_norm,
            k_norm=self.k_norm,
        )

    @property
    def input_projection(self) -> nn.Module:
        """The one layer that reads this block's input (PreNormDecoderLayer: the norm's consumer)."""
        return self.qkv_proj

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor | Fp8Activation) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        # split_with_sizes: Tensor.split's Python wrapper costs more than the three views at batch 1
        q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(positions, q, k, v))


class PreNormDecoderLayer(nn.Module):
    """norm -> self_attn -> norm -> mlp, the residual stream carried beside the hidden states (each RMSNorm adds
    it in). Subclasses build input_layernorm, self_attn, post_attention_layernorm and mlp.

    A block that reads its input only through one linear layer names it `input_projection` (LlamaAttention,
    LlamaMLP); the norm before it may then hand that layer its input quantized (RMSNorm's consumer)."""

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = _normed(self.input_layernorm, hidden_states, None, self.self_attn)
        else:
            hidden_states, residual = _normed(self.input_layernorm, hidden_states, residual, self.self_attn)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = _normed(self.post_attention_layernorm, hidden_states, residual, self.mlp)
        return self.mlp(hidden_states), residual


def _normed(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, block: nn.Module):
    """norm(x) or norm(x, residual); an RMSNorm may hand `block`'s input projection its input quantized. (An EAGLE
    head's first layer has no input norm: nn.Identity.)"""
    if isinstance(norm, RMSNorm):
        return norm(x, residual, consumer=getattr(block, "input_projection", None))
    return norm(x) if residual is None else norm(x, residual)


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 mlp: nn.Module | None = None, mlp_bias: bool | None = None) -> None:
        super().__init__()
        window = sliding_window_of(config, layer_idx)
        self.self_attn = LlamaAttention(config, qkv_bias, o_bias, qk_norm, window)
        # mlp: a family's own feed-forward block (MoE); the dense gated MLP otherwise, biased as mlp_bias says
        # (None: as the config's mlp_bias).
        if mlp_bias is None:
            mlp_bias = getattr(config, "mlp_bias", False)
        self.mlp = mlp if mlp is not None else LlamaMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, mlp_bias
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # On the CPU, the same kernels with less Python between them (model.cpu_layer_step), where they apply.
        if (hidden_states.is_cpu and hidden_states.dim() == 2 and hidden_states.is_contiguous()
                and (residual is None or residual.is_contiguous()) and not torch.is_grad_enabled()):
            step = CpuLayerStep.for_layer(self, hidden_states)
            if step is not None:
                return step(positions, hidden_states, residual)
        return super().forward(positions, hidden_states, residual)


def sliding_window_of(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The layer's attention window, honouring per-layer types where the config lists them."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    if getattr(config, "model_type", None) in _FULL_ATTENTION_MODEL_TYPES:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return window


MakeMLP = Callable[[PretrainedConfig, int], "nn.Module | None"]
"""(config, layer index) -> that layer's feed-forward block, or None for the dense gated MLP."""


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 make_mlp: MakeMLP | None = None, mlp_bias: bool | None = None) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config)
        # This pipeline stage's layers (all of them with one stage).
        self.stage = StageLayers(config, lambda i: LlamaDecoderLayer(
            config, i, qkv_bias, o_bias, qk_norm, make_mlp(config, i) if make_mlp else None, mlp_bias))
        self.layers = self.stage.modules
        self.norm = on_last_stage(lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        """Layers whose input (the residual stream the layers before them leave) the forward pass also
        returns, for a drafter that reads them (EAGLE-3, spec/eagle3.py); empty on the plain path."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.aux_hidden_state_layers:  # one stage only (EAGLE-3 is refused with pipeline parallelism)
            return self._forward_with_aux(positions, self.embed_tokens(input_ids))
        return self.stage.run(input_ids, positions, self.embed_tokens, self.norm)

    def _forward_with_aux(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The last hidden states and the aux layers' inputs, concatenated in the listed order
        ([num_tokens, len(aux_hidden_state_layers) * hidden_size])."""
        residual, captured = None, {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_state_layers:
                captured[i] = hidden_states if residual is None else hidden_states + residual
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states, torch.cat([captured[i] for i in self.aux_hidden_state_layers], dim=-1)


class LlamaForCausalLM(nn.Module):
    # Projection biases: None follows the config's attention_bias (mlp_bias for the MLP), as transformers' Llama
    # does; a family whose reference never reads such a field fixes the bias, so that a config carrying it (copied
    # from Llama's) still loads its checkpoint as transformers does.
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool | None = None
    qk_norm = False

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.make_model(config)
        self.lm_head = make_lm_head(config, self.model.embed_tokens)  # the last pipeline stage's

    def make_model(self, config: PretrainedConfig) -> nn.Module:
        """The decoder stack; families that share this wrapper (e.g. Gemma 2) override it."""
        attention_bias = getattr(config, "attention_bias", False)
        return LlamaModel(
            config,
            qkv_bias=attention_bias if self.qkv_bias is None else self.qkv_bias,
            o_bias=attention_bias if self.o_bias is None else self.o_bias,
            qk_norm=self.qk_norm,
            make_mlp=self.make_mlp,
            mlp_bias=getattr(config, "mlp_bias", False) if self.mlp_bias is None else self.mlp_bias,
        )

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module | None:
        """Layer `layer_idx`'s feed-forward block; None: the dense gated MLP. MoE families override it."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("lm_head.",) if self.config.tie_word_embeddings else ()
        load_weights_by_name(self, weights, LLAMA_STACKED_PARAMS, skip_prefixes=skip)


class MistralForCausalLM(LlamaForCausalLM):
    qkv_bias = o_bias = mlp_bias = False


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = mlp_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    mlp_bias = False  # q/k/v/o follow attention_bias
