"""Linear layers that know how to load (and, under tensor parallelism, shard) their weights.

What a layer's weight tensors are, and how they multiply, is its quant method's (layers.quant): dense by
default. Every parameter the method creates says which of its dimensions run along the layer's outputs and
inputs, and how many features one element spans there (8 for int4 packed in int32, 128 for a block scale),
so one loader shards all of them. Fused layers (QKV, gate+up) take each checkpoint tensor into its slice,
so checkpoints with separate q/k/v or gate/up tensors load into one matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from tokenmill.layers.quant.base import QuantMethod
from tokenmill.layers.quant.unquantized import UnquantizedLinearMethod


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def _elements(features: int, per_element: int, what: str) -> int:
    if features % per_element:
        raise ValueError(f"{what}: {features} features do not split into whole groups of {per_element}")
    return features // per_element


class LinearBase(nn.Module):
    """partition_sizes: this rank's output features of each part a fused layer holds (one part otherwise)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None,
                 partition_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.tp_dim = tp_dim  # 0: outputs split over ranks (column), 1: inputs split (row), None: replicated
        self.input_size, self.output_size = input_size, output_size
        self.partition_sizes = partition_sizes or [output_size]
        self.params_dtype = torch.get_default_dtype()
        self.quant_method: QuantMethod = UnquantizedLinearMethod()
        self.quant_method.create_weights(self)
        if bias:
            self.bias = self.make_param(torch.empty(output_size), output_dim=0)
        else:
            self.register_parameter("bias", None)

    def make_param(self, data: torch.Tensor, output_dim: int | None = None, input_dim: int | None = None,
                   output_block: int = 1, input_block: int = 1, per_partition: bool = False) -> nn.Parameter:
        """A parameter this layer's loader can fill. per_partition: one value per fused part (per-tensor scales)."""
        param = nn.Parameter(data, requires_grad=False)
        param.output_dim, param.input_dim = output_dim, input_dim  # type: ignore[attr-defined]
        param.output_block, param.input_block = output_block, input_block  # type: ignore[attr-defined]
        param.per_partition = per_partition  # type: ignore[attr-defined]
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        return param

    def set_quant_method(self, method: QuantMethod) -> None:
        """Replace the weight parameters by `method`'s, before the checkpoint loads."""
        for name, _ in list(self.named_parameters(recurse=False)):
            if name != "bias":
                delattr(self, name)
        self.quant_method = method
        method.create_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    # -- loading ---------------------------------------------------------------------------------------
    def partition_slice(self, shard_id: str | int | None) -> tuple[int, int, int, int]:
        """(part index, offset and size in this rank's output features, rank whose checkpoint slice it is)."""
        return 0, 0, self.output_size, self.tp_rank

    def checkpoint_partition_sizes(self) -> list[int]:
        """Output features of each part in the (unsharded) checkpoint, to split a tensor that holds them all."""
        return [self.output_size * (self.tp_size if self.tp_dim == 0 else 1)]

    def shard_ids(self) -> list[str | int | None]:
        return [None]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if shard_id is None and len(self.partition_sizes) > 1:
            self._load_fused(param, loaded)
            return
        index, offset, size, rank = self.partition_slice(shard_id)
        if param.per_partition:
            param.data[index].copy_(loaded.reshape(()))
            return
        target = param.data
        if param.output_dim is not None:
            dim, per = param.output_dim, param.output_block
            what = f"{type(self).__name__} parameter of shape {tuple(param.shape)}"
            if self.tp_dim == 0:
                loaded = loaded.narrow(dim, rank * _elements(size, per, what), _elements(size, per, what))
            target = target.narrow(dim, _elements(offset, per, what), _elements(size, per, what))
        if param.input_dim is not None and self.tp_dim == 1 and self.tp_size > 1:
            shard = target.shape[param.input_dim]
            loaded = loaded.narrow(param.input_dim, self.tp_rank * shard, shard)
        default_weight_loader(target, loaded)

    def _load_fused(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A checkpoint tensor that holds every part at once: one slice per part."""
        if param.per_partition:  # one scale shared by the parts
            for shard_id in self.shard_ids():
                self.weight_loader(param, loaded, shard_id)
            return
        if param.output_dim is None:  # nothing runs along the outputs: the parts share it
            self.weight_loader(param, loaded, self.shard_ids()[0])
            return
        sizes = [s // param.output_block for s in self.checkpoint_partition_sizes()]
        for shard_id, part in zip(self.shard_ids(), loaded.split(sizes, dim=param.output_dim)):
            self.weight_loader(param, part, shard_id)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 partition_sizes: list[int] | None = None) -> None:
        tp_size = get_tp_size()
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tensor-parallel size {tp_size}")
        super().__init__(input_size, output_size // tp_size, bias, tp_dim=0, partition_sizes=partition_sizes)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tensor-parallel size {tp_size}")
        super().__init__(input_size // tp_size, output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the reduction, not once per rank.
        y = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        return tp_all_reduce(y)  # over this pipeline stage's tensor-parallel group


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        tp_size = get_tp_size()
        super().__init__(input_size, sum(output_sizes), bias, partition_sizes=[s // tp_size for s in output_sizes])

    def partition_slice(self, shard_id: str | int | None) -> tuple[int, int, int, int]:
        index = int(shard_id or 0)
        return index, sum(self.partition_sizes[:index]), self.partition_sizes[index], self.tp_rank

    def checkpoint_partition_sizes(self) -> list[int]:
        return list(self.output_sizes)

    def shard_ids(self) -> list[str | int | None]:
        return list(range(len(self.output_sizes)))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; kv heads are replicated when fewer than ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.num_kv_head_replicas = max(1, tp_size // num_kv_heads)
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias, partition_sizes=[q_size, kv_size, kv_size])

    def partition_slice(self, shard_id: str | int | None) -> tuple[int, int, int, int]:
        q_size, kv_size = self.partition_sizes[0], self.partition_sizes[1]
        if shard_id in (None, "q"):
            return 0, 0, q_size, self.tp_rank
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        return (1, q_size, kv_size, kv_rank) if shard_id == "k" else (2, q_size + kv_size, kv_size, kv_rank)

    def checkpoint_partition_sizes(self) -> list[int]:
        kv = self.total_num_kv_heads * self.head_dim
        return [self.total_num_heads * self.head_dim, kv, kv]

    def shard_ids(self) -> list[str | int | None]:
        return ["q", "k", "v"]
