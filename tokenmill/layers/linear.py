"""Linear layers that know how to load (and, under tensor parallelism, shard) their weights.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`; fused layers
(QKV, gate+up) take each checkpoint tensor into its slice, so checkpoints with separate
q/k/v or gate/up tensors load into one matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import get_tp_rank, get_tp_size
from tokenmill.kernels import use_triton
from tokenmill.layers.cpu_gemm import cpu_linear


def _set_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias; decode batches of a few tokens on CUDA take the skinny GEMM (no split-K), the
    CPU takes oneDNN with prepacked weights (layers.cpu_gemm)."""
    if x.device.type == "cpu":
        return cpu_linear(x, weight, bias)
    if use_triton(x):
        from tokenmill.kernels.skinny_gemm import skinny_gemm, skinny_gemm_applies

        if skinny_gemm_applies(x, weight):
            y = skinny_gemm(x, weight)
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.tp_dim = tp_dim
        self.input_size, self.output_size = input_size, output_size
        weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight = _set_loader(weight, self.weight_loader)
        if bias:
            self.bias = _set_loader(nn.Parameter(torch.empty(output_size), requires_grad=False), self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_dim is not None and self.tp_size > 1 and (param.dim() > 1 or self.tp_dim == 0):
            shard = param.shape[self.tp_dim]
            loaded_weight = loaded_weight.narrow(self.tp_dim, self.tp_rank * shard, shard)
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tensor-parallel size {tp_size}")
        super().__init__(input_size, output_size // tp_size, bias, tp_dim=0)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tensor-parallel size {tp_size}")
        super().__init__(input_size // tp_size, output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the reduction, not once per rank.
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            torch.distributed.all_reduce(y)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:  # the checkpoint already holds the fused tensor
            sizes = self.output_sizes
            for i, part in enumerate(loaded_weight.split(sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        shard = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        loaded_weight = loaded_weight.narrow(0, self.tp_rank * shard, shard)
        default_weight_loader(param.data.narrow(0, offset, shard), loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; kv heads are replicated when fewer than ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.num_kv_head_replicas = max(1, tp_size // num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id is None:  # fused checkpoint tensor: split into the full q, k, v first
            total_q = q_size * self.tp_size
            total_kv = (loaded_weight.shape[0] - total_q) // 2
            for sid, part in zip("qkv", loaded_weight.split([total_q, total_kv, total_kv], dim=0)):
                self.weight_loader(param, part, sid)
            return
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.num_kv_head_replicas
        loaded_weight = loaded_weight.narrow(0, rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)
