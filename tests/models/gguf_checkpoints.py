"""GGUF files of transformers Llama and mixture-of-experts models, laid out as llama.cpp's converter lays them out
(tests only): metadata under `<arch>.*`, experts stacked into `blk.N.ffn_{gate,up,down}_exps` [E, rows, cols],
the router `ffn_gate_inp` (never quantized, as llama.cpp's quantizer leaves it), Qwen2-MoE's shared expert
`ffn_*_shexp` with its gate `ffn_gate_inp_shexp` a vector [H], and, for Mixtral (llama.cpp's arch "llama"
with an expert count), q/k rows permuted into llama.cpp's rotary layout, and Llama 3's RoPE scaling as the
`rope_freqs` tensor of per-band frequency divisors. Phi-3 as llama.cpp's converter writes
it: fused `attn_qkv` and `ffn_up` (gate and up), the rotary dimensions, the sliding window (0: none), and for
LongRoPE the pretrained context, the attention factor and the two factor vectors as tensors.

Names come from gguf's own tables (gguf.constants), not from tokenmill's loader, so the loader is checked
against the format rather than against itself.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType

ARCH_OF = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "llama": "llama", "phi3": "phi3"}

# HF module (after "model.layers.N.") -> GGUF tensor of block N
_LAYER_TENSORS = {
    "input_layernorm": MODEL_TENSOR.ATTN_NORM,
    "post_attention_layernorm": MODEL_TENSOR.FFN_NORM,
    "self_attn.q_proj": MODEL_TENSOR.ATTN_Q,
    "self_attn.k_proj": MODEL_TENSOR.ATTN_K,
    "self_attn.v_proj": MODEL_TENSOR.ATTN_V,
    "self_attn.o_proj": MODEL_TENSOR.ATTN_OUT,
    "self_attn.qkv_proj": MODEL_TENSOR.ATTN_QKV,
    "mlp.gate_up_proj": MODEL_TENSOR.FFN_UP,  # Phi-3's [gate | up] rows, as llama.cpp keeps them
    "self_attn.q_norm": MODEL_TENSOR.ATTN_Q_NORM,
    "self_attn.k_norm": MODEL_TENSOR.ATTN_K_NORM,
    "mlp.gate": MODEL_TENSOR.FFN_GATE_INP,
    "mlp.gate_proj": MODEL_TENSOR.FFN_GATE,
    "mlp.up_proj": MODEL_TENSOR.FFN_UP,
    "mlp.down_proj": MODEL_TENSOR.FFN_DOWN,
    "mlp.shared_expert.gate_proj": MODEL_TENSOR.FFN_GATE_SHEXP,
    "mlp.shared_expert.up_proj": MODEL_TENSOR.FFN_UP_SHEXP,
    "mlp.shared_expert.down_proj": MODEL_TENSOR.FFN_DOWN_SHEXP,
    "mlp.shared_expert_gate": MODEL_TENSOR.FFN_GATE_INP_SHEXP,
}
_GLOBAL_TENSORS = {"model.embed_tokens": MODEL_TENSOR.TOKEN_EMBD, "model.norm": MODEL_TENSOR.OUTPUT_NORM,
                   "lm_head": MODEL_TENSOR.OUTPUT}
# Kept in float32 whatever the file's type: llama.cpp's quantizer leaves routers and vectors alone.
_NEVER_QUANTIZED = (MODEL_TENSOR.FFN_GATE_INP, MODEL_TENSOR.FFN_GATE_INP_SHEXP)


def _llama_rotary_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k layout for arch "llama": each head's rows [first half | second half] interleaved."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _llama3_rope_factors(config, head_dim: int) -> np.ndarray:
    """Llama 3.1 / 3.2's RoPE scaling as llama.cpp's converter stores it: each band's frequency divisor."""
    rope = config.rope_parameters
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(divisors, dtype=np.float32)


