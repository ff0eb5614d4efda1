"""GGUF blocks repacked into the integer-weight layout (layers.quant.gguf_int) against gguf's own dequantization:
random blocks of every type it takes, blocks of scale 0 among them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

from tokenmill.layers.quant.gguf_int import INT_GGML_TYPES, gguf_int_weights
from tokenmill.layers.quant.w4a16 import dequantize_int, pack_int32

HALF_FIELDS = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 14: (208,)}
"""Byte offsets of each type's float16 fields in its block: d (and Q4_1's m, Q4_K's dmin; Q6_K's d comes last)."""


def random_blocks(ggml_type: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in the type's block layout, its float16 fields finite, every fourth block's scale 0."""
    per_block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    blocks = rng.integers(0, 256, (n, k // per_block, size), dtype=np.uint8)
    for i, at in enumerate(HALF_FIELDS[ggml_type]):
        values = rng.uniform(-0.05, 0.05, (n, k // per_block)).astype(np.float16)
        if i == 0:
            values[:, ::4] = 0
        blocks[..., at:at + 2] = values[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("ggml_type", sorted(INT_GGML_TYPES), ids=lambda t: GGMLQuantizationType(t).name)
def test_repacked_weights_equal_gguf_dequantization(ggml_type):
    n, k = 6, 512
    blocks = random_blocks(ggml_type, n, k, np.random.default_rng(ggml_type))
    expected = dequantize(blocks, GGMLQuantizationType(ggml_type)).reshape(n, k)
    w = gguf_int_weights(torch.from_numpy(blocks), ggml_type, k)
    bits = INT_GGML_TYPES[ggml_type]
    assert w.q.shape == (n, k) and int(w.q.min()) >= 0 and int(w.q.max()) < 1 << bits
    weight = dequantize_int(pack_int32(w.q, bits, dim=1), w.scale, w.zero, bits)
    torch.testing.assert_close(weight, torch.from_numpy(expected.astype(np.float32)), rtol=1e-5, atol=1e-6)


def test_a_fused_layer_of_mixed_types_runs_each_part_its_way():
    """Runs of Q4_1, Q6_K (no integer form: dense) and Q4_K parts, each writing its slice of the output, equal the
    dense product with gguf's dequantized weights (the torch path of the integer kernels, on the CPU)."""
    from torch import nn

    from tokenmill.layers.quant.gguf_int import apply_int_runs, hold_int_runs

    k, rng = 256, np.random.default_rng(7)
    layer = nn.Module()
    layer.input_size = k
    parts = [(3, 8), (14, 4), (12, 6)]  # (GGML type, output features)
    blocks = [random_blocks(t, n, k, rng) for t, n in parts]
    expected = [dequantize(b, GGMLQuantizationType(t)).reshape(n, k) for b, (t, n) in zip(blocks, parts)]

    def dense(ggml_type, raw):
        return torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType(ggml_type)).reshape(raw.shape[0], k))

    hold_int_runs(layer, [(t, [torch.from_numpy(b)]) for b, (t, _) in zip(blocks, parts)], dense)
    assert [bits for _, _, bits, _ in layer.gguf_int_runs] == [4, 0, 4]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    weight = torch.from_numpy(np.concatenate(expected).astype(np.float32))
    torch.testing.assert_close(apply_int_runs(layer, x, None), x @ weight.T, rtol=1e-4, atol=1e-4)
