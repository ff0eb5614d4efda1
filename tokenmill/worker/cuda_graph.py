"""CUDA graphs for decode-only steps: captured once per padded batch size, replayed with static buffers.

A decode step launches a few hundred small kernels; replaying them from a graph removes the launch
cost. The batch is padded up to the nearest captured size: padding requests have no context and a
negative slot, so they store nothing and read nothing. Every graph shares one memory pool, captured
largest first (a drafter's graphs may join the target's pool: the two never replay at once). Only the
target's forward pass is captured, its logits and sampling run eagerly on its output; a drafter's step
captures its greedy tokens too (spec/draft_model.GreedyDraftStep).

A model may take per-token inputs beside the token ids and positions (an EAGLE head's hidden states
[n, width]): each gets a static buffer of its own that run() copies the step's rows into. The graphs for
steps with prefills (worker.mixed_cuda_graph) are this runner with other sizes, another fit test and
metadata padded to a fixed shape: the three hooks _capture_sizes, _graph_size and _metadata.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, BatchLayout
from tokenmill.forward_context import forward_context
from tokenmill.kernels.precompile import precompile

logger = logging.getLogger(__name__)

GiB = 1 << 30


def capture_sizes(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    sizes = [s for s in sizes if s <= max_batch_size]
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def empty_layout(max_blocks_per_req: int, block_size: int, trees: bool = False) -> BatchLayout:
    """A step with no requests: what a graph's first, eager run pads to its size (`trees`: with the tree fields)."""
    return BatchLayout(
        query_start_loc=np.zeros(1, dtype=np.int32),
        seq_lens=np.zeros(0, dtype=np.int32),
        block_table=np.zeros((0, max_blocks_per_req), dtype=np.int32),
        slot_mapping=np.zeros(0, dtype=np.int64),
        block_size=block_size,
        tree_lens=np.zeros(0, dtype=np.int32) if trees else None,
        tree_bits=np.zeros(0, dtype=np.int64) if trees else None,
    )


def pad_layout(layout: BatchLayout, size: int, num_block_columns: int | None = None) -> BatchLayout:
    """A decode-only layout grown to `size` requests of one token each; the padding attends to nothing."""
    num_reqs = len(layout.seq_lens)
    num_pad = size - num_reqs
    width = layout.block_table.shape[1] if num_block_columns is None else num_block_columns
    block_table = np.zeros((size, width), dtype=np.int32)
    block_table[:num_reqs, : layout.block_table.shape[1]] = layout.block_table
    return BatchLayout(
        query_start_loc=np.arange(size + 1, dtype=np.int32),
        seq_lens=np.concatenate([layout.seq_lens, np.zeros(num_pad, dtype=np.int32)]),
        block_table=block_table,
        slot_mapping=np.concatenate([layout.slot_mapping, np.full(num_pad, -1, dtype=np.int64)]),
        block_size=layout.block_size,
    )


class CudaGraphRunner:
    captured = "decode CUDA graphs (batch sizes %d-%d)"
    """The start-up log's name for what this runner captures, with its smallest and largest size."""

    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        device: torch.device,
        block_size: int,
        max_blocks_per_req: int,
        max_batch_size: int,
        extra_inputs: tuple[tuple[int, torch.dtype], ...] = (),
    ) -> None:
        """`extra_inputs`: (width, dtype) of each per-token input the model takes after input_ids and positions."""
        self.model = model
        self.attn_backend = attn_backend
        self.device = device
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.sizes = self._capture_sizes(max_batch_size)
        self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)  # [max_batch_size]
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)  # [max_batch_size]
        # [max_batch_size, width] each; zeros, so that padding rows compute on finite values
        self.extra_inputs = [torch.zeros(self.sizes[-1], width, dtype=dtype, device=device)
                             for width, dtype in extra_inputs]
        self.pool = None
        """The graphs' memory pool handle, once captured."""
        # size -> (graph, its static attention metadata, its output hidden states [size, hidden_size], or
        # those and the auxiliary layers' a proposer asked the model for (EAGLE-3))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, torch.Tensor | tuple[torch.Tensor, ...]]] = {}

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """`pool`: another runner's pool to capture into (its graphs and these must never replay concurrently)."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        # every size's kernels compile together, before any capture
        precompile(lambda: [self._eager_forward(size) for size in self.sizes], self.device)
        for size in reversed(self.sizes):
            metadata = self._eager_forward(size)  # a first run outside the capture (lazy initialisations)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), forward_context(self.attn_backend, metadata):
                hidden_states = self.model(*self._static_inputs(size))
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, metadata, hidden_states)
        self.pool = pool
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d " + self.captured + " in %.1f s, %.2f GiB",
                    len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start, used / GiB)

    def _capture_sizes(self, max_size: int) -> list[int]:
        return capture_sizes(max_size)

    def _graph_size(self, layout: BatchLayout) -> int | None:
        """The captured size that takes this step, None if none does: here one token per request."""
        num_reqs = len(layout.seq_lens)
        if len(layout.slot_mapping) != num_reqs or num_reqs > self.sizes[-1] or layout.tree_lens is not None:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_reqs)]

    def _metadata(self, layout: BatchLayout, size: int) -> object:
        """The step's attention metadata padded to a graph of `size` (at the layout's block table width)."""
        return self.attn_backend.build_metadata(pad_layout(layout, size), self.device)

    def _eager_forward(self, size: int) -> object:
        """The padded step of `size` with no requests, run eagerly; returns its attention metadata."""
        metadata = self._metadata(empty_layout(self.max_blocks_per_req, self.block_size), size)
        with forward_context(self.attn_backend, metadata):
            self.model(*self._static_inputs(size))
        return metadata

    def _static_inputs(self, size: int) -> list[torch.Tensor]:
        return [self.input_ids[:size], self.positions[:size]] + [buffer[:size] for buffer in self.extra_inputs]

    def run(self, layout: BatchLayout, input_ids: torch.Tensor, positions: torch.Tensor,
            *extra_inputs: torch.Tensor, place=None) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """Hidden states [num_tokens, hidden_size] of the step (a tuple where the model returns several), or
        None if no graph fits it. The result is a view of the graph's static output: read it before the next
        replay of any graph of the pool. `place(metadata)`: changes the copied metadata on the device (a drafter's
        positions known only there: AttentionBackend.place_decodes)."""
        size = self._graph_size(layout)
        if size is None:
            return None
        num_tokens = len(layout.slot_mapping)
        graph, static_metadata, hidden_states = self.graphs[size]
        self.attn_backend.copy_metadata(static_metadata, self._metadata(layout, size))
        if place is not None:
            place(static_metadata)
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        for buffer, values in zip(self.extra_inputs, extra_inputs, strict=True):
            buffer[:num_tokens].copy_(values, non_blocking=True)
        graph.replay()
        if isinstance(hidden_states, tuple):
            return tuple(t[:num_tokens] for t in hidden_states)
        return hidden_states[:num_tokens]
