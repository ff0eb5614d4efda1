"""The CPU GGUF kernel (layers.quant.gguf_cpu) and method (layers.quant.gguf) against gguf's own `dequantize`.

Blocks are written with gguf's `quantize` where it implements the type (Q4_0, Q4_1, Q8_0) and as random
bytes with sane float16 scales otherwise (the K-quants: every bit pattern of their quants is a valid
block), plus real tensors of the default model's file. The reference is the float64 product with gguf's
dequantized values; the kernel sums float32 products, so it is held to a few float32 roundings of the
sum of |x| |w| (the size a dot product's rounding error scales with).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize, quantize

from tokenmill.layers import cpu_gemm
from tokenmill.layers.cpu_gemm import cpu_linear
from tokenmill.layers.quant import gguf_cpu
from tokenmill.layers.quant.gguf_cpu import (
    bf16_kernel_types,
    gguf_dequantize_cpu,
    gguf_gemm_bf16_cpu,
    gguf_gemm_cpu,
    load_kernel,
)

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler: GGUF layers are dequantized")

T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
# Byte offsets of the float16 fields in a block: (d[, dmin / m]) at the start, Q6_K's d at its end.
_HALF_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(ggml_type: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row_bytes] uint8 of valid blocks: gguf's quantize of Gaussian weights where it has the type."""
    try:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), ggml_type)
    except NotImplementedError:
        pass
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (n * k // block, block_bytes), dtype=np.uint8)
    for offset in _HALF_FIELDS[ggml_type]:
        halves = rng.uniform(0.001, 0.05, len(raw)).astype(np.float16)
        raw[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def check_gemm(raw: np.ndarray, ggml_type: int, x: torch.Tensor) -> None:
    w = dequantize(raw, GGMLQuantizationType(ggml_type)).astype(np.float64)
    k = w.shape[1]
    y = gguf_gemm_cpu(x, torch.from_numpy(np.array(raw)), int(ggml_type), k).double().numpy()
    x64 = x.double().numpy()
    expected, scale = x64 @ w.T, np.abs(x64) @ np.abs(w).T
    assert np.all(np.abs(y - expected) <= 1e-6 * scale + 1e-30), np.max(np.abs(y - expected) / scale)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_exactly(ggml_type):
    raw = random_blocks(ggml_type, 37, 512, np.random.default_rng(0))
    got = gguf_dequantize_cpu(torch.from_numpy(raw), int(ggml_type), 512).numpy()
    np.testing.assert_array_equal(got, dequantize(raw, ggml_type))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 64])  # the fused path (<= 8 rows), tiles and their edges
@pytest.mark.parametrize("n,k", [(37, 256), (8, 768)])
def test_gemm_matches_float64_reference(ggml_type, m, n, k):
    rng = np.random.default_rng(m * 1000 + n)
    check_gemm(random_blocks(ggml_type, n, k, rng), ggml_type, torch.from_numpy(rng.standard_normal((m, k))).float())


def test_gemm_on_the_default_models_tensors(smollm2_path):
    from gguf import GGUFReader

    reader = GGUFReader(smollm2_path)
    tensors = {t.name: t for t in reader.tensors}
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    for name, rows in (("blk.0.attn_q.weight", None), ("blk.3.ffn_gate.weight", None), ("token_embd.weight", 300)):
        tensor = tensors[name]
        raw = np.ascontiguousarray(tensor.data[:rows])
        for m in (1, 3):
            check_gemm(raw, int(tensor.tensor_type), x[:m].contiguous())


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_row_does_not_depend_on_the_batch(ggml_type):
    """float32 too: the fused path (<= 8 rows) and the tiles do the same arithmetic per output, so a row's
    result is the same alone or within any batch (the prefix cache recomputes a prompt's last rows alone)."""
    rng = np.random.default_rng(6)
    raw = torch.from_numpy(random_blocks(ggml_type, 53, 768, rng))  # 53 rows: a last step of fewer
    x = torch.from_numpy(rng.standard_normal((64, 768))).float()
    for row in (0, 5, 63):
        alone = gguf_gemm_cpu(x[row:row + 1].contiguous(), raw, int(ggml_type), 768)[0]
        for size in (2, 4, 7, 8, 9, 64):
            start = min(row, 64 - size)
            within = gguf_gemm_cpu(x[start:start + size].contiguous(), raw, int(ggml_type), 768)
            assert torch.equal(within[row - start], alone), (row, size)


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_gemm_writes_into_a_column_slice(ggml_type):
    """A fused layer's runs write their slices of one output in place (row stride = the whole output)."""
    rng = np.random.default_rng(1)
    raw = random_blocks(ggml_type, 12, 256, rng)
    x = torch.from_numpy(rng.standard_normal((5, 256))).float()
    out = torch.full((5, 20), 7.0)
    gguf_gemm_cpu(x, torch.from_numpy(raw), int(ggml_type), 256, out=out[:, 4:16])
    torch.testing.assert_close(out[:, 4:16], gguf_gemm_cpu(x, torch.from_numpy(raw), int(ggml_type), 256))
    assert (out[:, :4] == 7).all() and (out[:, 16:] == 7).all()


