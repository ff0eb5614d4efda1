"""Gated activations over a fused [gate | up] tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import use_triton
from tokenmill.layers.quant.base import wants_fp8_input
from tokenmill.layers.quant.fp8 import Fp8Activation


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor, consumer: nn.Module | None = None) -> torch.Tensor | Fp8Activation:
        """[..., 2 * d] -> [..., d]. consumer: the linear layer that alone reads the output; where its method
        wants FP8 input (fp8_input_wanted), the output comes quantized from this kernel (Fp8Activation)."""
        if use_triton(x):
            if wants_fp8_input(consumer, x):
                from tokenmill.kernels.activation import silu_and_mul_fp8

                return Fp8Activation(*silu_and_mul_fp8(x), x.dtype)
            from tokenmill.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: silu's output is a fresh tensor, one allocation fewer


class GeluAndMul(nn.Module):
    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor, consumer: nn.Module | None = None) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        """consumer: as SiluAndMul's; GELU has no quantizing kernel, so its output stays 16-bit."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


class ActivationAndMul(nn.Module):
    """act(gate) * up with transformers' own activation module, for the activations without a kernel here."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor, consumer: nn.Module | None = None) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        """consumer: as SiluAndMul's; the output stays unquantized."""
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


def get_gated_activation(hidden_act: str) -> nn.Module:
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    if hidden_act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new"):
        return GeluAndMul("tanh")
    if hidden_act == "gelu":
        return GeluAndMul("none")
    # Any other activation transformers names (gelu_fast, quick_gelu, relu, ...): its own function, unfused.
    from transformers.activations import ACT2FN

    if hidden_act not in ACT2FN:
        raise ValueError(f"unsupported activation {hidden_act!r}")
    return ActivationAndMul(ACT2FN[hidden_act])
