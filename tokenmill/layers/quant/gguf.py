"""GGUF linear weights kept in their GGML block types (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), multiplied in place.

The loader (model.loader.iter_gguf_weights) hands each linear layer the file's raw rows: a uint8 tensor
[out_features, row_bytes] tagged with its GGML type (`ggml_type`), already row-permuted where llama.cpp's
converter permuted q/k for its rotary layout (a permutation of whole output rows). Embeddings, the LM head
(tied to the embedding in SmolLM2) and norms stay dense: one lookup table serves both, and the norms are
F32 in every GGUF. The LM head's table also keeps its blocks, which layers.cpu_lm_head reads for decode rows.

A fused layer's parts (q/k/v, gate/up) may come in different types (llama.cpp's mixed "_M" recipes give v
and down more bits): after loading, runs of consecutive parts of one type are concatenated into one blob,
and each blob is one GEMM writing its slice of the output. A part that arrives dense (an F32/F16 tensor)
is a dense run of its own.

On CUDA (quantization="gguf"), Q4_0, Q4_1, Q8_0 and Q4_K runs go into the integer-weight layout of the int4/int8
kernels (layers.quant.gguf_int), the other types dequantized at load.

On the CPU the GEMM is layers.quant.gguf_cpu's C kernel: float32 activations in float32, bfloat16 ones
(Q4_0, Q4_1, Q8_0 on CPUs with AVX512_BF16) in bfloat16 products with float32 sums. Without a compiler, or
on a device without a quantized GEMM (the GPU: the loader does not pick this method there), the weights are
dequantized once and multiplied densely: the same numbers, the dense path's speed.

In bfloat16 on the CPU the kernel wins only for the few rows of a decode step (memory-bound: 5-6 bits a
weight against 16), and oneDNN's bfloat16 GEMM wins from a handful of rows on. So a small model
(GGUFConfig(dense_copy=True), chosen by the loader under DENSE_COPY_MAX_BYTES) keeps both forms of each
layer: its blocks, multiplied by the kernel's float32 path for up to FEW_ROWS rows (the bfloat16 activations
converted exactly, the float32 sums rounded to bfloat16 once), and a dense copy, the dequantized model's bfloat16
weights prepacked (layers.cpu_gemm: AMX tiles, AVX-512 panels or oneDNN's layout), for more rows. The two differ by
the bfloat16 rounding of the weights and by the sums' order. In float32 the same holds at twice the bytes (the
blocks win up to FEW_ROWS_FLOAT32 rows): a small model keeps both forms there too, the two differing by the sums'
order only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.cpu_amx_gemm import amx_q4_applies, pack_amx_q4
from tokenmill.layers.cpu_gemm import pack_weight, packed_linear
from tokenmill.layers.quant.base import QuantConfig, QuantMethod
from tokenmill.layers.quant.gguf_cpu import (
    KERNEL_TYPES,
    bf16_kernel_types,
    gguf_dequantize_bf16_cpu,
    gguf_dequantize_cpu,
    gguf_gemm_bf16_cpu,
    gguf_gemm_cpu,
    load_kernel,
)
from tokenmill.layers.quant.gguf_int import apply_int_runs, hold_int_runs, runs_by_type
from tokenmill.layers.quant.unquantized import dense_linear

if TYPE_CHECKING:
    from tokenmill.layers.linear import LinearBase

logger = logging.getLogger(__name__)

GGML_TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
QUANTIZED_TYPES = tuple(GGML_TYPE_NAMES)  # what the loader keeps quantized
DENSE = -1  # a part's "type" when it arrived as a float tensor

# From this many activation rows (prefill) the weight is dequantized into a dense tile for torch's GEMM,
# whose bfloat16 rate (AMX where present) is several times the kernel's float32 rate, and in bfloat16
# still 1.3-1.7x the kernel's AMX rate at 2048 rows (BENCHMARKS.md). Below it, a row's result does not depend
# on the row count (the kernel's paths are batch-invariant); across it the rounding differs (oneDNN's sums
# against the kernel's), so a prompt of 128+ rows computed whole and its last rows recomputed after a
# prefix-cache hit may round differently. Serving prefills from the kernel too would remove that, measured
# at 0.75x the dequantized engine's throughput on 64 prompts of 128 tokens (BENCHMARKS.md).
DENSE_GEMM_ROWS = 128

# With a dense copy (small models on the CPU), up to this many rows take the blocks in bfloat16, more the copy.
# Per default-model layer on one core of the AMD development machine (AVX512_BF16, no AMX), the blocks through
# the float32 path against oneDNN's bfloat16 at 1 / 2 / 4 / 8 rows: 182 / 214 / 316 / 523 us against
# 283 / 316 / 302 / 377 us (the kernel's bfloat16 path: 230 / 388 / 299 / 441). End to end, blocks against
# copy at batch 2 / 4 / 6 / 8: 1.23x / 1.11x / 0.90x / 0.93x. The kernel itself leaves its register path for
# tiles above 8 rows (SMALL_M in gguf_cpu's source), past the crossing.
FEW_ROWS = 4
FEW_ROWS_FLOAT32 = 5
"""The same in float32, whose dense copy reads twice bfloat16's bytes: the default model end to end, blocks against
the copy through layers.cpu_panel_gemm at batch 4 / 5 / 6 / 8 / 12 (same machine, float32): 1.18x / 1.21x / 0.96x /
0.92x / 0.83x (against oneDNN's copy the crossing was past 8). In bfloat16 the panel kernel moved it to ~4: 1.34x /
1.25x / 1.09x / 0.90-1.04x / 0.84x at 1 / 2 / 3 / 4 / 8."""


def few_rows(dtype: torch.dtype) -> int:
    """Up to how many rows a layer with a dense copy takes its blocks."""
    return FEW_ROWS_FLOAT32 if dtype == torch.float32 else FEW_ROWS
# The most bytes of dense linear weights (in the model's dtype) for which the loader keeps the dense copy
# beside the blocks: SmolLM2-135M's are 212 MB in bfloat16, a 360M model's ~630 MB. Above it the copy's
# memory outweighs the batch-1 gain for most users, and the model is dequantized at load as before.
DENSE_COPY_MAX_BYTES = 1_000_000_000


def uses_int_layout(device: torch.device) -> bool:
    """Where kept GGUF blocks go into the integer-weight layout (layers.quant.gguf_int): CUDA, for its int4/int8
    kernels; the CPU has its own GGML kernel."""
    return device.type == "cuda"


def tag_ggml(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Mark a [rows, row_bytes] uint8 tensor as GGUF blocks of `ggml_type` (what the loader yields)."""
    raw.ggml_type = int(ggml_type)  # type: ignore[attr-defined]
    return raw


def block_geometry(ggml_type: int) -> tuple[int, int]:
    """(weights per block, bytes per block), as gguf defines them."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def dequantize_gguf(raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """[n, row_bytes] uint8 -> [n, k] float32: the C kernel's decoding, else gguf's own (numpy)."""
    if load_kernel() is not None and ggml_type in KERNEL_TYPES:
        return gguf_dequantize_cpu(raw.cpu().contiguous(), ggml_type, k)
    from gguf import GGMLQuantizationType, dequantize

    values = dequantize(raw.cpu().numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(raw.shape[0], k)


class GGUFLinearMethod(QuantMethod):
    def __init__(self, dense_copy: bool = False) -> None:
        self.dense_copy = dense_copy  # also keep the dense weight (packed for oneDNN) for steps of many rows

    def create_weights(self, layer: LinearBase) -> None:
        # A placeholder the checkpoint's tensors are "loaded" into: their bytes go to layer.gguf_parts,
        # since a part's size depends on its type, known only when it arrives.
        layer.weight = layer.make_param(torch.empty(0, dtype=torch.uint8))
        layer.weight.weight_loader = lambda param, loaded, shard_id=None: self._load(layer, loaded, shard_id)
        layer.gguf_parts = {}

    def _load(self, layer: LinearBase, loaded: torch.Tensor, shard_id: Any) -> None:
        ggml_type = getattr(loaded, "ggml_type", DENSE)
        if shard_id is None and len(layer.partition_sizes) > 1:  # one tensor holding every part (phi3's qkv)
            for sid, part in zip(layer.shard_ids(), loaded.split(layer.checkpoint_partition_sizes(), dim=0)):
                self._load(layer, tag_ggml(part, ggml_type) if ggml_type != DENSE else part, sid)
            return
        index, _, size, rank = layer.partition_slice(shard_id)
        if layer.tp_dim == 0:
            loaded = loaded.narrow(0, rank * size, size)
        if layer.tp_dim == 1 and layer.tp_size > 1:  # input features split: whole blocks per rank only
            block, block_bytes = block_geometry(ggml_type) if ggml_type != DENSE else (1, 1)
            if layer.input_size % block:
                raise ValueError(f"GGUF {GGML_TYPE_NAMES.get(ggml_type)}: {layer.input_size} input features per "
                                 f"rank do not split into whole blocks of {block}; use fewer ranks")
            width = layer.input_size // block * block_bytes
            loaded = loaded.narrow(1, layer.tp_rank * width, width)
        if ggml_type == DENSE:
            expected = (size, layer.input_size)
        else:
            block, block_bytes = block_geometry(ggml_type)
            expected = (size, layer.input_size // block * block_bytes)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"GGUF tensor of shape {tuple(loaded.shape)} for a part of {expected}")
        layer.gguf_parts[index] = (ggml_type, loaded.contiguous())

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        parts = [layer.gguf_parts.get(i) for i in range(len(layer.partition_sizes))]
        if any(p is None for p in parts):
            raise ValueError(f"GGUF: some parts of a fused {type(layer).__name__} are missing from the file")
        del layer.gguf_parts, layer.weight
        device = torch.get_default_device()
        if uses_int_layout(device):  # the integer-weight kernels where the type has a 4/8-bit form, else dense
            hold_int_runs(layer, runs_by_type(parts), lambda t, raw: (
                raw if t == DENSE else dequantize_gguf(raw, t, layer.input_size)).to(layer.params_dtype))
            layer.gguf_runs = None
            return
        if device.type != "cpu" or load_kernel() is None:  # dequantize once: the dense path
            dense = [raw.float() if t == DENSE else dequantize_gguf(raw, t, layer.input_size) for t, raw in parts]
            layer.weight = nn.Parameter(torch.cat(dense).to(device, layer.params_dtype), requires_grad=False)
            layer.gguf_runs = None
            return
        runs = runs_by_type(parts)
        layer.gguf_runs = []  # (type, first output feature, features)
        offset = 0
        for i, (ggml_type, pieces) in enumerate(runs):
            blob = torch.cat(pieces)
            if ggml_type == DENSE:
                blob = blob.to(layer.params_dtype)
            elif ggml_type not in KERNEL_TYPES:  # the loader keeps only kernel types quantized; be safe anyway
                blob = dequantize_gguf(blob, ggml_type, layer.input_size).to(layer.params_dtype)
                ggml_type = DENSE
            layer.gguf_runs.append((ggml_type, offset, blob.shape[0]))
            offset += blob.shape[0]
            setattr(layer, f"qweight{i}", nn.Parameter(blob, requires_grad=False))
        # What apply() reads per call, gathered once (the f-string getattr per run and call showed in batch-1
        # profiles): the layer's own Parameter objects, which in-place loads and CPU casts keep.
        layer.gguf_run_weights = tuple((t, offset, size, getattr(layer, f"qweight{i}"))
                                       for i, (t, offset, size) in enumerate(layer.gguf_runs))
        # (type, weight) of a layer that is one run of a kernel type (every layer of the default model): apply's
        # short path for a decode's few rows.
        first = layer.gguf_run_weights[0]
        layer.gguf_one_run = (first[0], first[3]) if len(runs) == 1 and first[0] != DENSE else None
        # The same values the dequantized model holds, packed for layers.cpu_gemm (None where it cannot take them).
        layer.dense_copy = None
        one_run = layer.gguf_one_run
        if (self.dense_copy and layer.params_dtype == torch.bfloat16 and one_run is not None
                and amx_q4_applies(one_run[1], one_run[0], layer.input_size)):
            # With AMX, 4-bit blocks repacked for the AMX kernel stand in for the copy: the same bfloat16 values
            # decoded in L1/L2, a third of the copy's bytes from memory (layers.cpu_amx_gemm)
            layer.dense_copy = pack_amx_q4(one_run[1], one_run[0], layer.input_size)
        elif self.dense_copy:
            dense = [self._dense_run(layer, i, layer.params_dtype) for i in range(len(runs))]
            layer.dense_copy = pack_weight(dense[0] if len(dense) == 1 else torch.cat(dense))

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.gguf_runs is None:
            if hasattr(layer, "gguf_int_runs"):  # on CUDA (not the CPU's hot path)
                return apply_int_runs(layer, x, bias)
            return dense_linear(x, layer.weight, bias)
        one_run = layer.gguf_one_run
        if (one_run is not None and x.dim() == 2 and x.shape[0] <= FEW_ROWS and x.is_contiguous()
                and (x.dtype == torch.float32 or self._float_rows(layer, x, one_run[0]))):
            # What the kernel branch below computes for one run, with less Python: at batch 1 it weighs.
            y = gguf_gemm_cpu(x if x.dtype == torch.float32 else x.float(), one_run[1], one_run[0], x.shape[1])
            y = y if x.dtype == torch.float32 else y.to(x.dtype)
            return y if bias is None else y + bias
        shape = x.shape
        x2 = x if x.dim() == 2 else x.reshape(-1, shape[-1])
        rows, k = x2.shape
        if layer.dense_copy is not None and rows > few_rows(x2.dtype) and x2.dtype == layer.params_dtype:
            y = packed_linear(x2.contiguous(), layer.dense_copy, bias)
            return y.reshape(*shape[:-1], y.shape[-1])
        if rows >= DENSE_GEMM_ROWS:
            # F.linear, not the prepacking cpu_linear: the tile is used once. One run (a layer of one type, all
            # of the default model's) is not copied through torch.cat: a prefill's output is tens of MB.
            ys = [F.linear(x2, self._dense_run(layer, i, x.dtype)) for i in range(len(layer.gguf_runs))]
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
        else:
            # Beside a dense copy, few rows take the float32 path: faster than the bfloat16 one at 1-2 rows.
            bf16_types = bf16_kernel_types() if x2.dtype == torch.bfloat16 and layer.dense_copy is None else ()
            xb = x2.contiguous() if bf16_types else None
            xf = None
            y = torch.empty(rows, layer.output_size, dtype=torch.float32)
            runs = layer.gguf_run_weights
            for ggml_type, offset, size, weight in runs:
                out = y if len(runs) == 1 else y[:, offset:offset + size]  # one run: no slice view to build
                if ggml_type in bf16_types:  # bfloat16 products (AMX / AVX512_BF16), float32 sums
                    gguf_gemm_bf16_cpu(xb, weight, ggml_type, k, out=out)
                    continue
                if xf is None:  # float32 rows in place need no conversion op
                    xf = x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.float().contiguous()
                if ggml_type == DENSE:
                    out.copy_(dense_linear(xf, weight.float(), None))
                else:
                    gguf_gemm_cpu(xf, weight, ggml_type, k, out=out)
            if x.dtype != torch.float32:
                y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y if x.dim() == 2 else y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def _float_rows(layer: LinearBase, x: torch.Tensor, ggml_type: int) -> bool:
        """Whether a few bfloat16 rows take the kernel's float32 path (beside a dense copy, or for a type without
        bfloat16 products), as in apply's kernel branch."""
        return x.dtype == torch.bfloat16 and (layer.dense_copy is not None or ggml_type not in bf16_kernel_types())

    @staticmethod
    def _dense_run(layer: LinearBase, i: int, dtype: torch.dtype) -> torch.Tensor:
        return dense_tile(getattr(layer, f"qweight{i}"), layer.gguf_runs[i][0], layer.input_size, dtype)


