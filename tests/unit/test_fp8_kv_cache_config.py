"""kv_cache_dtype: validated in the config and on the command line, resolved to the pool's dtype, refused
where the kernels cannot run it; checkpoints' KV scales loaded under each exporter's names, and optional."""

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from tokenmill.attention.kv_quant import check_kv_cache_dtype, resolve_kv_cache_dtype
from tokenmill.cli import make_parser
from tokenmill.cli.args import engine_config_from_args
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.model.base import kv_scale_targets
from tokenmill.model.llama import LlamaForCausalLM


@pytest.mark.parametrize("value", ["auto", "fp8", "fp8_e4m3", "int8"])
def test_kv_cache_dtype_values(value):
    assert CacheConfig(kv_cache_dtype=value).kv_cache_dtype == value
    assert EngineConfig.from_kwargs("m", kv_cache_dtype=value).cache_config.kv_cache_dtype == value


@pytest.mark.parametrize("value", ["fp8_e5m2", "FP8", "INT8", "int4", "bfloat16", ""])
def test_unsupported_kv_cache_dtypes_are_refused_by_name(value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype .* not supported; choose one of auto, fp8, fp8_e4m3, int8"):
        CacheConfig(kv_cache_dtype=value)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig.from_kwargs("m", kv_cache_dtype=value)  # what LLM(model, kv_cache_dtype=...) builds


def test_kv_cache_dtype_flag():
    parse = lambda *argv: engine_config_from_args(make_parser().parse_args(["serve", "m", *argv]))
    assert parse().cache_config.kv_cache_dtype == "auto"
    assert parse("--kv-cache-dtype", "fp8").cache_config == CacheConfig(kv_cache_dtype="fp8")
    assert parse("--kv-cache-dtype", "int8").cache_config == CacheConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="fp8_e5m2"):
        parse("--kv-cache-dtype", "fp8_e5m2")


