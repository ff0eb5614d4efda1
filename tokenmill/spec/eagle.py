"""EAGLE (EAGLE-1) proposer: a small decoder head drafts from the target's own hidden states.

The head (usually one Llama decoder layer) sees, at position p, `fc(cat(embed(token[p + 1]), h[p]))`, where
h[p] is the target's last hidden state at p (the one its LM head reads); its output at p stands in for
the target's h[p + 1], so the shared LM head gives token[p + 2]. Draft 1 comes from the target's hidden
state at the position that produced the last known token; drafts 2..k from the head's own output.

The head's KV lives in the target's blocks, as the draft model's does (DraftModelProposer, whose layout
and forward machinery this reuses). The target's hidden states reach it through `observe`, called after
every target forward pass: positions whose next token is surely on the host are run through the head
at once (a prompt's chunks), the others wait in a small per-row window until the next proposal (or
observation) knows their next token. Only the acceptance rate depends on the head: a position whose
hidden state was never seen (a prefix-cache hit, an overflowing window) leaves whatever KV its slot holds.

With a draft tree (spec/tree.py) the head drafts level by level: the root's children are its top tokens at
the last known position, and one pass per level runs the head over that level's nodes (node i's KV in the slot
of buffer index L - 1 + i, each node attending to the context and its ancestors only: the tree mask), whose
outputs give the next level's tokens, each node's children its top tokens (spec/tree_level.py: a level's pass,
LM head and top-k included, replays a CUDA graph where the worker captured one for its row count).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.attention.backend import AttentionBackend, BatchLayout
from tokenmill.forward_context import forward_context
from tokenmill.layers.embedding import VocabParallelEmbedding
from tokenmill.model.base import LLAMA_STACKED_PARAMS, load_weights_by_name
from tokenmill.model.llama import LlamaDecoderLayer
from tokenmill.spec.draft_model import DraftModelProposer
from tokenmill.spec.tree import TokenTree
from tokenmill.spec.tree_level import TreeLevelStep, level_layout
from tokenmill.worker.chain_draft_graph import ChainDraftGraphs
from tokenmill.worker.request_state import RequestStates
from tokenmill.worker.tree_cuda_graph import TreeLevelGraphRunner


class EagleHead(nn.Module):
    """An EAGLE-1 head in the published layout: `fc` [hidden, 2 * hidden] (maybe a bias), `layers.i.*` (layer
    0 without an input norm unless the checkpoint has one), no final norm; the target's embedding and LM
    head unless the checkpoint brings its own embedding."""

    def __init__(self, config: PretrainedConfig, names: set[str], target_embed: nn.Module, compute_logits) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias="fc.bias" in names)
        bias = getattr(config, "attention_bias", False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, bias, bias, False)
                                    for i in range(config.num_hidden_layers))
        if "layers.0.input_layernorm.weight" not in names:
            self.layers[0].input_layernorm = nn.Identity()
        if "embed_tokens.weight" in names:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        else:
            object.__setattr__(self, "embed_tokens", target_embed)  # the target's: not a submodule of the head
        self._compute_logits = compute_logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.fc(torch.cat([self.embed_tokens(input_ids), hidden_states], dim=-1))
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return hidden_states + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._compute_logits(hidden_states)

    def load_weights(self, weights) -> None:
        load_weights_by_name(self, weights, LLAMA_STACKED_PARAMS, skip_prefixes=("lm_head.",))


def eagle_tensor_name(name: str) -> str:
    """Checkpoint names with or without the `model.` prefix (the original repos have none)."""
    return name.removeprefix("model.")


class EagleProposer(DraftModelProposer):
    def __init__(self, head: EagleHead, attn_backend: AttentionBackend, device: torch.device, block_size: int,
                 max_num_reqs: int, hidden_size: int, max_drafts: int, dtype: torch.dtype,
                 tree: TokenTree | None = None) -> None:
        """`max_drafts`: draft tokens per request and step (a tree's nodes); `tree`: None for chains."""
        super().__init__(head, attn_backend, device, block_size, max_num_reqs)
        self.tree = tree
        self.window = max_drafts + 4
        """Target hidden states kept per row: a verify step's 1 + k, and a few steps of lag."""
        self.pending = torch.zeros(max_num_reqs, self.window, hidden_size, dtype=dtype, device=device)
        self.pending_start = np.zeros(max_num_reqs, dtype=np.int64)
        self.pending_len = np.zeros(max_num_reqs, dtype=np.int64)
        self.graph_extra_inputs = ((hidden_size, dtype),)  # the hidden states each token's step reads
        self.tree_steps = [] if tree is None else [TreeLevelStep(head, self._top_tokens, tree, depth, device)
                                                   for depth in range(1, tree.max_depth)]
        """The level passes of a tree draft, depth 1 first (what the worker captures for them)."""
        self.tree_graphs: TreeLevelGraphRunner | None = None
        """tree_steps' graphs by level and padded row count, set by the worker (None: eager)."""
        self.max_drafts = max_drafts
        self.chain_graphs: ChainDraftGraphs | None = None
        """draft_after_verify's whole chains by padded row count, set by the worker (None: pass by pass)."""
        self._drafted_after_verify = np.full(max_num_reqs, -1, dtype=np.int64)
        """The row generation whose head state draft_after_verify left to settle once its tokens are on the host."""

    @torch.inference_mode()
    def observe(self, states: RequestStates, rows: np.ndarray, query_start_loc: np.ndarray, positions: np.ndarray,
                hidden_states: torch.Tensor, skip: np.ndarray | None = None) -> None:
        """The target computed `hidden_states` [num_tokens] at `positions`, rows' runs given by query_start_loc;
        `skip` [rows] bool: rows left to draft_after_verify."""
        num_rows = len(rows)
        if num_rows == 0:
            return
        self.settle(states, rows)
        first = positions[query_start_loc[:-1]]
        end = positions[query_start_loc[1:] - 1] + 1
        fresh = states.row_generation[rows] != self._generation[rows]
        self._generation[rows] = states.row_generation[rows]
        self.num_computed[rows[fresh]] = first[fresh]
        self.pending_start[rows[fresh]] = first[fresh]
        self.pending_len[rows[fresh]] = 0
        # The next token of position p is surely on the host for p + 1 < known (the last step's may not be).
        known = states.num_tokens[rows] - (states.last_step_index[rows] >= 0)
        window = self.window
        base = self.pending.shape[0] * window
        source = torch.cat([self.pending.view(base, -1), hidden_states[: int(query_start_loc[-1])]])
        consume_rows, consume_pos, consume_src, consume_end = [], [], [], []
        keep_dst, keep_src = [], []
        for i, row in enumerate(rows.tolist()):
            if skip is not None and skip[i]:
                continue
            c, e = int(first[i]), int(end[i])
            ps, pl = int(self.pending_start[row]), int(self.pending_len[row])
            avail = ps if ps + pl >= c else c  # the window and this step's run, when they join
            lo = max(int(self.num_computed[row]), avail)
            lo = min(lo, e)

            def src(p: int, i=i, c=c, ps=ps, row=row) -> int:
                return base + int(query_start_loc[i]) + p - c if p >= c else row * window + p - ps

            m = min(e, int(known[i]) - 2)  # the last known position waits for the proposal that drafts from it
            if m > lo:
                span = range(lo, m)
                consume_rows.append(np.full(len(span), row))
                consume_pos.append(np.arange(lo, m))
                consume_src.extend(src(p) for p in span)
                consume_end.append(m)
                lo = m
            keep_from = max(lo, e - window)
            self.num_computed[row] = keep_from  # positions dropped from a full window stay without head KV
            self.pending_start[row], self.pending_len[row] = keep_from, e - keep_from
            keep_dst.extend(row * window + j for j in range(e - keep_from))
            keep_src.extend(src(p) for p in range(keep_from, e))
        if consume_rows:
            token_rows = np.concatenate(consume_rows)
            pos = np.concatenate(consume_pos)
            counts = np.array([len(p) for p in consume_pos], dtype=np.int64)
            qsl = np.zeros(len(counts) + 1, dtype=np.int32)
            np.cumsum(counts, out=qsl[1:])
            row_ids = np.array([r[0] for r in consume_rows], dtype=np.int64)
            layout = self._layout(states, row_ids, token_rows, pos, qsl, np.array(consume_end, dtype=np.int32))
            hidden = source[self._to_device(np.array(consume_src, dtype=np.int64))]
            self._forward(layout, states.input_ids(token_rows, pos + 1), pos, hidden=hidden)
        if keep_dst:
            kept = source[self._to_device(np.array(keep_src, dtype=np.int64))]
            self.pending.view(base, -1)[self._to_device(np.array(keep_dst, dtype=np.int64))] = kept

    @torch.inference_mode()
    def propose(self, states: RequestStates, rows: np.ndarray, max_drafts: np.ndarray) -> list[np.ndarray]:
        """The drafts draft_after_verify made in the last step where they still fit, the head's passes for the rest."""
        self.settle(states, rows)
        ready = states.has_next_drafts(rows)
        if not ready.any():
            return self._propose_here(states, rows, max_drafts)
        drafts = [states.next_drafts[row, :k] for row, k in zip(rows.tolist(), max_drafts.tolist())]
        if not ready.all():
            rest = np.flatnonzero(~ready)
            for i, d in zip(rest.tolist(), self._propose_here(states, rows[rest], max_drafts[rest])):
                drafts[i] = d
        return drafts

    @torch.inference_mode()
    def draft_after_verify(self, states: RequestStates, rows: np.ndarray, first: np.ndarray, num_drafts: np.ndarray,
                           target_states: torch.Tensor, tokens: torch.Tensor, num_emitted: torch.Tensor,
                           shift: torch.Tensor | None = None) -> torch.Tensor:
        """The next step's chain of max_drafts drafts for rows that verified `num_drafts` [n] drafts from positions
        `first` [n] on in this step, drafted right after the verification without waiting for its tokens on the
        host: [n, max_drafts].

        The head first runs over the verified positions L - 1 .. L - 1 + d (`first` = L - 1; one row
        each, as the verification laid them out, so that its CUDA graphs take the pass), reading
        the target's states there (`target_states`, [sum(1 + d), width], row after row) and the emitted
        tokens (`tokens` [n, >= 1 + d], `num_emitted` [n] of them valid): its output at the last emitted token's
        predecessor gives draft 1 (the positions past it hold KV of rejected tokens, rewritten next time). Drafts
        2.. follow one position at a time from there. The emitted count is known on the device only: on the CPU
        it is read at once (no cost), elsewhere the one-token steps are laid out for the largest count and moved
        back on the device (AttentionBackend.place_decodes). Their KV slots run up to max_drafts - 1 past the
        verified ones (the scheduler allocates them: DraftBudget.slots_ahead). `shift` [n] on the device: how far
        before `first` each row's positions lie (a step laid out before its last one's counts were on the host:
        worker/verify_ahead.py); None: none. Where the worker captured them, the whole chain replays one CUDA graph
        (worker/chain_draft_graph.py)."""
        exact = self.device.type == "cpu" or not self.attn_backend.supports_device_positions
        if shift is not None and exact:
            first, shift = first - shift.cpu().numpy(), None
        self._generation[rows] = states.row_generation[rows]
        self._drafted_after_verify[rows] = states.row_generation[rows]
        # Step i's position: first + num_emitted + i - 1 (i = 1 ..), never past the allocated slots or the model.
        last = np.minimum(first + num_drafts + self.max_drafts - 1, states.token_ids.shape[1] - 1)
        if self.chain_graphs is not None:  # (captured only where positions move on the device: never exact)
            drafts = self.chain_graphs.run(states.block_table[rows], first, num_drafts, last, target_states, tokens,
                                           num_emitted, shift)
            if drafts is not None:
                return drafts
        counts = 1 + num_drafts
        starts = np.cumsum(counts) - counts
        within = np.arange(counts.sum()) - np.repeat(starts, counts)
        # One row per verified position, each attending to the head's KV up to itself (as the verification laid
        # out the target's): the one-token steps' CUDA graphs take the pass.
        token_rows = np.repeat(rows, counts)
        [(layout, positions)] = self._one_token_steps(states, token_rows, (np.repeat(first, counts) + within)[None])
        index = self._to_device(np.stack([np.repeat(np.arange(len(rows)), counts), within]))
        input_ids = tokens[index[0], index[1]].clamp(min=0)
        if shift is None:
            hidden, drafts = self._step(layout, input_ids, positions, self.from_target(target_states))
        else:
            hidden, drafts = self._step(layout, input_ids, positions - shift[index[0]],
                                        self.from_target(target_states), placed=True)
        at = self._to_device(starts) + num_emitted - 1
        hidden, steps = hidden[at], [drafts[at]]
        if self.max_drafts == 1:
            return steps[0][:, None]
        # Exact: the counts read on the host, the steps laid out where they are; else for every draft accepted.
        emitted = num_emitted.cpu().numpy() if exact else 1 + num_drafts
        upper = np.minimum(first + emitted + np.arange(self.max_drafts - 1)[:, None], last)
        first_t = None if exact else self._to_device(first) - (0 if shift is None else shift)
        on_device = None if exact else torch.minimum(
            first_t[None, :] + num_emitted[None, :] + torch.arange(self.max_drafts - 1, device=self.device)[:, None],
            self._to_device(last)[None, :])
        for i, (layout, pos) in enumerate(self._one_token_steps(states, rows, upper)):
            if on_device is None:
                hidden, draft = self._step(layout, steps[-1], pos, hidden)
            else:
                hidden, draft = self._step(layout, steps[-1], on_device[i], hidden, placed=True)
            steps.append(draft)
        return torch.stack(steps, dim=1)

    @property
    def target_state_width(self) -> int:
        """The width of the target's states that draft_after_verify reads."""
        return self.pending.shape[-1]

    def from_target(self, target_states: torch.Tensor) -> torch.Tensor:
        """The head's input from the target's states (EAGLE-3 projects its layers' states first)."""
        return target_states

    def settle(self, states: RequestStates, rows: np.ndarray) -> None:
        """Rows that draft_after_verify drafted for, now that their tokens are on the host: the head's KV is right up
        to the position before the last known token, and no target state waits in the window."""
        settled = rows[self._drafted_after_verify[rows] == states.row_generation[rows]]
        if len(settled) == 0:
            return
        self._drafted_after_verify[settled] = -1
        last = states.num_tokens[settled] - 1
        self.num_computed[settled] = last
        self.pending_start[settled] = last
        self.pending_len[settled] = 0

    def _propose_here(self, states: RequestStates, rows: np.ndarray, max_drafts: np.ndarray) -> list[np.ndarray]:
        lengths = states.num_tokens[rows]
        start = np.maximum(np.minimum(self.num_computed[rows], lengths - 2), self.pending_start[rows])
        # A row whose target hidden states up to its last known position are not in the window drafts nothing.
        ok = ((states.row_generation[rows] == self._generation[rows]) & (lengths >= 2) & (start < lengths - 1)
              & (lengths - 1 <= self.pending_start[rows] + self.pending_len[rows]))
        drafts = [np.zeros(0, dtype=np.int64) for _ in range(len(rows))]
        if not ok.any():
            return drafts
        index = np.flatnonzero(ok)
        rows, start, lengths, max_drafts = rows[ok], start[ok], lengths[ok], max_drafts[ok]
        num_new = lengths - 1 - start
        qsl = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(num_new, out=qsl[1:])
        token_rows = np.repeat(rows, num_new)
        positions = np.repeat(start, num_new) + np.arange(qsl[-1]) - np.repeat(qsl[:-1], num_new)
        src = token_rows * self.window + positions - self.pending_start[token_rows]
        hidden = self.pending.view(-1, self.pending.shape[-1])[self._to_device(src)]
        layout = self._layout(states, rows, token_rows, positions, qsl, (lengths - 1).astype(np.int32))
        input_ids = states.input_ids(token_rows, positions + 1)
        if len(positions) == len(rows):  # one position each (the usual pass after a verify step): graphs fit it
            hidden, tokens = self._step(layout, input_ids, positions, hidden)
        else:
            hidden = self._forward(layout, input_ids, positions, hidden=hidden)[self._to_device(qsl[1:] - 1)]
            tokens = self._greedy(hidden) if self.tree is None else None  # a tree's first level is the top tokens
        self.num_computed[rows] = lengths - 1
        if self.tree is not None:
            trees = self._draft_tree(states, rows, lengths, max_drafts, hidden.clone())
            for i, k, d in zip(index.tolist(), max_drafts.tolist(), trees):
                drafts[i] = d[:k]
            return drafts
        steps = [tokens]
        # Draft j + 1 from draft j and the head's own output, at position length + j - 2, one token per row:
        # graph replays where captured (`hidden`, a graph's output, goes to its input buffer first).
        for layout, pos in self._decode_steps(states, rows, lengths - 1, max_drafts):
            hidden, tokens = self._step(layout, tokens, pos, hidden)
            steps.append(tokens)
        drafted = torch.stack(steps, dim=1).cpu().numpy()
        for i, k, d in zip(index.tolist(), max_drafts.tolist(), drafted):
            drafts[i] = d[:k]
        return drafts

    def _draft_tree(self, states: RequestStates, rows: np.ndarray, lengths: np.ndarray, max_drafts: np.ndarray,
                    root_hidden: torch.Tensor) -> np.ndarray:
        """Each row's tree nodes [rows, num_nodes] (its first max_drafts are drafted; the rest are not read), from
        the head's outputs at each row's last known position `root_hidden` [rows, hidden]."""
        tree, starts = self.tree, self.tree.level_starts
        num_rows = len(rows)
        num_nodes = np.minimum(max_drafts, tree.num_nodes)
        tokens = torch.zeros((num_rows, tree.num_nodes), dtype=torch.int64, device=self.device)
        # Rows that draft no node past the first level take no level pass: the root's top tokens are all they draft.
        leaves = np.flatnonzero(num_nodes <= starts[1]) if tree.max_depth > 1 else np.arange(num_rows)
        if len(leaves):
            leaves_t = self._to_device(leaves)
            tokens[leaves_t, : starts[1]] = self._top_tokens(root_hidden[leaves_t], int(starts[1]))
        parent_out, previous = root_hidden[:, None], np.arange(num_rows)  # the rows parent_out holds
        for depth in range(1, tree.max_depth):
            first, end, next_end = (int(x) for x in starts[depth - 1 : depth + 2])
            selected = np.flatnonzero(num_nodes > end)  # the rows with nodes on the next level (fewer each level)
            if len(selected) == 0:
                break
            if len(selected) < len(previous):
                parent_out = parent_out[self._to_device(np.searchsorted(previous, selected))]
            rows_index = slice(None) if len(selected) == num_rows else self._to_device(selected)
            previous = selected
            layout, positions = level_layout(tree, depth, states.block_table, rows[selected], lengths[selected],
                                             self.block_size)
            level_tokens = None if depth == 1 else tokens[rows_index, first:end]
            level_tokens, parent_out, children = self._tree_level(depth, layout, positions, parent_out, level_tokens)
            if depth == 1:
                tokens[rows_index, first:end] = level_tokens
            tokens[rows_index, end:next_end] = children
        return tokens.cpu().numpy()

    def _tree_level(self, depth: int, layout: BatchLayout, positions: np.ndarray, parent_out: torch.Tensor,
                    tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A level's pass (spec/tree_level.TreeLevelStep): one graph replay where a graph fits (its outputs are
        then the graph's static ones: used before its next replay), else eagerly."""
        positions_t = self._to_device(positions)
        if self.tree_graphs is not None:
            out = self.tree_graphs.run(depth, layout, positions_t, parent_out, tokens)
            if out is not None:
                return out
        metadata = self.attn_backend.build_metadata(layout, self.device)
        with forward_context(self.attn_backend, metadata):
            return self.tree_steps[depth - 1](positions_t, parent_out, tokens)
