"""compressed-tensors checkpoints (`quant_method: "compressed-tensors"`, as llm-compressor writes them).

Each config group names its target layers ("Linear", or module names and `re:` patterns) and how their
weights and input activations are quantized. Supported formats: `float-quantized` (FP8 W8A8: tensor,
channel or block weight scales; dynamic per-token or static per-tensor activations), `naive-quantized` with
FP8 weights (the same layout: compressed-tensors names FP8 weight-only schemes, W8A16, so) and `pack-quantized`
(W4A16 / W8A16 integer weights, layers.quant.w4a16). A group may name its own `format` (llm-compressor's
`mixed-precision` checkpoints). Other formats are refused by name.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.layers.quant.base import QuantConfig, QuantMethod, matches_any
from tokenmill.layers.quant.compressed_tensors_packed import packed_method
from tokenmill.layers.quant.fp8 import Fp8Config, Fp8LinearMethod, block_size_of
from tokenmill.layers.quant.unquantized import UnquantizedLinearMethod

logger = logging.getLogger(__name__)

SUPPORTED_FORMATS = ("float-quantized", "naive-quantized", "pack-quantized")


class CompressedTensorsConfig(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], QuantMethod]], ignored: list[str]) -> None:
        super().__init__(ignored)
        self.groups = groups

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> CompressedTensorsConfig | None:
        """None: nothing is quantized (a pruned model stored dense, or one whose rotations are fused into its
        weights), the checkpoint loads as a dense one."""
        _check_sparsity_and_transforms(config)
        groups = []
        for name, group in (config.get("config_groups") or {}).items():
            fmt = group.get("format") or config.get("format")
            if fmt not in SUPPORTED_FORMATS:
                raise ValueError(f"compressed-tensors format {fmt!r} is not supported (supported: "
                                 f"{', '.join(SUPPORTED_FORMATS)})")
            method = packed_method(name, group) if fmt == "pack-quantized" else _float_method(name, group, fmt)
            groups.append((list(group.get("targets") or ["Linear"]), method))
        if not groups:  # pruning or offline transforms alone: no quantized tensor (as vLLM, all layers dense)
            logger.info("the compressed-tensors checkpoint quantizes no layer (no config_groups): loaded dense")
            return None
        return cls(groups, list(config.get("ignore") or []))

    def linear_method(self, layer_name: str, part_names: list[str] | None = None) -> QuantMethod:
        # Targets name checkpoint modules (re:.*q_proj$): a fused layer (qkv_proj) is matched by its parts,
        # which must all fall in one group, as they share one matmul.
        found = {self._group_of(name) for name in part_names or [layer_name]}
        if len(found) > 1:
            raise ValueError(f"{layer_name}: the checkpoint quantizes {part_names} with different schemes, which "
                             "one fused matmul holds; this layout is not supported")
        group = found.pop()
        return UnquantizedLinearMethod() if group is None else self.groups[group][1]

    def moe_method(self, layer_name: str) -> Any:
        """FP8 experts (float-quantized, any weight strategy, dynamic activations) load as layers.quant.fp8_moe
        holds them; integer (pack-quantized) experts have no MoE path."""
        group = self._group_of(f"{layer_name}.0")  # the experts' modules: <layer>.<expert>.<projection>
        method = None if group is None else self.groups[group][1]
        if not isinstance(method, Fp8LinearMethod):
            return None
        return method.config.moe_method(layer_name)

    def _group_of(self, module_name: str) -> int | None:
        """The first config group whose targets take the module, None for none."""
        return next((i for i, (targets, _) in enumerate(self.groups)
                     if "Linear" in targets or matches_any(module_name, targets)), None)


def _check_sparsity_and_transforms(config: dict[str, Any]) -> None:
    """What would leave the weights unreadable or computing something else: sparse weights stored compressed
    (bitmasks), and transforms applied at run time (SpinQuant / QuIP rotations of activations or KV), which a
    reader that ignores them would not apply. Transforms fused into the weights offline change nothing here."""
    sparsity = config.get("sparsity_config") or {}
    fmt = sparsity.get("format") or "dense"
    if fmt != "dense":
        raise ValueError(f"compressed-tensors sparsity_config format {fmt!r} stores the weights compressed, which "
                         "tokenmill does not read (only sparsity stored dense, format 'dense')")
    schemes = ((config.get("transform_config") or {}).get("config_groups") or {}).values()
    online = sorted({str(args.get("location")) for scheme in schemes for args in scheme.get("apply") or []
                     if args.get("location") not in ("weight_input", "weight_output")})
    if online:
        raise ValueError(f"the compressed-tensors checkpoint's transform_config applies transforms at run time "
                         f"({', '.join(online)}), which tokenmill does not: its weights expect rotated inputs")


def _float_method(group_name: str, group: dict[str, Any], fmt: str) -> QuantMethod:
    weights, activations = group.get("weights") or {}, group.get("input_activations")
    what = f"compressed-tensors group {group_name!r}"
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(f"{what}: weights of type {weights.get('type')!r} with {weights.get('num_bits')} bits "
                         f"in format {fmt}; only 8-bit float (fp8 e4m3) is supported")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"{what}: weight strategy {strategy!r} is not supported (tensor, channel or block)")
    block = block_size_of(weights.get("block_structure"), f"{what} block_structure") if strategy == "block" else 0
    if strategy == "block" and not block:
        raise ValueError(f"{what}: block strategy without block_structure")
    static = False
    if activations is not None:
        if activations.get("type") != "float" or activations.get("num_bits") != 8:
            raise ValueError(f"{what}: input activations must be 8-bit float in format float-quantized")
        static = not activations.get("dynamic", False)
        if static and activations.get("strategy") != "tensor":
            raise ValueError(f"{what}: static input activations must be per tensor")
        if block and static:
            raise ValueError(f"{what}: block-wise weights with static activation scales are not supported")
    config = Fp8Config(checkpoint_fp8=True, block=block, channel_scales=strategy == "channel",
                       static_activations=static, block_scale_name="weight_scale", weight_only=activations is None)
    return Fp8LinearMethod(config)
