"""Phi-3 GGUF files (llama.cpp's arch "phi3", written as its converter writes them: gguf_checkpoints.py) against
transformers in float32 on the same weights: LongRoPE (its factors stored as tensors), half of each head rotated
and a sliding window, the three fields transformers' GGUF reader drops (model/gguf_config.py). F32, and Q8_0 kept
in its blocks on the CPU (the fused qkv and gate/up rows multiplied by the GGUF kernel)."""

from __future__ import annotations

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from tests.models.conftest import TINY_MODELS, build_tiny_model, greedy_hf
from tests.models.gguf_checkpoints import write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.model.loader import load_hf_config

# Prompts within the pretrained context of 16 that grow past it, and longer ones (the long factors throughout).
PROMPTS = [[5, 9, 33, 100, 7, 250, 3], list(range(3, 120, 3))]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def phi3_hf(tmp_path_factory):
    spec = TINY_MODELS["phi3-longrope-partial-rotary"]
    return build_tiny_model(spec, tmp_path_factory.mktemp("phi3-hf")), tmp_path_factory.mktemp("phi3-gguf")


def test_the_config_keeps_longrope_the_rotary_dimensions_and_the_window(phi3_hf):
    hf_model, folder = phi3_hf
    path = str(folder / "phi3-F32.gguf")
    write_gguf(hf_model, path)
    config = load_hf_config(ModelConfig(path))
    rope, expected = config.rope_parameters, hf_model.config.rope_parameters
    assert rope["rope_type"] == "longrope"
    assert rope["partial_rotary_factor"] == expected["partial_rotary_factor"] == 0.5
    assert rope["original_max_position_embeddings"] == 16
    assert rope["long_factor"] == pytest.approx(expected["long_factor"])
    assert rope["short_factor"] == pytest.approx(expected["short_factor"])
    assert config.sliding_window == hf_model.config.sliding_window == 12


@pytest.mark.parametrize("quant", [None, GGMLQuantizationType.Q8_0], ids=["F32", "Q8_0"])
def test_greedy_tokens_match_transformers(phi3_hf, quant):
    hf_model, folder = phi3_hf
    path = str(folder / f"phi3-{quant.name if quant else 'F32'}.gguf")
    meant = write_gguf(hf_model, path, quant)
    reference = transformers.AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32).eval()
    reference.load_state_dict(meant)
    expected = [greedy_hf(reference, prompt)[:NUM_TOKENS] for prompt in PROMPTS]
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", kv_cache_space=0.01, max_model_len=256)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
