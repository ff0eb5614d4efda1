"""compressed-tensors `pack-quantized`: integer weights (W4A16, W8A16), as llm-compressor writes them.

The published layout (compressed_tensors.compressors.pack_quantized), per linear layer, b = num_bits:
- `weight_packed` int32 [n, k * b / 32]: packed along the input, lowest bits first; each value is the
  signed integer plus 2^(b-1) (so unsigned);
- `weight_scale` [n, k / group] (strategy group) or [n, 1] (channel), in the checkpoint's float dtype;
- `weight_zero_point` int32 [n * b / 32, k / group], only when asymmetric: the signed zero points, offset
  and packed the same way but along the OUTPUT (dim 0);
- `weight_shape` [2]: the dense shape (n, k);
- `weight_g_idx` [k] with `actorder: "group"` (GPTQ's act-order); "weight" (alias "static") changes only
  the calibration, not the layout.
The weight is (q_signed - zero_signed) * scale = (q_unsigned - zero_unsigned) * scale: the offsets cancel,
so this is layers.quant.w4a16's layout once the zero points are unpacked along the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

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


class PackQuantizedLinearMethod(IntWeightMethod):
    def __init__(self, bits: int, group_size: int, symmetric: bool, act_order: bool) -> None:
        self.bits, self.group_size, self.symmetric, self.act_order = bits, group_size, symmetric, act_order

    def checkpoint_params(self) -> list[str]:
        return ["weight_packed", "weight_scale", "weight_shape"] + (
            [] if self.symmetric else ["weight_zero_point"]) + (["weight_g_idx"] if self.act_order else [])

    def create_weights(self, layer: LinearBase) -> None:
        pack, group = 32 // self.bits, self.group_size
        what = "compressed-tensors pack-quantized"
        n, k, parts = layer.output_size, layer.input_size, len(layer.partition_sizes)
        all_groups = self.act_order and act_order_keeps_all_groups(layer, group)
        groups = check_groups(layer, group, pack, what, whole_input=all_groups)
        # One per-channel scale column is every rank's, and so is every act-order group's under row parallelism.
        scale_input, per_group = (None, k) if group <= 0 else (None if all_groups else 1, group)
        layer.weight_packed = layer.make_param(torch.empty(n, k // pack, dtype=torch.int32), output_dim=0,
                                               input_dim=1, input_block=pack)
        # float32 holds fp16 and bf16 scales exactly; the repack narrows them back (w4a16.narrow_exactly).
        layer.weight_scale = layer.make_param(torch.empty(n, groups, dtype=torch.float32), output_dim=0,
                                              input_dim=scale_input, input_block=per_group)
        # The dense shape each part's checkpoint states, which unpack checks; a dummy load keeps what is made here.
        k_total = k * (layer.tp_size if layer.tp_dim == 1 else 1)
        layer.weight_shape = layer.make_param(torch.tensor([[size, k_total] for size in
                                                            layer.checkpoint_partition_sizes()], dtype=torch.int64))
        layer.weight_shape.weight_loader = per_part_loader(layer)
        layer.weight_shape.kept_by_dummy_load = True
        if not self.symmetric:
            layer.weight_zero_point = layer.make_param(torch.empty(n // pack, groups, dtype=torch.int32),
                                                       output_dim=0, input_dim=scale_input, output_block=pack,
                                                       input_block=per_group)
        if self.act_order:
            layer.weight_g_idx = layer.make_param(torch.empty(parts, k, dtype=torch.int32))
            layer.weight_g_idx.weight_loader = per_part_loader(layer, input_dim=0)

    def unpack(self, layer: LinearBase) -> IntWeights:
        k_total = layer.input_size * (layer.tp_size if layer.tp_dim == 1 else 1)
        shapes = layer.weight_shape.data.tolist()
        if any(shape[1] != k_total for shape in shapes):
            raise ValueError(f"compressed-tensors weight_shape {shapes}: not {k_total} input features")
        q = unpack_int32(layer.weight_packed.data, self.bits, dim=1)
        zero = None if self.symmetric else unpack_int32(layer.weight_zero_point.data, self.bits, dim=0)
        scale = layer.weight_scale.data
        g_idx = shared_rows(layer.weight_g_idx.data, "compressed-tensors weight_g_idx") if self.act_order else None
        return IntWeights(q, scale, None if zero is None else zero.to(scale.dtype), g_idx)


def packed_method(group_name: str, group: dict[str, Any]) -> PackQuantizedLinearMethod:
    weights, activations = group.get("weights") or {}, group.get("input_activations")
    what = f"compressed-tensors group {group_name!r}"
    bits = weights.get("num_bits")
    if weights.get("type") != "int" or bits not in (4, 8):
        raise ValueError(f"{what}: weights of type {weights.get('type')!r} with {bits} bits in format "
                         "pack-quantized; only 4- and 8-bit int are supported")
    if activations is not None:
        raise ValueError(f"{what}: pack-quantized with quantized input activations is not supported (W4A16, W8A16)")
    strategy = weights.get("strategy")
    if strategy == "group":
        group_size = int(weights.get("group_size") or 0)
        if group_size <= 0:
            raise ValueError(f"{what}: group strategy without a group_size")
    elif strategy == "channel":
        group_size = -1
    else:
        raise ValueError(f"{what}: weight strategy {strategy!r} is not supported (group or channel)")
    actorder = weights.get("actorder")
    if actorder not in (None, "weight", "static", "group", "dynamic"):
        raise ValueError(f"{what}: actorder {actorder!r} is not supported")
    act_order = actorder in ("group", "dynamic") and strategy == "group"
    return PackQuantizedLinearMethod(int(bits), group_size, bool(weights.get("symmetric", True)), act_order)
