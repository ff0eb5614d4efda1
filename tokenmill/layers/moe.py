"""Mixture-of-experts layer: every expert's weights stacked in two tensors, routed by select_experts, run by
the fused Triton kernels on CUDA (kernels.fused_moe; kernels.fused_moe_decode at up to 4 tokens) or
fused_experts_torch elsewhere.

Tensor parallel: each rank holds a slice of every expert's intermediate features (gate/up rows, down
columns), as the dense MLP's column/row-parallel pair does, and the partial outputs are all-reduced.
Expert parallel (ParallelConfig.enable_expert_parallel): each rank of the tensor-parallel group holds whole
experts instead, a contiguous range of them (expert_range), and loads only those. The routing runs on every
rank alike (the activations are replicated), each rank computes only its own experts' assignments (the others
become expert -1 with weight 0, which both experts paths skip) and the same all-reduce sums the ranks' parts.
Fewer, larger GEMMs per rank and no slicing of the intermediate size; the shared experts stay sliced.
Across data-parallel replicas (enable_expert_parallel with data_parallel_size > 1: parallel_state.ReplicaExperts)
every rank of every replica holds a contiguous range of the experts, but a replica's tokens are its own: each of
its tensor-parallel ranks sends a 1/tp share of them to the ranks holding their experts and back by all-to-all
(layers.moe_all_to_all), and the shares are gathered, once the engine cores step in lockstep; the passes before
that (memory profiling, warm-up) compute only the rank's own experts' assignments, whose values nobody reads.
Experts are 16-bit, or e4m3 under an fp8 quantization config (layers.quant.fp8_moe: block-quantized FP8
checkpoints, or online per-row), or a GGUF file's GGML blocks on the CPU (layers.quant.gguf_moe); other
quantized experts are refused by layers.quant.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from tokenmill.distributed.parallel_state import (
    expert_parallel_enabled,
    get_replica_experts,
    get_tp_rank,
    get_tp_size,
    tp_all_reduce,
    tp_gather_rows,
)
from tokenmill.kernels import use_triton
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.layers.moe_all_to_all import ExpertExchange
from tokenmill.layers.moe_routing import expert_range, fused_experts_torch, routed_experts_of, select_experts

# Hugging Face's per-expert checkpoint tensors: <prefix>.experts.<e>.<projection>.weight
# (and, FP8 checkpoints, .weight_scale_inv or .weight_scale: the w13_ / w2_weight_scale_inv parameters)
_PER_EXPERT = re.compile(
    r"(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<part>weight(_scale_inv|_scale)?)")
# transformers 5's in-memory layout (save_pretrained(save_original_format=False) writes it): every expert at
# once, gate_up_proj [E, 2 * I, H] ([gate | up] rows) and down_proj [E, H, I].
_ALL_EXPERTS = re.compile(r"(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)")


class MoERouter(ReplicatedLinear):
    """The router (`gate`): hidden -> one logit per expert, replicated on every rank (also Qwen2-MoE's
    shared_expert_gate). Never quantized: the routing decision is sensitive and the layer is tiny."""

    quantizable = False


def check_expert_parallel(hf_config, parallel_config) -> None:
    """Refuse at start-up an expert-parallel split that leaves a rank without experts."""
    num_experts = routed_experts_of(hf_config)
    if parallel_config.enable_expert_parallel and num_experts:
        expert_range(num_experts, 0, parallel_config.tensor_parallel_size)


class FusedMoE(nn.Module):
    """The routed experts of one layer. forward(hidden [T, H], router_logits [T, E]) -> [T, H], reduced over ranks.

    checkpoint_names: the (gate, up, down) projection names of one expert in the checkpoint
    (Qwen: gate_proj/up_proj/down_proj; Mixtral: w1/w3/w2). hidden_act: the config's, refused unless SiLU.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        scoring: str = "softmax",
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        hidden_act: str = "silu",
    ) -> None:
        super().__init__()
        # Every expert kernel (Triton, CPU, quantized) computes silu(gate) * up: another activation would run as
        # SiLU and silently give other tokens.
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"MoE experts compute SiLU-gated MLPs; this config's hidden_act is {hidden_act!r}")
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"MoE routing picks {top_k} of {num_experts} experts")
        replicas = get_replica_experts()
        self.exchange: ExpertExchange | None = None
        """Across data-parallel replicas: the all-to-all of this rank's share of its replica's tokens (None: every
        token this rank computes is here)."""
        self.expert_parallel = expert_parallel_enabled() and (self.tp_size > 1 or replicas.size > 1)
        if self.expert_parallel and replicas.size > 1:  # whole experts, 1/(dp x tp) of them, its tokens exchanged
            self.first_expert, self.num_local_experts = expert_range(num_experts, replicas.rank, replicas.size)
            self.exchange = ExpertExchange(num_experts, replicas.size, replicas.group)
            self.shard_rank, num_shards = 0, 1
        elif self.expert_parallel:  # whole experts [first_expert, first_expert + num_local_experts) on this rank
            self.first_expert, self.num_local_experts = expert_range(num_experts, self.tp_rank, self.tp_size)
            self.shard_rank, num_shards = 0, 1
        else:  # every expert, a slice of each
            self.first_expert, self.num_local_experts = 0, num_experts
            self.shard_rank, num_shards = self.tp_rank, self.tp_size
        if intermediate_size % num_shards:
            raise ValueError(f"the experts' intermediate size {intermediate_size} is not divisible by "
                             f"tensor-parallel size {self.tp_size}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        self.scoring, self.routed_scaling_factor = scoring, routed_scaling_factor
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.checkpoint_names = checkpoint_names
        self.intermediate_size_per_partition = size = intermediate_size // num_shards
        # [local experts, 2 * intermediate / shards, hidden]: each expert's [gate | up] rows of this rank
        self.w13_weight = self._param(torch.empty(self.num_local_experts, 2 * size, hidden_size))
        # [local experts, hidden, intermediate / shards]
        self.w2_weight = self._param(torch.empty(self.num_local_experts, hidden_size, size))
        self.quant_method = None  # layers.quant.fp8_moe.Fp8MoEMethod, or None: 16-bit experts
        self._loaded: set[tuple[str, str, int]] = set()  # (tensor, shard, global expert) filled by the checkpoint

    def set_quant_method(self, method) -> None:
        """Quantized experts (before the checkpoint loads): the method replaces the weight parameters."""
        self.quant_method = method
        method.create_weights(self)

    def _param(self, data: torch.Tensor, part: str = "weight") -> nn.Parameter:
        """part: which tensor of each expert projection the checkpoint fills it from."""
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        param.moe_part = part  # type: ignore[attr-defined]
        return param

    # -- loading -----------------------------------------------------------------------------------------
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str, expert: int | None) -> None:
        """shard: "gate" [I, H], "up" [I, H] or "down" [H, I] of one expert; "gate_up" [E, 2I, H] or
        "down" [E, H, I] of every expert when `expert` is None. The same for the block scales of FP8
        experts ([I / b, H / b] ...): the slices follow the parameter's shape, so they fall on block bounds."""
        if expert is None:
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"checkpoint holds {loaded.shape[0]} experts, the model {self.num_experts}")
            for e in self._local_experts():
                if shard == "gate_up":
                    gate, up = loaded[e].chunk(2, dim=0)
                    self.weight_loader(param, gate, "gate", e)
                    self.weight_loader(param, up, "up", e)
                else:
                    self.weight_loader(param, loaded[e], shard, e)
            return
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint expert {expert} is out of range: the model has {self.num_experts}")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert (expert parallelism)
        rank = self.shard_rank
        # The intermediate features of this rank in `param`: I / shards, or (block scales) I / shards / b.
        size = param.shape[2] if shard == "down" else param.shape[1] // 2
        offset = size if shard == "up" else 0
        target = param.data[local] if shard == "down" else param.data[local, offset : offset + size]
        if param.moe_part != "weight" and loaded.numel() == 1:  # a per-tensor scale: each of its rows takes it
            source = loaded.reshape(1, 1).expand_as(target)
        elif shard == "down" and loaded.shape[-1] == 1 == param.shape[2]:  # per-row scales: down's rows are whole
            source = loaded
        elif shard == "down":
            source = loaded.narrow(1, rank * size, size)
        else:
            source = loaded.narrow(0, rank * size, size)
        if target.shape != source.shape:
            raise ValueError(f"expert {expert} {shard}: shape mismatch, parameter slice {tuple(target.shape)}, "
                             f"checkpoint slice {tuple(source.shape)}")
        target.copy_(source)
        self._loaded.add((param.moe_part, shard, expert))

    def checkpoint_target(self, shard_name: str) -> str | None:
        """A checkpoint projection name -> its shard ("gate" / "up" / "down"), None if not an expert's."""
        gate, up, down = self.checkpoint_names
        return {gate: "gate", up: "up", down: "down"}.get(shard_name)

    def _local_experts(self) -> range:
        """The global ids of the experts this rank holds."""
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    def missing_weights(self) -> list[str]:
        """This rank's expert tensors the checkpoint did not provide (empty after a full load)."""
        parts = self.quant_method.checkpoint_parts() if self.quant_method is not None else ("weight",)
        return [f"expert {e} {shard}" + ("" if part == "weight" else f" {part}")
                for e in self._local_experts() for shard in ("gate", "up", "down") for part in parts
                if (part, shard, e) not in self._loaded]

    def checkpoint_part_names(self, module_name: str) -> list[str]:
        """The checkpoint modules of one expert, for quantization configs' exclusion lists."""
        return [f"{module_name}.0.{name}" for name in self.checkpoint_names]

    # -- forward -----------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states [T, H], router_logits [T, E]; correction_bias [E] (DeepSeek-V3) moves the choice only."""
        topk_weights, topk_ids = select_experts(
            router_logits, self.top_k, self.renormalize, self.scoring, correction_bias,
            self.num_expert_group, self.topk_group, self.routed_scaling_factor,
        )
        if self.exchange is not None and ExpertExchange.live:
            return self._exchange_tokens(hidden_states, topk_weights, topk_ids)
        if self.expert_parallel:
            topk_weights, topk_ids = self.local_assignments(topk_weights, topk_ids)
        return tp_all_reduce(self._local_experts_forward(hidden_states, topk_weights, topk_ids))

    def _exchange_tokens(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
        """Across replicas: the tokens to their experts' ranks and back. A replica's tensor-parallel ranks hold the
        same tokens: each sends its 1/tp share, and the shares' outputs are gathered."""
        if self.tp_size == 1:
            return self.exchange.run(hidden_states, topk_weights, topk_ids, self._local_experts_forward)
        num_tokens = hidden_states.shape[0]
        share = -(-num_tokens // self.tp_size)
        mine = slice(self.tp_rank * share, (self.tp_rank + 1) * share)
        out = self.exchange.run(hidden_states[mine], topk_weights[mine], topk_ids[mine], self._local_experts_forward)
        out = nn.functional.pad(out, (0, 0, 0, share - out.shape[0]))  # equal shares for the gather
        return tp_gather_rows(out)[:num_tokens]

    def exchange_without_tokens(self, dtype: torch.dtype) -> None:
        """This layer's part of an exchange in which this replica has no tokens (replica lockstep); `dtype`: the
        model's activations'."""
        device = next(self.parameters()).device
        self.exchange.run(torch.empty(0, self.hidden_size, dtype=dtype, device=device),
                          torch.empty(0, self.top_k, device=device),
                          torch.empty(0, self.top_k, dtype=torch.int64, device=device), self._local_experts_forward)

    def _local_experts_forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                               topk_ids: torch.Tensor) -> torch.Tensor:
        """Rows through this rank's experts (local ids; -1 for none), summed with their weights: [T, H]."""
        kernel = fused_experts_kernel() if use_triton(hidden_states) else None
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden_states, topk_weights, topk_ids, kernel)
        if kernel is not None:
            return kernel(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                          skip_negative_ids=self.expert_parallel)  # [T, H]
        return fused_experts_torch(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    def local_assignments(self, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ids [T, K] -> this rank's local ids, -1 (and weight 0) for other ranks' experts.
        Device ops only: no host read-back, so CUDA graphs capture it."""
        local = topk_ids - self.first_expert
        elsewhere = (local < 0) | (local >= self.num_local_experts)
        return topk_weights.masked_fill(elsewhere, 0.0), local.masked_fill(elsewhere, -1)


@functools.cache
def fused_experts_kernel() -> Callable | None:
    """The fused Triton experts where their module exists (it imports triton): kernels.fused_moe_decode's GEMVs
    for up to 4 tokens of 16-bit activations, kernels.fused_moe's grouped GEMMs otherwise."""
    if importlib.util.find_spec("tokenmill.kernels.fused_moe_decode") is None:
        return None
    from tokenmill.kernels.fused_moe_decode import fused_experts_any_size

    return fused_experts_any_size


def expert_weight_target(moe_layers: dict[str, FusedMoE], name: str) -> tuple[str, tuple] | None:
    """A checkpoint tensor of some FusedMoE's experts -> (parameter name, weight loader arguments); None for
    any other tensor."""
    match = _PER_EXPERT.fullmatch(name)
    if match is not None and match["prefix"] in moe_layers:
        layer = moe_layers[match["prefix"]]
        shard = layer.checkpoint_target(match["proj"])
        parts = layer.quant_method.checkpoint_parts() if layer.quant_method is not None else ("weight",)
        if match["part"] not in parts:
            return None  # a scale of experts that hold none: reported as a tensor without a parameter
        if shard is not None:
            param = ("w2_" if shard == "down" else "w13_") + ("weight" if match["part"] == "weight" else
                                                              "weight_scale_inv")
            return f"{match['prefix']}.{param}", (shard, int(match["expert"]))
    match = _ALL_EXPERTS.fullmatch(name)
    if match is not None and match["prefix"] in moe_layers:
        if match["proj"] == "gate_up_proj":
            return f"{match['prefix']}.w13_weight", ("gate_up", None)
        return f"{match['prefix']}.w2_weight", ("down", None)
    return None


def load_moe_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                     stacked_params: dict[str, tuple[str, str | int]], skip_prefixes: tuple[str, ...] = (),
                     rename: Callable[[str], str | None] | None = None) -> None:
    """load_weights_by_name, with the experts' tensors (per expert, or transformers 5's all-expert layout)
    going to their FusedMoE; fails if any expert's tensor is missing."""
    from tokenmill.model.base import load_weights_by_name

    moe_layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    load_weights_by_name(model, weights, stacked_params, skip_prefixes=skip_prefixes, rename=rename,
                         expert_params=lambda name: expert_weight_target(moe_layers, name))
    for name, layer in moe_layers.items():
        missing = layer.missing_weights()
        if missing:
            raise ValueError(f"checkpoint is missing weights of {name}: {missing[:8]}")
