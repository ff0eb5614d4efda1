"""FP8 mixture-of-experts weights (layers.quant.fp8_moe) through the real engine on the CPU.

A tiny Qwen3-MoE written as the Qwen3-30B-A3B-FP8 / DeepSeek-V3 releases are (quant_method fp8,
weight_block_size, per-expert e4m3 `weight` + `weight_scale_inv`; 32 x 32 blocks at this size) is compared
with its dequantized dense twin under the dense FP8 tests' bounds (test_quantization_fp8.py says why they
hold and can fail), in every engine mode, and over two tensor-parallel or expert-parallel ranks against
one. Online `--quantization fp8` quantizes the experts too (one scale per output row), the routers stay dense;
per-channel and per-tensor FP8 checkpoints (compressed-tensors, HF fp8) load their scales as per-row ones.
Measured on the CPU (2026-12-02, deterministic): top-1 0.969, KL 0.0062 against the twin; online against the
float32 model (weights rounded too) top-1 0.908, KL 0.0116; the experts' down scales doubled: KL 0.136.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoConfig

from tests.e2e.quant_checkpoints import (
    TINY_TEXT,
    engine,
    greedy_prefix_lengths,
    per_expert_state,
    tiny_moe_model,
    write_fp8,
)
from tests.e2e.quant_checkpoints import _save as save_checkpoint
from tests.e2e.test_quantization_fp8 import MODES, _mode_tokens
from tokenmill import LLM, SamplingParams
from tokenmill.bench.quant_quality import compare, prompt_distributions, quant_quality
from tokenmill.config import ModelConfig
from tokenmill.distributed import parallel_state
from tokenmill.layers.moe import FusedMoE
from tokenmill.model.loader import load_model

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(fp8 block checkpoint, its dequantized twin, the 16-bit original) of the tiny Qwen3-MoE."""
    model, root = tiny_moe_model(seed=1), tmp_path_factory.mktemp("fp8-moe")
    quantized, dense = write_fp8(model, root, "hf-block", block=32, state=per_expert_state(model))
    original = save_checkpoint(model, root / "original", per_expert_state(model), None)
    return quantized, dense, original


def _experts(llm: LLM) -> list[FusedMoE]:
    model = llm.engine.core.executor.driver_worker.model
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def test_fp8_block_moe_checkpoint_means_what_its_dequantized_twin_means(checkpoint):
    quantized, dense, _ = checkpoint
    llm = engine(quantized)
    for layer in _experts(llm):
        assert layer.w13_weight.dtype == FP8 and layer.w13_weight_scale_inv.shape == (8, 4, 2)
        assert layer.w2_weight.dtype == FP8 and layer.w2_weight_scale_inv.shape == (8, 2, 2)
    router = llm.engine.core.executor.driver_worker.model.model.layers[0].mlp.gate
    assert router.weight.dtype == torch.float32
    quality = quant_quality(engine(dense), llm, TINY_TEXT)
    print(f"fp8 block MoE checkpoint vs its dequantized twin: {quality}")
    assert quality.top1_agreement >= 0.9 and quality.mean_kl < 0.01, quality


def test_a_misread_expert_scale_would_fail_these_bounds(checkpoint, tmp_path):
    """The bounds can fail: the experts' down-projection scales doubled is far off (KL 0.136)."""
    from safetensors.torch import load_file, save_file

    quantized, dense, _ = checkpoint
    tensors = load_file(f"{quantized}/model.safetensors")
    for e in range(8):
        for layer in range(2):
            name = f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight_scale_inv"
            tensors[name] = tensors[name] * 2
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(f"{quantized}/config.json", broken / "config.json")
    save_file(tensors, str(broken / "model.safetensors"))
    quality = quant_quality(engine(dense), engine(str(broken)), TINY_TEXT)
    assert quality.mean_kl > 0.05, quality


