"""Parsed GGUF files are remembered per file version: parsed once, re-parsed once the file changes, and a
caller's changes to what it got never reach the next caller."""

import os

from tokenmill.model import gguf_cache


def test_a_file_is_parsed_once_per_version(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"one")
    parses = []

    def parse():
        parses.append(path.read_bytes())
        return {"content": path.read_bytes()}

    first = gguf_cache.remembered("test", str(path), parse)
    assert gguf_cache.remembered("test", str(path), parse) is first and parses == [b"one"]
    assert gguf_cache.remembered("other kind", str(path), parse) is not first  # each kind is parsed apart
    path.write_bytes(b"two!")  # another size (and time): another version
    os.utime(path, ns=(1, 1))
    assert gguf_cache.remembered("test", str(path), parse) == {"content": b"two!"}


def test_the_config_of_a_gguf_is_parsed_once_and_handed_out_as_copies(smollm2_path, monkeypatch):
    from tokenmill.config import ModelConfig
    from tokenmill.model import loader

    calls = []
    parse = loader._gguf_config
    monkeypatch.setattr(loader, "_gguf_config", lambda path: calls.append(path) or parse(path))
    first = loader.load_hf_config(ModelConfig(model=smollm2_path))
    first.num_hidden_layers = -1  # a caller's change
    second = loader.load_hf_config(ModelConfig(model=smollm2_path))
    # Parsed at most once (not at all if an engine of this session parsed it before).
    assert len(calls) <= 1 and second.num_hidden_layers == 30 and second.model_type == "llama"


def test_a_config_is_stored_on_disk_and_read_back_equal_by_later_processes(tmp_path, monkeypatch):
    from transformers import LlamaConfig, Qwen3MoeConfig

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    for index, config in enumerate([LlamaConfig(num_hidden_layers=3, rope_parameters={"rope_type": "llama3",
                                    "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
                                    Qwen3MoeConfig(num_experts=4, tie_word_embeddings=True)]):
        path = tmp_path / f"model{index}.gguf"
        path.write_bytes(b"model")
        parses = []

        def parse(config=config, parses=parses):
            parses.append(1)
            return config

        assert gguf_cache.config_kept_on_disk(str(path), parse) is config
        again = gguf_cache.config_kept_on_disk(str(path), parse)  # what a new process finds
        assert type(again) is type(config) and again.to_dict() == config.to_dict() and len(parses) == 1
    [stored] = [p for p in (tmp_path / "cache" / "gguf_configs").iterdir() if p.read_text().find("qwen3") >= 0]
    stored.write_text("{not json")  # damaged: parsed and stored again
    assert gguf_cache.config_kept_on_disk(str(path), parse).to_dict() == config.to_dict() and len(parses) == 2
    path.write_bytes(b"another model")  # another version of the file: parsed again
    assert gguf_cache.config_kept_on_disk(str(path), parse) is config and len(parses) == 3


def test_the_stored_configs_are_bounded(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "MAX_STORED_CONFIGS", 3)
    for index in range(5):
        path = tmp_path / f"model{index}.gguf"
        path.write_bytes(b"model")
        gguf_cache.config_kept_on_disk(str(path), LlamaConfig)
    assert len(list((tmp_path / "cache" / "gguf_configs").iterdir())) == 3
