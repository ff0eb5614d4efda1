"""GGUF files of Phi-3 / Phi-3.5 / Phi-4-mini (llama.cpp's arch "phi3"): the config fields transformers' GGUF
reader leaves out.

transformers maps the phi3 family's sizes but drops three fields that change every output: the rotary
dimensions (`phi3.rope.dimension_count`: Phi-4-mini rotates 3/4 of each head), the sliding window
(`phi3.attention.sliding_window`: 2,047 tokens for Phi-3-mini-4k; 0 is none), and LongRoPE (Phi-3.5, Phi-3-128k,
Phi-4-mini), which llama.cpp's converter stores as the pretrained context
(`phi3.rope.scaling.original_context_length`), the attention factor (`phi3.rope.scaling.attn_factor`) and the
two factor vectors as the tensors `rope_factors_long` / `rope_factors_short`. Without them such a file loads
as plain RoPE over its whole context, and every token differs from the model's. phi3_config puts them back.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from tokenmill.model.gguf_cache import gguf_header


def phi3_config(path: str, config: PretrainedConfig) -> PretrainedConfig:
    """transformers' config of a phi3 GGUF file, with the fields it misses (module docstring)."""
    header = gguf_header(path)
    metadata = header.metadata
    if metadata.get("general.architecture") != "phi3":
        return config
    rope = dict(config.rope_parameters or {"rope_type": "default", "rope_theta": config.rope_theta})
    head_dim = config.hidden_size // config.num_attention_heads
    rotary_dims = metadata.get("phi3.rope.dimension_count")
    if rotary_dims:
        rope["partial_rotary_factor"] = rotary_dims / head_dim
    config.sliding_window = metadata.get("phi3.attention.sliding_window") or None
    factors = {t.name: t.data for t in header.tensors if t.name in ("rope_factors_long.weight",
                                                                    "rope_factors_short.weight")}
    if factors:
        original = int(metadata["phi3.rope.scaling.original_context_length"])
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    factor=config.max_position_embeddings / original,
                    long_factor=[float(f) for f in factors["rope_factors_long.weight"]],
                    short_factor=[float(f) for f in factors["rope_factors_short.weight"]])
        if metadata.get("phi3.rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = float(metadata["phi3.rope.scaling.attn_factor"])
        config.original_max_position_embeddings = original
    config.rope_parameters = rope
    return config
