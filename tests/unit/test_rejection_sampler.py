"""Draft verification keeps the target distribution exactly, whatever the drafts (chi-square tests).

Many identical rows are verified at once: each row's emitted run is one sample of the speculative
process. Its first token must follow the target's processed distribution at the first position, and,
where the first draft was accepted, the second token the distribution at the second, and so on; the
drafts are chosen deliberately unlike the target (its least likely token, or a token it excludes).
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.sample.metadata import build_sampling_metadata
from tokenmill.sample.sampler import apply_min_p, apply_top_k_top_p
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.rejection import VerifyBatch, verify_drafts

CPU = torch.device("cpu")
VOCAB = 8
# The target's logits at the three positions of a two-draft run (the last one is the bonus position).
LOGITS = torch.tensor([
    [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
    [-1.0, 0.0, 2.5, 0.3, 1.0, -2.0, 0.5, 0.1],
    [0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0],
])


def processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits.unsqueeze(0) / params.temperature
    if params.min_p:
        logits = apply_min_p(logits, torch.tensor([params.min_p]))
    if params.top_k or params.top_p < 1:
        logits = apply_top_k_top_p(logits, torch.tensor([params.top_k or VOCAB]), torch.tensor([params.top_p]))
    return logits.softmax(-1)[0]


def chi_square_ok(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    counts = torch.bincount(tokens, minlength=VOCAB).float()
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "emitted a token with zero probability"
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    # 99.9th percentile of chi-square with df degrees of freedom (Wilson-Hilferty approximation).
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3 if df > 0 else 0.0
    return stat < critical + 1e-6


def verify(params: SamplingParams, drafts: list[int], num_rows: int = 40000):
    torch.manual_seed(2024)
    logits = LOGITS.repeat(num_rows, 1)  # row i's positions are 3i, 3i + 1, 3i + 2
    metadata = build_sampling_metadata([params] * num_rows, {}, VOCAB, CPU)
    bonus = torch.multinomial(processed(LOGITS[2], params), num_rows, replacement=True)
    k = len(drafts)
    batch = VerifyBatch(
        rows=torch.arange(num_rows),
        draft_token_ids=torch.tensor(drafts).repeat(num_rows, 1),
        num_drafts=torch.full((num_rows,), k),
        logit_positions=torch.arange(num_rows).unsqueeze(1) * 3 + torch.arange(k),
        is_greedy=torch.zeros(num_rows, dtype=torch.bool),
        all_greedy=False,
    )
    return verify_drafts(logits, bonus, batch, metadata)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.2, top_k=4, min_p=0.05),
], ids=["plain", "top_p", "top_k-min_p"])
@pytest.mark.parametrize("drafts", [[7, 0], [0, 2], [3, 6]], ids=["unlikely", "likely", "mixed"])
def test_emitted_runs_follow_the_target_distribution(params, drafts):
    tokens, counts = verify(params, drafts)
    assert chi_square_ok(tokens[:, 0], processed(LOGITS[0], params))
    second = counts >= 2  # the first draft was accepted: the second token is drawn at position 1
    assert bool((tokens[second, 0] == drafts[0]).all())
    if second.sum() > 200:
        assert chi_square_ok(tokens[second, 1], processed(LOGITS[1], params))
    third = counts == 3
    if third.sum() > 200:
        assert chi_square_ok(tokens[third, 2], processed(LOGITS[2], params))
    # Nothing is emitted past a rejection.
    positions = torch.arange(3)
    assert bool((tokens[positions[None, :] >= counts[:, None]] == -1).all())


def test_greedy_rows_accept_the_argmax_and_emit_it_where_the_draft_differs():
    params = SamplingParams(temperature=0.0)
    metadata = build_sampling_metadata([params] * 3, {}, VOCAB, CPU)
    logits = LOGITS.repeat(3, 1)
    argmax = LOGITS.argmax(-1)  # [0, 2, 3]
    drafts = torch.tensor([[0, 2], [0, 5], [1, 2]])
    batch = VerifyBatch(torch.arange(3), drafts, torch.tensor([2, 2, 1]),
                        torch.arange(3).unsqueeze(1) * 3 + torch.tensor([[0, 1], [0, 1], [0, 0]]),
                        torch.ones(3, dtype=torch.bool), True)
    tokens, counts = verify_drafts(logits, argmax[2].repeat(3), batch, metadata)
    assert counts.tolist() == [3, 2, 1]
    assert tokens.tolist() == [[0, 2, 3], [0, 2, -1], [0, -1, -1]]


# A draft tree (spec/tree.py): the root's three children, two under the first, one under the second.
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]
TREE_LOGITS = torch.cat([LOGITS, torch.tensor([
    [1.0, 0.2, -0.3, 0.0, 2.0, 0.5, -1.0, 0.0],
    [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 2.1],
    [-0.5, 1.0, 0.0, 0.7, 0.0, 1.3, 0.0, -2.0],
    [0.3, -0.3, 1.1, 0.0, 0.0, 0.9, 0.0, 0.2],
])])  # the root's distribution, then node i's


def verify_tree_rows(params: SamplingParams, node_tokens: list[int], num_rows: int = 40000):
    from tokenmill.config import parse_token_tree
    from tokenmill.spec.tree import TokenTree
    from tokenmill.spec.tree_rejection import TreeVerifyBatch, verify_tree

    torch.manual_seed(2025)
    tree = TokenTree.from_paths(parse_token_tree(TREE))
    metadata = build_sampling_metadata([params] * num_rows, {}, VOCAB, CPU)
    batch = TreeVerifyBatch(
        rows=torch.arange(num_rows),
        node_token_ids=torch.tensor(node_tokens).repeat(num_rows, 1),
        num_nodes=torch.full((num_rows,), tree.num_nodes),
        logit_positions=torch.arange(1 + tree.num_nodes).repeat(num_rows, 1),
        is_greedy=torch.full((num_rows,), params.temperature == 0),
        all_greedy=params.temperature == 0,
        children=torch.from_numpy(tree.children),
        max_depth=tree.max_depth,
    )
    return verify_tree(TREE_LOGITS, batch, metadata), tree


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)],
                         ids=["plain", "top_p"])
# Node tokens: the root's least likely tokens first (and one it may exclude), then unlikely grandchildren.
@pytest.mark.parametrize("nodes", [[7, 6, 0, 6, 3, 0], [0, 1, 2, 4, 0, 5]], ids=["unlikely", "likely"])
def test_a_walked_tree_emits_each_token_from_the_target_distribution(params, nodes):
    (tokens, counts, path), tree = verify_tree_rows(params, nodes)
    assert chi_square_ok(tokens[:, 0], processed(TREE_LOGITS[0], params))
    for node in range(tree.num_nodes):  # where the walk reached a node, the next token follows its distribution
        depth = int(tree.depth[node])
        reached = path[:, depth - 1] == node
        assert bool((tokens[reached, depth - 1] == nodes[node]).all())
        if reached.sum() > 200:
            assert chi_square_ok(tokens[reached, depth], processed(TREE_LOGITS[1 + node], params)), node
    # A token that is not a child of the node it was emitted at ends the walk there.
    assert bool((tokens[torch.arange(3)[None, :] >= counts[:, None]] == -1).all())
    assert bool(((path >= 0).sum(dim=1) == counts - 1).all())


def test_a_greedy_tree_walk_takes_the_child_equal_to_the_argmax():
    params = SamplingParams(temperature=0.0)
    # Root argmax 0: node 1 (token 0) is accepted; its argmax 3 is not its child (node 5, token 5): emitted.
    (tokens, counts, path), _ = verify_tree_rows(params, [7, 0, 3, 6, 3, 5], num_rows=2)
    assert tokens.tolist() == [[0, 3, -1]] * 2 and counts.tolist() == [2, 2] and path.tolist() == [[1, -1]] * 2
    # Node 5 now holds node 1's argmax: accepted, and node 5's argmax (2) follows it.
    (tokens, counts, path), _ = verify_tree_rows(params, [7, 0, 3, 6, 3, 3], num_rows=1)
    assert tokens.tolist() == [[0, 3, 2]] and path.tolist() == [[1, 5]]
