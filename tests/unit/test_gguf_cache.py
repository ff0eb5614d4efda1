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
