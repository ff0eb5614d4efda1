"""GGUF files of mixture-of-experts models in llama.cpp's layout: the config fields transformers' GGUF reader
leaves out, and the experts' tensors under Hugging Face per-expert names.

Config: transformers maps `<arch>.expert_count` / `expert_used_count` but not the experts' widths
(`expert_feed_forward_length`, Qwen2-MoE's `expert_shared_feed_forward_length`), so its Qwen-MoE configs keep
the class defaults (768, 1408 / 5632: right for Qwen3-30B-A3B and Qwen1.5-MoE-A2.7B by coincidence, wrong for
Qwen3-235B-A22B or Qwen2-57B-A14B); and Mixtral, which llama.cpp writes as arch "llama" with an expert count,
comes back as a dense LlamaConfig. moe_config corrects both from the file's metadata.

Tensors: llama.cpp stacks a layer's experts, `blk.N.ffn_{gate,up,down}_exps` [E, rows, cols]. expert_weights
yields them one expert at a time as `model.layers.N.mlp.experts.E.<projection>.weight` with the family's
checkpoint projection names (Qwen: gate_proj / up_proj / down_proj; Mixtral: w1 / w3 / w2), as layers.moe
loads a Hugging Face checkpoint. One expert at a time: a quantized expert is copied raw or dequantized alone,
never the whole float32 stack of a layer (2.4 GB per Qwen3-30B-A3B layer).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np
import torch
from transformers import MixtralConfig, PretrainedConfig

from tokenmill.model.gguf_cache import gguf_header

# The Hugging Face architectures whose GGUF files load (others with experts are refused by the loader).
GGUF_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")

_STACKED_EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)_exps\.weight")
# llama.cpp's first Mixtral files (before April 2024) held one tensor per expert.
_SPLIT_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")
_PROJECTIONS = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}
_QWEN_PROJECTIONS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def moe_config(path: str, config: PretrainedConfig) -> PretrainedConfig:
    """transformers' config of a GGUF file, with the mixture-of-experts fields it misses (module docstring)."""
    metadata = gguf_header(path).metadata
    arch = metadata.get("general.architecture")

    def field(name: str):
        return metadata.get(f"{arch}.{name}")

    if arch in ("qwen2moe", "qwen3moe"):
        for key, attribute in (("expert_feed_forward_length", "moe_intermediate_size"),
                               ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
                               ("expert_weights_norm", "norm_topk_prob")):
            if field(key) is not None:
                setattr(config, attribute, field(key))
    elif arch == "llama" and field("expert_count"):
        config = _mixtral_config(config, field("expert_count"), field("expert_used_count"),
                                 field("expert_feed_forward_length"))
    return config


def _mixtral_config(llama: PretrainedConfig, num_experts: int, top_k: int | None,
                    expert_size: int | None) -> PretrainedConfig:
    """A llama.cpp "llama" file with experts is Mixtral: its attention fields, one FFN width per expert."""
    if not top_k:
        raise ValueError("GGUF llama file with experts but no expert_used_count: cannot route its tokens")
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
              "bos_token_id", "eos_token_id", "pad_token_id")
    kept = {name: getattr(llama, name) for name in fields if getattr(llama, name, None) is not None}
    return MixtralConfig(**kept, intermediate_size=expert_size or llama.intermediate_size,
                         num_local_experts=num_experts, num_experts_per_tok=top_k,
                         architectures=["MixtralForCausalLM"])


def is_expert_tensor(name: str) -> bool:
    """Whether a GGUF tensor holds routed experts (expert_weights yields them)."""
    if _SPLIT_EXPERT.fullmatch(name):
        raise ValueError(f"GGUF tensor {name!r}: one tensor per expert is llama.cpp's layout before April 2024, "
                         "which tokenmill does not read; convert the model again with a current llama.cpp")
    return _STACKED_EXPERTS.fullmatch(name) is not None


def expert_weights(tensor, model_type: str,
                   keep_raw: Callable[[str], bool] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked experts tensor (model.gguf_file.GGUFTensor) -> (per-expert Hugging Face name, tensor): the raw rows
    tagged with their GGML type where keep_raw(name) holds (keep_raw None: none), else float32 values."""
    from gguf import dequantize

    from tokenmill.layers.quant.gguf import tag_ggml

    match = _STACKED_EXPERTS.fullmatch(tensor.name)
    projection = _PROJECTIONS.get(model_type, _QWEN_PROJECTIONS)[match["proj"]]
    ggml_type = int(tensor.tensor_type)
    for expert in range(tensor.data.shape[0]):
        name = f"model.layers.{match['layer']}.mlp.experts.{expert}.{projection}.weight"
        if keep_raw is not None and keep_raw(name):
            yield name, tag_ggml(torch.from_numpy(np.copy(tensor.data[expert])), ggml_type)
        else:
            yield name, torch.from_numpy(np.array(dequantize(tensor.data[expert], tensor.tensor_type),
                                                  dtype=np.float32))
