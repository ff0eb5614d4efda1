"""The CPU's fast paths other than attention: prepacked oneDNN linear layers equal F.linear (and follow
weight changes), and dtype='auto' picks bfloat16 only where the CPU has bfloat16 units, saying why."""

import logging

import pytest
import torch
import torch.nn.functional as F

from tokenmill.config import ModelConfig
from tokenmill.layers import cpu_gemm
from tokenmill.layers.cpu_gemm import cpu_linear, prepacked_linear_applies
from tokenmill.model.loader import cpu_auto_dtype, resolve_dtype

needs_onednn = pytest.mark.skipif(not cpu_gemm._onednn_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_linear_equals_f_linear(dtype, tol, num_tokens, with_bias):
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 96, generator=g).to(dtype)
    weight = torch.randn(160, 96, generator=g).to(dtype)
    bias = torch.randn(160, generator=g).to(dtype) if with_bias else None
    with torch.inference_mode():
        assert prepacked_linear_applies(x, weight)
        out = cpu_linear(x, weight, bias)
    ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol


@needs_onednn
def test_prepacked_weight_follows_in_place_changes_and_any_leading_dims():
    weight = torch.nn.Parameter(torch.randn(32, 16), requires_grad=False)
    x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linear(x, weight, None), F.linear(x, weight))
    with torch.no_grad():
        weight.copy_(torch.randn(32, 16))  # an in-place write through the parameter moves its version
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linear(x, weight, None), F.linear(x, weight))


def test_prepacking_is_left_out_where_it_cannot_serve():
    weight = torch.randn(8, 4)
    assert not prepacked_linear_applies(torch.randn(3, 4), weight)  # autograd on: oneDNN's op has no backward
    with torch.inference_mode():
        assert not prepacked_linear_applies(torch.randn(0, 4), weight)  # an empty batch
        assert not prepacked_linear_applies(torch.randn(3, 4).half(), weight.half())
        torch.testing.assert_close(cpu_linear(torch.randn(0, 4), weight, None), torch.empty(0, 8))


@pytest.mark.parametrize("flags,expected", [
    ({"avx2", "fma", "avx512f"}, torch.float32),  # AVX-512 alone converts bfloat16: slower than float32
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"avx2", "amx_tile", "amx_bf16"}, torch.bfloat16),
    (set(), torch.float32),  # flags unknown (no /proc/cpuinfo)
])
def test_auto_dtype_on_the_cpu_follows_the_bfloat16_units(flags, expected):
    dtype, reason = cpu_auto_dtype(flags)
    assert dtype == expected
    assert ("natively" in reason) == (expected == torch.bfloat16)


def test_resolve_dtype_logs_the_cpu_choice_and_honours_an_explicit_dtype(monkeypatch, caplog):
    monkeypatch.setattr("tokenmill.model.loader.cpu_flags", lambda: {"avx2"})
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="tokenmill.model.loader"):
        assert resolve_dtype(ModelConfig(model="m", dtype="auto"), None, cpu) == torch.float32
    assert "float32" in caplog.text and "no bfloat16 units" in caplog.text
    monkeypatch.setattr("tokenmill.model.loader.cpu_flags", lambda: {"avx512_bf16"})
    assert resolve_dtype(ModelConfig(model="m", dtype="auto"), None, cpu) == torch.bfloat16
    assert resolve_dtype(ModelConfig(model="m", dtype="float32"), None, cpu) == torch.float32


def test_bfloat16_gguf_keeps_both_forms_only_for_small_models(monkeypatch, caplog):
    """In bfloat16 on the CPU a GGUF's linear layers keep their blocks and a dense copy while the copy stays
    under layers.quant.gguf.DENSE_COPY_MAX_BYTES (said at start-up, with its size), else they are
    dequantized at load; float16 is always dequantized."""
    from transformers import LlamaConfig

    from tokenmill.layers.quant import gguf
    from tokenmill.model.loader import _gguf_form
    from tokenmill.model.registry import get_model_class

    hf_config = LlamaConfig(vocab_size=64, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4)
    model_class = get_model_class(["LlamaForCausalLM"])  # built on the meta device: no memory taken
    # Per layer: qkv 1024 x (1024 + 2 x 512), o 1024 x 1024, gate/up 2 x 2048 x 1024, down 1024 x 2048.
    dense_bytes = 2 * (1024 * 2048 + 1024 * 1024 + 2 * 2048 * 1024 + 1024 * 2048) * 2
    cpu, config = torch.device("cpu"), ModelConfig(model="m.gguf")
    with caplog.at_level(logging.INFO, logger="tokenmill.model.loader"):
        assert _gguf_form(config, hf_config, model_class, cpu, torch.bfloat16) == "blocks and dense"
    assert round(dense_bytes / 1e6) == 38 and "dense bfloat16 copy (38 MB" in caplog.text
    monkeypatch.setattr(gguf, "DENSE_COPY_MAX_BYTES", dense_bytes - 1)
    assert _gguf_form(config, hf_config, model_class, cpu, torch.bfloat16) == "dense"
    assert "over the" in caplog.text
    monkeypatch.setattr(gguf, "DENSE_COPY_MAX_BYTES", dense_bytes)
    assert _gguf_form(config, hf_config, model_class, cpu, torch.bfloat16) == "blocks and dense"
    assert _gguf_form(config, hf_config, model_class, cpu, torch.float16) == "dense"
    assert _gguf_form(config, hf_config, model_class, cpu, torch.float32) == "blocks"  # 76 MB in float32: over
    monkeypatch.setattr(gguf, "DENSE_COPY_MAX_BYTES", 2 * dense_bytes)
    assert _gguf_form(config, hf_config, model_class, cpu, torch.float32) == "blocks and dense"
    kept = ModelConfig(model="m.gguf", quantization="gguf")
    assert _gguf_form(kept, hf_config, model_class, cpu, torch.bfloat16) == "blocks"
