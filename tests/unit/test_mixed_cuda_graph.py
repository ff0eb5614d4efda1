"""Which steps a full-step graph takes and the shape its metadata is padded to (the capture itself needs a GPU:
tests/models/test_models_vs_hf.py::test_greedy_tokens_match_hf_on_cuda)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.attention.backend import BatchLayout
from tokenmill.worker.mixed_cuda_graph import MixedCudaGraphRunner, mixed_capture_sizes

pytest.importorskip("triton")


def test_capture_sizes_pad_little_and_end_at_the_maximum():
    sizes = mixed_capture_sizes(2048)
    assert sizes[:3] == [16, 32, 64] and sizes[-1] == 2048 and sizes == sorted(set(sizes))
    steps = np.diff(sizes)
    assert steps[np.array(sizes[1:]) <= 1024].max() == 64 and steps.max() == 128
    assert mixed_capture_sizes(300)[-1] == 300 and mixed_capture_sizes(10) == [10]


def _layout(q_lens: list[int], block_size: int = 16) -> BatchLayout:
    seq_lens = np.array(q_lens, dtype=np.int32) + 3
    num_blocks = -(-int(seq_lens.max()) // block_size)
    return BatchLayout(
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        seq_lens=seq_lens,
        block_table=np.arange(len(q_lens) * num_blocks, dtype=np.int32).reshape(len(q_lens), num_blocks),
        slot_mapping=np.arange(sum(q_lens), dtype=np.int64),
        block_size=block_size,
    )


def test_steps_take_the_next_size_up_while_their_requests_fit():
    from tokenmill.attention.triton_attn import TritonAttentionBackend

    runner = MixedCudaGraphRunner(None, TritonAttentionBackend(), torch.device("cpu"), block_size=16,
                                  max_blocks_per_req=8, max_num_reqs=6, max_tokens=128)
    assert runner.sizes == [16, 32, 64, 128]
    assert runner._graph_size(_layout([1, 1, 30])) == 32
    assert runner._graph_size(_layout([1] * 6 + [57])) == 64  # six decodes and a prompt chunk
    assert runner._graph_size(_layout([100, 29])) is None  # 129 tokens: eager
    assert runner._graph_size(_layout([1] * 7 + [5])) is None  # more decodes than a graph has slots for

    step = _layout([1, 30, 1, 5])
    metadata = runner._metadata(step, 64)
    assert metadata.fixed_grid
    assert metadata.slot_mapping.shape == (64,) and (metadata.slot_mapping[37:] == -1).all()
    assert metadata.decode_req_ids.tolist() == [0, 2, -1, -1, -1, -1]
    assert metadata.prefill_req_ids.tolist() == [1, 3, -1, -1, -1, -1] and metadata.num_prefills.item() == 2
    assert metadata.query_start_loc.tolist() == [0, 1, 31, 32, 37] + [37] * 8
    assert metadata.block_table.shape == (12, step.block_table.shape[1])
