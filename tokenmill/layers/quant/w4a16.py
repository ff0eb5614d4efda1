"""Weight-only integer weights (int4, int8) with 16-bit activations: the layout every such format loads into.

GPTQ, AWQ and compressed-tensors `pack-quantized` each pack their integers differently (layers.quant.gptq,
.awq, .compressed_tensors); `process_weights_after_loading` repacks them all into one layout, so one apply
path and one pair of kernels (kernels.w4a16_gemm) serve every format:
- `weight_packed` int32 [n, k / pack]: unsigned b-bit integers packed along the input, pack = 32 / b per
  int32, the lowest bits first (feature k sits in int32 k // pack at bits b * (k % pack)). A row of the
  weight is contiguous, as the GEMM walks it.
- `weight_scale` [n, k / group] in the 16-bit dtype that holds the checkpoint's scales exactly (fp16 or
  bf16, as the checkpoint had them); one group spans the whole input for per-channel scales.
- `weight_zero` [n, k / group] in the same dtype (small integers, exact there), or None: symmetric, the
  zero point is the midpoint 2^(b-1). The weight is (q - zero) * scale.
- `input_perm` int32 [k'] or None: GPTQ's act-order (`g_idx`) puts input features in groups by their
  rank in the calibration, not by position. The repack sorts the input features by group, so the groups
  are contiguous again, and the activations are gathered in that order (x[:, input_perm]): the same
  product, and the kernel never gathers a scale. Under row parallelism a rank's slice of the inputs holds an
  uneven share of each act-order group (it keeps every group's scales: `act_order_keeps_all_groups`): each
  group's features are then padded to whole groups of VIRTUAL_GROUP, the padding's weights at the zero point
  (they add nothing), so k' >= k, and the layer gathers x into that order itself.

The CPU path dequantizes the weight to the activations' dtype on every call and multiplies densely: it is
the correctness path (and the kernels' reference), not a fast one, and it keeps the weight at 4 bits in
memory rather than caching a 16-bit copy. On the GPU, past decode's row counts, the kernels do the same into
one scratch buffer per device (kernels.dequant_scratch), whose size each layer reserves at load, and cuBLAS
multiplies. apply() has no host syncs and no data-dependent shapes, so it runs under CUDA graphs and with
speculative decoding's variable row counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenmill.kernels import use_triton
from tokenmill.kernels.dequant_scratch import reserve_dequant_scratch
from tokenmill.layers.quant.base import QuantMethod

if TYPE_CHECKING:
    from tokenmill.layers.linear import LinearBase


@dataclass(frozen=True)
class IntWeights:
    """A format's integers as one layer holds them once unpacked: q [n, k] unsigned, scale and zero
    [n, groups] (zero None: the midpoint), g_idx [k] (None: feature k is in group k // group_size)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    g_idx: torch.Tensor | None = None


# -- packing (pure torch: load-time repacking, the CPU path, the test checkpoints) -------------------------
def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 words holding 32 / bits values each, along `dim`, lowest bits first -> int32 values, `dim`
    32 / bits times longer. order[j]: the slot of a word that holds its j-th value (AWQ interleaves)."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    if order is not None:
        shifts = shifts[torch.tensor(order, device=packed.device)]
    moved = packed.movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*moved.shape[:-1], moved.shape[-1] * pack).movedim(-1, dim)


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """The inverse of unpack_int32: values in [0, 2^bits) along `dim` -> int32 words."""
    pack = 32 // bits
    moved = values.movedim(dim, -1).to(torch.int64)
    if moved.shape[-1] % pack:
        raise ValueError(f"{moved.shape[-1]} values do not pack into whole int32 words of {pack}")
    moved = moved.reshape(*moved.shape[:-1], -1, pack)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    if order is not None:
        shifts = shifts[torch.tensor(order, device=values.device)]
    words = (moved << shifts).sum(-1)  # disjoint bits: the sum is the bitwise or
    # int32 holds the words' bit patterns: those >= 2^31 wrap to negative numbers.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()


