"""Hugging Face architecture name -> model class."""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under tokenmill.model, class name); imported on first use.
_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen3_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(f"tokenmill.model.{module}"), name)
    raise ValueError(
        f"model architecture {architectures} is not supported; supported: {', '.join(supported_architectures())}"
    )
