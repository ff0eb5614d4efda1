"""The AMX bfloat16 GEMM (layers.cpu_amx_gemm) and the CPU argmax (sample.cpu_argmax) against float64 and torch.

The AMX kernel's products of bfloat16 values are exact and its sums float32, so it is held to a few float32
roundings of the sum of |x| |w| (plus the output's bfloat16 rounding), for shapes with partial row groups and
feature strips, strided rows, float32 output and a bias; layers.cpu_gemm packs bfloat16 weights for it, and GGUF
Q4 layers keep their blocks repacked for it. Skipped where the CPU has no AMX (the development Xeon has it; CI's
may not).
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.cpu_amx_gemm import AMXWeight, amx_available, amx_linear, pack_amx
from tokenmill.layers.cpu_gemm import pack_weight, packed_linear
from tokenmill.sample.cpu_argmax import argmax_applies, argmax_rows
from tokenmill.sample.cpu_argmax import load_kernel as load_argmax

needs_amx = pytest.mark.skipif(not amx_available(), reason="no AMX on this CPU: oneDNN serves bfloat16 linears")


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> None:
    reference = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    bound = scale * 2.0**-20 + (reference.abs() * 2.0**-8 if out_dtype == torch.bfloat16 else 0)
    assert y.dtype == out_dtype and y.shape == reference.shape
    assert ((y.double() - reference).abs() <= bound + 1e-30).all()


@needs_amx
@pytest.mark.parametrize("m, n, k", [(1, 32, 32), (5, 50, 64), (16, 96, 576), (33, 17, 96), (64, 576, 1536),
                                     (130, 200, 128), (300, 64, 32)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_matches_float64_reference(m, n, k, out_dtype):
    generator = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=generator).bfloat16()
    w = (torch.randn(n, k, generator=generator) * 0.05).bfloat16()
    assert_close(amx_linear(x, pack_amx(w), out_dtype), x, w, out_dtype)


@needs_amx
def test_strided_rows_and_a_row_does_not_depend_on_the_batch():
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(40, 256, generator=generator).bfloat16()
    x = wide[:, 64:192]  # rows 256 apart, 128 inputs each
    w = (torch.randn(70, 128, generator=generator) * 0.05).bfloat16()
    packed = pack_amx(w)
    y = amx_linear(x, packed)
    assert torch.equal(y, amx_linear(x.contiguous(), packed))
    for rows in (1, 7, 16, 17):  # whole and partial groups: each row's tiles sum in one order
        assert torch.equal(amx_linear(x[:rows], packed), y[:rows])


@needs_amx
def test_packed_linear_takes_the_amx_tiles_for_bfloat16_weights():
    generator = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 64, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16()
    packed = pack_weight(w)
    assert isinstance(packed, AMXWeight)
    for rows in (3, 64, 600):
        x = torch.randn(rows, 64, generator=generator).bfloat16()
        y = packed_linear(x, packed, bias)
        assert torch.equal(y, amx_linear(x, packed) + bias)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), rtol=2e-2, atol=2e-2)
        logits = packed_linear(x, packed, None, out_float32=True)
        assert torch.equal(logits, amx_linear(x, packed, torch.float32))


def test_float32_weights_stay_with_onednn():
    assert not isinstance(pack_weight(torch.randn(64, 64)), AMXWeight)


@pytest.mark.skipif(load_argmax() is None, reason="no C compiler: torch.max serves")
def test_argmax_matches_torch_with_ties_nans_and_infinities():
    generator = torch.Generator().manual_seed(3)
    for shape in [(64, 49152), (3, 17), (5, 15), (1, 1), (2, 33)]:
        x = torch.randn(shape, generator=generator)
        assert torch.equal(argmax_rows(x), torch.max(x, -1).indices), shape
    x = torch.randint(0, 3, (16, 1000), generator=generator).float()  # ties everywhere: the first index wins
    assert torch.equal(argmax_rows(x), torch.argmax(x, -1))
    x = torch.zeros(5, 100)
    x[0, 5] = x[0, 85] = 2
    x[1, 37] = x[1, 90] = 1
    x[2, 60] = x[2, 50] = float("nan")
    x[3, 99] = float("inf")
    x[4] = float("-inf")
    assert argmax_rows(x).tolist() == [5, 37, 50, 99, 0] == torch.max(x, -1).indices.tolist()
    wide = torch.randn(4, 200, generator=generator)
    assert argmax_applies(wide[:, :150]) and torch.equal(argmax_rows(wide[:, :150]), wide[:, :150].argmax(-1))
    assert not argmax_applies(wide.bfloat16()) and not argmax_applies(wide.t())


@needs_amx
@pytest.mark.parametrize("ggml_type", [2, 3])  # Q4_0, Q4_1
@torch.no_grad()
def test_q4_blocks_give_the_dense_bfloat16_copys_products(ggml_type):
    """A Q4 layer with a dense copy (the loader's form for small bfloat16 GGUFs) keeps its blocks repacked for the
    AMX kernel instead of the copy: the decoded weights are the dense bfloat16 weights, so the layer's many-row
    output is the AMX product with those weights bit for bit, and a few rows still take the blocks' float32
    kernel."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize, quantize

    from tokenmill.layers.cpu_amx_gemm import AMXWeight, amx_q4_applies, pack_amx_q4
    from tokenmill.layers.linear import MergedColumnParallelLinear
    from tokenmill.layers.quant.gguf import FEW_ROWS, GGUFLinearMethod, tag_ggml

    rng = np.random.default_rng(ggml_type)
    layer = MergedColumnParallelLinear(128, [80, 80])  # 160 features: a partial strip of 32
    layer.set_quant_method(GGUFLinearMethod(dense_copy=True))
    layer.params_dtype = torch.bfloat16
    dense = []
    for shard in (0, 1):
        raw = quantize(rng.standard_normal((80, 128)).astype(np.float32) * 0.05, GGMLQuantizationType(ggml_type))
        layer.weight.weight_loader(layer.weight, tag_ggml(torch.from_numpy(raw), ggml_type), shard)
        dense.append(dequantize(raw, GGMLQuantizationType(ggml_type)))
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.dense_copy, AMXWeight) and layer.dense_copy.ggml_type == ggml_type
    blocks = layer.gguf_one_run[1]
    assert amx_q4_applies(blocks, ggml_type, 128) and not amx_q4_applies(blocks, 8, 128)
    weight_bf16 = torch.from_numpy(np.concatenate(dense)).bfloat16()
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    many = layer(x)
    assert torch.equal(many, amx_linear(x, pack_amx(weight_bf16)))
    assert torch.equal(amx_linear(x, pack_amx_q4(blocks, ggml_type, 128), torch.float32),
                       amx_linear(x, pack_amx(weight_bf16), torch.float32))
    torch.testing.assert_close(layer(x[:FEW_ROWS]), many[:FEW_ROWS], rtol=2e-2, atol=2e-2)
