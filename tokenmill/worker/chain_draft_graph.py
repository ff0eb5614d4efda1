"""An EAGLE chain drafted right after a verification (spec/eagle.py draft_after_verify) in one CUDA graph per padded
row count: the head's pass over each row's verified positions, then its k - 1 one-token steps.

Drafted pass by pass, that chain is k graph replays with some fifteen small launches around each (metadata
copies, positions moved on the device, the last emitted token's state picked out): on the H200 the host took
longer to launch an EAGLE-3 k = 4 step than the GPU to run it. Here the host copies the rows' inputs into static
buffers and replays once. Every position is computed on the device from the rows' first verified position, their
emitted counts and shift (a step launched ahead: worker/verify_ahead.py), as the eager passes do.

Each row takes 1 + k slots of the first pass whatever it verified: the slots past its drafts, and padding rows,
sit at position -1, which stores nothing and attends to nothing (AttentionBackend.place_decodes, `padded`).
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.device_copy import pack_to_device
from tokenmill.forward_context import forward_context
from tokenmill.kernels.precompile import precompile
from tokenmill.worker.cuda_graph import capture_sizes, empty_layout, pad_layout

logger = logging.getLogger(__name__)


class ChainDraftGraphs:
    def __init__(self, proposer, attn_backend: AttentionBackend, device: torch.device, block_size: int,
                 max_blocks_per_req: int, max_rows: int) -> None:
        """`proposer`: an EagleProposer drafting chains of proposer.max_drafts tokens."""
        self.step = proposer.graph_step
        self.from_target = proposer.from_target
        self.attn_backend = attn_backend
        self.device = device
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.num_drafts = proposer.max_drafts
        self.sizes = capture_sizes(max_rows)
        rows, slots = self.sizes[-1], self.sizes[-1] * (1 + self.num_drafts)
        (_, dtype), = proposer.graph_extra_inputs
        # Static inputs, sliced per size. Zeros: rows never written compute on finite values.
        self.target_states = torch.zeros(slots, proposer.target_state_width, dtype=dtype, device=device)
        self.tokens = torch.zeros(rows, 1 + self.num_drafts, dtype=torch.int64, device=device)
        self.num_emitted = torch.ones(rows, dtype=torch.int64, device=device)
        self.shift = torch.zeros(rows, dtype=torch.int64, device=device)
        self.row_fields = torch.full((3, rows), -1, dtype=torch.int64, device=device)
        """Each row's first verified position, its draft count and its last drafting position (-1: padding)."""
        self.block_table = torch.zeros(rows, max_blocks_per_req, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple]] = {}
        """size -> (graph, its drafts [size, k], the static metadata of its first pass and of its steps: kept, the
        graph reads and writes their tensors)."""

    @torch.inference_mode()
    def capture(self, pool) -> None:
        start = time.perf_counter()
        metadata = {size: (self._metadata(size * (1 + self.num_drafts)), self._metadata(size)) for size in self.sizes}
        precompile(lambda: [self._draft(size, *metadata[size]) for size in self.sizes], self.device)
        for size in reversed(self.sizes):
            self._draft(size, *metadata[size])  # a first run outside the capture (lazy initialisations)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                drafts = self._draft(size, *metadata[size])
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, drafts, metadata[size])
        torch.cuda.synchronize(self.device)
        logger.info("captured %d graphs of whole draft chains after verification (rows %d-%d) in %.1f s",
                    len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def _metadata(self, num_rows: int) -> object:
        """Decode metadata of `num_rows` rows at no position: place_decodes sets each pass's in the graph."""
        return self.attn_backend.build_metadata(
            pad_layout(empty_layout(self.max_blocks_per_req, self.block_size), num_rows), self.device)

    def _draft(self, size: int, first_pass, chain) -> torch.Tensor:
        """The chain of `size` rows from the static inputs: drafts [size, k] (what a graph captures)."""
        width = 1 + self.num_drafts
        first, num_drafts, last = self.row_fields[:, :size]
        base = first - self.shift[:size]
        within = torch.arange(width, device=self.device)
        # Slot j of a row: its verified position first + j, for j up to its draft count.
        positions = torch.where(within <= num_drafts[:, None], base[:, None] + within, -1).reshape(-1)
        block_table = self.block_table[:size]
        self.attn_backend.place_decodes(first_pass, positions, self.block_size,
                                        block_table=block_table.repeat_interleave(width, dim=0), padded=True)
        with forward_context(self.attn_backend, first_pass):
            hidden, drafts = self.step(self.tokens[:size].clamp(min=0).reshape(-1), positions.clamp(min=0),
                                       self.from_target(self.target_states[: size * width]))
        # The output at the last emitted token's predecessor gives draft 1 (eagle.py draft_after_verify).
        at = torch.arange(size, device=self.device) * width + (self.num_emitted[:size] - 1).clamp(min=0)
        hidden, tokens = hidden[at], drafts[at]
        steps = [tokens]
        step_start = base + self.num_emitted[:size]
        for i in range(self.num_drafts - 1):
            positions = torch.minimum(step_start + i, last)  # padding rows: last = -1
            self.attn_backend.place_decodes(chain, positions, self.block_size,
                                            block_table=block_table if i == 0 else None, padded=True)
            with forward_context(self.attn_backend, chain):
                hidden, tokens = self.step(tokens, positions.clamp(min=0), hidden)
            steps.append(tokens)
        return torch.stack(steps, dim=1)

    def run(self, block_table: np.ndarray, first: np.ndarray, num_drafts: np.ndarray, last: np.ndarray,
            target_states: torch.Tensor, tokens: torch.Tensor, num_emitted: torch.Tensor,
            shift: torch.Tensor | None) -> torch.Tensor | None:
        """draft_after_verify's chains [n, k] for its n rows (their block tables [n, width] and the arguments
        draft_after_verify takes, `last`: each row's last drafting position), None if no graph fits."""
        num_rows = len(first)
        if num_rows > self.sizes[-1]:
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, num_rows)]
        fields = np.full((3, size), -1, dtype=np.int64)
        fields[:, :num_rows] = first, num_drafts, last
        counts = 1 + num_drafts
        slots = np.repeat(np.arange(num_rows) * (1 + self.num_drafts) - np.cumsum(counts) + counts, counts)
        slots += np.arange(counts.sum())  # row i's verified positions go to its slots i * (1 + k) + j
        fields_t, slots_t, block_table_t = pack_to_device([fields, slots, block_table], self.device)[2]
        self.row_fields[:, :size].copy_(fields_t)
        self.block_table[:num_rows, : block_table.shape[1]].copy_(block_table_t)
        self.target_states.index_copy_(0, slots_t, target_states)
        self.tokens[:num_rows, : tokens.shape[1]].copy_(tokens)
        self.num_emitted[:num_rows].copy_(num_emitted)
        if shift is None:
            self.shift[:num_rows].zero_()
        else:
            self.shift[:num_rows].copy_(shift)
        graph, drafts, _ = self.graphs[size]
        graph.replay()
        return drafts[:num_rows].clone()  # the graph's output is overwritten by its next replay
