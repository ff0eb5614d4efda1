"""The shape of a draft tree (speculative_token_tree): its nodes breadth-first, and what drafting, attention and
verification read from it.

Node i (0-based, breadth-first: every node after its parent, each level's nodes together, a parent's children
together in rank order) is the rank[i]-th most likely token after its parent (-1: the root, the request's last
known token). In a step that verifies a tree, the request's token buffer holds node i at index L + i (L: its
known tokens), so its KV goes to that slot; its position is L - 1 + depth[i]. A tree's first m nodes are a tree
too (a request with less room drafts fewer of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TokenTree:
    paths: tuple[tuple[int, ...], ...]
    parent: np.ndarray  # [num_nodes] int64: the parent node, -1 for the root's children
    depth: np.ndarray  # [num_nodes] int64: 1 for the root's children
    rank: np.ndarray  # [num_nodes] int64: which of its parent's most likely tokens the node is
    ancestor_bits: np.ndarray  # [num_nodes] int64: bit j set where node j is the node itself or its ancestor
    children: np.ndarray  # [1 + num_nodes, max_children] int64: row 0 the root's, row 1 + i node i's; -1 padding
    level_starts: np.ndarray  # [depth + 1] int64: level d is nodes [level_starts[d - 1], level_starts[d])

    @classmethod
    def from_paths(cls, paths: tuple[tuple[int, ...], ...]) -> TokenTree:
        """`paths`: breadth-first sorted and checked (config.parse_token_tree)."""
        index = {path: i for i, path in enumerate(paths)}
        parent = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=np.int64)
        depth = np.array([len(p) for p in paths], dtype=np.int64)
        rank = np.array([p[-1] for p in paths], dtype=np.int64)
        bits = np.zeros(len(paths), dtype=np.int64)
        for i in range(len(paths)):
            bits[i] = (1 << i) | (bits[parent[i]] if parent[i] >= 0 else 0)
        num_children = np.bincount(parent + 1, minlength=len(paths) + 1)
        children = np.full((len(paths) + 1, max(1, int(num_children.max()))), -1, dtype=np.int64)
        for i in range(len(paths)):
            children[parent[i] + 1, rank[i]] = i
        level_starts = np.searchsorted(depth, np.arange(1, int(depth[-1]) + 2))
        return cls(paths, parent, depth, rank, bits, children, level_starts.astype(np.int64))

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return int(self.depth[-1])

    def depth_of(self, num_nodes: np.ndarray) -> np.ndarray:
        """The depth of the tree of each count of first nodes (0 for none)."""
        return np.where(num_nodes > 0, self.depth[np.maximum(num_nodes, 1) - 1], 0)


def tree_mask(bits: torch.Tensor, seq_len: int, tree_len: int) -> torch.Tensor:
    """[n, seq_len] bool: the keys n queries of a request with `tree_len` tree nodes at the end of its keys may
    see beside causality: the keys before the nodes, and the nodes whose bit is set in each query's `bits` [n]."""
    node = torch.arange(seq_len, device=bits.device) - (seq_len - tree_len)
    bit = (bits[:, None] >> node.clamp(0, 63)[None, :]) & 1
    return (node[None, :] < 0) | (bit != 0)