def dense_tile(weight: torch.Tensor, ggml_type: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A kept weight [n, row_bytes] (or a dense run [n, k]) as a dense [n, k] tile of `dtype`."""
    if ggml_type == DENSE:
        return weight.to(dtype)
    if dtype == torch.bfloat16 and ggml_type in bf16_kernel_types():  # one pass, the same values
        return gguf_dequantize_bf16_cpu(weight, ggml_type, k)
    return gguf_dequantize_cpu(weight, ggml_type, k).to(dtype)


def gguf_matmul(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """x [m, k] @ one kept weight [n, row_bytes] (GGML blocks, or dense [n, k] for DENSE) -> [m, n] in x's
    dtype, choosing as GGUFLinearMethod.apply does: a dense tile from DENSE_GEMM_ROWS rows, else the kernel
    (bfloat16 products where the type has them)."""
    if ggml_type == DENSE or x.shape[0] >= DENSE_GEMM_ROWS:
        return F.linear(x, dense_tile(weight, ggml_type, k, x.dtype))
    if x.dtype == torch.bfloat16 and ggml_type in bf16_kernel_types():
        return gguf_gemm_bf16_cpu(x.contiguous(), weight, ggml_type, k).to(x.dtype)
    return gguf_gemm_cpu(x.float().contiguous(), weight, ggml_type, k).to(x.dtype)


class GGUFConfig(QuantConfig):
    """A .gguf file's own quantization (chosen by the loader for GGUF files; `gguf_dequantize` opts out)."""

    name = "gguf"

    def __init__(self, dense_copy: bool = False) -> None:
        super().__init__()
        self.dense_copy = dense_copy  # the linear layers keep a dense copy too (the loader's "dense_copy" key)

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> GGUFConfig:
        return cls(dense_copy=bool(config.get("dense_copy", False)))

    def linear_method(self, layer_name: str, part_names: list[str] | None = None) -> QuantMethod:
        return GGUFLinearMethod(self.dense_copy)

    def moe_method(self, layer_name: str) -> Any:
        from tokenmill.layers.quant.gguf_moe import GGUFMoEMethod

        return GGUFMoEMethod()

    def describe(self) -> str:
        copy = (f", and a dense copy of the linear weights for steps of more than {FEW_ROWS} rows "
                f"({FEW_ROWS_FLOAT32} in float32; on CPUs with AMX, Q4_0 and Q4_1 layers keep their blocks repacked "
                "for the AMX kernel instead)"
                if self.dense_copy else "")
        return (f"gguf (linear weights and MoE experts kept in their GGML types, multiplied by the CPU kernel{copy}; "
                "embeddings, LM head, routers and norms dense)")
