"""The CPU attention backend: the batched decode path equals per-request attention, whatever garbage
sits in the pool's unwritten slots."""

import numpy as np
import torch

from tokenmill.attention.backend import BatchLayout
from tokenmill.attention.torch_attn import TorchAttentionBackend, paged_attention_torch
from tokenmill.layers.attention import Attention


def test_batched_decode_ignores_nan_in_unwritten_slots():
    torch.manual_seed(0)
    block_size, num_blocks, kv_heads, heads, dim = 4, 16, 2, 4, 8
    seq_lens = np.array([3, 9, 6], dtype=np.int32)  # decodes: one new token each
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, dim), float("nan"))
    block_table = np.array([[5, 0, 0], [1, 7, 3], [9, 2, 0]], dtype=np.int32)
    for i, n in enumerate(seq_lens.tolist()):  # the cached tokens; the step writes the last one
        for pos in range(n - 1):
            kv_cache[:, block_table[i, pos // block_size], pos % block_size] = torch.randn(2, kv_heads, dim)
    slots = np.array([block_table[i, (n - 1) // block_size] * block_size + (n - 1) % block_size
                      for i, n in enumerate(seq_lens)], dtype=np.int64)
    layout = BatchLayout(np.arange(4, dtype=np.int32), seq_lens, block_table, slots, block_size)
    query, key, value = torch.randn(3, heads, dim), torch.randn(3, kv_heads, dim), torch.randn(3, kv_heads, dim)

    layer = Attention(heads, dim, 0.125, kv_heads)
    out = TorchAttentionBackend().forward(layer, torch.from_numpy(seq_lens - 1).long(), query, key, value, kv_cache,
                                          TorchAttentionBackend().build_metadata(layout, torch.device("cpu")))
    reference = paged_attention_torch(query, kv_cache, torch.from_numpy(block_table).long(), [0, 1, 2, 3],
                                      seq_lens.tolist(), layer.scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference)
