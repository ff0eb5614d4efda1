"""Every supported architecture, tiny and random: tokenmill's greedy tokens equal transformers'.

Float32 on CPU, so the tokens must be identical, under these schedules: one prefill per prompt,
prefill chunked into 16-token steps, a KV pool so small that requests get preempted and recomputed,
and speculative decoding (n-gram drafts verified in one pass) alone and with the last two; and on two
pipeline stages of two tensor-parallel ranks each (gloo). The tiny models and their reference outputs come from
conftest.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_spec_decode import always_draft
from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import iter_safetensors_weights
from tokenmill.model.registry import get_model_class, supported_architectures

# The CPU default pool (4 GiB) means half a million block objects for a model this small, about a
# second per engine; the pool's size changes nothing the test checks.
BASE_ARGS = {"skip_tokenizer_init": True, "device": "cpu", "dtype": "float32", "kv_cache_space": 0.01}

# Short n-grams: the tiny models' outputs repeat often enough that drafts are accepted and rejected.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}

ENGINE_SETTINGS = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    # 6 blocks of 16 tokens, while the four requests need 12 between them.
    "preemption": {"num_gpu_blocks_override": 6, "max_model_len": 64, "max_num_batched_tokens": 16},
    "ngram": {"speculative_config": NGRAM},
    "ngram-chunked-preemption": {"num_gpu_blocks_override": 6, "max_model_len": 64, "max_num_batched_tokens": 16,
                                 "speculative_config": NGRAM, "async_scheduling": True},
    # Two stages of two ranks in processes of their own (gloo), each stage building and loading only its layers,
    # sliced, two micro-batches in flight, async scheduling: every architecture shards and splits both ways. (Two
    # ranks of one stage had a setting of their own, which sliced the same layers the same way: the one-stage path
    # is the architecture-independent one, tests/e2e/test_tensor_parallel.py's; two stages alone:
    # tests/e2e/test_pipeline_parallel.py.)
    "tensor-pipeline-parallel": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "max_num_batched_tokens": 16,
                                 "async_scheduling": True},
}


def test_every_registered_architecture_is_covered(tiny_model_architectures):
    # A new registry entry needs a tiny model in conftest.py too.
    assert tiny_model_architectures == set(supported_architectures())


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
def test_greedy_tokens_match_hf(references, model_name: str, setting: str):
    ref = references(model_name)
    llm = LLM(ref.path, **BASE_ARGS, **ENGINE_SETTINGS[setting])
    if "ngram" in setting:
        always_draft(llm)  # a random model's drafts gain little: draft every step anyway
    params = SamplingParams(temperature=0, max_tokens=len(ref.expected[0]), ignore_eos=True)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in ref.prompts], params, use_tqdm=False)
    finally:
        if "parallel" in setting:
            llm.engine.core.shutdown()  # one multi-process engine per process at a time
    assert [out.outputs[0].token_ids for out in outputs] == ref.expected
    stats = llm.engine.last_stats
    if "preemption" in setting:
        assert stats.num_preemptions > 0, "the tiny KV pool should have forced preemption"
    if "ngram" in setting:
        assert stats.spec_decoding.num_drafts > 0, "no step verified a draft"


def test_gemma2_final_logits_are_soft_capped(references):
    # Soft-capping is monotonic, so greedy tokens cannot see it: compare the logits themselves.
    ref = references("gemma2-window-softcap")
    hf = ref.hf_model
    model = get_model_class(hf.config.architectures)(hf.config)
    model.load_weights(iter_safetensors_weights(ref.path))
    input_ids = torch.tensor([ref.prompts[0]])
    with torch.no_grad():
        hidden = hf.model(input_ids).last_hidden_state[0]
        expected = hf(input_ids).logits[0]
        got = model.compute_logits(hidden)
    assert got.abs().max() <= hf.config.final_logit_softcapping
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["default", "chunked-prefill", "ngram-chunked-preemption"])
def test_greedy_tokens_match_hf_on_cuda(references, model_name: str, setting: str):
    """float32 on the GPU with every step in a CUDA graph where one fits: decode-only steps and steps with
    prefills (fixed-grid attention, padded tokens and requests); transformers' greedy tokens exactly."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    ref = references(model_name)
    llm = LLM(ref.path, **{**BASE_ARGS, "device": "cuda"}, max_num_seqs=8, max_cudagraph_capture_size=256,
              **ENGINE_SETTINGS[setting])
    runner = llm.engine.core.executor.driver_worker.model_runner
    replays = []
    if runner.mixed_cuda_graphs is not None:  # absent for latent attention (MLA) models
        mixed_run = runner.mixed_cuda_graphs.run
        runner.mixed_cuda_graphs.run = lambda *args, **kwargs: replays.append(mixed_run(*args, **kwargs)) or replays[-1]
    if "ngram" in setting:
        always_draft(llm)  # a random model's drafts gain little: draft every step anyway
    params = SamplingParams(temperature=0, max_tokens=len(ref.expected[0]), ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ref.prompts], params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == ref.expected
    if runner.mixed_cuda_graphs is not None:
        assert any(r is not None for r in replays), "no step with prefills replayed a graph"


def test_longrope_drafters_are_refused_at_start_up(references):
    """A drafter's forward passes are not given the long-prompt flags its LongRoPE table needs (layers/rotary.py)."""
    path = references("phi3-longrope-partial-rotary").path
    with pytest.raises(ValueError, match="LongRoPE model .* is not supported yet: use the ngram method"):
        LLM(path, **BASE_ARGS, speculative_config={"method": "draft_model", "model": path,
                                                   "num_speculative_tokens": 2})


def test_longrope_long_prompts_reuse_no_block_of_a_shorter_prompt(references):
    """A prompt past the pretrained context takes the long frequencies at every position, so a shorter prompt's
    cached blocks (short frequencies) hold other keys for the same tokens: the prefix cache keeps the two apart,
    and long prompts still share among themselves."""
    ref = references("phi3-longrope-partial-rotary")  # pretrained context 16
    long_prompt, expected = ref.prompts[2], ref.expected[2]  # 23 tokens
    assert len(long_prompt) > 16
    llm = LLM(ref.path, **BASE_ARGS, enable_prefix_caching=True, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=len(expected), ignore_eos=True)
    llm.generate([{"prompt_token_ids": long_prompt[:16]}], params, use_tqdm=False)  # caches its block
    for hits in (0, 16):  # then the second long run finds the first's block
        outputs = llm.generate([{"prompt_token_ids": long_prompt}], params, use_tqdm=False)
        assert outputs[0].outputs[0].token_ids == expected
        assert llm.engine.last_stats.prefix_cache_hits == hits
