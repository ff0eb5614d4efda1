"""InputBatch: the flat token layout of one step, built with numpy from the persistent rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.attention.backend import BatchLayout
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.worker.request_state import RequestStates


@dataclass
class InputBatch:
    request_ids: list[str]  # batch order: decodes first, as scheduled
    rows: np.ndarray  # [num_reqs] row of each request in RequestStates
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    layout: BatchLayout
    logits_indices: np.ndarray  # [num_sampled] flat index of each sampled request's last token
    sampled_rows: np.ndarray  # [num_sampled] rows of the requests that get a new token
    last_token_dst: np.ndarray  # flat indices of input tokens sampled by the last step...
    last_token_src: np.ndarray  # ...and their indices in that step's sampled tokens (on the device)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def prepare_inputs(scheduler_output: SchedulerOutput, states: RequestStates, block_size: int) -> InputBatch:
    request_ids = list(scheduler_output.num_scheduled_tokens)
    rows = np.fromiter((states.row_of[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
    num_new = np.fromiter(scheduler_output.num_scheduled_tokens.values(), dtype=np.int64, count=len(request_ids))
    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(num_new, out=query_start_loc[1:])
    num_computed = states.num_computed_tokens[rows]

    token_rows = np.repeat(rows, num_new)
    offsets = np.arange(query_start_loc[-1]) - np.repeat(query_start_loc[:-1], num_new)
    positions = np.repeat(num_computed, num_new) + offsets
    input_ids = states.token_ids[token_rows, positions]
    # The last step's tokens may still be on their way to the host: those inputs are read on the device.
    last_index = states.last_step_index[token_rows]
    last_token_dst = np.flatnonzero((last_index >= 0) & (positions == states.num_tokens[token_rows] - 1))
    slot_mapping = states.block_table[token_rows, positions // block_size].astype(np.int64) * block_size
    slot_mapping += positions % block_size

    seq_lens = (num_computed + num_new).astype(np.int32)
    max_blocks = int(-(-seq_lens.max() // block_size))
    # A request gets a new token only when this step reaches the end of its known tokens.
    is_sampled = seq_lens == states.num_tokens[rows]
    return InputBatch(
        request_ids=request_ids,
        rows=rows,
        input_ids=input_ids,
        positions=positions,
        layout=BatchLayout(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=states.block_table[rows, :max_blocks],
            slot_mapping=slot_mapping,
            block_size=block_size,
        ),
        logits_indices=query_start_loc[1:][is_sampled] - 1,
        sampled_rows=rows[is_sampled],
        last_token_dst=last_token_dst,
        last_token_src=last_index[last_token_dst],
    )
