"""FP8 weights (layers.quant.fp8) through the real engine on the CPU, where the same W8A8 math runs in float32.

Each checkpoint layout is compared with its dequantized dense twin (what the checkpoint means: a misread
layout, scale or exclusion changes the predictions far beyond the bounds), and online quantization of the
real default model with the unquantized model, on a fixed text.

Bounds. e4m3 keeps 3 mantissa bits: each weight and activation is off by up to 1/16 of its value, about
1/30 on average, and the errors of a dot product's terms are independent, so a logit moves by a few percent
of its spread. On SmolLM2 (measured 2026-12-02: KL 0.017 nats, top-1 0.914 over 81 positions; the CPU run is
deterministic) the bounds leave room for another platform's rounding, while a wrong scale (a factor of 2 on
one layer's down projection, test below) moves the KL by an order of magnitude. The tiny random models
have HF's initial weights (a larger spread makes two random layers chaotic: any rounding flips tokens) and an
LM head scaled up so that their next-token distributions are peaked as a trained model's (measured: KL
~0.003 against the dequantized twin, top-1 ~0.95).
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.quant_checkpoints import TINY_TEXT, engine, greedy_prefix_lengths, tiny_model, write_fp8
from tests.e2e.test_spec_decode import always_draft
from tokenmill import LLM, SamplingParams
from tokenmill.bench.quant_quality import quant_quality

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a screw press adapted from wine making. Within fifty years "
        "presses were running in more than two hundred European cities, and the price of books fell sharply. "
        "Scholars could compare identical copies of a text for the first time, which changed how knowledge "
        "was checked, corrected and shared across the continent.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(), tmp_path_factory.mktemp("fp8")


@pytest.mark.parametrize("layout,input_scale", [
    ("hf-block", None), ("hf-tensor", None), ("hf-tensor", 0.05), ("ct-channel", None), ("ct-block", None),
    ("ct-tensor", 0.05),
])
def test_fp8_checkpoint_layouts_mean_what_their_dequantized_twin_means(tiny, layout, input_scale):
    model, root = tiny
    quantized, dense = write_fp8(model, root / f"{layout}-{input_scale}", layout, input_scale=input_scale)
    quality = quant_quality(engine(dense), engine(quantized), TINY_TEXT)
    # Weights are identical by construction: what is left is the activations' rounding to e4m3.
    assert quality.top1_agreement >= 0.9 and quality.mean_kl < 0.01, quality


@pytest.mark.parametrize("layout", ["ct-channel", "ct-tensor", "ct-block"])
def test_fp8_weight_only_checkpoints_keep_16_bit_activations(tiny, layout):
    """compressed-tensors saves FP8 weights without input_activations (W8A16) in format naive-quantized (was
    refused): the weights are read as float-quantized ones and the activations stay unquantized, so the engine
    computes what the dequantized twin does, to the order of float32 sums (quantized activations: KL ~0.003)."""
    model, root = tiny
    quantized, dense = write_fp8(model, root / "w8a16", layout, weight_only=True)
    quality = quant_quality(engine(dense), engine(quantized), TINY_TEXT)
    assert quality.top1_agreement >= 0.99 and quality.mean_kl < 1e-4, quality


def test_modules_to_not_convert_stay_dense(tiny):
    model, root = tiny
    quantized, dense = write_fp8(model, root / "skip", "hf-block", skip=("down_proj",))
    llm = engine(quantized)
    layers = llm.engine.core.executor.driver_worker.model.model.layers
    assert layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    quality = quant_quality(engine(dense), llm, TINY_TEXT)
    assert quality.top1_agreement >= 0.9 and quality.mean_kl < 0.01, quality


def test_a_misread_scale_would_fail_these_bounds(tiny):
    """The bounds above can fail: the same checkpoint with one layer's scales doubled is far off."""
    from safetensors.torch import load_file, save_file

    model, root = tiny
    quantized, dense = write_fp8(model, root / "broken", "ct-channel")
    tensors = load_file(f"{quantized}/model.safetensors")
    for name in list(tensors):
        if name.endswith("mlp.down_proj.weight_scale"):
            tensors[name] = tensors[name] * 2
    save_file(tensors, f"{quantized}/model.safetensors")
    quality = quant_quality(engine(dense), engine(quantized), TINY_TEXT)
    assert quality.mean_kl > 0.05, quality


