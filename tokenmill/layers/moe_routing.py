"""Mixture-of-experts math in plain torch: routing (which experts, with what weights) and the experts'
computation. The CPU path, and the reference the fused Triton kernel (kernels/fused_moe.py) is tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def expert_range(num_experts: int, rank: int, num_ranks: int) -> tuple[int, int]:
    """(first expert, number of experts) that `rank` holds under expert parallelism: contiguous ranges, the
    first num_experts % num_ranks ranks one expert more than the others."""
    if num_experts < num_ranks:
        raise ValueError(f"expert parallelism over {num_ranks} ranks needs at least {num_ranks} routed experts; "
                         f"the model has {num_experts} (turn enable_expert_parallel off to slice each expert)")
    base, extra = divmod(num_experts, num_ranks)
    return rank * base + min(rank, extra), base + (rank < extra)


def routed_experts_of(hf_config) -> int:
    """The routed experts of a mixture-of-experts config (Qwen-MoE, Mixtral, DeepSeek names); 0 if dense."""
    names = ("num_experts", "num_local_experts", "n_routed_experts")
    return next((value for name in names if (value := getattr(hf_config, name, None))), 0)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] -> (weights [num_tokens, top_k] float32, ids [num_tokens, top_k] int64).

    scoring "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3). correction_bias [num_experts] moves the
    choice of experts but not their weights (DeepSeek-V3's e_score_correction_bias). Grouped routing keeps the
    topk_group best of num_expert_group groups (a group scores as its best expert, or, with a correction bias,
    as the sum of its two best) and picks the top_k experts inside them.
    """
    logits = router_logits.float()
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"unknown MoE scoring function {scoring!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
        if correction_bias is None:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, kept_groups, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        # DeepSeek-V3's 1e-20 (transformers' too): sigmoid scores that all underflow give 0, not NaN. Elsewhere a
        # no-op: it is below half an ulp of any sum above ~1e-12 (a softmax top-k sums to at least 1/num_experts).
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def fused_experts_torch(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: int = 0,
) -> torch.Tensor:
    """Each token through its top-k experts (SiLU-gated MLPs), summed with the routing weights.

    hidden_states [num_tokens, hidden]; w13 [num_experts, 2 * intermediate, hidden] ([gate | up] rows);
    w2 [num_experts, hidden, intermediate]; topk_weights / topk_ids [num_tokens, top_k], an id of -1 for
    "no expert here" (expert parallelism: another rank's), which contributes nothing and costs no GEMM rows.
    Rounds as transformers' default experts path (grouped_mm) does: one output row per (token, slot), scaled
    by its weight, then the top_k rows of a token summed in slot order.

    e4m3 weights (layers.quant.fp8_moe) come with w13_scale / w2_scale: [E, N / b, K / b] per b x b block
    (scale_block b), or [E, N, 1] per row (scale_block 0). Each expert is dequantized when its turn comes and
    multiplied as the dense FP8 CPU path does (fp8_linear_torch: W8A8 in float32).
    """
    if w13_scale is None:
        def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, w2[expert])
    else:
        def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
            gate, up = _fp8_linear(x, w13[expert], w13_scale[expert], scale_block).chunk(2, -1)
            return _fp8_linear(F.silu(gate) * up, w2[expert], w2_scale[expert], scale_block)
    return run_experts(hidden_states, topk_weights, topk_ids, w13.shape[0], w2.shape[1], expert_mlp)


def run_experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    out_features: int,
    expert_mlp: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """fused_experts_torch's dispatch and combine around any expert computation: expert_mlp(expert, rows
    [n, hidden]) -> [n, out_features] for the rows routed to that expert (each expert called once, if any)."""
    num_tokens, top_k = topk_ids.shape
    weights = topk_weights.to(hidden_states.dtype)
    # One sort instead of a scan of the assignments per expert; the -1s sort first and are skipped.
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    skipped, *counts = torch.bincount(flat_ids + 1, minlength=num_experts + 1).tolist()
    token_of = order // top_k
    new = hidden_states.new_zeros if skipped else hidden_states.new_empty  # skipped slots stay zero
    slot_out = new(num_tokens * top_k, out_features)  # [num_tokens * top_k, out_features]
    start = skipped
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]
        tokens = token_of[start : start + count]
        start += count
        slot_out[slots] = expert_mlp(expert, hidden_states[tokens]).to(slot_out.dtype)
    weighted = slot_out * weights.reshape(-1, 1)
    return weighted.view(num_tokens, top_k, out_features).sum(dim=1)


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_block: int) -> torch.Tensor:
    """x [m, k] @ one expert's e4m3 weight [n, k]^T, scale [n / b, k / b] or [n, 1]."""
    from tokenmill.layers.quant.fp8 import fp8_linear_torch

    return fp8_linear_torch(x, weight, scale if scale_block else scale.reshape(-1), scale_block, None, None)