def test_a_missing_expert_scale_is_reported(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    quantized, _, _ = checkpoint
    tensors = load_file(f"{quantized}/model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"]
    shutil.copy(f"{quantized}/config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights of .*experts: \['expert 3 down weight_scale_inv'\]"):
        engine(str(tmp_path))


@pytest.mark.parametrize("mode", list(MODES))
def test_fp8_moe_gives_the_same_tokens_in_every_engine_mode(checkpoint, mode):
    """Chunked and prefix-cached prompts, async scheduling, preemption, n > 1: each row is routed and its
    activations quantized on their own, so every mode computes what the plain engine computes."""
    quantized, _, _ = checkpoint
    plain, _ = _mode_tokens(quantized, enable_prefix_caching=False)
    tokens, llm = _mode_tokens(quantized, **MODES[mode])
    assert tokens == plain
    if mode == "preempting":
        assert llm.engine.core.scheduler.num_preemptions > 0
    else:
        assert llm.engine.last_stats.prefix_cache_hits > 0


PARALLEL = {"tp2": {}, "tp2-expert-parallel": {"enable_expert_parallel": True}}


@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_two_ranks_give_the_one_rank_tokens(checkpoint, parallel):
    """TP: every expert sliced at block bounds (32 of the 64 intermediate features, one scale column, per
    rank); EP: four whole experts per rank. gloo on the CPU, float32: the same greedy tokens as one rank."""
    quantized, _, _ = checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": TINY_TEXT[i : i + 5 + 7 * i]} for i in range(3)]
    one = [o.outputs[0].token_ids for o in engine(quantized).generate(prompts, params, use_tqdm=False)]
    llm = engine(quantized, tensor_parallel_size=2, async_scheduling=True, max_num_batched_tokens=24,
                 **PARALLEL[parallel])
    try:
        layer = _experts(llm)[0]
        assert layer.w13_weight.dtype == FP8
        if parallel == "tp2":
            assert layer.w13_weight.shape == (8, 64, 64) and layer.w2_weight_scale_inv.shape == (8, 2, 1)
        else:
            assert layer.w13_weight.shape == (4, 128, 64) and layer.w2_weight_scale_inv.shape == (4, 2, 2)
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.core.shutdown()
    assert two == one


def test_a_tensor_parallel_split_that_cuts_a_scale_block_is_refused(tmp_path, monkeypatch):
    """64-wide blocks over an intermediate size of 64: two ranks would each hold half a block."""
    model = tiny_moe_model()
    quantized, _ = write_fp8(model, tmp_path, "hf-block", block=64, state=per_expert_state(model))
    monkeypatch.setattr(parallel_state, "_TP_GROUP", parallel_state.TensorParallelGroup(0, 2))
    monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", False)  # whole experts would keep the blocks whole
    with pytest.raises(ValueError, match=r"intermediate size per rank \(32\).*tensor-parallel size 2 cuts a block"):
        load_model(ModelConfig(model=quantized), AutoConfig.from_pretrained(quantized), torch.device("cpu"),
                   torch.float32)


def test_online_fp8_quantizes_the_experts_per_row(checkpoint):
    _, _, original = checkpoint
    llm = engine(original, quantization="fp8")
    for layer in _experts(llm):
        assert layer.w13_weight.dtype == FP8 and layer.w13_weight_scale_inv.shape == (8, 128, 1)
        assert layer.w2_weight.dtype == FP8 and layer.w2_weight_scale_inv.shape == (8, 64, 1)
    router = llm.engine.core.executor.driver_worker.model.model.layers[1].mlp.gate
    assert router.weight.dtype == torch.float32
    quality = quant_quality(engine(original), llm, TINY_TEXT)
    print(f"online fp8 MoE vs float32: {quality}")
    # Weights rounded too (not only activations): the online dense test's bounds.
    assert quality.top1_agreement >= 0.85 and quality.mean_kl < 0.04, quality


@pytest.mark.gpu
@pytest.mark.parametrize("online", [False, True], ids=["block-checkpoint", "online-per-row"])
def test_fp8_moe_kernel_in_the_engine_on_the_gpu(checkpoint, online):
    """bfloat16 on CUDA: the fused MoE kernel's fp8 path (decode and prefill rows) inside the real engine, with
    CUDA graphs and async scheduling, against the dequantized twin (online: the 16-bit model) in bfloat16."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    quantized, dense, original = checkpoint

    def gpu_engine(path, **kwargs):
        return LLM(path, dtype="bfloat16", kv_cache_space=0.5, max_model_len=256, skip_tokenizer_init=True,
                   async_scheduling=True, **kwargs)

    reference = gpu_engine(original if online else dense)
    candidate = gpu_engine(original, quantization="fp8") if online else gpu_engine(quantized)
    assert _experts(candidate)[0].w13_weight.dtype == FP8
    quality = quant_quality(reference, candidate, TINY_TEXT)
    print(f"fp8 MoE ({'online' if online else 'block checkpoint'}) on the GPU: {quality}")
    assert quality.top1_agreement >= 0.85 and quality.mean_kl < 0.04, quality
    same = greedy_prefix_lengths(reference, candidate)
    if not online:  # against its dequantized twin only the kernel's arithmetic differs; online fp8 rounds the
        # weights too, so a tiny random model's near-ties may flip early (the quality bounds above judge it)
        assert sum(same) >= 32, same


@pytest.fixture(scope="module", params=["ct-channel", "ct-tensor", "hf-tensor"])
def scaled_checkpoint(request, tmp_path_factory):
    """(fp8 checkpoint with one scale per output row or per projection, its dequantized twin): compressed-tensors
    channel / tensor strategy (llm-compressor's FP8-dynamic releases), and HF fp8 per-tensor."""
    model, root = tiny_moe_model(seed=1), tmp_path_factory.mktemp(request.param)
    return write_fp8(model, root, request.param, state=per_expert_state(model))


def test_fp8_experts_with_row_or_tensor_scales_mean_what_their_twin_means(scaled_checkpoint):
    """Each expert's scales become per-row scales (a projection's one scale on each of its rows): the checkpoint
    against its dequantized twin within the block checkpoint's bounds."""
    quantized, dense = scaled_checkpoint
    llm = engine(quantized)
    for layer in _experts(llm):
        assert layer.w13_weight.dtype == FP8 and layer.w13_weight_scale_inv.shape == (8, 128, 1)
        assert layer.w2_weight.dtype == FP8 and layer.w2_weight_scale_inv.shape == (8, 64, 1)
    quality = quant_quality(engine(dense), llm, TINY_TEXT)
    assert quality.top1_agreement >= 0.9 and quality.mean_kl < 0.01, quality


@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_row_scaled_fp8_experts_on_two_ranks(scaled_checkpoint, parallel):
    """TP: each rank takes its gate/up rows' scales and every down row's (down's rows are the hidden features,
    which tensor parallelism does not split); EP: four whole experts per rank. Against the dequantized twin within
    the same bounds (the tokens themselves may differ from one rank's: this checkpoint has a near-tie in its
    second prompt, which the ranks' other summation order flips)."""
    quantized, dense = scaled_checkpoint
    llm = engine(quantized, tensor_parallel_size=2, max_num_batched_tokens=24, **PARALLEL[parallel])
    try:
        assert _experts(llm)[0].w2_weight_scale_inv.shape == (4 if PARALLEL[parallel] else 8, 64, 1)
        two_ranks = prompt_distributions(llm, TINY_TEXT)
    finally:
        llm.engine.core.shutdown()  # first: no other engine may run beside a multi-process one in this process
    quality = compare(prompt_distributions(engine(dense), TINY_TEXT), two_ranks)
    assert quality.top1_agreement >= 0.9 and quality.mean_kl < 0.01, quality


def test_experts_with_static_activation_scales_are_refused(tmp_path):
    """The experts' kernel keeps activations 16-bit: a checkpoint that quantizes them with static scales would
    be computed otherwise than it says."""
    model = tiny_moe_model(seed=1)
    quantized, _ = write_fp8(model, tmp_path, "ct-tensor", input_scale=0.05, state=per_expert_state(model))
    with pytest.raises(ValueError, match="does not load for MoE experts yet"):
        engine(quantized)
