"""GGUF mixture-of-experts weights kept in their GGML block types: layers.moe.FusedMoE's experts as llama.cpp
stores them, multiplied by layers.quant.gguf_cpu's kernel one expert at a time.

The loader (model.loader.iter_gguf_weights, model.gguf_moe) splits llama.cpp's stacked `ffn_{gate,up,down}_exps`
into one tensor per expert and projection: the raw rows (uint8 [rows, row_bytes] tagged with `ggml_type`) for
the kernel's types, float32 values for the others (F32/F16 files, types the kernel lacks). After loading, each
projection's experts are stacked again: gate and up as one [E, 2I, row_bytes] blob when they share a type (one
GEMM per expert, as the dense w13), else two; down [E, H, row_bytes]. The routing and the dispatch over experts
are the unquantized CPU path's (layers.moe_routing.run_experts); each expert's GEMMs are gguf_matmul's, the
dense GGUF layers' choice (the kernel for few rows, a dequantized tile from DENSE_GEMM_ROWS).

Tensor parallelism slices every expert's intermediate features as layers.moe does: whole rows of gate/up,
and whole blocks of each down row (a split that cuts a block is refused). Off the CPU, or without the kernel,
the experts are dequantized once into the ordinary dense w13 / w2 (the loader only picks this method there
when `quantization="gguf"` asks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quant.gguf import DENSE, GGML_TYPE_NAMES, block_geometry, dequantize_gguf, gguf_matmul
from tokenmill.layers.quant.gguf_cpu import KERNEL_TYPES, load_kernel

if TYPE_CHECKING:
    from tokenmill.layers.moe import FusedMoE

_SHARDS = ("gate", "up", "down")


class GGUFMoEMethod:
    """How one FusedMoE holds, loads and runs GGUF experts (see the module docstring)."""

    def create_weights(self, layer: FusedMoE) -> None:
        # Placeholders the checkpoint's tensors are "loaded" into: the bytes go to layer.gguf_experts, since a
        # projection's size depends on its type, known only when it arrives.
        layer.gguf_dtype, layer.gguf_hidden_size = layer.w13_weight.dtype, layer.w13_weight.shape[2]
        layer.gguf_experts = {}  # (shard, local expert) -> (ggml type or DENSE, tensor)
        for name in ("w13_weight", "w2_weight"):
            param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            param.weight_loader = lambda param, loaded, shard, expert: self._load(layer, loaded, shard, expert)
            param.moe_part = "weight"
            setattr(layer, name, param)

    def checkpoint_parts(self) -> tuple[str, ...]:
        return ("weight",)

    def _load(self, layer: FusedMoE, loaded: torch.Tensor, shard: str, expert: int | None) -> None:
        """One expert's gate / up [I, K-bytes] or down [H, I-bytes] (or, expert None, every expert's)."""
        ggml_type = getattr(loaded, "ggml_type", DENSE)
        if expert is None:  # transformers' all-experts layout: [E, 2I, H] gate_up or [E, H, I] down
            for e in range(loaded.shape[0]):
                parts = zip(("gate", "up"), loaded[e].chunk(2, dim=0)) if shard == "gate_up" else [(shard, loaded[e])]
                for name, part in parts:
                    if ggml_type != DENSE:
                        part.ggml_type = ggml_type
                    self._load(layer, part, name, e)
            return
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"GGUF expert {expert} is out of range: the model has {layer.num_experts}")
        local = expert - layer.first_expert
        if not 0 <= local < layer.num_local_experts:
            return  # another rank's expert (expert parallelism)
        size, rank = layer.intermediate_size_per_partition, layer.shard_rank
        if shard == "down":
            width = size
            if ggml_type != DENSE:  # whole blocks of each row per rank
                block, block_bytes = block_geometry(ggml_type)
                if size % block:
                    raise ValueError(f"GGUF {GGML_TYPE_NAMES.get(ggml_type, ggml_type)} experts: {size} "
                                     f"intermediate features per rank do not split into whole blocks of {block}; "
                                     "use fewer ranks, or enable_expert_parallel (whole experts per rank)")
                width = size // block * block_bytes
            loaded = loaded.narrow(1, rank * width, width)
        else:
            loaded = loaded.narrow(0, rank * size, size)
        if ggml_type == DENSE:  # float32 from the loader: held in the model's dtype until every expert is in
            loaded = loaded.to(layer.gguf_dtype)
        layer.gguf_experts[(shard, local)] = (ggml_type, loaded.contiguous())
        layer._loaded.add(("weight", shard, expert))

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        stacked = {shard: self._stack(layer, shard) for shard in _SHARDS}
        del layer.gguf_experts, layer.w13_weight, layer.w2_weight
        device = torch.get_default_device()
        kept = device.type == "cpu" and load_kernel() is not None
        if not kept or all(ggml_type == DENSE for ggml_type, _ in stacked.values()):
            # The dense experts FusedMoE runs itself (the fused kernel on CUDA).
            dense = {shard: self._dense(t, raw, self._columns(layer, shard)) for shard, (t, raw) in stacked.items()}
            layer.w13_weight = nn.Parameter(torch.cat([dense["gate"], dense["up"]], dim=1).to(device, layer.gguf_dtype),
                                            requires_grad=False)
            layer.w2_weight = nn.Parameter(dense["down"].to(device, layer.gguf_dtype), requires_grad=False)
            layer.gguf_w13_types = None
            return
        (gate_type, gate), (up_type, up), (down_type, down) = (self._kept(layer, s, *stacked[s]) for s in _SHARDS)
        if gate_type == up_type:  # one GEMM per expert for both, as the dense w13
            layer.gguf_w13_types = (gate_type,)
            layer.w13_weight = nn.Parameter(torch.cat([gate, up], dim=1), requires_grad=False)
        else:
            layer.gguf_w13_types = (gate_type, up_type)
            layer.w1_weight = nn.Parameter(gate, requires_grad=False)
            layer.w3_weight = nn.Parameter(up, requires_grad=False)
        layer.gguf_w2_type = down_type
        layer.w2_weight = nn.Parameter(down, requires_grad=False)

    @staticmethod
    def _stack(layer: FusedMoE, shard: str) -> tuple[int, torch.Tensor]:
        """Every local expert's `shard` as one [E, rows, cols] tensor of one type (DENSE float32 where the
        experts' types differ)."""
        parts = [layer.gguf_experts[(shard, e)] for e in range(layer.num_local_experts)]  # complete: checked
        types = {ggml_type for ggml_type, _ in parts}
        if len(types) == 1:
            return types.pop(), torch.stack([t for _, t in parts])
        cols = GGUFMoEMethod._columns(layer, shard)
        return DENSE, torch.stack([GGUFMoEMethod._dense(t, raw, cols) for t, raw in parts])

    @staticmethod
    def _columns(layer: FusedMoE, shard: str) -> int:
        """The input features of an expert's `shard` on this rank."""
        return layer.intermediate_size_per_partition if shard == "down" else layer.gguf_hidden_size

    @staticmethod
    def _dense(ggml_type: int, raw: torch.Tensor, k: int) -> torch.Tensor:
        """[..., rows, row_bytes] blocks (or float values) -> float32 [..., rows, k]."""
        if ggml_type == DENSE:
            return raw.float()
        return dequantize_gguf(raw.reshape(-1, raw.shape[-1]), ggml_type, k).reshape(*raw.shape[:-1], k)

    @staticmethod
    def _kept(layer: FusedMoE, shard: str, ggml_type: int, stacked: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A stacked projection as the CPU path keeps it: the kernel's types as blocks, the rest dense."""
        if ggml_type == DENSE:
            return DENSE, stacked.to(layer.gguf_dtype)
        if ggml_type not in KERNEL_TYPES:  # the loader keeps only kernel types quantized; be safe anyway
            return DENSE, GGUFMoEMethod._dense(ggml_type, stacked, GGUFMoEMethod._columns(layer, shard)).to(
                layer.gguf_dtype)
        return ggml_type, stacked

    def apply(self, layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, kernel) -> torch.Tensor:
        """hidden_states [T, H] -> [T, H] (this rank's part). kernel: kernels.fused_moe.fused_experts or None."""
        from tokenmill.layers.moe_routing import fused_experts_torch, run_experts

        if layer.gguf_w13_types is None:  # dequantized at load
            if kernel is not None:
                return kernel(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                              skip_negative_ids=layer.expert_parallel)
            return fused_experts_torch(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        hidden, inter = hidden_states.shape[1], layer.intermediate_size_per_partition
        w13_types, w2_type = layer.gguf_w13_types, layer.gguf_w2_type

        def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
            if len(w13_types) == 1:
                gate, up = gguf_matmul(x, layer.w13_weight[expert], w13_types[0], hidden).chunk(2, dim=-1)
            else:
                gate = gguf_matmul(x, layer.w1_weight[expert], w13_types[0], hidden)
                up = gguf_matmul(x, layer.w3_weight[expert], w13_types[1], hidden)
            return gguf_matmul(F.silu(gate) * up, layer.w2_weight[expert], w2_type, inter)

        return run_experts(hidden_states, topk_weights, topk_ids, layer.num_local_experts, hidden, expert_mlp)
