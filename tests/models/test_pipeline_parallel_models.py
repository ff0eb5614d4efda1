"""Two pipeline stages (two processes, gloo) give transformers' greedy tokens for the families whose decoder
stack or LM head is built apart from Llama's (Gemma 2's scaled embedding and soft-capped logits, DeepSeek-V3's
latent attention and experts) and for a checkpoint the loader renames (Mixtral). tests/e2e/test_pipeline_parallel.py
covers Llama and Qwen2-MoE with every scheduling feature on."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

NAMES = ["gemma2-window-softcap", "deepseek-v3", "mixtral"]


@pytest.mark.parametrize("name", NAMES)
def test_two_stages_match_transformers(references, name: str):
    ref = references(name)
    llm = LLM(ref.path, skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
              pipeline_parallel_size=2, max_num_batched_tokens=16, async_scheduling=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=len(ref.expected[0]), ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in ref.prompts], params, use_tqdm=False)
    finally:
        llm.engine.core.shutdown()
    assert [list(out.outputs[0].token_ids) for out in outputs] == ref.expected
