"""RMSNorm with an optional fused residual add (returns the normalized output and the new residual)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import use_triton
from tokenmill.layers import cpu_norm
from tokenmill.layers.quant.base import wants_fp8_input
from tokenmill.layers.quant.fp8 import Fp8Activation


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        """offset=1.0 gives Gemma's variant, which scales by (1 + weight)."""
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            # Gemma multiplies in float32 before casting back.
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, consumer: nn.Module | None = None
    ) -> torch.Tensor | Fp8Activation | tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        """consumer: the linear layer that alone reads the normed output; where its method wants FP8 input
        (fp8_input_wanted), the output comes quantized from this kernel (Fp8Activation)."""
        weight = self.weight  # a parameter: each read goes through nn.Module.__getattr__
        if x.is_cpu:
            if cpu_norm.rms_norm_applies(x, weight, residual):
                return cpu_norm.rms_norm_cpu(x, weight, self.eps, self.offset, residual)
        elif use_triton(x):
            if wants_fp8_input(consumer, x):
                from tokenmill.kernels.rms_norm import rms_norm_fp8

                q, scale, residual_out = rms_norm_fp8(x, weight, self.eps, self.offset, residual)
                out = Fp8Activation(q, scale, x.dtype)
                return out if residual is None else (out, residual_out)
            from tokenmill.kernels.rms_norm import rms_norm

            return rms_norm(x, weight, self.eps, self.offset, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
