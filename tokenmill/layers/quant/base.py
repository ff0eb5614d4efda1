"""The quantization seam: a linear layer asks its method to create, load and apply its weights.

A `QuantConfig` is read once from the checkpoint's `quantization_config` (or `--quantization`) and gives
each linear layer, by its module name, the `QuantMethod` that owns the layer's weight tensors: which
parameters exist (with the dimensions the layer's loader shards them on), what happens to them once the
checkpoint is loaded (repacking, online quantization), and the matmul. Models never branch on it.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from tokenmill.layers.linear import LinearBase


class QuantMethod(ABC):
    """How one linear layer holds, loads and multiplies its weights."""

    @abstractmethod
    def create_weights(self, layer: LinearBase) -> None:
        """Register the layer's weight parameters through `layer.make_param` (the bias is the layer's)."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:  # noqa: B027 - optional hook
        """Runs once every checkpoint tensor is in place: quantize, repack, fold scales."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size] (this rank's shard)."""

    def fp8_input_wanted(self, layer: LinearBase, x: torch.Tensor) -> bool:
        """Whether apply() takes an input of x's rows, dtype and device quantized already by the kernel that
        produces it (layers.quant.fp8.Fp8Activation: RMSNorm's and SiluAndMul's `consumer`). FP8 methods only."""
        return False


def wants_fp8_input(consumer: LinearBase | None, x: torch.Tensor) -> bool:
    """Whether the producer of `consumer`'s input (an RMSNorm, a SiLU-and-mul, computing from x) should hand it
    quantized (fp8_input_wanted); False without a consumer."""
    return consumer is not None and consumer.quant_method.fp8_input_wanted(consumer, x)


class QuantConfig(ABC):
    """One checkpoint format (or online method): which layers it quantizes and with what."""

    name: ClassVar[str]

    def __init__(self, ignored: list[str] | None = None) -> None:
        self.ignored = list(ignored or [])

    @classmethod
    @abstractmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> QuantConfig | None:
        """Parse a checkpoint's `quantization_config`; raise ValueError naming what is not supported. None: the
        checkpoint quantizes nothing (loaded dense)."""

    @classmethod
    def online(cls) -> QuantConfig:
        """The method applied to an unquantized checkpoint (`--quantization NAME` without one)."""
        raise ValueError(f"quantization {cls.name!r} loads checkpoints quantized in that format (their config.json "
                         f"names it), and this model is not one: leave --quantization out, or pass fp8 to quantize "
                         f"it at load")

    def describe(self) -> str:
        """What the weights become, for the start-up log."""
        return self.name

    def quantizes_checkpoint_tensors(self) -> bool:
        """Whether the checkpoint stores the weights quantized (False: an online method quantizes dense ones)."""
        return True

    @abstractmethod
    def linear_method(self, layer_name: str, part_names: list[str] | None = None) -> QuantMethod:
        """The method of the linear layer called `layer_name` (not ignored); `part_names`: the checkpoint
        modules it holds, as in is_ignored (None: itself)."""

    def moe_method(self, layer_name: str) -> Any:
        """The method of the FusedMoE experts called `layer_name` (not ignored); None: this format has none."""
        return None

    def is_ignored(self, layer_name: str, part_names: list[str]) -> bool:
        """Whether a layer stays unquantized. `part_names` are the checkpoint modules a fused layer
        holds (q/k/v_proj for qkv_proj): all or none of them may be ignored."""
        ignored = [matches_any(name, self.ignored) for name in part_names]
        if any(ignored) and not all(ignored):
            raise ValueError(f"{layer_name}: the checkpoint quantizes only some of {part_names}, which one "
                             "fused matmul holds; this layout is not supported")
        return all(ignored)


def matches_any(module_name: str, patterns: list[str]) -> bool:
    """Exclusion lists name modules whole (`lm_head`), by suffix or component (`mlp.gate`, `down_proj`,
    as `modules_to_not_convert` does), or by regular expression (`re:.*q_proj`, compressed-tensors), which
    matches from the name's start, as compressed-tensors (and vLLM) match it: `re:.*layers.1.` takes all of
    layer 1, and a pattern ends where it is written with `$`."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module_name):
                return True
        elif (module_name == pattern or module_name.endswith("." + pattern)
              or f".{pattern}." in f".{module_name}."):
            return True
    return False
