"""InputBatch: the flat token layout of one step, built with numpy from the persistent rows.

A request's tokens this step are its scheduled ones, less the lookahead its proposer did not fill: a
decode with d drafts computes 1 + d tokens and needs logits at all of them (d to verify, one more to
sample after them). A step of decodes and verifications only is laid out for attention one row per
token: each token attends to the cache up to itself, as a decode does (the layer writes the whole
step's KV before attending), so the decode kernels and the decode CUDA graphs run it.

With a draft tree (spec/tree.py) a request's d drafts are the tree's first d nodes: in its buffer after its
known tokens, node i at index L + i (its KV slot), at position L - 1 + depth(i), attending under the tree mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.attention.backend import BatchLayout
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.spec.tree import TokenTree
from tokenmill.worker.request_state import RequestStates


@dataclass
class InputBatch:
    request_ids: list[str]  # batch order: decodes first, as scheduled
    rows: np.ndarray  # [num_reqs] row of each request in RequestStates
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    layout: BatchLayout
    query_start_loc: np.ndarray  # [num_reqs + 1] each request's tokens in the flat batch
    num_new: np.ndarray  # [num_reqs] tokens computed per request
    logits_indices: np.ndarray  # [sum(1 + drafts)] flat indices of the sampled requests' last 1 + d tokens
    sampled_rows: np.ndarray  # [num_sampled] rows of the requests that get a new token
    sampled_num_drafts: np.ndarray  # [num_sampled] drafts each of them verifies
    last_token_dst: np.ndarray  # flat indices of input tokens sampled by the last step...
    last_token_src: np.ndarray  # ...and their indices in that step's sampled tokens (on the device)
    buffer_positions: np.ndarray | None = None
    """[num_tokens] each token's index in its request's token buffer, where a draft tree makes it differ from
    its position (None: no tree this step, the positions are those indices)."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def kv_slots(block_table: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The pool slot (block * block_size + offset) of each token at `positions` of the request in row
    `token_rows` (any shapes that broadcast together) -> int64."""
    slots = block_table[token_rows, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    return slots


def prepare_inputs(
    scheduler_output: SchedulerOutput, states: RequestStates, block_size: int, num_drafts: np.ndarray | None = None,
    tree: TokenTree | None = None, num_ahead: np.ndarray | None = None,
) -> InputBatch:
    """`num_drafts` [num_reqs]: draft tokens written after each request's known tokens (None: none); `tree`: the
    drafts are that tree's first nodes; `num_ahead` [num_reqs]: the drafts of a verifying step still in flight,
    which the rows count as computed and accepted (worker/verify_ahead.py): the step is laid out that far on."""
    request_ids = list(scheduler_output.num_scheduled_tokens)
    rows = np.fromiter((states.row_of[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
    num_new = np.fromiter(scheduler_output.num_scheduled_tokens.values(), dtype=np.int64, count=len(request_ids))
    if scheduler_output.num_lookahead_tokens:
        lookahead = scheduler_output.num_lookahead_tokens
        num_new -= np.fromiter((lookahead.get(r, 0) for r in request_ids), dtype=np.int64, count=len(request_ids))
    if num_drafts is None:
        num_drafts = np.zeros(len(request_ids), dtype=np.int64)
    num_new += num_drafts
    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(num_new, out=query_start_loc[1:])
    num_computed = states.num_computed_tokens[rows]

    token_rows = np.repeat(rows, num_new)
    offsets = np.arange(query_start_loc[-1]) - np.repeat(query_start_loc[:-1], num_new)
    positions = np.repeat(num_computed, num_new) + offsets
    input_ids = states.input_ids(token_rows, positions)
    num_known = states.num_tokens[rows] if num_ahead is None else states.num_tokens[rows] + num_ahead
    # The last step's tokens may still be on their way to the host: those inputs are read on the device.
    last_index = states.last_step_index[token_rows]
    last_token_dst = np.flatnonzero((last_index >= 0) & (positions == np.repeat(num_known, num_new) - 1))
    slot_mapping = kv_slots(states.block_table, token_rows, positions, block_size)

    seq_lens = (num_computed + num_new).astype(np.int32)
    max_blocks = int(-(-seq_lens.max() // block_size))
    buffer_positions = tree_lens = tree_bits = None
    if tree is not None and num_drafts.any():
        node = positions - states.num_tokens[token_rows]  # >= 0: a draft node's index
        is_node = (node >= 0) & (np.repeat(num_drafts, num_new) > 0)
        buffer_positions, positions = positions, positions.copy()
        positions[is_node] += tree.depth[node[is_node]] - 1 - node[is_node]
        tree_bits = np.full(len(positions), -1, dtype=np.int64)
        tree_bits[is_node] = tree.ancestor_bits[node[is_node]]
        tree_lens = num_drafts.astype(np.int32)
    if tree_lens is not None:
        layout = BatchLayout(query_start_loc, seq_lens, states.block_table[rows, :max_blocks], slot_mapping,
                             block_size, tree_lens, tree_bits)
    elif num_drafts.any() and (num_new == 1 + num_drafts).all():
        layout = BatchLayout(np.arange(len(positions) + 1, dtype=np.int32), (positions + 1).astype(np.int32),
                             states.block_table[token_rows, :max_blocks], slot_mapping, block_size)
    else:
        layout = BatchLayout(query_start_loc, seq_lens, states.block_table[rows, :max_blocks], slot_mapping,
                             block_size)
    # A request gets a new token only when this step reaches the end of its known tokens (and drafts).
    is_sampled = seq_lens == num_known + num_drafts
    ends = query_start_loc[1:][is_sampled]
    sampled_num_drafts = num_drafts[is_sampled]
    if sampled_num_drafts.any():
        counts = 1 + sampled_num_drafts
        first = np.cumsum(counts) - counts
        logits_indices = np.repeat(ends - counts, counts) + np.arange(counts.sum()) - np.repeat(first, counts)
    else:
        logits_indices = ends - 1
    return InputBatch(
        request_ids=request_ids,
        rows=rows,
        input_ids=input_ids,
        positions=positions,
        layout=layout,
        query_start_loc=query_start_loc,
        num_new=num_new,
        logits_indices=logits_indices,
        sampled_rows=rows[is_sampled],
        sampled_num_drafts=sampled_num_drafts,
        last_token_dst=last_token_dst,
        last_token_src=last_index[last_token_dst],
        buffer_positions=buffer_positions,
    )
