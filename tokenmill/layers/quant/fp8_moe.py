"""FP8 (e4m3) mixture-of-experts weights: layers.moe.FusedMoE's w13 / w2 stored in e4m3 with float32 scales.

Two forms, as the dense Fp8LinearMethod has:
- block (an FP8 checkpoint with `weight_block_size`, DeepSeek-V3 and Qwen3-MoE FP8 releases): w13_weight
  e4m3 [E, 2I, H] with w13_weight_scale_inv [E, 2I / b, H / b], w2_weight [E, H, I] with w2_weight_scale_inv
  [E, H / b, I / b], loaded from each expert's gate/up/down `weight` and `weight_scale_inv`. Tensor
  parallelism slices every expert's intermediate features at block granularity: a split that cuts a block
  is refused.
- channel: one scale per output row, w13_weight_scale_inv [E, 2I, 1] and w2_weight_scale_inv [E, H, 1]. From a
  per-channel FP8 checkpoint (compressed-tensors `strategy: channel`, as llm-compressor's FP8-dynamic releases
  store experts: each projection's `weight_scale` [rows, 1]; a tensor-parallel rank takes its gate/up rows'
  scales and all of down's), or per-tensor (one `weight_scale` per projection, given to each of its rows), or
  `--quantization fp8` on a 16-bit checkpoint: the 16-bit experts load as usual, then each expert is quantized.

The CPU path dequantizes one expert at a time inside the expert loop and computes the dense FP8 CPU path's
W8A8 math (fp8_linear_torch: activations quantized per token, or per token and b-wide group with block
scales), so the dense FP8 tests' bounds hold. The Triton kernel (kernels.fused_moe) is W8A16: activations
stay 16-bit and the weight tiles are widened in registers, each K-block's partial sums scaled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.layers.quant.fp8 import FP8, FP8_MAX, MIN_SCALE

if TYPE_CHECKING:
    from tokenmill.layers.moe import FusedMoE
    from tokenmill.layers.quant.fp8 import Fp8Config


class Fp8MoEMethod:
    """How one FusedMoE holds, loads and runs e4m3 experts (see the module docstring)."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    @property
    def block(self) -> int:
        """The scales' square block, 0 for one scale per output row."""
        return self.config.block if self.config.checkpoint_fp8 else 0

    @property
    def scale_part(self) -> str:
        """The checkpoint's name of each projection's scale tensor."""
        return self.config.block_scale_name if self.block else "weight_scale"

    def create_weights(self, layer: FusedMoE) -> None:
        if not self.config.checkpoint_fp8:  # online: 16-bit weights load, process_weights_after_loading quantizes
            return
        b = self.block
        experts, two_inter, hidden = layer.w13_weight.shape
        inter = two_inter // 2
        if not b:  # one scale per output row (per-tensor checkpoints fill each projection's rows with theirs)
            layer.w13_weight = layer._param(torch.empty(experts, two_inter, hidden, dtype=FP8))
            layer.w2_weight = layer._param(torch.empty(experts, hidden, inter, dtype=FP8))
            f32 = torch.float32
            layer.w13_weight_scale_inv = layer._param(torch.empty(experts, two_inter, 1, dtype=f32), self.scale_part)
            layer.w2_weight_scale_inv = layer._param(torch.empty(experts, hidden, 1, dtype=f32), self.scale_part)
            return
        if inter % b or hidden % b:
            cut = (f"; tensor-parallel size {layer.tp_size} cuts a block (use a smaller tensor-parallel size, or "
                   "enable_expert_parallel, which keeps experts whole)" if layer.tp_size > 1 and
                   not layer.expert_parallel and not hidden % b else "")
            raise ValueError(f"fp8 experts with {b}x{b} scale blocks: the intermediate size per rank ({inter}) "
                             f"and the hidden size ({hidden}) must be multiples of {b}{cut}")
        layer.w13_weight = layer._param(torch.empty(experts, two_inter, hidden, dtype=FP8))
        layer.w2_weight = layer._param(torch.empty(experts, hidden, inter, dtype=FP8))
        # [E, 2I / b, H / b] and [E, H / b, I / b]: the [gate | up] block rows, as the weight's rows
        f32 = torch.float32
        layer.w13_weight_scale_inv = layer._param(torch.empty(experts, two_inter // b, hidden // b, dtype=f32),
                                                 self.scale_part)
        layer.w2_weight_scale_inv = layer._param(torch.empty(experts, hidden // b, inter // b, dtype=f32),
                                                self.scale_part)

    def checkpoint_parts(self) -> tuple[str, ...]:
        """The tensors of each expert projection the checkpoint must provide."""
        return ("weight", self.scale_part) if self.config.checkpoint_fp8 else ("weight",)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        if self.config.checkpoint_fp8:
            return
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name).data  # [E, N, K] 16-bit
            q = torch.empty(weight.shape, dtype=FP8, device=weight.device)
            scales = torch.empty(weight.shape[0], weight.shape[1], 1, dtype=torch.float32,
                                 device=weight.device)  # [E, N, 1]
            for e in range(weight.shape[0]):  # one expert at a time: a float32 copy of one, not all
                w = weight[e].float()
                scales[e, :, 0] = (w.abs().amax(1) / FP8_MAX).clamp(min=MIN_SCALE)
                q[e] = (w / scales[e]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            setattr(layer, name, nn.Parameter(q, requires_grad=False))
            setattr(layer, f"{name}_scale_inv", nn.Parameter(scales, requires_grad=False))

    def apply(self, layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, kernel) -> torch.Tensor:
        """hidden_states [T, H] -> [T, H] (this rank's part). kernel: kernels.fused_moe.fused_experts or None."""
        w13_scale, w2_scale = layer.w13_weight_scale_inv, layer.w2_weight_scale_inv
        if kernel is not None:  # any activation dtype: the torch path reads counts on the host (no CUDA graphs)
            return kernel(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                          skip_negative_ids=layer.expert_parallel, w13_scale=w13_scale, w2_scale=w2_scale,
                          scale_block=self.block)
        from tokenmill.layers.moe_routing import fused_experts_torch

        return fused_experts_torch(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                   w13_scale=w13_scale, w2_scale=w2_scale, scale_block=self.block)
