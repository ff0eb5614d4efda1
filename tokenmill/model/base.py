"""What every model implements, and the shared weight-loading loop."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from tokenmill.layers.linear import default_weight_loader

# Checkpoint projection name -> (fused parameter name, shard id) for the fused layers.
LLAMA_STACKED_PARAMS: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# A checkpoint's per-layer KV cache scales, wherever its exporter put them: on the projections
# (self_attn.k_proj.k_scale), on the attention module (self_attn.k_scale, vLLM's self_attn.attn.k_scale),
# or one kv_scale for both (older fp8 exports). They belong to the Attention layer at self_attn.attn.
_KV_SCALE_NAME = re.compile(r"(?P<attn>.*\.self_attn)(?:\.(?:k_proj|v_proj|qkv_proj|attn))?\."
                            r"(?P<kind>k_scale|v_scale|kv_scale)")
# compressed-tensors' first kv_cache_scheme quantized the K and V projections' outputs: their output_scale is
# the layer's K or V scale (as vLLM reads it).
_KV_OUTPUT_SCALE_NAME = re.compile(r"(?P<attn>.*\.self_attn)\.(?P<kind>k|v)_proj\.output_scale")


def kv_scale_targets(name: str) -> list[str] | None:
    """The Attention buffers a checkpoint KV-scale tensor fills; None for any other tensor."""
    match = _KV_SCALE_NAME.fullmatch(name)
    if match is None:
        match = _KV_OUTPUT_SCALE_NAME.fullmatch(name)
        return None if match is None else [f"{match['attn']}.attn.{match['kind']}_scale"]
    kinds = ("k_scale", "v_scale") if match["kind"] == "kv_scale" else (match["kind"],)
    return [f"{match['attn']}.attn.{kind}" for kind in kinds]


class CausalLM(Protocol):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size]."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def load_weights_by_name(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: dict[str, tuple[str, str | int]],
    skip_prefixes: tuple[str, ...] = (),
    rename=None,
    expert_params=None,
) -> None:
    """Copy checkpoint tensors into parameters through their weight loaders; fail on gaps.

    expert_params(name) -> (parameter name, loader arguments) or None: where MoE experts' tensors go
    (layers.moe.load_moe_weights)."""
    params = dict(model.named_parameters())
    # Optional tensors (KV scales): loaded when the checkpoint has them, never reported missing.
    buffers = {name: b for name, b in model.named_buffers() if hasattr(b, "weight_loader")}
    loaded: set[str] = set()
    fused_shards: dict[str, tuple[str, set[str | int]]] = {}  # fused parameter -> (its layer name, shards loaded)
    for name, tensor in weights:
        if rename is not None:
            name = rename(name)
        if name is None or name.startswith(skip_prefixes) or "rotary_emb.inv_freq" in name:
            continue
        scale_targets = kv_scale_targets(name)
        if scale_targets is not None:
            for target in scale_targets:
                if target not in buffers:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching KV scale in {type(model).__name__}")
                buffers[target].weight_loader(buffers[target], tensor)
            continue
        expert_target = expert_params(name) if expert_params is not None else None
        if expert_target is not None:
            name, loader_args = expert_target
            params[name].weight_loader(params[name], tensor, *loader_args)
            loaded.add(name)
            continue
        checkpoint_name, shard_id = name, None
        for ckpt_name, (fused_name, sid) in stacked_params.items():
            if f".{ckpt_name}." in name:
                name, shard_id = name.replace(f".{ckpt_name}.", f".{fused_name}."), sid
                fused_shards.setdefault(name, (fused_name, set()))[1].add(sid)
                break
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                default_weight_loader(param, tensor)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except (ValueError, RuntimeError) as e:  # e.g. a shape the config does not give: say which tensor
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise ValueError(f"loading checkpoint tensor {checkpoint_name!r}: {e}") from None
        loaded.add(name)
    # A parameter a format may leave out (GPTQ's g_idx without act-order) keeps the value its layer gave it.
    missing = sorted(name for name in set(params) - loaded if not getattr(params[name], "may_be_absent", False))
    missing += _missing_shards(fused_shards, stacked_params)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _missing_shards(fused_shards: dict[str, tuple[str, set[str | int]]],
                    stacked_params: dict[str, tuple[str, str | int]]) -> list[str]:
    """The checkpoint tensors absent from fused parameters that got some of theirs: a q_proj without its k_proj
    would otherwise leave k's rows at their initial values, unnoticed."""
    return sorted(name.replace(f".{fused}.", f".{ckpt_name}.")
                  for name, (fused, found) in fused_shards.items()
                  for ckpt_name, (fused_name, sid) in stacked_params.items()
                  if fused_name == fused and sid not in found)
