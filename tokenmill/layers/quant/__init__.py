"""Quantization methods of linear layers (the seam of STYLE.md section 9), and choosing them for a model."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from tokenmill.layers.quant.awq import AwqConfig
from tokenmill.layers.quant.base import QuantConfig, QuantMethod
from tokenmill.layers.quant.compressed_tensors import CompressedTensorsConfig
from tokenmill.layers.quant.fp8 import Fp8Config
from tokenmill.layers.quant.gguf import GGUFConfig
from tokenmill.layers.quant.gptq import GptqConfig

logger = logging.getLogger(__name__)

# quant_method (as checkpoints and --quantization name it) -> its config class
QUANT_CONFIGS: dict[str, type[QuantConfig]] = {
    "fp8": Fp8Config,
    "compressed-tensors": CompressedTensorsConfig,
    "gptq": GptqConfig,  # checkpoints only: no online int4 (QuantConfig.online refuses)
    "awq": AwqConfig,
    "gguf": GGUFConfig,  # a .gguf file's own types: the loader gives it as the checkpoint's quant_method
}

__all__ = ["QUANT_CONFIGS", "QuantConfig", "QuantMethod", "quantize_linear_layers",
           "process_weights_after_loading", "resolve_quant_config"]


def resolve_quant_config(requested: str | None, checkpoint: dict[str, Any] | None) -> QuantConfig | None:
    """The checkpoint's own format when it has one (`--quantization` may only name it again), else the
    online method `--quantization` asks for, else None (dense)."""
    if checkpoint is not None and not isinstance(checkpoint, dict):
        checkpoint = checkpoint.to_dict()  # a transformers QuantizationConfig object
    method = (checkpoint or {}).get("quant_method")
    if checkpoint and not method:
        # Quantized, but not saying how: loaded dense, its packed tensors would fail to load or, if named like
        # dense ones, run as garbage. (vLLM refuses it too.)
        raise ValueError(f"the checkpoint's quantization_config has no quant_method (it has "
                         f"{', '.join(map(str, checkpoint))}): add the method its tensors are in, one of "
                         f"{', '.join(QUANT_CONFIGS)}, to config.json")
    if method:
        method = str(method).lower()
        if requested not in (None, method):
            raise ValueError(f"--quantization {requested} was given, but the checkpoint is quantized with "
                             f"{method!r}: leave --quantization out to load it as it is")
        if method not in QUANT_CONFIGS:
            raise ValueError(f"the checkpoint is quantized with {method!r}, which tokenmill does not load "
                             f"(supported: {', '.join(QUANT_CONFIGS)})")
        try:
            return QUANT_CONFIGS[method].from_checkpoint(checkpoint)
        except (AttributeError, TypeError, KeyError) as e:
            # The parsers read config.json as its writers spell it; a value of another type (a number where a
            # mapping or list belongs) fails inside them, which would be a traceback about their code.
            raise ValueError(f"the checkpoint's {method} quantization_config has a value of the wrong type "
                             f"({type(e).__name__}: {e}): check it against the {method} format") from None
    if requested is None:
        return None
    if requested not in QUANT_CONFIGS:
        raise ValueError(f"unknown quantization {requested!r} (supported: {', '.join(QUANT_CONFIGS)})")
    return QUANT_CONFIGS[requested].online()


def fused_part_names(layer_name: str, stacked_params: dict[str, tuple[str, str | int]]) -> list[str]:
    """The checkpoint modules a (possibly fused) layer holds: model.x.qkv_proj -> model.x.{q,k,v}_proj."""
    prefix, _, leaf = layer_name.rpartition(".")
    parts = [ckpt for ckpt, (fused, _) in stacked_params.items() if fused == leaf] or [leaf]
    return [f"{prefix}.{part}" if prefix else part for part in parts]


def quantize_linear_layers(model: nn.Module, config: QuantConfig,
                           stacked_params: dict[str, tuple[str, str | int]]) -> None:
    """Give each linear layer its config's method (before the checkpoint loads), honouring exclusions."""
    from tokenmill.layers.linear import LinearBase

    check_moe_experts(model, config)
    moe_quantized = 0
    for name, layer in _quantized_moe_layers(model, config):
        method = config.moe_method(name)
        if method is not None:
            layer.set_quant_method(method)
            moe_quantized += 1
    if moe_quantized:
        logger.info("quantization: the experts of %d MoE layers in %s (routers stay dense)", moe_quantized,
                    config.describe())
    quantized = kept = 0
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        # MoE routers (layers.moe.MoERouter) keep the model's dtype.
        parts = fused_part_names(name, stacked_params)
        if not getattr(module, "quantizable", True) or config.is_ignored(name, parts):
            kept += 1
            continue
        module.set_quant_method(config.linear_method(name, parts))
        quantized += 1
    logger.info("quantization: %s; %d linear layers quantized, %d kept unquantized (embeddings and LM head "
                "stay in the model's dtype)", config.describe(), quantized, kept)


def check_moe_experts(model: nn.Module, config: QuantConfig) -> None:
    """Experts stay in the model's dtype where the config has no MoE method (config.moe_method): under an
    online method that is a choice (logged); a checkpoint that stores them quantized is refused rather than
    misloaded."""
    for name, _ in _quantized_moe_layers(model, config):
        if config.moe_method(name) is not None:
            continue
        if not config.quantizes_checkpoint_tensors():
            logger.info("quantization %s: the MoE layer %s's experts stay unquantized", config.name, name)
            continue
        raise ValueError(f"{name}: the checkpoint stores mixture-of-experts weights quantized with "
                         f"{config.name!r} ({config.describe()}), which tokenmill does not load for MoE experts "
                         "yet (only unquantized experts, fp8 with dynamic activations, or GGUF); use the unquantized "
                         "checkpoint")


def _quantized_moe_layers(model: nn.Module, config: QuantConfig) -> list[tuple[str, nn.Module]]:
    """The FusedMoE layers the config does not exclude."""
    from tokenmill.layers.moe import FusedMoE

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, FusedMoE) and not config.is_ignored(name, m.checkpoint_part_names(name))]


def process_weights_after_loading(model: nn.Module) -> None:
    from tokenmill.layers.linear import LinearBase
    from tokenmill.layers.moe import FusedMoE

    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)
        elif isinstance(module, FusedMoE) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)
