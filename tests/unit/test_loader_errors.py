"""Broken checkpoints, as users meet them (a cut-off download, a lost shard, a tensor too few, a config that
does not match its weights): each fails with a message that names the file or tensor at fault."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tokenmill.config import ModelConfig
from tokenmill.model.loader import load_hf_config, load_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 1-layer Llama saved by transformers: config.json and model.safetensors."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def broken_copy(checkpoint, tmp_path, tensors=None, config_changes=None):
    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder)
    if tensors is not None:
        save_file(tensors(load_file(folder / "model.safetensors")), folder / "model.safetensors",
                  metadata={"format": "pt"})
    if config_changes is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def load(folder):
    model_config = ModelConfig(model=str(folder))
    return load_model(model_config, load_hf_config(model_config), torch.device("cpu"), torch.float32)


def without(name):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


@pytest.mark.parametrize("removed", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_a_missing_part_of_a_fused_layer_is_named(checkpoint, tmp_path, removed):
    # The layer's other parts are there: it used to load with these rows left at their initial values.
    with pytest.raises(ValueError, match=rf"missing weights: \['{removed}'\]"):
        load(broken_copy(checkpoint, tmp_path, tensors=without(removed)))


def test_a_tensor_that_does_not_fit_the_config_is_named(checkpoint, tmp_path):
    folder = broken_copy(checkpoint, tmp_path, config_changes={"intermediate_size": 48})
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.mlp.\w+_proj.weight'.*shape"):
        load(folder)


@pytest.mark.parametrize("keep_bytes", [100, 10_000])  # a cut-off header, cut-off data
def test_a_truncated_safetensors_file_is_named(checkpoint, tmp_path, keep_bytes):
    folder = broken_copy(checkpoint, tmp_path)
    shard = folder / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:keep_bytes])
    with pytest.raises(ValueError, match=rf"{shard} is not a readable safetensors file .* download it again"):
        load(folder)


def test_an_index_naming_a_missing_shard(checkpoint, tmp_path):
    folder = broken_copy(checkpoint, tmp_path)
    names = load_file(folder / "model.safetensors").keys()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "model-00001-of-00002.safetensors" if "layers" in name else "model.safetensors"
                        for name in names}}))
    with pytest.raises(FileNotFoundError, match="index.json names 1 shard.*: model-00001-of-00002.safetensors"):
        load(folder)


def test_a_config_without_architectures_loads_as_its_model_type(checkpoint, tmp_path):
    folder = broken_copy(checkpoint, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    assert load_hf_config(ModelConfig(model=str(folder))).architectures == ["LlamaForCausalLM"]


def write_gguf(path, architecture: str) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_truncated_gguf_file(tmp_path):
    path = tmp_path / "cut.gguf"
    write_gguf(path, "llama")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"cannot read .*cut.gguf \(\d+ bytes\) as a GGUF file.*download it again"):
        load_hf_config(ModelConfig(model=str(path)))


def test_a_gguf_of_an_unknown_family_lists_the_supported_ones(tmp_path):
    path = tmp_path / "odd.gguf"
    write_gguf(path, "rwkv9")
    with pytest.raises(ValueError, match="architecture rwkv9 is not supported.* Supported: .*LlamaForCausalLM"):
        load_hf_config(ModelConfig(model=str(path)))


def test_a_quantization_config_without_its_method_is_refused(checkpoint, tmp_path):
    # It used to load as a dense model: a quantized checkpoint's tensors then fail to load, or run as garbage.
    folder = broken_copy(checkpoint, tmp_path, config_changes={"quantization_config": {"bits": 4, "group_size": 128}})
    with pytest.raises(ValueError, match="quantization_config has no quant_method .*bits, group_size.*gptq"):
        load(folder)


@pytest.mark.parametrize("quantization_config", [
    {"quant_method": "compressed-tensors", "config_groups": 5},
    {"quant_method": "compressed-tensors", "config_groups": {"group_0": "Linear"}},
    {"quant_method": "gptq", "bits": 4, "group_size": None},
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "modules_to_not_convert": 5},
])
def test_a_quantization_config_value_of_the_wrong_type_is_named(checkpoint, tmp_path, quantization_config):
    folder = broken_copy(checkpoint, tmp_path, config_changes={"quantization_config": quantization_config})
    method = quantization_config["quant_method"]
    with pytest.raises(ValueError, match=f"the checkpoint's {method} quantization_config has a value of the wrong"):
        load(folder)


@pytest.mark.parametrize(("config", "message"), [
    # transformers' own error was a paragraph on upgrading transformers.
    ({"model_type": "foo", "architectures": ["FooForCausalLM"]},
     r"config.json: model_type 'foo' is not supported; supported architectures: .*LlamaForCausalLM"),
    ([1, 2], r"config.json is not a JSON object of model settings"),
])
def test_a_config_of_no_model_transformers_knows_is_one_line(checkpoint, tmp_path, config, message):
    folder = broken_copy(checkpoint, tmp_path)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as refused:
        load_hf_config(ModelConfig(model=str(folder)))
    assert "\n" not in str(refused.value)


def test_a_quantization_config_that_is_no_object_is_one_line(checkpoint, tmp_path):
    # transformers failed with an AttributeError traceback while printing the config.
    folder = broken_copy(checkpoint, tmp_path, config_changes={"quantization_config": "gptq"})
    with pytest.raises(ValueError, match="config.json: quantization_config must be a JSON object with a quant_method"
                                         ", got 'gptq'"):
        load_hf_config(ModelConfig(model=str(folder)))


def test_a_load_format_that_does_not_read_the_path_is_named(checkpoint):
    # It used to hand the folder to the GGUF reader: an IsADirectoryError traceback.
    model_config = ModelConfig(model=str(checkpoint), load_format="gguf")
    with pytest.raises(ValueError, match=r"--load-format gguf does not read a model folder .*leave --load-format out"):
        load_model(model_config, load_hf_config(model_config), torch.device("cpu"), torch.float32)
