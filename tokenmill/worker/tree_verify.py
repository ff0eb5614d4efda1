"""A step's verification of draft trees on the worker (speculative_token_tree), after its forward pass.

Each verifying request computed its root (last known token) and its tree's first d nodes, node i in the
slot of buffer index L + i. spec/tree_rejection.py walks each tree; then the accepted path's KV moves to the
slots the request now holds (its j-th accepted node to index L + j: each slot read before any is written), so
the rejected nodes' slots are free for the next step, and the drafter observes the target's states in that
order too (the path first, the rest past the request's new length, where nothing reads them).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill.device_copy import pack_to_device
from tokenmill.layers.attention import Attention
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import LogprobsTensors, Sampler, SamplerOutput, gather_logprobs, raw_scores
from tokenmill.sample.state import SamplingState
from tokenmill.spec.tree import TokenTree
from tokenmill.spec.tree_rejection import TreeVerifyBatch, verify_tree
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.pending_output import VerifiedTokens
from tokenmill.worker.request_state import RequestStates


class TreeVerification:
    def __init__(self, tree: TokenTree, sampler: Sampler, model: nn.Module, device: torch.device) -> None:
        self.tree = tree
        self.sampler = sampler
        self.kv_layers = [m for m in model.modules() if isinstance(m, Attention)]
        """The target's attention layers, whose KV the accepted paths move."""
        self.device = device
        self.children = torch.from_numpy(tree.children).to(device)

    def sample_and_verify(self, logits: torch.Tensor, batch: InputBatch, metadata: SamplingMetadata,
                          states: RequestStates, sampling_state: SamplingState,
                          ) -> tuple[VerifiedTokens, SamplerOutput, torch.Tensor]:
        """As SpeculativeDecoding.sample_and_verify; also returns the order [num_tokens] in which the drafter
        observes the step's hidden states (each tree's accepted path right after its root)."""
        tree = self.tree
        counts = 1 + batch.sampled_num_drafts
        starts = np.cumsum(counts) - counts
        verifying = np.flatnonzero(batch.sampled_num_drafts)
        num_nodes = batch.sampled_num_drafts[verifying]
        draft_rows = batch.sampled_rows[verifying]
        columns = np.minimum(np.arange(tree.num_nodes)[None, :], num_nodes[:, None] - 1)  # [r, N], clamped
        node_tokens = states.token_ids[draft_rows[:, None], states.num_tokens[draft_rows, None] + columns]
        logit_positions = starts[verifying, None] + np.concatenate([np.zeros_like(columns[:, :1]), 1 + columns], 1)
        node_flat = batch.logits_indices[logit_positions[:, 1:]]  # [r, N] each node's token in the batch
        node_slots = batch.layout.slot_mapping[node_flat]
        is_greedy = sampling_state.columns.is_greedy[draft_rows]
        host = [starts + counts - 1, verifying, node_tokens, num_nodes, logit_positions, is_greedy, node_slots,
                node_flat]
        last_t, rows_t, tokens_t, num_nodes_t, positions_t, greedy_t, slots_t, flat_t = (
            pack_to_device(host, self.device)[2])
        output = self.sampler(logits[last_t], metadata)
        verify = TreeVerifyBatch(rows_t, tokens_t, num_nodes_t, positions_t, greedy_t, bool(is_greedy.all()),
                                 self.children, tree.max_depth)
        verified, num_verified, path = verify_tree(logits, verify, metadata)
        tokens = torch.full((len(counts), 1 + tree.max_depth), -1, dtype=torch.int64, device=logits.device)
        tokens[:, 0] = output.token_ids
        tokens[rows_t] = verified
        num_emitted = torch.ones(len(counts), dtype=torch.int64, device=logits.device)
        num_emitted[rows_t] = num_verified
        self._move_accepted_kv(path, slots_t)
        num_positions = np.zeros(len(counts), dtype=np.int64)
        num_positions[verifying] = tree.depth_of(num_nodes)
        entries = 1 + num_positions
        logprob_starts = np.cumsum(entries) - entries
        if metadata.max_num_logprobs is not None:
            output.logprobs = self._path_logprobs(logits, tokens, last_t, rows_t, positions_t, path, entries,
                                                  metadata.max_num_logprobs)
        order = torch.arange(len(batch.input_ids), device=logits.device)
        destinations = flat_t[:, : tree.max_depth]
        order[destinations.flatten()] = torch.where(path >= 0, flat_t.gather(1, path.clamp(min=0)),
                                                    destinations).flatten()
        verified_tokens = VerifiedTokens(tokens, num_emitted, batch.sampled_num_drafts, logprob_starts, num_positions)
        return verified_tokens, output, order

    def _move_accepted_kv(self, path: torch.Tensor, node_slots: torch.Tensor) -> None:
        """path [r, max_depth] accepted nodes (-1: none); node_slots [r, num_nodes] each node's slot."""
        destinations = node_slots[:, : path.shape[1]]
        sources = torch.where(path >= 0, node_slots.gather(1, path.clamp(min=0)), destinations)
        sources, destinations = sources.flatten(), destinations.flatten()
        for layer in self.kv_layers:
            layer.move_kv_slots(sources, destinations)

    def _path_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, last: torch.Tensor, rows: torch.Tensor,
                       positions: torch.Tensor, path: torch.Tensor, entries: np.ndarray, num_top: int
                       ) -> LogprobsTensors:
        """Raw logprobs of each emitted token where it was emitted: the root, then each accepted node (entries
        past a row's emitted tokens carry placeholders; nobody reads them)."""
        width = tokens.shape[1]
        index = last[:, None].repeat(1, width)  # rows that only sampled: their one position
        nodes = torch.cat([torch.zeros_like(path[:, :1]), 1 + path.clamp(min=0)], dim=1)
        index[rows] = positions.gather(1, nodes)
        selected = torch.from_numpy(np.concatenate([i * width + np.arange(n) for i, n in enumerate(entries)]))
        selected = selected.to(logits.device)
        emitted = tokens.flatten()[selected].clamp(min=0)
        scores = raw_scores(logits[index.flatten()[selected]], self.sampler.logprobs_mode)
        return gather_logprobs(scores, emitted, num_top)