def _add_phi3_metadata(writer: gguf.GGUFWriter, config, head_dim: int) -> None:
    rope = config.rope_parameters
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_sliding_window(config.sliding_window or 0)
    writer.add_pad_token_id(config.pad_token_id)  # else Phi3Config's default (32,000) is past a tiny vocabulary
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = config.max_position_embeddings / original  # the converter's attention factor
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        for kind, key in ((MODEL_TENSOR.ROPE_FACTORS_LONG, "long_factor"), (MODEL_TENSOR.ROPE_FACTORS_SHORT,
                                                                            "short_factor")):
            writer.add_tensor(TENSOR_NAMES[kind] + ".weight", np.asarray(rope[key], dtype=np.float32))


def _gguf_name(hf_name: str) -> tuple[MODEL_TENSOR, int | None, str]:
    """A (non-expert) HF tensor name -> (GGUF tensor kind, block, suffix)."""
    module, _, suffix = hf_name.rpartition(".")
    if module in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[module], None, suffix
    _, _, block, rest = module.split(".", 3)
    return _LAYER_TENSORS[rest], int(block), suffix


def write_gguf(model: torch.nn.Module, path: str, quant_type: GGMLQuantizationType | None = None
                   ) -> dict[str, torch.Tensor]:
    """Write `model` (a transformers Llama, Qwen3-MoE, Qwen2-MoE or Mixtral) to `path`: float32, or its matrices in
    `quant_type` (routers stay float32). Returns the state dict the file means: each quantized tensor
    replaced by its dequantized values (the reference model loads it)."""
    config = model.config
    arch = ARCH_OF[config.model_type]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        if config.rope_parameters.get("rope_type") == "llama3":
            writer.add_tensor(TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight", _llama3_rope_factors(config, head_dim))
        if config.model_type == "mixtral":
            writer.add_expert_count(config.num_local_experts)
    elif arch == "phi3":
        _add_phi3_metadata(writer, config, head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.model_type not in ("llama", "phi3"):
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)

    meant: dict[str, torch.Tensor] = {}

    def add(name: str, kind: MODEL_TENSOR, values: np.ndarray, hf_name: str, permute_heads: int = 0) -> None:
        quantize = quant_type is not None and values.ndim >= 2 and kind not in _NEVER_QUANTIZED
        if quantize:
            blocks = gguf.quants.quantize(values, quant_type)
            values = gguf.quants.dequantize(blocks, quant_type)  # whole rows: commutes with the row permutation
        meant[hf_name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        if permute_heads:
            values = _llama_rotary_permute(values, permute_heads)
        if quantize:
            writer.add_tensor(name, gguf.quants.quantize(values, quant_type), raw_dtype=quant_type)
        else:
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))

    state = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, values in state.items():
        if hf_name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: llama.cpp stores gate and up apart
            block = int(hf_name.split(".")[2])
            gate_up = np.empty_like(values)
            for part, kind in ((0, MODEL_TENSOR.FFN_GATE_EXP), (1, MODEL_TENSOR.FFN_UP_EXP)):
                rows = values.shape[1] // 2
                part_name = f"{hf_name}.{part}"
                add(TENSOR_NAMES[kind].format(bid=block) + ".weight", kind,
                    values[:, part * rows:(part + 1) * rows], part_name)
                gate_up[:, part * rows:(part + 1) * rows] = meant.pop(part_name).numpy()
            meant[hf_name] = torch.from_numpy(gate_up)
            continue
        if hf_name.endswith("experts.down_proj"):  # [E, H, I]
            block = int(hf_name.split(".")[2])
            add(TENSOR_NAMES[MODEL_TENSOR.FFN_DOWN_EXP].format(bid=block) + ".weight", MODEL_TENSOR.FFN_DOWN_EXP,
                values, hf_name)
            continue
        kind, block, suffix = _gguf_name(hf_name)
        name = TENSOR_NAMES[kind].format(bid=block) + "." + suffix
        if kind == MODEL_TENSOR.FFN_GATE_INP_SHEXP:
            values = values.reshape(-1)  # llama.cpp's shape: [H], not HF's [1, H]
        heads = 0
        if arch == "llama" and kind in (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K):
            heads = config.num_attention_heads if kind == MODEL_TENSOR.ATTN_Q else config.num_key_value_heads
        add(name, kind, values, hf_name, heads)
        meant[hf_name] = meant[hf_name].reshape(model.state_dict()[hf_name].shape)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return meant