# -- the bfloat16 path (AMX / AVX512_BF16): bfloat16 products of the weights rounded to bfloat16, float32 sums
BF16_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
needs_bf16 = pytest.mark.skipif(not bf16_kernel_types(), reason="no AVX512_BF16: bfloat16 takes the float32 path")


def bf16_values(a: np.ndarray) -> np.ndarray:
    """float32 -> the float64 of its bfloat16 rounding (torch's, round to nearest even)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).bfloat16().double().numpy()


@needs_bf16
@pytest.mark.parametrize("ggml_type", BF16_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 5, 64])
@pytest.mark.parametrize("n,k", [(37, 256), (8, 768)])
def test_bf16_gemm_matches_float64_reference(ggml_type, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + 7)
    raw = random_blocks(ggml_type, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k))).bfloat16()
    y = gguf_gemm_bf16_cpu(x, torch.from_numpy(raw), int(ggml_type), k).double().numpy()
    w = bf16_values(dequantize(raw, ggml_type))  # the dense bfloat16 model's weights
    x64 = x.double().numpy()
    expected, scale = x64 @ w.T, np.abs(x64) @ np.abs(w).T
    # Products of bfloat16 values are exact in float32; only the float32 sums round.
    assert np.all(np.abs(y - expected) <= 1e-6 * scale + 1e-30), np.max(np.abs(y - expected) / scale)


@needs_bf16
@pytest.mark.parametrize("ggml_type", BF16_TYPES, ids=lambda t: t.name)
def test_bf16_weights_are_the_dense_bfloat16_weights(ggml_type):
    """The decoding rounds gguf's float32 values to bfloat16 as torch does (the prefill tile, and the GEMM:
    one-hot activation rows pick single weights, exactly)."""
    raw = random_blocks(ggml_type, 37, 256, np.random.default_rng(4))
    expected = torch.from_numpy(dequantize(raw, ggml_type)).bfloat16()
    dense = gguf_cpu.gguf_dequantize_bf16_cpu(torch.from_numpy(raw), int(ggml_type), 256)
    assert torch.equal(dense, expected)
    picked = gguf_gemm_bf16_cpu(torch.eye(256).bfloat16(), torch.from_numpy(raw), int(ggml_type), 256)
    assert torch.equal(picked.T.bfloat16(), expected)


@needs_bf16
@pytest.mark.parametrize("ggml_type", BF16_TYPES, ids=lambda t: t.name)
def test_bf16_row_does_not_depend_on_the_batch(ggml_type):
    """The prefix cache recomputes a prompt's last rows alone: their results must be the batch's, bit for bit."""
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(random_blocks(ggml_type, 53, 576, rng))
    x = torch.from_numpy(rng.standard_normal((64, 576))).bfloat16()
    for row in (0, 5, 63):
        alone = gguf_gemm_bf16_cpu(x[row:row + 1].contiguous(), raw, int(ggml_type), 576)[0]
        for batch in (x[row - row % 7:][:7] if row < 63 else x[57:], x):
            within = gguf_gemm_bf16_cpu(batch.contiguous(), raw, int(ggml_type), 576)
            index = [i for i in range(len(batch)) if torch.equal(batch[i], x[row])][0]
            assert torch.equal(within[index], alone), (row, len(batch))


@needs_bf16
def test_bf16_layer_uses_the_bf16_path_consistently():
    """The method: a bfloat16 row computed alone equals the same row within a batch of 7 and of 64 (below
    DENSE_GEMM_ROWS; the Q6_K part v takes the float32 kernel, batch-invariant too)."""
    layer, weight = mixed_qkv_layer(torch.bfloat16)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    full, seven, alone = layer(x), layer(x[:7]), layer(x[6:7])
    assert torch.equal(full[6], alone[0]) and torch.equal(seven[6], alone[0])
    expected = x.double() @ weight.T
    torch.testing.assert_close(full.double(), expected, rtol=0.02, atol=0.02 * float(expected.abs().max()))


# -- the method: fused parts of mixed types, the prefill path, the fallback -----------------------------
def mixed_qkv_layer(dtype: torch.dtype, dense_copy: bool = False):
    """A QKV layer whose q, k, v come as Q4_1, Q8_0 and Q6_K blocks (as llama.cpp's mixed recipes give them),
    and the float64 weight they mean."""
    from tokenmill.layers.linear import QKVParallelLinear
    from tokenmill.layers.quant.gguf import GGUFLinearMethod, tag_ggml

    rng = np.random.default_rng(2)
    layer = QKVParallelLinear(hidden_size=256, head_dim=32, num_heads=4, num_kv_heads=2)
    layer.set_quant_method(GGUFLinearMethod(dense_copy))
    layer.params_dtype = dtype
    dense = []
    for shard, ggml_type, rows in (("q", T.Q4_1, 128), ("k", T.Q8_0, 64), ("v", T.Q6_K, 64)):
        raw = random_blocks(ggml_type, rows, 256, rng)
        layer.weight.weight_loader(layer.weight, tag_ggml(torch.from_numpy(raw), int(ggml_type)), shard)
        dense.append(dequantize(raw, ggml_type).astype(np.float64))
    layer.quant_method.process_weights_after_loading(layer)
    return layer, torch.from_numpy(np.concatenate(dense))


@pytest.mark.parametrize("rows", [1, 7, 20, 200])  # fused path (<= 8 rows), tiles, dense tile for prefill
def test_fused_layer_of_mixed_types(rows):
    layer, weight = mixed_qkv_layer(torch.float32)
    assert [run[0] for run in layer.gguf_runs] == [int(T.Q4_1), int(T.Q8_0), int(T.Q6_K)]
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    y, expected = layer(x).double(), x.double() @ weight.T
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_bfloat16_activations():
    layer, weight = mixed_qkv_layer(torch.bfloat16)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    expected = x.double() @ weight.T
    torch.testing.assert_close(y.double(), expected, rtol=0.02, atol=0.02 * float(expected.abs().max()))


@pytest.mark.skipif(not cpu_gemm._onednn_available(), reason="torch built without oneDNN: no dense copy")
@torch.no_grad()
def test_dense_copy_serves_many_rows_and_the_blocks_few():
    """Both forms of one bfloat16 layer (the loader's choice for small models): up to FEW_ROWS rows the
    blocks through the float32 kernel (a float32 layer's result, rounded to bfloat16 once), more rows the
    dense copy through oneDNN (the dequantized bfloat16 weights' oneDNN product); the two agree within
    bfloat16 rounding, and the float32 reference holds both."""
    from tokenmill.layers.quant.gguf import FEW_ROWS

    both, weight = mixed_qkv_layer(torch.bfloat16, dense_copy=True)
    assert both.dense_copy is not None
    float32_blocks, _ = mixed_qkv_layer(torch.float32)
    dense_bf16 = weight.to(torch.bfloat16)  # what the dequantizing load gives (rounded once from float32 values)
    x = torch.randn(FEW_ROWS + 1, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    few, many = both(x[:FEW_ROWS]), both(x)
    assert few.dtype == many.dtype == torch.bfloat16
    assert torch.equal(few, float32_blocks(x[:FEW_ROWS].float()).bfloat16())
    assert torch.equal(many, cpu_linear(x, dense_bf16, None))
    assert not torch.equal(few, many[:FEW_ROWS])  # two forms, not one: the weights round differently
    expected = x.double() @ weight.T
    tol = dict(rtol=0.02, atol=0.02 * float(expected.abs().max()))
    torch.testing.assert_close(few.double(), many[:FEW_ROWS].double(), **tol)
    torch.testing.assert_close(many.double(), expected, **tol)
    torch.testing.assert_close(few.double(), expected[:FEW_ROWS], **tol)


def test_without_a_compiler_the_weights_are_dequantized_once(monkeypatch):
    import tokenmill.layers.quant.gguf as gguf_method

    monkeypatch.setattr(gguf_method, "load_kernel", lambda: None)
    monkeypatch.setattr(gguf_cpu, "load_kernel", lambda: None)
    layer, weight = mixed_qkv_layer(torch.float32)
    assert layer.gguf_runs is None and layer.weight.dtype == torch.float32
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    expected = x.double() @ weight.T
    torch.testing.assert_close(layer(x).double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
