"""Config fields of GGUF files that transformers' GGUF reader leaves out or at its classes' defaults, read back
from the file as llama.cpp reads them (the mixture-of-experts fields: model.gguf_moe). Without them such files
load and run, and every token differs from the model's.

- phi3 (Phi-3 / Phi-3.5 / Phi-4-mini): the rotary dimensions (`phi3.rope.dimension_count`: Phi-4-mini rotates 3/4
  of each head), the sliding window (`phi3.attention.sliding_window`: 2,047 tokens for Phi-3-mini-4k; 0 is none),
  and LongRoPE, which llama.cpp's converter stores as the pretrained context
  (`phi3.rope.scaling.original_context_length`), the attention factor (`phi3.rope.scaling.attn_factor`) and the
  two factor vectors as the tensors `rope_factors_long` / `rope_factors_short`.
- gemma2: the soft-caps (`gemma2.attn_logit_softcapping`, `gemma2.final_logit_softcapping`); the query scale is
  not in the file: llama.cpp scales queries by 1/sqrt(hidden_size / heads) for Gemma-2-27B (the 46-layer model,
  whose query_pre_attn_scalar is 144) and by 1/sqrt(head_dim) for the others, where the class's default of 256 is
  right only for the 2B and 9B.
- any family: RoPE scaling stored as the tensor `rope_freqs`, each rotary band's frequency divisor. llama.cpp's
  converter bakes Llama 3.1 / 3.2's "llama3" scaling into it and writes no scaling metadata, so such a file
  (Llama-3.2-1B/3B-Instruct's GGUFs, say) would compute every low-frequency band unscaled. The divisors go into the
  config as `rope_freq_divisors`, which layers.rotary applies (inv_freq / divisor per band, as llama.cpp does).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from tokenmill.model.gguf_cache import gguf_header
from tokenmill.model.gguf_file import GGUFHeader

GEMMA2_27B_LAYERS = 46
ROPE_FREQS = "rope_freqs.weight"
_LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def with_missing_fields(path: str, config: PretrainedConfig) -> PretrainedConfig:
    """transformers' config of a GGUF file, with the fields it misses (module docstring)."""
    header = gguf_header(path)
    arch = header.metadata.get("general.architecture")
    if arch == "phi3":
        _phi3_fields(header, config)
    elif arch == "gemma2":
        _gemma2_fields(header, config)
    rope_freqs = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    if rope_freqs is not None:
        config.rope_freq_divisors = [float(d) for d in rope_freqs.data.reshape(-1)]
    return config


def _phi3_fields(header: GGUFHeader, config: PretrainedConfig) -> None:
    metadata = header.metadata
    rope = dict(config.rope_parameters or {"rope_type": "default", "rope_theta": config.rope_theta})
    head_dim = config.hidden_size // config.num_attention_heads
    rotary_dims = metadata.get("phi3.rope.dimension_count")
    if rotary_dims:
        rope["partial_rotary_factor"] = rotary_dims / head_dim
    config.sliding_window = metadata.get("phi3.attention.sliding_window") or None
    factors = {t.name: t.data for t in header.tensors if t.name in _LONGROPE_FACTORS}
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


def _gemma2_fields(header: GGUFHeader, config: PretrainedConfig) -> None:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if header.metadata.get(f"gemma2.{field}") is not None:
            setattr(config, field, float(header.metadata[f"gemma2.{field}"]))
    config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads
                                    if config.num_hidden_layers == GEMMA2_27B_LAYERS else config.head_dim)
