"""RoPE scaling that llama.cpp stores as a tensor: `rope_freqs`, each rotary band's frequency divisor.

llama.cpp's converter bakes Llama 3.1 / 3.2's "llama3" scaling (and other families' per-band factors) into
that tensor and writes no scaling metadata, so transformers' GGUF reader returns plain RoPE and such a file
(Llama-3.2-1B/3B-Instruct's GGUFs, say) computes every low-frequency band unscaled: its outputs drift from the
model's, by little at short contexts and by much past the pretrained context. The divisors go into the config as
`rope_freq_divisors`, which layers.rotary applies (inv_freq / divisor per band, as llama.cpp does).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from tokenmill.model.gguf_cache import gguf_header

ROPE_FREQS = "rope_freqs.weight"


def rope_freqs_config(path: str, config: PretrainedConfig) -> PretrainedConfig:
    """transformers' config of a GGUF file, with the file's per-band frequency divisors if it has them."""
    tensor = next((t for t in gguf_header(path).tensors if t.name == ROPE_FREQS), None)
    if tensor is not None:
        config.rope_freq_divisors = [float(d) for d in tensor.data.reshape(-1)]
    return config