def test_online_fp8_of_the_default_model_stays_close_to_it(smollm2_llm, smollm2_path, smollm2_tokenizer):
    token_ids = smollm2_tokenizer(TEXT)["input_ids"]
    fp8 = LLM(smollm2_path, kv_cache_space=0.1, max_model_len=512, dtype="float32", quantization="fp8")
    quality = quant_quality(smollm2_llm, fp8, token_ids)
    print(f"SmolLM2-135M online fp8 vs float32: {quality}")
    assert quality.top1_agreement >= 0.85 and quality.mean_kl < 0.04, quality
    # Greedy decoding runs end to end on it too.
    greedy = SamplingParams(temperature=0.0, max_tokens=8)  # the defaults sample (temperature 1)
    out = fp8.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in out


def test_quantization_flag_conflicting_with_the_checkpoint_is_refused(tiny):
    model, root = tiny
    quantized, _ = write_fp8(model, root / "conflict", "ct-channel")
    with pytest.raises(ValueError, match="leave --quantization out"):
        engine(quantized, quantization="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["hf-block", "ct-channel", "hf-tensor"])
def test_fp8_kernels_in_the_engine_on_the_gpu(tiny, layout):
    """bfloat16 on CUDA: the Triton and cuBLASLt paths (decode rows, prefill rows) inside the real engine, with
    CUDA graphs and async scheduling, against the dequantized twin in bfloat16."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model, root = tiny
    quantized, dense = write_fp8(model, root / f"gpu-{layout}", layout)

    def gpu_engine(path):
        return LLM(path, dtype="bfloat16", kv_cache_space=0.5, max_model_len=256, skip_tokenizer_init=True)

    reference, candidate = gpu_engine(dense), gpu_engine(quantized)
    quality = quant_quality(reference, candidate, TINY_TEXT)
    print(f"{layout} on the GPU: {quality}")
    assert quality.top1_agreement >= 0.85 and quality.mean_kl < 0.03, quality
    # Decoding (skinny rows) agrees too: greedy continuations share a long prefix.
    same = greedy_prefix_lengths(reference, candidate)
    assert sum(same) >= 32, same


MODES = {
    "prefix-caching+chunked-prefill": dict(max_num_batched_tokens=16),
    "async+chunked-prefill": dict(max_num_batched_tokens=16, async_scheduling=True),
    "preempting": dict(num_gpu_blocks_override=10, max_num_batched_tokens=64, max_model_len=128),
    # Verification passes: a request's drafts are rows of one forward pass, its activations quantized row by row.
    "ngram+async+chunked-prefill": dict(max_num_batched_tokens=16, async_scheduling=True,
                                        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_min": 1, "prompt_lookup_max": 2}),
}


def _mode_tokens(path: str, **engine_args):
    shared = TINY_TEXT[:40]  # two full blocks: prefix-cache hits
    prompts = [{"prompt_token_ids": shared + TINY_TEXT[40 + i:45 + 3 * i]} for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)]
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True,
              **({"kv_cache_space": 0.05, "max_model_len": 128} | engine_args))
    if "speculative_config" in engine_args:
        always_draft(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in out.outputs] for out in outputs], llm


def check_mode(llm: LLM, mode: str) -> None:
    """The mode did what it is there for: preemptions, prefix-cache hits, drafts verified."""
    stats = llm.engine.last_stats
    if mode == "preempting":
        assert llm.engine.core.scheduler.num_preemptions > 0
    else:
        assert stats.prefix_cache_hits > 0
    if "ngram" in mode:
        assert stats.spec_decoding.num_draft_tokens > 0, stats.spec_decoding


@pytest.mark.parametrize("mode", list(MODES))
def test_fp8_weights_give_the_same_tokens_in_every_engine_mode(tiny, mode):
    """Prefix-cached and chunked prompts, async scheduling, preempted and recomputed requests, n > 1: each
    row's activations are quantized on their own, so every mode computes what the plain engine computes."""
    model, root = tiny
    quantized, _ = write_fp8(model, root / "modes", "hf-block")
    plain, _ = _mode_tokens(quantized, enable_prefix_caching=False)
    tokens, llm = _mode_tokens(quantized, **MODES[mode])
    assert tokens == plain
    check_mode(llm, mode)
