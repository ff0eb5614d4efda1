"""A Llama GGUF file with Llama 3's RoPE scaling, which llama.cpp's converter stores only as the `rope_freqs`
tensor (gguf_checkpoints.py writes it as the converter does): tokenmill applies the divisors
(model/gguf_config.py) and its greedy tokens equal transformers' on the Hugging Face model with the "llama3"
scaling, on prompts within and past the pretrained context of 64; without them, they do not."""

from __future__ import annotations

import pytest

from tests.models.conftest import TINY_MODELS, build_tiny_model, greedy_hf
from tests.models.gguf_checkpoints import write_gguf
from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 9, 33, 100, 7, 250, 3], list(range(3, 300, 3))]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def llama3_gguf(tmp_path_factory):
    hf_model = build_tiny_model(TINY_MODELS["llama3-rope-sharded"], tmp_path_factory.mktemp("llama3-hf"))
    path = str(tmp_path_factory.mktemp("llama3-gguf") / "llama3-F32.gguf")
    write_gguf(hf_model, path)
    return hf_model, path


def test_greedy_tokens_match_transformers_with_the_scaling(llama3_gguf):
    hf_model, path = llama3_gguf
    expected = [greedy_hf(hf_model, prompt)[:NUM_TOKENS] for prompt in PROMPTS]
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", kv_cache_space=0.01, max_model_len=256)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert llm.engine.hf_config.rope_freq_divisors[-1] == 8.0  # the lowest band slowed by the scaling's factor
