"""Rotary position embedding with a precomputed cos/sin table.

Frequencies (and the scalings: linear, llama3, yarn, ...) come from transformers' own RoPE
initialisers, so every scaling a checkpoint names is computed exactly as its reference does.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokenmill.kernels import use_triton

# (config json, head_dim, rotary_dim, max_position, device) -> the cos | sin table; weakly held, so a
# table lives as long as some model's layers use it.
_SHARED_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

# These change frequencies with the sequence length, which a fixed table cannot express.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


class RotaryEmbedding(nn.Module):
    def __init__(
        self, config: PretrainedConfig, head_dim: int, max_position: int, rotary_dim: int | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        params = rope_parameters(config)
        # Phi-3/4 and others rotate only the first partial_rotary_factor of each head.
        self.rotary_dim = rotary_dim or int(head_dim * params.get("partial_rotary_factor", 1.0))
        rope_type = params["rope_type"]
        if rope_type in _LENGTH_DEPENDENT:
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported yet")
        # Every layer of a model has the same table: build it once (it can be 64 MiB at 128k positions).
        key = (config.to_json_string(), head_dim, self.rotary_dim, max_position, torch.empty(0).device)
        cache = _SHARED_TABLES.get(key)
        if cache is None:
            # A meta-device build (a shape check before loading) computes it on the CPU: transformers' yarn init
            # copies to the device it is given, which meta tensors cannot.
            device = key[-1]
            with torch.device("cpu" if device.type == "meta" else device):
                if rope_type == "default":
                    inv_freq, scale = _default_inv_freq(params["rope_theta"], self.rotary_dim), 1.0
                else:
                    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
                positions = torch.arange(max_position, dtype=torch.float32)
                freqs = positions[:, None] * inv_freq.float().to(positions.device)[None, :]
                # [max_position, rotary_dim]: cos | sin halves, computed in float32 as the reference does
                cache = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
            cache = cache.to(device)
            _SHARED_TABLES[key] = cache
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens]; q [num_tokens, heads, head_dim]; k [num_tokens, kv_heads, head_dim]."""
        if use_triton(q):
            from tokenmill.kernels.rotary import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos_sin_cache)
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return torch.cat([rotated, rest], dim=-1) if rest.numel() else rotated
