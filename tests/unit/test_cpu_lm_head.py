"""The CPU LM head (layers.cpu_lm_head): a few rows (float32 or bfloat16) through the GGUF blocks, the rest dense.

Blocks come from gguf's own `quantize`; the dense table is their `dequantize`, as the loader gives both. The
reference is the float64 product with that table: both paths sum float32 products, so they are held to a
few float32 roundings of the sum of |x| |w|, and their greedy tokens (argmax) must be the same.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from tokenmill.layers.cpu_gemm import cpu_linear
from tokenmill.layers.cpu_lm_head import BF16_QUANTIZED_ROWS, QUANTIZED_ROWS, cpu_logits, quantized_lm_head_applies
from tokenmill.layers.quant.gguf import tag_ggml
from tokenmill.layers.quant.gguf_cpu import gguf_gemm_cpu, load_kernel

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler: the LM head stays dense")

VOCAB, HIDDEN = 3000, 576


@functools.cache
def table(ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """A dense [VOCAB, HIDDEN] float32 table carrying its GGUF blocks, as the loader hands it over (read only)."""
    rng = np.random.default_rng(int(ggml_type))
    blocks = quantize(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.05, ggml_type)
    weight = torch.from_numpy(np.ascontiguousarray(dequantize(blocks, ggml_type), dtype=np.float32))
    weight.ggml_blocks = tag_ggml(torch.from_numpy(blocks), int(ggml_type))
    return weight


def assert_close_to_float64(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    reference = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    assert logits.dtype == torch.float32 and logits.shape == reference.shape
    assert ((logits.double() - reference).abs() <= 4 * HIDDEN ** 0.5 * 2.0 ** -24 * scale + 1e-30).all()


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1])
@pytest.mark.parametrize("rows", [1, 2, 5, QUANTIZED_ROWS])
@torch.no_grad()
def test_few_rows_read_the_blocks(ggml_type, rows):
    weight = table(ggml_type)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    assert quantized_lm_head_applies(x, weight)
    logits = cpu_logits(x, weight, None)
    # The kernel's own result (the blocks were read), close to the exact product, with the dense argmax.
    torch.testing.assert_close(logits, gguf_gemm_cpu(x, weight.ggml_blocks, int(ggml_type), HIDDEN), rtol=0, atol=0)
    assert_close_to_float64(logits, x, weight)
    assert torch.equal(logits.argmax(-1), cpu_linear(x, weight, None).argmax(-1))


@torch.no_grad()
def test_bias_and_leading_dimensions():
    weight = table(GGMLQuantizationType.Q8_0)
    bias = torch.randn(VOCAB)
    x = torch.randn(2, 3, HIDDEN)
    logits = cpu_logits(x, weight, bias)
    assert logits.shape == (2, 3, VOCAB)
    assert_close_to_float64((logits - bias).reshape(6, VOCAB), x.reshape(6, HIDDEN), weight)


@torch.no_grad()
def test_few_bfloat16_rows_read_the_blocks_in_float32():
    """bfloat16 hidden states (a small model's "blocks and dense" form keeps the table's blocks): up to
    BF16_QUANTIZED_ROWS rows, converted exactly, take the float32 kernel over the blocks, held to the float32
    bound against the blocks' exact values; the dense bfloat16 table's logits differ by its rounding."""
    weight = table(GGMLQuantizationType.Q8_0)
    bf16_weight = weight.bfloat16()
    bf16_weight.ggml_blocks = weight.ggml_blocks
    x = torch.randn(BF16_QUANTIZED_ROWS, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert quantized_lm_head_applies(x, bf16_weight) and quantized_lm_head_applies(x[:1], bf16_weight)
    logits = cpu_logits(x, bf16_weight, None)
    blocks = weight.ggml_blocks
    torch.testing.assert_close(logits, gguf_gemm_cpu(x.float(), blocks, blocks.ggml_type, HIDDEN), rtol=0, atol=0)
    assert_close_to_float64(logits, x, weight)
    dense = cpu_linear(x, bf16_weight, None).float()
    torch.testing.assert_close(logits, dense, rtol=0.02, atol=0.02 * float(dense.abs().max()))


@torch.no_grad()
def test_many_rows_bfloat16_and_tables_without_blocks_stay_dense():
    weight = table(GGMLQuantizationType.Q8_0)
    many = torch.randn(QUANTIZED_ROWS + 1, HIDDEN)
    assert not quantized_lm_head_applies(many, weight)
    torch.testing.assert_close(cpu_logits(many, weight, None), cpu_linear(many, weight, None), rtol=0, atol=0)
    assert_close_to_float64(cpu_logits(many, weight, None), many, weight)

    bf16_weight = weight.bfloat16()
    bf16_weight.ggml_blocks = weight.ggml_blocks
    x = torch.randn(BF16_QUANTIZED_ROWS + 1, HIDDEN, dtype=torch.bfloat16)
    assert not quantized_lm_head_applies(x, bf16_weight)
    logits = cpu_logits(x, bf16_weight, None)
    assert logits.dtype == torch.float32  # the sampler's argmax is ~9x faster over float32
    # The dense GEMM's logits, written in float32 by the AMX kernel (where the CPU has it), else oneDNN's converted
    torch.testing.assert_close(logits, cpu_linear(x, bf16_weight, None, out_float32=True), rtol=0, atol=0)
    torch.testing.assert_close(logits, cpu_linear(x, bf16_weight, None).float(), rtol=1e-2, atol=1e-2)

    plain = weight.clone()
    assert not hasattr(plain, "ggml_blocks") and not quantized_lm_head_applies(many[:1], plain)
    torch.testing.assert_close(cpu_logits(many[:1], plain, None), cpu_linear(many[:1], plain, None), rtol=0, atol=0)
