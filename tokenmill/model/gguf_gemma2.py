"""GGUF files of Gemma 2 (llama.cpp's arch "gemma2"): the attention fields transformers' GGUF reader leaves at
Gemma2Config's defaults.

The soft-caps are in the file (`gemma2.attn_logit_softcapping`, `gemma2.final_logit_softcapping`) and are read
from it. The query scale is not: llama.cpp scales queries by 1/sqrt(hidden_size / heads) for Gemma-2-27B (the
46-layer model, whose query_pre_attn_scalar is 144) and by 1/sqrt(head_dim) for the others, where the class's
default of 256 is right only for the 2B and 9B. gemma2_config applies the same rule.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from tokenmill.model.gguf_cache import gguf_header

GEMMA2_27B_LAYERS = 46


def gemma2_config(path: str, config: PretrainedConfig) -> PretrainedConfig:
    metadata = gguf_header(path).metadata
    if metadata.get("general.architecture") != "gemma2":
        return config
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if metadata.get(f"gemma2.{field}") is not None:
            setattr(config, field, float(metadata[f"gemma2.{field}"]))
    config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads
                                    if config.num_hidden_layers == GEMMA2_27B_LAYERS else config.head_dim)
    return config
