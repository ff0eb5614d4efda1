"""What every model implements, and the shared weight-loading loop."""

from __future__ import annotations

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
) -> None:
    """Copy checkpoint tensors into parameters through their weight loaders; fail on gaps."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if rename is not None:
            name = rename(name)
        if name is None or name.startswith(skip_prefixes) or "rotary_emb.inv_freq" in name:
            continue
        shard_id = None
        for ckpt_name, (fused_name, sid) in stacked_params.items():
            if f".{ckpt_name}." in name:
                name, shard_id = name.replace(f".{ckpt_name}.", f".{fused_name}."), sid
                break
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            default_weight_loader(param, tensor)
        elif shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
