"""Draft-model proposer: a smaller model of the same vocabulary drafts k tokens, one greedy step at a time.

Its KV cache lives in the target's blocks (the same block ids, tensors of its own: the pool's blocks are
sized for both models), so the scheduler's allocation, prefix caching and preemption need nothing new.
Each proposal first brings the draft model's KV up to the request's known tokens (the tokens accepted
since its last proposal, or the whole prompt of a new request: a prefix-cache hit holds the target's
KV, not necessarily the draft's), in one varlen forward pass whose last position gives draft 1; then
k - 1 one-token steps give the rest, their layouts built together before the first runs. A one-token
step (the first pass too, when it is one token per request) replays a CUDA graph of the forward pass and
its argmax where the worker captured one. The KV it writes at drafted
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
from tokenmill.sample.sampler import greedy_ids
from tokenmill.worker.cuda_graph import CudaGraphRunner
from tokenmill.worker.input_batch import kv_slots
from tokenmill.worker.request_state import RequestStates


class GreedyDraftStep(nn.Module):
    """A drafter's forward pass followed by each row's greedy token: what a draft step's CUDA graph captures, so
    that the LM head and argmax launch nothing of their own either."""

    def __init__(self, model: nn.Module, greedy) -> None:
        super().__init__()
        self.model = model
        self.greedy = greedy

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = self.model(*inputs)
        return hidden_states, self.greedy(hidden_states)


class DraftModelProposer:
    def __init__(self, model: nn.Module, attn_backend: AttentionBackend, device: torch.device, block_size: int,
                 max_num_reqs: int) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.device = device
        self.block_size = block_size
        self.graph_step = GreedyDraftStep(model, self._greedy)
        """What the worker captures for one-token draft steps."""
        self.graph_extra_inputs: tuple[tuple[int, torch.dtype], ...] = ()
        """(width, dtype) of each per-token input the model takes beside token ids and positions (its graphs'
        extra static buffers)."""
        self.cuda_graphs: CudaGraphRunner | None = None
        """graph_step's graphs by padded batch size, set by the worker (None: eager)."""
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
        # Draft j + 1 from draft j at position length + j - 1 (all rows step together: the few that need
        # fewer drafts only waste a row of a small model's step).
        for layout, positions in self._decode_steps(states, rows, lengths, max_drafts):
            tokens = self._step(layout, tokens, positions)[1]
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
        input_ids = states.input_ids(token_rows, positions)
        if len(positions) == len(rows):  # one token each (nothing accepted last time): a step graphs may replay
            return self._step(layout, input_ids, positions)[1]
        hidden = self._forward(layout, input_ids, positions)
        return self._greedy(hidden[self._to_device(query_start_loc[1:] - 1)])

    def _decode_steps(self, states: RequestStates, rows: np.ndarray, first: np.ndarray,
                      max_drafts: np.ndarray) -> list[tuple[BatchLayout, torch.Tensor]]:
        """The layouts and device positions of the max(max_drafts) - 1 one-token steps of `rows`, the first at
        positions `first`, each one further: built together before any runs (one host-to-device copy of the
        positions). A row past its own max_drafts - 1 steps (its output unused) stays at its last draft's
        position: the slots beyond may not be the request's (near max_model_len, not even in the block table)."""
        num_steps = int(max_drafts.max()) - 1
        if num_steps <= 0:
            return []
        positions = np.minimum(first[None, :] + np.arange(num_steps)[:, None], first + max_drafts - 1)
        return self._one_token_steps(states, rows, positions)

    def _one_token_steps(self, states: RequestStates, rows: np.ndarray,
                         positions: np.ndarray) -> list[tuple[BatchLayout, torch.Tensor]]:
        """The layouts and device positions of one-token steps of `rows` at `positions` [steps, rows]."""
        num_steps = len(positions)
        block_size = self.block_size
        slots = kv_slots(states.block_table, rows[None, :], positions, block_size)
        seq_lens = (positions + 1).astype(np.int32)
        max_blocks = -(-seq_lens.max(axis=1) // block_size)
        block_table = states.block_table[rows, : int(max_blocks[-1])]
        query_start_loc = np.arange(len(rows) + 1, dtype=np.int32)
        positions_t = self._to_device(positions)
        return [(BatchLayout(query_start_loc, seq_lens[s], block_table[:, : int(max_blocks[s])], slots[s], block_size),
                 positions_t[s]) for s in range(num_steps)]

    def _layout(self, states: RequestStates, rows: np.ndarray, token_rows: np.ndarray, positions: np.ndarray,
                query_start_loc: np.ndarray, seq_lens: np.ndarray) -> BatchLayout:
        slot_mapping = kv_slots(states.block_table, token_rows, positions, self.block_size)
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        return BatchLayout(query_start_loc, seq_lens, states.block_table[rows, :max_blocks], slot_mapping,
                           self.block_size)

    def _step(self, layout: BatchLayout, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray | torch.Tensor,
              hidden: torch.Tensor | None = None, placed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A pass of one token per row: its output hidden states and each row's greedy token, from one graph
        replay where a graph fits (the hidden states are then the graph's static output: use them before its
        next replay), else eagerly. `placed`: `positions` (on the device) are at or before the layout's, which the
        attention metadata is moved to on the device (AttentionBackend.place_decodes)."""
        place = None
        if placed:
            place = lambda metadata: self.attn_backend.place_decodes(metadata, positions, self.block_size)  # noqa: E731
        if self.cuda_graphs is not None:
            out = self.cuda_graphs.run(layout, self._tensor(input_ids), self._tensor(positions),
                                       *(() if hidden is None else (hidden,)), place=place)
            if out is not None:
                hidden_states, tokens = out
                return hidden_states, tokens.clone()  # the drafts of every step are stacked after the last
        hidden_states = self._forward(layout, input_ids, positions, hidden=hidden, place=place)
        return hidden_states, self._greedy(hidden_states)

    def _forward(self, layout: BatchLayout, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray | torch.Tensor,
                 hidden: torch.Tensor | None = None, place=None) -> torch.Tensor:
        """An eager pass; `hidden`: the extra input of a head that drafts from hidden states (spec/eagle.py);
        `place(metadata)`: as in CudaGraphRunner.run."""
        metadata = self.attn_backend.build_metadata(layout, self.device)
        if place is not None:
            place(metadata)
        with forward_context(self.attn_backend, metadata):
            if hidden is not None:
                return self.model(self._tensor(input_ids), self._tensor(positions), hidden)
            return self.model(self._tensor(input_ids), self._tensor(positions))

    def _greedy(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return greedy_ids(self.model.compute_logits(hidden_states))

    def _top_tokens(self, hidden_states: torch.Tensor, k: int) -> torch.Tensor:
        """Each position's k most likely tokens [n, k], most likely first (a draft tree's children)."""
        return self.model.compute_logits(hidden_states).topk(k, dim=-1).indices

    def _tensor(self, values: np.ndarray | torch.Tensor) -> torch.Tensor:
        return values if isinstance(values, torch.Tensor) else self._to_device(values)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
