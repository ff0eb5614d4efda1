"""Rotary position embedding with a precomputed cos/sin table.

Frequencies (and the scalings: linear, llama3, yarn, longrope, ...) come from transformers' own RoPE
initialisers, so every scaling a checkpoint names is computed exactly as its reference does.

LongRoPE (Phi-3.5, Phi-4-mini) has two sets of frequencies: the short ones while a sequence is within the
pretrained context (`original_max_position_embeddings`), the long ones past it. Transformers picks the set per
forward pass by its longest position, so a request's prompt longer than the pretrained context is computed with
the long set throughout, and a shorter one with the short set up to that length and the long set after it. The
table holds the short set's rows for the pretrained context, then the long set's for every position; a token's
row is its position, moved into the long part when its position is past the pretrained context or its request's
prompt is longer (per request, not per batch as transformers does, so that no request's tokens depend on
another's). The model runner says which tokens' requests have such prompts (`long_prompt_flags`); the prefix
cache keeps their blocks apart from shorter prompts' (`KVCacheSpec.long_prompt_len`).
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

# This one changes frequencies with the exact sequence length, which a fixed table cannot express.
_LENGTH_DEPENDENT = ("dynamic",)


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def max_rope_positions(config: PretrainedConfig) -> int | None:
    """The positions the model serves: max_position_embeddings, or the context a linear or yarn scaling stretches
    the pretrained one to where that is longer (a Qwen2.5 config given yarn x4 keeps max_position_embeddings 32768
    and serves 131072 positions; transformers computes any position, and vLLM derives the same length)."""
    model_max = getattr(config, "max_position_embeddings", None)
    params = rope_parameters(config)
    if params["rope_type"] not in ("linear", "yarn") or not params.get("factor"):
        return model_max
    pretrained = model_max  # yarn names the context it stretches; linear stretches max_position_embeddings
    if params["rope_type"] == "yarn":
        pretrained = params.get("original_max_position_embeddings") or model_max
    if pretrained is None:
        return None
    return max(model_max or 0, int(pretrained * params["factor"]))


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
        self.pretrained_len: int | None = None
        """longrope: the pretrained context, past which a sequence takes the long frequencies (None: one set)."""
        if rope_type == "longrope":
            self.pretrained_len = int(params.get("original_max_position_embeddings")
                                      or config.original_max_position_embeddings)
        self.long_prompts: torch.Tensor | None = None
        """longrope: [capacity] int64, 1 at the step's tokens whose request's prompt is longer than pretrained_len
        (filled by the model runner before each forward pass; one buffer for all layers, so that CUDA graphs
        read it at its address)."""
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
                    divisors = getattr(config, "rope_freq_divisors", None)  # from a GGUF file (model.gguf_config)
                    if divisors is not None:
                        if len(divisors) != len(inv_freq):
                            raise ValueError(f"the GGUF file's rope_freqs holds {len(divisors)} frequency divisors; "
                                             f"the model rotates {len(inv_freq)} bands")
                        inv_freq = inv_freq / torch.tensor(divisors, dtype=torch.float32, device=inv_freq.device)
                else:
                    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
                if 2 * inv_freq.numel() != self.rotary_dim:
                    # transformers' scaled initialisers apply partial_rotary_factor themselves, also for a model
                    # whose attention rotates the whole head (its reference then fails on the shapes too).
                    raise ValueError(f"RoPE scaling {rope_type!r} gives {2 * inv_freq.numel()} rotary dimensions; "
                                     f"this model rotates {self.rotary_dim} (partial_rotary_factor "
                                     f"{params.get('partial_rotary_factor')} is not supported with it)")
                cache = _cos_sin_table(inv_freq, scale, max_position)
                if self.pretrained_len is not None:  # the short rows, then the long ones (the module's docstring)
                    long_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"),
                                                                      seq_len=self.pretrained_len + 1)
                    cache = torch.cat([cache[: self.pretrained_len], _cos_sin_table(long_inv_freq, scale,
                                                                                   max_position)])
            cache = cache.to(device)
            _SHARED_TABLES[key] = cache
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def table_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Each token's row of cos_sin_cache: its position, but for longrope (the module's docstring)."""
        if self.pretrained_len is None:
            return positions
        if self.long_prompts is None or positions.shape[0] > self.long_prompts.shape[0]:
            raise RuntimeError("longrope needs the step's long-prompt flags (layers.rotary.attach_long_prompt_flags) "
                               f"for its {positions.shape[0]} tokens")
        long = (positions >= self.pretrained_len) | self.long_prompts[: positions.shape[0]].bool()
        return positions + self.pretrained_len * long

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens]; q [num_tokens, heads, head_dim]; k [num_tokens, kv_heads, head_dim]."""
        positions = self.table_rows(positions)
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


def _cos_sin_table(inv_freq: torch.Tensor, scale: float, num_positions: int) -> torch.Tensor:
    """[num_positions, rotary_dim]: cos | sin halves, computed in float32 as the reference does."""
    positions = torch.arange(num_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float().to(positions.device)[None, :]
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)


def _long_rope_embeddings(model: nn.Module) -> list[RotaryEmbedding]:
    return [m for m in model.modules() if isinstance(m, RotaryEmbedding) and m.pretrained_len is not None]


def long_rope_pretrained_len(model: nn.Module) -> int | None:
    """A longrope model's pretrained context (prompts longer than it take the long frequencies), else None."""
    embeddings = _long_rope_embeddings(model)
    return embeddings[0].pretrained_len if embeddings else None


def attach_long_prompt_flags(model: nn.Module, capacity: int, device: torch.device) -> None:
    """Give the model's longrope embeddings one flags buffer for up to `capacity` tokens a forward pass (once,
    before any forward pass: CUDA graphs capture its address). Nothing for the other scalings."""
    embeddings = _long_rope_embeddings(model)
    flags = torch.zeros(capacity, dtype=torch.int64, device=device) if embeddings else None
    for module in embeddings:
        module.long_prompts = flags


def long_prompt_flags(model: nn.Module) -> tuple[torch.Tensor, int] | None:
    """(the flags buffer, the pretrained context) of a longrope model, else None."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding) and module.long_prompts is not None:
            return module.long_prompts, module.pretrained_len
    return None
