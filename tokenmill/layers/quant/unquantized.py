"""Dense weights in the model's dtype: the method every linear layer has unless a quant config says otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenmill.kernels import use_triton
from tokenmill.layers.cpu_gemm import cpu_linear
from tokenmill.layers.quant.base import QuantMethod

if TYPE_CHECKING:
    from tokenmill.layers.linear import LinearBase


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias; decode batches of a few tokens on CUDA take the skinny GEMM (one launch), the
    CPU takes oneDNN with prepacked weights (layers.cpu_gemm)."""
    if x.device.type == "cpu":
        return cpu_linear(x, weight, bias)
    if use_triton(x):
        from tokenmill.kernels.skinny_gemm import skinny_gemm, skinny_gemm_applies

        if skinny_gemm_applies(x, weight):
            y = skinny_gemm(x, weight)
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class UnquantizedLinearMethod(QuantMethod):
    def create_weights(self, layer: LinearBase) -> None:
        layer.weight = layer.make_param(torch.empty(layer.output_size, layer.input_size, dtype=layer.params_dtype),
                                        output_dim=0, input_dim=1)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)
