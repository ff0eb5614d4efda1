"""Verification of a draft tree: walk it from the root, keeping what the target model would have produced.

At the current node (the root first) with target distribution p (processed as the sampler processes it:
logit mask, temperature, min_p, top_k, top_p), the node's children x_1, x_2, ... (the head's top tokens,
distinct, in rank order) are tried in turn against a residual r, which starts as p: x_j is accepted with
probability r(x_j) / sum(r), and a rejected x_j leaves r(x_j) = 0. An accepted child becomes the current node;
when no child is accepted (or the node has none) the token emitted there is drawn from r, and the walk ends.
Each draft is a deterministic function of the context, so this is the multi-draft form of the accept/resample
rule with one-hot draft distributions: the token emitted at each node follows p exactly, since child x_j is
emitted with probability prod_{i<j}(1 - p(x_i) / m_i) * p(x_j) / m_j = p(x_j), m_j the mass left before it, and
the residual draw covers the rest. Greedy requests take the child equal to the argmax, and emit the argmax
where none is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import draw_from_probs
from tokenmill.spec.rejection import processed_probs


@dataclass
class TreeVerifyBatch:
    """The requests of a step that verify draft trees; `rows` index the step's sampled requests."""

    rows: torch.Tensor  # [r] int64
    node_token_ids: torch.Tensor  # [r, num_nodes] int64: each node's token, padded past each row's count
    num_nodes: torch.Tensor  # [r] int64: the row's tree is the tree's first num_nodes nodes
    logit_positions: torch.Tensor  # [r, 1 + num_nodes] index into the step's logits: the root's, then node i's
    is_greedy: torch.Tensor  # [r] bool
    all_greedy: bool
    children: torch.Tensor  # [1 + num_nodes, max_children] int64: the root's (row 0) and node i's (row 1 + i)
    max_depth: int


def verify_tree(logits: torch.Tensor, batch: TreeVerifyBatch,
                metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [positions, vocab]. Returns the emitted tokens [r, max_depth + 1] (padded with -1), how many each
    row emits [r], and the accepted nodes [r, max_depth] in order (padded with -1).

    Every node of every tree decides at once which of its children it would accept and what it would emit if
    none, with randomness of its own (the nodes off the walk are never read, so the walk's nodes stay
    independent draws); then the walk from the root follows those decisions: a few dozen kernels whatever the
    tree, rather than a loop over its levels and siblings."""
    num_rows, num_positions = batch.logit_positions.shape  # positions: the root and each node
    children = batch.children  # [P, B]
    per_position = batch.rows.repeat_interleave(num_positions)
    target = logits[batch.logit_positions.flatten()].float()  # [r * P, vocab]
    if metadata.logit_mask is not None:
        target = target + metadata.logit_mask[per_position]
    argmax = target.argmax(dim=-1).view(num_rows, num_positions)
    child_ids = children.clamp(min=0).flatten()[None, :].expand(num_rows, -1)
    child_tokens = batch.node_token_ids.gather(1, child_ids).view(num_rows, num_positions, -1)  # [r, P, B]
    is_child = (children >= 0)[None] & (children < batch.num_nodes[:, None, None])
    chosen = torch.full_like(argmax, -1)  # [r, P] the child each node accepts (a node index), -1: none
    for slot in range(children.shape[1]):
        hit = is_child[..., slot] & (child_tokens[..., slot] == argmax) & (chosen < 0)
        chosen = torch.where(hit, children[None, :, slot], chosen)
    final = argmax  # [r, P] what each node emits when it accepts no child
    if not batch.all_greedy:
        residual = processed_probs(target, metadata, per_position).view(num_rows, num_positions, -1)
        sampled_choice = torch.full_like(argmax, -1)
        for slot in range(children.shape[1]):
            draft = child_tokens[..., slot, None]  # [r, P, 1]
            tried = is_child[..., slot] & (sampled_choice < 0)
            draft_mass = residual.gather(2, draft).squeeze(2)
            accepted = tried & (torch.rand_like(draft_mass) * residual.sum(dim=-1) < draft_mass)
            rejected = tried & ~accepted
            residual.scatter_(2, draft, torch.where(rejected, 0.0, draft_mass).unsqueeze(2))
            sampled_choice = torch.where(accepted, children[None, :, slot], sampled_choice)
        residual_draw = draw_from_probs(residual)
        greedy = batch.is_greedy[:, None]
        chosen = torch.where(greedy, chosen, sampled_choice)
        final = torch.where(greedy, argmax, residual_draw)
    current = torch.zeros(num_rows, 1, dtype=torch.int64, device=logits.device)  # 0: the root, 1 + i: node i
    alive = torch.ones(num_rows, dtype=torch.bool, device=logits.device)
    tokens = torch.full((num_rows, batch.max_depth + 1), -1, dtype=torch.int64, device=logits.device)
    path = torch.full((num_rows, batch.max_depth), -1, dtype=torch.int64, device=logits.device)
    for depth in range(batch.max_depth + 1):
        child = chosen.gather(1, current).squeeze(1)
        has_child = child >= 0
        emitted = torch.where(has_child, batch.node_token_ids.gather(1, child.clamp(min=0)[:, None]).squeeze(1),
                              final.gather(1, current).squeeze(1))
        tokens[:, depth] = torch.where(alive, emitted, -1)
        alive = alive & has_child
        if depth < batch.max_depth:
            path[:, depth] = torch.where(alive, child, -1)
        current = torch.where(alive, child + 1, current.squeeze(1))[:, None]
    return tokens, (tokens >= 0).sum(dim=1), path