def test_kv_cache_dtype_resolves_to_the_pool_dtype():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    for name in ("fp8", "fp8_e4m3"):
        assert resolve_kv_cache_dtype(name, torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("int8", torch.bfloat16) == torch.int8


def test_int8_is_refused_for_latent_attention_caches():
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' does not support latent attention"):
        check_kv_cache_dtype(torch.int8, torch.device("cpu"), "torch", has_latent_attention=True)
    check_kv_cache_dtype(torch.int8, torch.device("cpu"), "torch")
    check_kv_cache_dtype(torch.float8_e4m3fn, torch.device("cpu"), "torch", has_latent_attention=True)


def test_int8_pool_counts_its_scales_and_copies_them_with_its_blocks():
    """Bytes per token: K and V int8 rows plus a float32 scale per row; a block copy (a forked sample's) takes the
    rows' scales along, and releasing the pool gives the layer its 0-d scales back."""
    from tokenmill.layers.attention import Attention

    layer = Attention(num_heads=8, head_dim=128, scale=1.0, num_kv_heads=2)
    assert layer.kv_cache_bytes_per_token(torch.bfloat16) == 2 * 2 * 128 * 2
    assert layer.kv_cache_bytes_per_token(torch.int8) == 2 * 2 * (128 + 4)
    layer.allocate_kv_cache(5, 16, torch.int8, torch.device("cpu"))
    assert layer.kv_cache.shape == (2, 5, 16, 2, 128) and layer.k_scale.shape == layer.v_scale.shape == (5, 16, 2)
    layer.kv_cache.copy_(torch.randint(-127, 128, layer.kv_cache.shape, dtype=torch.int8))
    layer.k_scale.copy_(torch.rand(5, 16, 2))
    layer.v_scale.copy_(torch.rand(5, 16, 2))
    layer.copy_kv_blocks(torch.tensor([1, 3]), torch.tensor([4, 0]))
    for src, dst in ((1, 4), (3, 0)):
        assert torch.equal(layer.kv_cache[:, dst], layer.kv_cache[:, src])
        for scales in (layer.k_scale, layer.v_scale):
            assert torch.equal(scales[dst], scales[src])
    assert not torch.equal(layer.k_scale[2], layer.k_scale[1])
    layer.release_kv_cache()
    assert layer.kv_cache.numel() == 0 and layer.k_scale.shape == layer.v_scale.shape == ()


def test_fp8_on_a_gpu_without_e4m3_conversions_is_refused_at_start_up(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        check_kv_cache_dtype(torch.float8_e4m3fn, cuda, "triton")
    check_kv_cache_dtype(torch.float8_e4m3fn, cuda, "torch")  # torch converts in software
    check_kv_cache_dtype(torch.bfloat16, cuda, "triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_kv_cache_dtype(torch.float8_e4m3fn, cuda, "triton")


def test_checkpoint_kv_scale_names():
    assert kv_scale_targets("model.layers.3.self_attn.k_proj.k_scale") == ["model.layers.3.self_attn.attn.k_scale"]
    assert kv_scale_targets("model.layers.3.self_attn.v_proj.v_scale") == ["model.layers.3.self_attn.attn.v_scale"]
    assert kv_scale_targets("model.layers.0.self_attn.k_scale") == ["model.layers.0.self_attn.attn.k_scale"]
    assert kv_scale_targets("model.layers.0.self_attn.attn.v_scale") == ["model.layers.0.self_attn.attn.v_scale"]
    assert kv_scale_targets("model.layers.1.self_attn.kv_scale") == ["model.layers.1.self_attn.attn.k_scale",
                                                                     "model.layers.1.self_attn.attn.v_scale"]
    for other in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight_scale",
                  "model.layers.0.self_attn.k_proj.input_scale", "model.layers.0.mlp.k_scale"):
        assert kv_scale_targets(other) is None


@pytest.fixture(scope="module")
def tiny_checkpoint():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return config, HFLlama(config).state_dict()


def load(config, weights):
    model = LlamaForCausalLM(config)
    model.load_weights(iter(weights.items()))
    return [(layer.self_attn.attn.k_scale.item(), layer.self_attn.attn.v_scale.item()) for layer in model.model.layers]


def test_checkpoints_without_kv_scales_load_with_scales_of_one(tiny_checkpoint):
    assert load(*tiny_checkpoint) == [(1.0, 1.0)] * 3


def test_kv_scales_load_from_each_exporters_names(tiny_checkpoint):
    config, weights = tiny_checkpoint
    scales = {
        "model.layers.0.self_attn.k_proj.k_scale": torch.tensor([0.25]),  # shape [1], as some exporters save it
        "model.layers.0.self_attn.v_proj.v_scale": torch.tensor(0.5),
        "model.layers.1.self_attn.k_scale": torch.tensor(2.0, dtype=torch.bfloat16),
        "model.layers.1.self_attn.v_scale": torch.tensor(4.0),
        "model.layers.2.self_attn.kv_scale": torch.tensor(0.125),
    }
    assert load(config, {**weights, **scales}) == [(0.25, 0.5), (2.0, 4.0), (0.125, 0.125)]


@pytest.mark.parametrize("bad, match", [(torch.ones(2), "per-head scales are not supported"),
                                        (torch.tensor(0.0), "positive and finite"),
                                        (torch.tensor(float("nan")), "positive and finite")])
def test_unusable_kv_scales_are_refused(tiny_checkpoint, bad, match):
    config, weights = tiny_checkpoint
    with pytest.raises(ValueError, match=match):
        load(config, {**weights, "model.layers.0.self_attn.k_scale": bad})


def test_dummy_weights_leave_kv_scales_at_one(tiny_checkpoint):
    from tokenmill.model.loader import init_dummy_weights

    model = LlamaForCausalLM(tiny_checkpoint[0])
    init_dummy_weights(model, seed=0)
    assert all(layer.self_attn.attn.k_scale.item() == layer.self_attn.attn.v_scale.item() == 1.0
               for layer in model.model.layers)
