"""AWQ checkpoints (`quant_method: "awq"`, AutoAWQ's `version: "gemm"`): 4-bit weights, asymmetric.

The published layout, per linear layer, 8 values per int32, packed along the OUTPUT:
- `qweight` int32 [k, n / 8] and `qzeros` int32 [k / group, n / 8]: the word of output columns
  8c ... 8c + 7 holds column 8c + ORDER[i] in its i-th nibble (bits 4i ... 4i + 3), ORDER = [0, 2, 4, 6,
  1, 3, 5, 7] (an interleave AutoAWQ's GEMM kernel unpacks cheaply);
- `scales` fp16 [k / group, n].
The weight is (q - zero) * scale, zeros stored as they are (no GPTQ-style offset). `zero_point: false` and
the GEMV / Marlin versions are refused; `modules_to_not_convert` stays dense.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokenmill.layers.quant.base import QuantConfig, QuantMethod
from tokenmill.layers.quant.w4a16 import IntWeightMethod, IntWeights, check_groups, unpack_int32

if TYPE_CHECKING:
    from tokenmill.layers.linear import LinearBase

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds output column AWQ_ORDER[i] of its eight
# unpack_int32 wants, for each column j of the eight, the nibble that holds it: the inverse permutation.
AWQ_SLOTS = [AWQ_ORDER.index(j) for j in range(8)]


class AwqLinearMethod(IntWeightMethod):
    bits = 4

    def __init__(self, config: AwqConfig) -> None:
        self.config = config

    def checkpoint_params(self) -> list[str]:
        return ["qweight", "qzeros", "scales"]

    def create_weights(self, layer: LinearBase) -> None:
        group = self.config.group_size
        groups = check_groups(layer, group, 8, "awq")
        n, k = layer.output_size, layer.input_size
        scale_input = None if group <= 0 else 0
        per_group = k if group <= 0 else group
        layer.qweight = layer.make_param(torch.empty(k, n // 8, dtype=torch.int32), output_dim=1, input_dim=0,
                                         output_block=8)
        layer.qzeros = layer.make_param(torch.empty(groups, n // 8, dtype=torch.int32), output_dim=1,
                                        input_dim=scale_input, output_block=8, input_block=per_group)
        layer.scales = layer.make_param(torch.empty(groups, n, dtype=torch.float32), output_dim=1,
                                        input_dim=scale_input, input_block=per_group)

    def unpack(self, layer: LinearBase) -> IntWeights:
        q = unpack_int32(layer.qweight.data, 4, dim=1, order=AWQ_SLOTS).t()
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_SLOTS).t()
        scale = layer.scales.data.t()
        return IntWeights(q, scale, zeros.to(scale.dtype))


class AwqConfig(QuantConfig):
    name = "awq"

    def __init__(self, group_size: int, ignored: list[str]) -> None:
        super().__init__(ignored)
        self.group_size = group_size

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> AwqConfig:
        bits = int(config.get("bits", config.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"awq checkpoint with {bits} bits: only 4 is supported")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported (gemm)")
        if not config.get("zero_point", True):
            raise ValueError("awq checkpoint without zero points (zero_point: false) is not supported")
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        if group_size == 0 or group_size < -1:
            raise ValueError(f"awq checkpoint: group_size {group_size} is not a group size or -1")
        return cls(group_size, list(config.get("modules_to_not_convert") or []))

    def linear_method(self, layer_name: str, part_names: list[str] | None = None) -> QuantMethod:
        return AwqLinearMethod(self)

    def describe(self) -> str:
        groups = "per-channel" if self.group_size <= 0 else f"group {self.group_size}"
        return f"awq int4 weights ({groups}, asymmetric), 16-bit activations"
