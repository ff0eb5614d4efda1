"""EAGLE-3 proposer: a one-layer head drafts from the target's residual stream at a few of its layers.

The target hands over its residual stream at the input of its auxiliary layers (by default 2,
num_layers // 2 and num_layers - 3, or the head config's `eagle_aux_hidden_state_layer_ids`), concatenated;
the head's `fc` projects them to its width. Its one decoder layer ("midlayer") attends over
[input_layernorm(embed(token[p + 1])) ; hidden_norm(h[p])] (2 * hidden wide, so q/k/v_proj take twice the
width), keeps h[p] as its residual, and its output at p, through its own `norm` and `lm_head` over a draft
vocabulary, gives token[p + 2]: draft id d is target token d + d2t[d]. Drafts 2..k feed back the head's
own pre-norm output in place of fc(target states).

The machinery is EAGLE-1's (spec/eagle.py): observe() brings in the target's states of each step (here
through fc, once per position) and propose() runs the head over them, then one step per further draft.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.linear import QKVParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.model.base import LLAMA_STACKED_PARAMS, load_weights_by_name
from tokenmill.model.llama import LlamaAttention, LlamaMLP, head_dim_of
from tokenmill.sample.sampler import greedy_ids
from tokenmill.spec.eagle import EagleProposer
from tokenmill.worker.request_state import RequestStates


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The layers EAGLE-3 heads are trained on unless their config names others: early, middle, late."""
    return (2, num_layers // 2, num_layers - 3)


def aux_layers_of(head_config: PretrainedConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input the head reads, in fc's order; checked against the target's depth."""
    ids = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None)
    layers = tuple(ids) if ids else default_aux_layers(num_target_layers)
    if not all(type(i) is int and 0 <= i < num_target_layers for i in layers):
        where = "its eagle_aux_hidden_state_layer_ids" if ids else "the default (2, L // 2, L - 3)"
        raise ValueError(f"the EAGLE-3 head reads the target's layers {list(layers)} ({where}), but the target "
                         f"has {num_target_layers} layers (ids 0 to {num_target_layers - 1}); set "
                         f"eagle_aux_hidden_state_layer_ids in the head's config.json")
    return layers


def speculators_head_config(raw: dict, where: str) -> PretrainedConfig:
    """The head config of an EAGLE-3 head in the `speculators` library's format (as vLLM reads it): the decoder
    layer's settings under `transformer_layer_config` (its vocab_size the target's), the EAGLE-3 fields
    (draft_vocab_size, target_hidden_size, norm_before_residual, eagle_aux_hidden_state_layer_ids) at the top.
    Its tensors carry the converted names (`layers.0.*`, `fc` with a bias)."""
    from transformers import AutoConfig

    from tokenmill.config import EAGLE3_ARCHITECTURES

    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise ValueError(f"{where}: a speculators head of type {kind!r}; only 'eagle3' heads load (method 'eagle3')")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: a speculators config needs a transformer_layer_config object")
    if raw.get("norm_before_fc"):
        raise ValueError(f"{where}: norm_before_fc (an RMSNorm before fc) is not supported")
    layer = dict(layer)
    config = AutoConfig.for_model(layer.pop("model_type", "llama"), **layer)
    config.architectures = [EAGLE3_ARCHITECTURES[1]]
    config.draft_vocab_size = raw.get("draft_vocab_size")
    if raw.get("target_hidden_size") is not None:
        config.target_hidden_size = raw["target_hidden_size"]
    config.norm_before_residual = raw.get("norm_before_residual", True)  # vLLM's default where it is absent
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        config.eagle_aux_hidden_state_layer_ids = raw["eagle_aux_hidden_state_layer_ids"]
    return config


def eagle3_tensor_name(name: str) -> str:
    """Published names (`midlayer.*`) and converted ones (`layers.0.*`), with or without `model.`."""
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


class Eagle3MidLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, getattr(config, "attention_bias", False)
        self.self_attn = LlamaAttention(config, bias, bias, False)
        # The token's embedding and the hidden state side by side: q/k/v read twice the width.
        self.self_attn.qkv_proj = QKVParallelLinear(2 * hidden, head_dim_of(config), config.num_attention_heads,
                                                    config.num_key_value_heads, bias=bias)
        self.mlp = LlamaMLP(hidden, config.intermediate_size, config.hidden_act, getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = self.hidden_norm(hidden_states)
        residual = normed if self.norm_before_residual else hidden_states
        x = self.self_attn(positions, torch.cat([self.input_layernorm(embeds), normed], dim=-1))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual  # [num_tokens, hidden]: the pre-norm output, fed back for later drafts


class Eagle3Head(nn.Module):
    """An EAGLE-3 head in the published layout: `fc` [hidden, n_aux * target_hidden], `midlayer.*`, `norm`,
    `lm_head` [draft_vocab, hidden], `d2t` [draft_vocab] (absent: the draft vocabulary is the target's);
    the target's embedding unless the checkpoint brings `embed_tokens`."""

    def __init__(self, config: PretrainedConfig, num_aux: int, target_hidden: int, names: set[str],
                 target_embed: nn.Module) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.fc = nn.Linear(num_aux * target_hidden, hidden, bias="fc.bias" in names)
        self.layers = nn.ModuleList([Eagle3MidLayer(config)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64) if "d2t" in names else None)
        if "embed_tokens.weight" in names:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        else:
            object.__setattr__(self, "embed_tokens", target_embed)  # the target's: not a submodule of the head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_tokens, hidden]: fc(target states) or the head's own last output."""
        return self.layers[0](positions, self.embed_tokens(input_ids), hidden_states)

    def greedy_target_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target-vocabulary id of each position's most likely draft token."""
        return self._to_target(greedy_ids(self._draft_logits(hidden_states)))

    def top_target_ids(self, hidden_states: torch.Tensor, k: int) -> torch.Tensor:
        """The target-vocabulary ids of each position's k most likely draft tokens [n, k], most likely first."""
        return self._to_target(self._draft_logits(hidden_states).topk(k, dim=-1).indices)

    def _draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(self.norm(hidden_states))

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights) -> None:
        """`weights`: (name, tensor) under eagle3_tensor_name's names; `t2d` is d2t's inverse, unused."""
        rest = []
        for name, tensor in weights:
            if name == "d2t":
                self._load_d2t(tensor)
            elif name != "t2d":
                rest.append((name, tensor))
        load_weights_by_name(self, rest, LLAMA_STACKED_PARAMS)

    def _load_d2t(self, d2t: torch.Tensor) -> None:
        if d2t.shape != (self.draft_vocab_size,):
            raise ValueError(f"the EAGLE-3 head's d2t has shape {list(d2t.shape)}, not [draft_vocab_size] = "
                             f"[{self.draft_vocab_size}]")
        target_ids = torch.arange(self.draft_vocab_size) + d2t.long().cpu()
        vocab = self.embed_tokens.vocab_size
        if target_ids.min() < 0 or target_ids.max() >= vocab:
            raise ValueError(f"the EAGLE-3 head's d2t maps draft tokens outside the target's vocabulary of {vocab}")
        self.d2t.copy_(d2t.long())


class Eagle3Proposer(EagleProposer):
    """EAGLE-1's proposer over the width of fc's output: the target's auxiliary states go through fc as
    they arrive, and greedy drafts are mapped from the draft vocabulary to the target's."""

    @torch.inference_mode()
    def observe(self, states: RequestStates, rows: np.ndarray, query_start_loc: np.ndarray, positions: np.ndarray,
                hidden_states: torch.Tensor, skip: np.ndarray | None = None) -> None:
        """`hidden_states`: the target's auxiliary layers' states [num_tokens, n_aux * target_hidden]."""
        combined = self.model.fc(hidden_states[: int(query_start_loc[-1])])  # [num_tokens, hidden]
        super().observe(states, rows, query_start_loc, positions, combined, skip=skip)

    @property
    def target_state_width(self) -> int:
        return self.model.fc.in_features

    def from_target(self, target_states: torch.Tensor) -> torch.Tensor:
        return self.model.fc(target_states)

    def _greedy(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.greedy_target_ids(hidden_states)

    def _top_tokens(self, hidden_states: torch.Tensor, k: int) -> torch.Tensor:
        return self.model.top_target_ids(hidden_states, k)
