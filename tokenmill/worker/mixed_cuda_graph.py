"""CUDA graphs for steps with prefills: prompt chunks beside decodes, short prompts, draft verification.

An eager step with prefills spends 25-45 ms of host time launching its few hundred kernels on the H200's
host (BENCHMARKS.md, "Where the serving time goes"): longer than the GPU takes for a prompt chunk of a
thousand tokens on an 8B model, so such steps were host-bound. Here a step of up to `max_tokens` tokens
replays a graph captured for the next size up. The tokens past the step's own are padding (no slot: they
store nothing), the requests past its own are empty, and the attention kernels launch on grids fixed by the
captured shape (the backend's `padded_to` metadata), so one graph serves every mix of prefills and decodes
that fits it. Larger steps run eagerly: there the GPU's work outlasts the launches. Decode-only steps keep
their own graphs (worker.cuda_graph), whose split-KV decode suits long contexts.

With draft trees (speculative_token_tree) the graphs are captured with the prefill kernel's tree masks, so
that they replay tree verification too; every step they replay then carries tree fields (none: no nodes).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np
import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, BatchLayout, FixedShape
from tokenmill.worker.cuda_graph import CudaGraphRunner

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


class MixedCudaGraphRunner(CudaGraphRunner):
    captured = "CUDA graphs for steps with prefills (%d-%d tokens)"

    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        device: torch.device,
        block_size: int,
        max_blocks_per_req: int,
        max_num_reqs: int,
        max_tokens: int,
        trees: bool = False,
    ) -> None:
        """`trees`: capture with draft-tree masks (speculative_token_tree)."""
        assert attn_backend.supports_mixed_cuda_graphs
        self.max_num_reqs = max_num_reqs
        self.trees = trees
        super().__init__(model, attn_backend, device, block_size, max_blocks_per_req, max_batch_size=max_tokens)

    def _capture_sizes(self, max_size: int) -> list[int]:
        return mixed_capture_sizes(max_size)

    def _request_slots(self, size: int) -> int:
        """Requests of each kind (decodes, the others) a graph of `size` tokens has room for: every request of a
        step has a token, and a step has at most max_num_reqs."""
        return min(self.max_num_reqs, size)

    def _graph_size(self, layout: BatchLayout) -> int | None:
        num_tokens = len(layout.slot_mapping)
        if num_tokens > self.sizes[-1] or (layout.tree_lens is not None and not self.trees):
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        slots = self._request_slots(size)
        num_decodes = int(np.count_nonzero(layout.decode_requests()))  # a tree's request takes a prefill slot
        return size if num_decodes <= slots and len(layout.seq_lens) - num_decodes <= slots else None

    def _metadata(self, layout: BatchLayout, size: int) -> object:
        # The layout's own block table width: copy_metadata fills only those columns of the graph's.
        slots = self._request_slots(size)
        padded_to = FixedShape(size, slots, slots, layout.block_table.shape[1])
        if self.trees and layout.tree_lens is None:  # the graph's kernels read tree fields: a step without nodes
            layout = dataclasses.replace(layout, tree_lens=np.zeros(len(layout.seq_lens), dtype=np.int32),
                                         tree_bits=np.full(len(layout.slot_mapping), -1, dtype=np.int64))
        return self.attn_backend.build_metadata(layout, self.device, padded_to=padded_to)
