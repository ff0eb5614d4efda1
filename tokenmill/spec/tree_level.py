"""One level pass of an EAGLE draft tree as a module: what the eager path runs and a CUDA graph captures.

A level's pass (spec/eagle.py, `_draft_tree`) feeds each of the level's nodes its parent's output (the head's
output at the previous level's node, or at the last known position for the root's children), runs the head over
the nodes, and takes each node of the next level as its parent's top token of its rank. Per (rows, level) every
shape is fixed, so with the level's index tensors held here the whole pass, LM head and top-k included, is one
graph replay (worker.tree_cuda_graph), as a chain's draft step is (spec/draft_model.GreedyDraftStep).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill.attention.backend import BatchLayout
from tokenmill.spec.tree import TokenTree
from tokenmill.worker.input_batch import kv_slots


class TreeLevelStep(nn.Module):
    def __init__(self, model: nn.Module, top_tokens, tree: TokenTree, depth: int, device: torch.device) -> None:
        """The pass over the nodes of level `depth` (1: the root's children), which drafts level depth + 1;
        `top_tokens(hidden [n, hidden], k)` -> [n, k] token ids, most likely first."""
        super().__init__()
        self.model = model
        self.top_tokens = top_tokens
        starts = tree.level_starts
        first, end, next_end = (int(x) for x in starts[depth - 1 : depth + 2])
        parent_first = int(starts[depth - 2]) if depth > 1 else -1  # the root is node -1
        self.depth = depth
        self.width = end - first
        """The level's nodes: tokens per row of the pass."""
        self.parent_width = first - parent_first if depth > 1 else 1
        children = np.arange(end, next_end)
        self.num_top = int(tree.rank[children].max()) + 1

        def index(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values.astype(np.int64)).to(device)

        self.parents = index(tree.parent[first:end] - parent_first)  # [width]: each node's in the parent level
        self.child_parents = index(tree.parent[children] - first)  # [next width]: each child's in this level
        self.child_ranks = index(tree.rank[children])  # [next width]

    def forward(self, positions: torch.Tensor, parent_out: torch.Tensor,
                tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """positions [rows * width]; parent_out [rows, parent_width, hidden], the parent level's outputs;
        tokens [rows, width], the level's (None at depth 1: the root's top tokens, taken here).
        Returns the level's tokens [rows, width], its outputs [rows, width, hidden] and the next level's
        tokens [rows, next width]."""
        rows = parent_out.shape[0]
        if tokens is None:  # the root's children are its top tokens in rank order
            tokens = self.top_tokens(parent_out[:, 0], self.width)
        hidden = parent_out[:, self.parents].flatten(0, 1)
        out = self.model(tokens.flatten(), positions, hidden)
        top = self.top_tokens(out, self.num_top).view(rows, self.width, -1)
        return tokens, out.view(rows, self.width, -1), top[:, self.child_parents, self.child_ranks]


def level_layout(tree: TokenTree, depth: int, block_table: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
                 block_size: int) -> tuple[BatchLayout, np.ndarray]:
    """The layout and positions of the pass over level `depth`'s nodes of `rows` (of `block_table`), whose known
    tokens number `lengths`: node i's KV in the slot of buffer index L - 1 + i, each node seeing the context and
    its ancestors (the tree mask), at the position a chain's draft of its depth has."""
    first, end = (int(x) for x in tree.level_starts[depth - 1 : depth + 1])
    nodes = np.arange(first, end)
    width = len(nodes)
    buffer_index = np.repeat(lengths - 1, width) + np.tile(nodes, len(rows))
    seq_lens = (lengths - 1 + end).astype(np.int32)
    max_blocks = int(-(-seq_lens.max() // block_size))
    layout = BatchLayout(
        query_start_loc=(np.arange(len(rows) + 1) * width).astype(np.int32),
        seq_lens=seq_lens,
        block_table=block_table[rows, :max_blocks],
        slot_mapping=kv_slots(block_table, np.repeat(rows, width), buffer_index, block_size),
        block_size=block_size,
        tree_lens=np.full(len(rows), end, dtype=np.int32),
        tree_bits=np.tile(tree.ancestor_bits[nodes], len(rows)),
    )
    return layout, np.repeat(lengths + depth - 2, width)  # a node at depth d is fed at L + d - 2
