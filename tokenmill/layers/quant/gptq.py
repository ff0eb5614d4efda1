"""GPTQ checkpoints (`quant_method: "gptq"`, as AutoGPTQ, GPTQModel and optimum write them): 4 or 8 bits.

The published layout, per linear layer, with pack = 32 / bits values per int32, lowest bits first:
- `qweight` int32 [k / pack, n]: packed along the input (row i holds features i * pack ... i * pack + pack - 1);
- `qzeros` int32 [k / group, n / pack]: packed along the output;
- `scales` fp16 [k / group, n]; group = k for `group_size: -1` (per-channel);
- `g_idx` int32 [k]: the group of input feature k. k // group unless `desc_act` (act-order), where groups
  follow the calibration's order of the features; without act-order it is ignored and may be absent.
The weight is (q - zero) * scale. Zeros: `checkpoint_format: "gptq"` (the historical "v1", the default when
the field is absent) stores zero - 1, so a reader adds 1 back (a zero point of 0 is not representable:
stored as -1, it reads back as 2^bits); `"gptq_v2"` (GPTQModel) stores the zero itself. Symmetric
checkpoints still store zeros (the midpoint 2^(bits-1), 0x77777777 words in v1).

Exclusions: `modules_to_not_convert`, and GPTQModel's `dynamic` rules whose key starts with "-:" (a regular
expression matched from the start of the module's name); positive rules that change the bits or groups of
some modules are refused. `lm_head: true` (a quantized LM head) is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokenmill.layers.quant.base import QuantConfig, QuantMethod
from tokenmill.layers.quant.w4a16 import (
    IntWeightMethod,
    IntWeights,
    act_order_keeps_all_groups,
    check_groups,
    per_part_loader,
    shared_rows,
    unpack_int32,
)

if TYPE_CHECKING:
    from tokenmill.layers.linear import LinearBase

CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # -> what to add to a stored zero


class GptqLinearMethod(IntWeightMethod):
    def __init__(self, config: GptqConfig) -> None:
        self.config, self.bits = config, config.bits

    def checkpoint_params(self) -> list[str]:
        return ["qweight", "qzeros", "scales", "g_idx"]

    def create_weights(self, layer: LinearBase) -> None:
        cfg, pack = self.config, 32 // self.bits
        n, k = layer.output_size, layer.input_size
        all_groups = cfg.desc_act and act_order_keeps_all_groups(layer, cfg.group_size)
        groups = check_groups(layer, cfg.group_size, pack, "gptq", whole_input=all_groups)
        per_group = k if cfg.group_size <= 0 else cfg.group_size
        # One per-channel scale row is every rank's, and so is every act-order group's under row parallelism.
        scale_input = None if cfg.group_size <= 0 or all_groups else 0
        layer.qweight = layer.make_param(torch.empty(k // pack, n, dtype=torch.int32), output_dim=1, input_dim=0,
                                         input_block=pack)
        layer.qzeros = layer.make_param(torch.empty(groups, n // pack, dtype=torch.int32), output_dim=1,
                                        input_dim=scale_input, output_block=pack, input_block=per_group)
        layer.scales = layer.make_param(torch.empty(groups, n, dtype=torch.float32), output_dim=1,
                                        input_dim=scale_input, input_block=per_group)
        layer.g_idx = layer.make_param(torch.empty(len(layer.partition_sizes), k, dtype=torch.int32))
        layer.g_idx.weight_loader = per_part_loader(layer, input_dim=0)
        # Without act-order the groups are sequential and g_idx is never read: some exporters leave it out.
        layer.g_idx.may_be_absent = not cfg.desc_act

    def unpack(self, layer: LinearBase) -> IntWeights:
        q = unpack_int32(layer.qweight.data, self.bits, dim=0).t()  # [n, k]
        zeros = unpack_int32(layer.qzeros.data, self.bits, dim=1) + CHECKPOINT_FORMATS[self.config.checkpoint_format]
        scale = layer.scales.data.t()
        g_idx = shared_rows(layer.g_idx.data, "gptq g_idx") if self.config.desc_act else None
        return IntWeights(q, scale, zeros.t().to(scale.dtype), g_idx)


class GptqConfig(QuantConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str,
                 ignored: list[str]) -> None:
        super().__init__(ignored)
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym
        self.checkpoint_format = checkpoint_format

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> GptqConfig:
        bits = int(config.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"gptq checkpoint with {bits} bits: only 4 and 8 are supported")
        group_size = int(config.get("group_size", 128))
        if group_size == 0 or group_size < -1:
            raise ValueError(f"gptq checkpoint: group_size {group_size} is not a group size or -1")
        fmt = str(config.get("checkpoint_format") or "gptq").lower()
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported ({', '.join(CHECKPOINT_FORMATS)})")
        if config.get("lm_head"):
            raise ValueError("gptq checkpoint with a quantized lm_head: not supported")
        ignored = list(config.get("modules_to_not_convert") or [])
        for key, override in (config.get("dynamic") or {}).items():
            if key.startswith("-:"):  # GPTQModel: re.match, anchored at the start only
                ignored.append(f"re:{key[2:]}")
                continue
            changed = {f: v for f, v in (override or {}).items()
                       if f in ("bits", "group_size", "desc_act", "sym") and v != config.get(f)}
            if changed:
                raise ValueError(f"gptq dynamic rule {key!r} changes {changed} for some modules: not supported")
        desc_act = bool(config.get("desc_act", False))
        return cls(bits, group_size, desc_act, bool(config.get("sym", True)), fmt, ignored)

    def linear_method(self, layer_name: str, part_names: list[str] | None = None) -> QuantMethod:
        return GptqLinearMethod(self)

    def describe(self) -> str:
        groups = "per-channel" if self.group_size <= 0 else f"group {self.group_size}"
        return (f"gptq int{self.bits} weights ({groups}, {'symmetric' if self.sym else 'asymmetric'}"
                f"{', act-order' if self.desc_act else ''}, {self.checkpoint_format}), 16-bit activations")

