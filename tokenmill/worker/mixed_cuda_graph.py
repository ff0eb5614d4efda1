"""CUDA graphs for steps with prefills: prompt chunks beside decodes, short prompts, draft verification.

An eager step with prefills spends 25-45 ms of host time launching its few hundred kernels on the H200's
host (BENCHMARKS.md, "Where the serving time goes"): longer than the GPU takes for a prompt chunk of a
thousand tokens on an 8B model, so such steps were host-bound. Here a step of up to `max_tokens` tokens
replays a graph captured for the next size up. The tokens past the step's own are padding (no slot: they
store nothing), the requests past its own are empty, and the attention kernels launch on grids fixed by the
captured shape (the backend's `padded_to` metadata), so one graph serves every mix of prefills and decodes
that fits it. Larger steps run eagerly: there the GPU's work outlasts the launches. Decode-only steps keep
their own graphs (worker.cuda_graph), whose split-KV decode suits long contexts.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, BatchLayout, FixedShape
from tokenmill.forward_context import forward_context
from tokenmill.kernels.precompile import precompile

logger = logging.getLogger(__name__)

GiB = 1 << 30

DEFAULT_MAX_TOKENS = 2048
"""Beyond about this many tokens an 8B model's step on an H200 outlasts its eager launches."""


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture. A step pads up to the next one, and padding costs GPU time in proportion:
    steps of 64 tokens up to 1,024 (at most 6% padding past 1,024), of 128 beyond."""
    sizes = [16, 32, 64] + list(range(128, 1025, 64)) + list(range(1152, max_tokens + 1, 128))
    sizes = [s for s in sizes if s <= max_tokens]
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


class MixedCudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        device: torch.device,
        block_size: int,
        max_blocks_per_req: int,
        max_num_reqs: int,
        max_tokens: int,
    ) -> None:
        assert attn_backend.supports_mixed_cuda_graphs
        self.model = model
        self.attn_backend = attn_backend
        self.device = device
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.max_num_reqs = max_num_reqs
        self.sizes = mixed_capture_sizes(max_tokens)
        self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)  # [max_tokens]
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)  # [max_tokens]
        # size -> (graph, its static attention metadata, its output hidden states or tuple of them)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, torch.Tensor | tuple[torch.Tensor, ...]]] = {}

    def _shape(self, size: int, num_block_columns: int) -> FixedShape:
        """A graph of `size` tokens has room for as many requests as the step may have of either kind."""
        slots = min(self.max_num_reqs, size)
        return FixedShape(size, slots, slots, num_block_columns)

    def _metadata(self, layout: BatchLayout, size: int, num_block_columns: int) -> object:
        padded_to = self._shape(size, num_block_columns)
        return self.attn_backend.build_metadata(layout, self.device, padded_to=padded_to)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        precompile(lambda: [self._eager_forward(size) for size in self.sizes], self.device)
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
            metadata = self._eager_forward(size)
            input_ids, positions = self.input_ids[:size], self.positions[:size]
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), forward_context(self.attn_backend, metadata):
                hidden_states = self.model(input_ids, positions)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, metadata, hidden_states)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d CUDA graphs for steps with prefills (%d-%d tokens) in %.1f s, %.2f GiB",
                    len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start, used / GiB)

    def _eager_forward(self, size: int) -> object:
        """A step of `size` padding tokens and no requests, run eagerly; returns its attention metadata."""
        empty = BatchLayout(
            query_start_loc=np.zeros(1, dtype=np.int32),
            seq_lens=np.zeros(0, dtype=np.int32),
            block_table=np.zeros((0, self.max_blocks_per_req), dtype=np.int32),
            slot_mapping=np.zeros(0, dtype=np.int64),
            block_size=self.block_size,
        )
        metadata = self._metadata(empty, size, self.max_blocks_per_req)
        with forward_context(self.attn_backend, metadata):
            self.model(self.input_ids[:size], self.positions[:size])
        return metadata

    def run(self, layout: BatchLayout, input_ids: torch.Tensor,
            positions: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """Hidden states [num_tokens, hidden_size] of the step (a tuple where the model returns several), or
        None if no graph fits it."""
        num_tokens = len(layout.slot_mapping)
        if num_tokens > self.sizes[-1]:
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        num_decodes = int(np.count_nonzero(np.diff(layout.query_start_loc) == 1))
        shape = self._shape(size, 0)
        if num_decodes > shape.num_decodes or len(layout.seq_lens) - num_decodes > shape.num_prefills:
            return None
        graph, static_metadata, hidden_states = self.graphs[size]
        # The step's own block table width: copy_metadata fills only those columns of the graph's.
        metadata = self._metadata(layout, size, layout.block_table.shape[1])
        self.attn_backend.copy_metadata(static_metadata, metadata)
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        graph.replay()
        if isinstance(hidden_states, tuple):
            return tuple(t[:num_tokens] for t in hidden_states)
        return hidden_states[:num_tokens]
