"""FP8 (e4m3) weights with float32 scales: online from a 16-bit checkpoint, or as an FP8 checkpoint ships them.

Every layout ends in one of two forms once loaded (`process_weights_after_loading`):
- channel: `weight` e4m3 [n, k] and `weight_scale` [n], one scale per output channel. Online quantization
  computes these; per-tensor checkpoint scales (one per fused part) spread over their channels, which is
  the same product. Optional `input_scale` (a checkpoint's static activation scale).
- block: `weight` e4m3 and `weight_scale` [n / b, k / b], one scale per b x b tile (b = 128 in the
  DeepSeek-V3 and Qwen3 FP8 releases, whose files call it `weight_scale_inv`); activations are quantized
  per token and b-wide group.

On the GPU decode batches (<= 16 rows) keep 16-bit activations and widen the weight in registers (half the
bytes of bf16, nothing lost on the activations' side); larger batches quantize activations per token (or per
token and group) and multiply in fp8; with per-channel weight scales that per-token quantization runs in the
kernel producing the layer's input where that is an RMSNorm or SiLU-and-mul (`Fp8Activation`,
`fp8_input_wanted`). The CPU computes the same math in float32 (the reference of the kernel tests, and slow:
on the CPU FP8 is for checking, not for speed).
Mixture-of-experts weights in FP8 (block checkpoints, online per row): layers.quant.fp8_moe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tokenmill.kernels import use_triton
from tokenmill.layers.quant.base import QuantConfig, QuantMethod

if TYPE_CHECKING:
    from tokenmill.layers.linear import LinearBase

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12 / FP8_MAX  # an all-zero row gets a tiny scale, not a division by zero
SKINNY_MIN_WEIGHT = 4096  # both weight dims: below it cuBLASLt wins at decode (kernels.skinny_gemm)


# -- pure torch: the CPU path and the kernels' reference ------------------------------------------------
def quantize_fp8_torch(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (e4m3 [m, k], float32 scales [m, k / group_size]); group_size None: one scale per row."""
    m, k = x.shape
    group = k if group_size is None else group_size
    if k % group:
        raise ValueError(f"{k} features do not split into groups of {group}")
    groups = x.float().reshape(m, k // group, group)
    scales = (groups.abs().amax(-1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (groups / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(m, k), scales


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, scale_block: int = 0) -> torch.Tensor:
    """The float32 values of an e4m3 tensor: scale [n] per row, or [n / b, k / b] per b x b tile."""
    w = weight.float()
    if not scale_block:
        return w * scale.float().reshape(-1, 1)
    tiles = scale.float().repeat_interleave(scale_block, 0).repeat_interleave(scale_block, 1)
    return w * tiles[: w.shape[0], : w.shape[1]]


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_block: int,
                     input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                     weight_only: bool = False) -> torch.Tensor:
    """W8A8 in float32: activations quantized as the GPU's prefill path quantizes them, then dequantized
    (`weight_only`: W8A16, the activations as they are)."""
    if weight_only:
        x_deq = x.float()
    elif scale_block:
        q, s = quantize_fp8_torch(x, scale_block)
        x_deq = (q.float().reshape(x.shape[0], -1, scale_block) * s[..., None]).reshape(x.shape)
    elif input_scale is not None:
        x_deq = quantize_fp8_static(x, input_scale).float() * input_scale
    else:
        q, s = quantize_fp8_torch(x)
        x_deq = q.float() * s
    y = x_deq @ dequantize_fp8(weight, scale, scale_block).T
    return (y if bias is None else y + bias.float()).to(x.dtype)


class Fp8Activation(NamedTuple):
    """A linear layer's input already quantized per token by the kernel that produced it (kernels.rms_norm's
    rms_norm_fp8, kernels.activation's silu_and_mul_fp8), bit for bit as apply() would quantize it: only for
    a layer whose method's `fp8_input_wanted` said so, which then skips its own pass over the activations."""

    q: torch.Tensor  # e4m3 [..., k]
    scale: torch.Tensor  # float32 [rows, 1], one per token
    dtype: torch.dtype  # the 16-bit activations' dtype, the output's


# -- the method -------------------------------------------------------------------------------------
class Fp8LinearMethod(QuantMethod):
    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    def create_weights(self, layer: LinearBase) -> None:
        cfg = self.config
        out, inp, parts = layer.output_size, layer.input_size, len(layer.partition_sizes)
        if not cfg.checkpoint_fp8:  # online: the 16-bit weight loads as usual, then is quantized
            layer.weight = layer.make_param(torch.empty(out, inp, dtype=layer.params_dtype), output_dim=0, input_dim=1)
            return
        layer.weight = layer.make_param(torch.empty(out, inp, dtype=FP8), output_dim=0, input_dim=1)
        if cfg.block:
            b = cfg.block
            scale = layer.make_param(torch.empty(-(-out // b), -(-inp // b), dtype=torch.float32), output_dim=0,
                                     input_dim=1, output_block=b, input_block=b)
            setattr(layer, cfg.block_scale_name, scale)
        elif cfg.channel_scales:
            layer.weight_scale = layer.make_param(torch.empty(out, 1, dtype=torch.float32), output_dim=0)
        else:
            layer.weight_scale = layer.make_param(torch.empty(parts, dtype=torch.float32), per_partition=True)
        if cfg.static_activations:
            layer.input_scale = layer.make_param(torch.empty(parts, dtype=torch.float32), per_partition=True)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        cfg = self.config
        if cfg.block:
            layer.scale_block = cfg.block
            if cfg.block_scale_name != "weight_scale":
                layer.weight_scale = getattr(layer, cfg.block_scale_name)
                delattr(layer, cfg.block_scale_name)
            return
        layer.scale_block = 0
        if not cfg.checkpoint_fp8:
            w = layer.weight.data.float()
            scale = (w.abs().amax(1) / FP8_MAX).clamp(min=MIN_SCALE)
            weight = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        else:
            weight, scale = layer.weight.data, layer.weight_scale.data.reshape(-1)
            if not cfg.channel_scales:  # one scale per fused part, spread over its channels
                sizes = torch.tensor(layer.partition_sizes, device=scale.device)
                scale = scale.repeat_interleave(sizes)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale.float().contiguous(), requires_grad=False)
        if cfg.static_activations:  # one activation feeds every fused part: the largest scale covers all
            layer.input_scale = torch.nn.Parameter(layer.input_scale.data.max().reshape(1), requires_grad=False)

    def fp8_input_wanted(self, layer: LinearBase, x: torch.Tensor) -> bool:
        """Whether apply() would quantize an input of x's rows, dtype and device per token for cuBLASLt (the
        16-bit-input kernels take too few rows; per-channel weight scales; dynamic activation scales), with rows
        narrow enough for the producing kernel to quantize (kernels.fp8_quant.FUSED_MAX_FEATURES)."""
        if not use_triton(x) or x.dtype not in (torch.bfloat16, torch.float16) or self.config.weight_only:
            return False
        if layer.scale_block or getattr(layer, "input_scale", None) is not None:
            return False
        from tokenmill.kernels.fp8_gemm import SKINNY_MAX_ROWS
        from tokenmill.kernels.fp8_quant import FUSED_MAX_FEATURES

        # As _fp8_linear_cuda dispatches: the GEMV and skinny kernels keep up to 16 rows in 16 bits, large weights only.
        max_16bit_rows = SKINNY_MAX_ROWS if min(layer.weight.shape) >= SKINNY_MIN_WEIGHT else 0
        return x.shape[:-1].numel() > max_16bit_rows and layer.input_size <= FUSED_MAX_FEATURES

    def apply(self, layer: LinearBase, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, Fp8Activation):  # quantized already, as fp8_input_wanted asked
            q = x.q.reshape(-1, x.q.shape[-1])
            y = _scaled_mm_rowwise(q, x.scale, layer.weight, layer.weight_scale, bias, x.dtype)
            return y.reshape(*x.q.shape[:-1], y.shape[-1])
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        block, scale = layer.scale_block, layer.weight_scale
        input_scale = getattr(layer, "input_scale", None)
        weight_only = self.config.weight_only
        if not use_triton(x2) or x2.dtype not in (torch.bfloat16, torch.float16):
            y = fp8_linear_torch(x2, layer.weight, scale, block, input_scale, bias, weight_only)
        else:
            y = _fp8_linear_cuda(x2, layer.weight, scale, block, input_scale, bias, weight_only)
        return y.reshape(*shape[:-1], y.shape[-1])


def _fp8_linear_cuda(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int,
                     input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                     weight_only: bool = False) -> torch.Tensor:
    from tokenmill.kernels.fp8_gemm import (
        GEMV_MAX_ROWS,
        SKINNY_MAX_ROWS,
        block_fp8_gemm,
        gemv_fp8,
        quantize_fp8,
        skinny_fp8_gemm,
    )

    rows = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    # One to four rows with per-channel scales: the CUDA-core GEMV reads the weight faster than a tensor-core
    # tile that is mostly padding (benchmarks/fp8_gemm.py).
    if rows <= GEMV_MAX_ROWS and not block and min(weight.shape) >= SKINNY_MIN_WEIGHT:
        y = gemv_fp8(x, weight, scale)
        return y if bias is None else y + bias
    if rows <= SKINNY_MAX_ROWS and (block or min(weight.shape) >= SKINNY_MIN_WEIGHT):
        y = skinny_fp8_gemm(x, weight, scale, block)
        return y if bias is None else y + bias
    if weight_only:  # W8A16 past the 16-bit-input kernels' rows: the weight widened, the activations as they are
        return torch.nn.functional.linear(x, dequantize_fp8(weight, scale, block).to(x.dtype), bias)
    if block:
        q, q_scale = quantize_fp8(x, block)
        y = block_fp8_gemm(q, q_scale, weight, scale, block, x.dtype)
        return y if bias is None else y + bias
    if input_scale is not None:
        q, q_scale = quantize_fp8_static(x, input_scale), input_scale.expand(rows, 1).contiguous()
    else:
        q, q_scale = quantize_fp8(x)
    return _scaled_mm_rowwise(q, q_scale, weight, scale, bias, x.dtype)


def _scaled_mm_rowwise(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    # cuBLASLt with row-wise scales: one per token (activations) and one per output channel (weight). Fast
    # accumulation (no promotion of the MMA's partial sums to float32 every few k-steps) is 1.11-1.12x faster
    # at prefill sizes on the H200 for 1.3-2x the accumulation error, which stays far below e4m3's own
    # rounding (benchmarks/fp8_prefill_gemm.py measures both).
    return torch._scaled_mm(q, weight.t(), scale_a=q_scale, scale_b=scale.view(1, -1), bias=bias,
                            out_dtype=out_dtype, use_fast_accum=True)


# -- the formats --------------------------------------------------------------------------------------
class Fp8Config(QuantConfig):
    """`quant_method: "fp8"` (Hugging Face's FP8 format with `weight_block_size`, and the per-tensor one with
    `activation_scheme`), or `--quantization fp8` on a 16-bit checkpoint."""

    name = "fp8"

    def __init__(self, checkpoint_fp8: bool, block: int = 0, channel_scales: bool = False,
                 static_activations: bool = False, ignored: list[str] | None = None,
                 block_scale_name: str = "weight_scale_inv", weight_only: bool = False) -> None:
        super().__init__(ignored)
        self.checkpoint_fp8, self.block, self.block_scale_name = checkpoint_fp8, block, block_scale_name
        self.channel_scales, self.static_activations = channel_scales, static_activations
        self.weight_only = weight_only
        """W8A16: the checkpoint leaves the activations unquantized (compressed-tensors without input_activations)."""

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> Fp8Config:
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 checkpoint: activation_scheme {scheme!r} is not 'dynamic' or 'static'")
        block = block_size_of(config.get("weight_block_size"), "fp8 checkpoint weight_block_size")
        if block and scheme == "static":
            raise ValueError("fp8 checkpoint: block-wise weights with static activation scales are not supported")
        ignored = config.get("modules_to_not_convert") or config.get("ignored_layers") or []
        return cls(checkpoint_fp8=True, block=block, static_activations=scheme == "static", ignored=ignored)

    @classmethod
    def online(cls) -> Fp8Config:
        return cls(checkpoint_fp8=False)

    def linear_method(self, layer_name: str, part_names: list[str] | None = None) -> QuantMethod:
        return Fp8LinearMethod(self)

    def moe_method(self, layer_name: str) -> Any:
        """FP8 checkpoints (block, channel or tensor scales) and online quantization (per row); static activation
        scales have no MoE path (the experts' kernel keeps activations 16-bit)."""
        if self.static_activations:
            return None
        from tokenmill.layers.quant.fp8_moe import Fp8MoEMethod

        return Fp8MoEMethod(self)

    def quantizes_checkpoint_tensors(self) -> bool:
        return self.checkpoint_fp8

    def describe(self) -> str:
        weights = (f"{self.block}x{self.block} block scales" if self.block else "per-channel scales"
                   if self.channel_scales or not self.checkpoint_fp8 else "per-tensor scales")
        source = "from the checkpoint" if self.checkpoint_fp8 else "quantized at load"
        activations = ("16-bit activations" if self.weight_only else "static activation scales"
                       if self.static_activations else "dynamic activation scales")
        return f"fp8 e4m3 weights ({source}, {weights}), {activations}"


def block_size_of(value: Any, what: str) -> int:
    """A [b, b] weight block as one int (0: none); other shapes are refused."""
    if value is None:
        return 0
    if not (isinstance(value, list | tuple) and len(value) == 2 and value[0] == value[1] and int(value[0]) > 0):
        raise ValueError(f"{what} {value!r}: only square blocks such as [128, 128] are supported")
    return int(value[0])