def dequantize_int(weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The layout above -> the dense weight [n, k]: (q - zero) * scale, computed in float32."""
    q = unpack_int32(weight_packed, bits, dim=1).float()
    group = q.shape[1] // scale.shape[1]
    zero = (1 << (bits - 1)) if zero is None else zero.float().repeat_interleave(group, 1)
    return ((q - zero) * scale.float().repeat_interleave(group, 1)).to(dtype)


def int_linear_torch(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     perm: torch.Tensor | None, bits: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The CPU path: dequantize per call (no 16-bit copy kept), then a dense matmul in x's dtype."""
    if perm is not None:
        x = x.index_select(-1, perm)
    return F.linear(x, dequantize_int(weight_packed, scale, zero, bits, x.dtype), bias)


# -- the method ------------------------------------------------------------------------------------------
class IntWeightMethod(QuantMethod):
    """Shared by the formats: a subclass creates the checkpoint's parameters and unpacks them (`unpack`);
    the repack and the matmul are here."""

    bits: int

    def unpack(self, layer: LinearBase) -> IntWeights:
        raise NotImplementedError

    def checkpoint_params(self) -> list[str]:
        """The parameters create_weights registers, dropped once repacked."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        w, perm = self.unpack(layer), None
        if w.g_idx is not None:
            w, perm = _sort_groups(w, self.bits, type(layer).__name__)
        q = w.q
        n, k = q.shape
        midpoint = 1 << (self.bits - 1)
        zero = w.zero
        if zero is not None and bool((zero == midpoint).all()):  # load time: a sync is fine here
            zero = None  # symmetric after all: the kernel's cheaper variant
        for name in self.checkpoint_params():
            delattr(layer, name)
        scale = narrow_exactly(w.scale)
        layer.weight_packed = _frozen(pack_int32(q, self.bits, dim=1))
        layer.weight_scale = _frozen(scale.contiguous())
        layer.weight_zero = None if zero is None else _frozen(zero.to(scale.dtype).contiguous())
        layer.input_perm = None if perm is None else _frozen(perm.to(torch.int32))
        layer.weight_bits = self.bits
        if layer.weight_packed.is_cuda:  # large row counts dequantize the whole weight into a shared scratch
            reserve_dequant_scratch(layer.weight_packed.device, n * k)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        perm = layer.input_perm
        if perm is not None and perm.shape[0] != x2.shape[1]:  # padded act-order groups: the kernels take x as is
            x2, perm = x2.index_select(1, perm), None
        args = (layer.weight_packed, layer.weight_scale, layer.weight_zero, perm, layer.weight_bits)
        if use_triton(x2) and x2.dtype in (torch.bfloat16, torch.float16):
            from tokenmill.kernels.w4a16_gemm import int_weight_gemm

            y = int_weight_gemm(x2, *args)
            y = y if bias is None else y + bias
        else:
            y = int_linear_torch(x2, *args, bias)
        return y.reshape(*shape[:-1], y.shape[-1])


def narrow_exactly(scale: torch.Tensor) -> torch.Tensor:
    """Scales load as float32 (exact for an fp16 or a bf16 checkpoint): back to the 16-bit type that holds
    them exactly, which halves their bytes in the GEMM; float32 where neither does."""
    for dtype in (torch.float16, torch.bfloat16):
        narrowed = scale.to(dtype)
        if torch.equal(narrowed.float(), scale.float()):
            return narrowed
    return scale.float()


def _frozen(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


VIRTUAL_GROUP = 32
"""Features per scale where an act-order rank's groups are uneven (4 int4 words: the GEMV's widest unit)."""


def act_order_keeps_all_groups(layer: LinearBase, group_size: int) -> bool:
    """Whether an act-order layer's rank keeps the scales (and zero points) of every group, not of a slice: under
    row parallelism its slice of the inputs holds some features of every group."""
    return group_size > 0 and layer.tp_dim == 1 and layer.tp_size > 1


def _sort_groups(w: IntWeights, bits: int, what: str) -> tuple[IntWeights, torch.Tensor | None]:
    """Act-order: input features sorted by group, so that group j is features [j * size, (j + 1) * size) where every
    group has `size` features here; else each group padded to whole groups of VIRTUAL_GROUP (zero-point weights).
    Returns the weights in that order and the input features' order (None: as they are)."""
    q, g_idx, groups = w.q, w.g_idx.long(), w.scale.shape[1]
    k = q.shape[1]
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ValueError(f"{what}: g_idx names groups outside [0, {groups})")
    perm = torch.argsort(g_idx, stable=True)
    counts = torch.bincount(g_idx, minlength=groups)
    if k % groups == 0 and bool((counts == k // groups).all()):
        if torch.equal(perm, torch.arange(k, device=perm.device)):
            return IntWeights(q, w.scale, w.zero), None  # g_idx in order (desc_act false, or per-channel)
        return IntWeights(q[:, perm], w.scale, w.zero), perm
    size = VIRTUAL_GROUP
    padded = (counts + size - 1) // size * size
    sorted_groups = g_idx[perm]
    # Feature perm[i] goes to its group's padded run, at its rank among the group's features.
    rank_in_group = torch.arange(k, device=q.device) - (torch.cumsum(counts, 0) - counts)[sorted_groups]
    dest = (torch.cumsum(padded, 0) - padded)[sorted_groups] + rank_in_group
    total = int(padded.sum())
    virtual = torch.repeat_interleave(torch.arange(groups, device=q.device), padded // size)  # each one's group
    scale = w.scale[:, virtual]
    zero = None if w.zero is None else w.zero[:, virtual]
    midpoint = 1 << (bits - 1)
    at_zero = (torch.full_like(scale, midpoint) if zero is None else zero).round().to(q.dtype)
    q_padded = at_zero.repeat_interleave(size, dim=1)  # the padding: (zero - zero) * scale = 0
    q_padded[:, dest] = q[:, perm]
    input_perm = torch.zeros(total, dtype=perm.dtype, device=perm.device)  # the padding reads feature 0 (times 0)
    input_perm[dest] = perm
    return IntWeights(q_padded, scale, zero), input_perm


def per_part_loader(layer: LinearBase, input_dim: int | None = None) -> Callable:
    """A loader for a [parts, ...] parameter holding one row per fused part (GPTQ's g_idx, compressed-tensors'
    weight_shape): what the layer's loader does for scalars, for vectors. input_dim: the row's dimension that
    runs along the inputs (sharded under row parallelism)."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if input_dim is not None and layer.tp_dim == 1 and layer.tp_size > 1:
            size = param.shape[1 + input_dim]
            loaded = loaded.narrow(input_dim, layer.tp_rank * size, size)
        if shard_id is None and len(layer.partition_sizes) > 1:  # one tensor for the fused parts: each gets it
            param.data.copy_(loaded.expand_as(param))
            return
        index = layer.partition_slice(shard_id)[0]
        if param.data[index].shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter row {tuple(param.data[index].shape)}, checkpoint "
                             f"{tuple(loaded.shape)}")
        param.data[index].copy_(loaded)

    return load


def shared_rows(param: torch.Tensor, what: str) -> torch.Tensor:
    """The one row every fused part must agree on (one permutation of the input feeds all of them)."""
    if not bool((param == param[0]).all()):
        raise ValueError(f"{what} differs between the parts of a fused layer, which share one input order")
    return param[0]


def check_groups(layer: LinearBase, group_size: int, pack: int, what: str, whole_input: bool = False) -> int:
    """Groups of this rank's input (1 for per-channel, group_size <= 0), or of the whole input with `whole_input`
    (act_order_keeps_all_groups); raises where the shape does not split."""
    k = layer.input_size
    if k % pack:
        raise ValueError(f"{what}: {k} input features do not pack into int32 words of {pack}")
    if any(size % pack for size in layer.partition_sizes):
        raise ValueError(f"{what}: output parts {layer.partition_sizes} do not pack into int32 words of {pack}")
    if group_size <= 0:
        return 1
    if whole_input:
        k *= layer.tp_size
    if k % group_size:
        whose = "the whole input's" if whole_input else "this rank's"
        raise ValueError(f"{what}: {k} input features ({whose}) do not split into groups of {group_size}")
    return k // group_size
