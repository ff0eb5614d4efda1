"""CUDA graphs for the level passes of EAGLE draft trees: one per (level, padded row count), replayed with static
buffers.

A level's pass (spec/tree_level.TreeLevelStep: the head over the level's `width` nodes of each row, then the LM
head and the top tokens that make the next level) launches a few dozen small kernels, as a chain's draft step
does. Run eagerly, a tree's drafting made its steps cost 2.6x a plain decode step on the H200 at batch 1, against
1.5x for a chain, whose draft steps replay graphs. Here a pass of n rows replays its level's graph for the next
captured row count up: padding rows are empty requests whose tokens store nothing (their outputs are never
read), and the prefill kernel, which takes every row (each row's keys end in tree nodes), runs on the grid fixed
by the shape (FixedShape, as in worker.mixed_cuda_graph). Row counts are the decode graphs' (1, 2, 4, 8, then
multiples of 16) for passes of at most `max_tokens` tokens, so the largest graph of a level computes the logits
of at most max_tokens positions, as the largest draft-step graph does of max_num_seqs. Larger passes run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from tokenmill.attention.backend import AttentionBackend, BatchLayout, FixedShape
from tokenmill.forward_context import forward_context
from tokenmill.kernels.precompile import precompile
from tokenmill.spec.tree_level import TreeLevelStep
from tokenmill.worker.cuda_graph import GiB, capture_sizes, empty_layout

logger = logging.getLogger(__name__)


def level_capture_sizes(width: int, max_num_reqs: int, max_tokens: int) -> list[int]:
    """The row counts to capture for a level of `width` nodes: those of the decode graphs, while a pass has at
    most max_tokens tokens (none if a single row's has more)."""
    max_rows = min(max_num_reqs, max_tokens // width)
    return capture_sizes(max_rows) if max_rows > 0 else []


class TreeLevelGraphRunner:
    def __init__(self, steps: list[TreeLevelStep], attn_backend: AttentionBackend, device: torch.device,
                 block_size: int, max_blocks_per_req: int, max_num_reqs: int, max_tokens: int, hidden_size: int,
                 dtype: torch.dtype) -> None:
        """`steps`: the tree's level passes; `hidden_size`, `dtype`: of the head's outputs."""
        assert attn_backend.supports_mixed_cuda_graphs
        self.attn_backend = attn_backend
        self.device = device
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.steps = {step.depth: step for step in steps}
        self.sizes = {step.depth: sizes for step in steps
                      if (sizes := level_capture_sizes(step.width, max_num_reqs, max_tokens))}
        """Each level's captured row counts (a level whose single row exceeds max_tokens has none)."""
        # Static inputs of each level, for its largest row count; zeros, so that padding rows compute on finite
        # values: positions [rows * width], the parent level's outputs [rows, parent_width, hidden_size] and the
        # level's tokens [rows, width] (none at depth 1, whose tokens are the root's top tokens).
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        for depth, sizes in self.sizes.items():
            step, rows = self.steps[depth], sizes[-1]
            self.inputs[depth] = (
                torch.zeros(rows * step.width, dtype=torch.int64, device=device),
                torch.zeros(rows, step.parent_width, hidden_size, dtype=dtype, device=device),
                None if depth == 1 else torch.zeros(rows, step.width, dtype=torch.int64, device=device),
            )
        # (depth, rows) -> (graph, its static attention metadata, its outputs: TreeLevelStep.forward's)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, object, tuple[torch.Tensor, ...]]] = {}
        self.pool = None

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """`pool`: another runner's pool to capture into (its graphs and these must never replay concurrently)."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        # largest pass first: the smaller ones reuse its memory
        keys = sorted(((depth, rows) for depth, sizes in self.sizes.items() for rows in sizes),
                      key=lambda key: -key[1] * self.steps[key[0]].width)
        precompile(lambda: [self._eager_forward(*key) for key in keys], self.device)
        for depth, rows in keys:
            metadata = self._eager_forward(depth, rows)  # a first run outside the capture (lazy initialisations)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), forward_context(self.attn_backend, metadata):
                outputs = self.steps[depth](*self._static_inputs(depth, rows))
            pool = graph.pool() if pool is None else pool
            self.graphs[depth, rows] = (graph, metadata, outputs)
        self.pool = pool
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d CUDA graphs of draft-tree levels (%s) in %.1f s, %.2f GiB", len(keys),
                    ", ".join(f"level {d}: {s[0]}-{s[-1]} rows" for d, s in self.sizes.items()),
                    time.perf_counter() - start, used / GiB)

    def _metadata(self, layout: BatchLayout, depth: int, rows: int) -> object:
        """The pass's attention metadata padded to its level's graph of `rows` rows (at the layout's block table
        width: copy_metadata fills only those columns of the graph's)."""
        padded_to = FixedShape(rows * self.steps[depth].width, 0, rows, layout.block_table.shape[1])
        return self.attn_backend.build_metadata(layout, self.device, padded_to=padded_to)

    def _eager_forward(self, depth: int, rows: int) -> object:
        """The level's padded pass of `rows` rows with none of them requests, run eagerly; returns its metadata."""
        metadata = self._metadata(empty_layout(self.max_blocks_per_req, self.block_size, trees=True), depth, rows)
        with forward_context(self.attn_backend, metadata):
            self.steps[depth](*self._static_inputs(depth, rows))
        return metadata

    def _static_inputs(self, depth: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        positions, parent_out, tokens = self.inputs[depth]
        return (positions[: rows * self.steps[depth].width], parent_out[:rows],
                None if tokens is None else tokens[:rows])

    def run(self, depth: int, layout: BatchLayout, positions: torch.Tensor, parent_out: torch.Tensor,
            tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """TreeLevelStep.forward's outputs for the pass of `layout`'s rows over level `depth` (arguments as it
        takes them), or None if no graph fits it. The outputs are views of the graph's static ones: read them
        before the next replay of any graph of the pool."""
        num_rows = len(layout.seq_lens)
        rows = self._graph_rows(depth, num_rows)
        if rows is None:
            return None
        graph, static_metadata, outputs = self.graphs[depth, rows]
        self._load(depth, rows, static_metadata, layout, positions, parent_out, tokens)
        graph.replay()
        return tuple(t[:num_rows] for t in outputs)

    def _graph_rows(self, depth: int, num_rows: int) -> int | None:
        """The captured row count of level `depth` that takes a pass of num_rows rows, None if none does."""
        sizes = self.sizes.get(depth)
        if sizes is None or num_rows > sizes[-1]:
            return None
        return sizes[bisect.bisect_left(sizes, num_rows)]

    def _load(self, depth: int, rows: int, static_metadata: object, layout: BatchLayout, positions: torch.Tensor,
              parent_out: torch.Tensor, tokens: torch.Tensor | None) -> None:
        """Copy a pass's metadata and inputs into those of its level's graph of `rows` rows (the padding rows
        keep whatever finite values they held)."""
        self.attn_backend.copy_metadata(static_metadata, self._metadata(layout, depth, rows))
        static_positions, static_parent_out, static_tokens = self.inputs[depth]
        num_rows = len(layout.seq_lens)
        static_positions[: len(positions)].copy_(positions, non_blocking=True)
        static_parent_out[:num_rows].copy_(parent_out, non_blocking=True)
        if tokens is not None:
            static_tokens[:num_rows].copy_(tokens, non_blocking=True)
