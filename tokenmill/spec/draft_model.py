"""Draft-model proposer: a smaller model of the same vocabulary drafts k tokens, one greedy step at a time.

Its KV cache lives in the target's blocks (the same block ids, tensors of its own: the pool's blocks are
sized for both models), so the scheduler's allocation, prefix caching and preemption need nothing new.
Each proposal first brings the draft model's KV up to the request's known tokens (the tokens accepted
since its last proposal, or the whole prompt of a new request: a prefix-cache hit holds the target's
KV, not necessarily the draft's), in one varlen forward pass whose last position gives draft 1; then
k - 1 one-token steps (decode CUDA graphs where captured) give the rest. The KV it writes at drafted
positions is not counted as computed: the next proposal rewrites it from the tokens actually emitted.

Greedy drafts are a deterministic function of the context, so the rejection rule's draft distribution
is one-hot at the draft (spec/rejection.py): exact for sampled requests too.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, BatchLayout
from tokenmill.device_copy import to_device
from tokenmill.forward_context import forward_context
from tokenmill.worker.cuda_graph import CudaGraphRunner
from tokenmill.worker.request_state import RequestStates


class DraftModelProposer:
    def __init__(self, model: nn.Module, attn_backend: AttentionBackend, device: torch.device, block_size: int,
                 max_num_reqs: int) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.device = device
        self.block_size = block_size
        self.cuda_graphs: CudaGraphRunner | None = None
        """The draft model's decode graphs, set by the worker (None: eager)."""
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        """Tokens of each row whose draft-model KV is in the cache."""
        self._generation = np.full(max_num_reqs, -1, dtype=np.int64)
        """The RequestStates row generation the counts above belong to."""

    @torch.inference_mode()
    def propose(self, states: RequestStates, rows: np.ndarray, max_drafts: np.ndarray) -> list[np.ndarray]:
        fresh = states.row_generation[rows] != self._generation[rows]
        self.num_computed[rows[fresh]] = 0  # a new request (or a resumed one) in this row
        self._generation[rows] = states.row_generation[rows]
        lengths = states.num_tokens[rows]
        start = np.minimum(self.num_computed[rows], lengths - 1)
        tokens = self._catch_up(states, rows, start, lengths)
        self.num_computed[rows] = lengths
        drafts = [tokens]
        for j in range(1, int(max_drafts.max())):
            # Draft j + 1 from draft j at position length + j - 1 (all rows step together: the few that need
            # fewer drafts only waste a row of a small model's step).
            tokens = self._step(states, rows, lengths + j - 1, tokens)
            drafts.append(tokens)
        drafted = torch.stack(drafts, dim=1).cpu().numpy()
        return [drafted[i, :k] for i, k in enumerate(max_drafts.tolist())]

    def _catch_up(self, states: RequestStates, rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> torch.Tensor:
        """KV for positions [start, end) of each row; the greedy token after each row's last position."""
        num_new = end - start
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start_loc[1:])
        token_rows = np.repeat(rows, num_new)
        positions = np.repeat(start, num_new) + np.arange(query_start_loc[-1]) - np.repeat(query_start_loc[:-1],
                                                                                           num_new)
        layout = self._layout(states, rows, token_rows, positions, query_start_loc, end.astype(np.int32))
        hidden = self._forward(layout, states.token_ids[token_rows, positions], positions, graphs=False)
        return self._greedy(hidden[self._to_device(query_start_loc[1:] - 1)])

    def _step(self, states: RequestStates, rows: np.ndarray, positions: np.ndarray,
              input_ids: torch.Tensor) -> torch.Tensor:
        layout = self._layout(states, rows, rows, positions, np.arange(len(rows) + 1, dtype=np.int32),
                              (positions + 1).astype(np.int32))
        return self._greedy(self._forward(layout, input_ids, positions, graphs=True))

    def _layout(self, states: RequestStates, rows: np.ndarray, token_rows: np.ndarray, positions: np.ndarray,
                query_start_loc: np.ndarray, seq_lens: np.ndarray) -> BatchLayout:
        slot_mapping = states.block_table[token_rows, positions // self.block_size].astype(np.int64) * self.block_size
        slot_mapping += positions % self.block_size
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        return BatchLayout(query_start_loc, seq_lens, states.block_table[rows, :max_blocks], slot_mapping,
                           self.block_size)

    def _forward(self, layout: BatchLayout, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray,
                 graphs: bool, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """`hidden`: the extra input of a head that drafts from hidden states (spec/eagle.py); eager."""
        if isinstance(input_ids, np.ndarray):
            input_ids = self._to_device(input_ids)
        positions_t = self._to_device(positions)
        if graphs and self.cuda_graphs is not None:
            hidden = self.cuda_graphs.run(layout, input_ids, positions_t)
            if hidden is not None:
                return hidden
        metadata = self.attn_backend.build_metadata(layout, self.device)
        with forward_context(self.attn_backend, metadata):
            if hidden is not None:
                return self.model(input_ids, positions_t, hidden)
            return self.model(input_ids, positions_t)

    def _greedy(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states).argmax(dim=-1)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
