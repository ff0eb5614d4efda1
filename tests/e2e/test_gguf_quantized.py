"""The default model served from its Q4_1 blocks kept quantized (layers.quant.gguf), against the same file
dequantized at load (the session's smollm2_llm engine, gguf_dequantize=True).

The two hold the same weight values (tested exactly below): the kernel only sums the products in another
order, so the logits differ by float32 rounding. Measured on the fixed text (2026-12-02, 2-core Xeon,
float32): top-1 agreement 1.000 over 81 positions, KL below 0.00005 nats everywhere (printed as 0.0000).
The bounds (top-1 >= 0.99, mean KL <= 1e-5, max KL <= 1e-3) leave room for another CPU's rounding; a wrong
block decoding, row permutation or part offset changes the predictions far past them (the FP8 test's
wrong-scale case moves KL to ~0.1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.quant_quality import quant_quality

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a screw press adapted from wine making. Within fifty years "
        "presses were running in more than two hundred European cities, and the price of books fell sharply. "
        "Scholars could compare identical copies of a text for the first time, which changed how knowledge "
        "was checked, corrected and shared across the continent.")


def model_of(llm: LLM):
    return llm.engine.core.executor.driver_worker.model


@pytest.fixture(scope="module")
def kept_llm(smollm2_path):
    llm = LLM(smollm2_path, kv_cache_space=0.1, max_model_len=512, dtype="float32")
    yield llm
    assert not llm.engine.has_unfinished_requests()


def test_linear_layers_keep_their_blocks(kept_llm, smollm2_llm):
    layer = model_of(kept_llm).model.layers[0]
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    assert qkv.gguf_runs == [(3, 0, 576 + 2 * 192)]  # q, k, v all Q4_1: one run, one GEMM
    assert qkv.qweight0.dtype == torch.uint8 and qkv.qweight0.shape == (960, 576 // 32 * 20)
    assert down.qweight0.shape == (576, 1536 // 32 * 20)
    dense = model_of(smollm2_llm).model.layers[0].self_attn.qkv_proj  # the opt-out: float32 as before
    assert dense.weight.dtype == torch.float32 and dense.weight.shape == (960, 576)


def test_blocks_dequantize_to_the_dense_weights(kept_llm, smollm2_llm):
    """The kept blocks (q/k rows permuted as whole rows by the loader, parts fused) mean exactly the weights
    the dequantizing load gives."""
    from gguf import GGMLQuantizationType, dequantize

    for index in (0, 17):
        kept, dense = model_of(kept_llm).model.layers[index], model_of(smollm2_llm).model.layers[index]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            blocks = kept.get_submodule(name).qweight0.numpy()
            values = dequantize(blocks, GGMLQuantizationType.Q4_1)
            np.testing.assert_array_equal(values, dense.get_submodule(name).weight.numpy(), err_msg=name)


def test_lm_head_reads_the_embedding_blocks(kept_llm, smollm2_llm):
    """The tied table keeps its Q8_0 blocks (layers.cpu_lm_head reads them for decode rows); they mean exactly
    the dense table. The dequantizing load keeps none."""
    from gguf import GGMLQuantizationType, dequantize

    weight = model_of(kept_llm).lm_head.weight
    assert weight is model_of(kept_llm).model.embed_tokens.weight
    assert weight.ggml_blocks.ggml_type == GGMLQuantizationType.Q8_0 and weight.ggml_blocks.shape == (49152, 612)
    values = dequantize(weight.ggml_blocks.numpy(), GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(values, weight.numpy())
    np.testing.assert_array_equal(values, model_of(smollm2_llm).lm_head.weight.numpy())
    assert not hasattr(model_of(smollm2_llm).lm_head.weight, "ggml_blocks")


def test_greedy_tokens_match_the_dequantized_model(kept_llm, smollm2_llm):
    """Decode rows take the blocks' LM head here, oneDNN's dense one there (whose greedy tokens equal
    transformers': test_smollm2_offline.py): the same 24 tokens."""
    from tests.e2e.test_smollm2_offline import NUM_TOKENS, PROMPTS

    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in smollm2_llm.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in kept_llm.generate(PROMPTS, params, use_tqdm=False)] == expected


def test_predictions_match_the_dequantized_model(kept_llm, smollm2_llm, smollm2_tokenizer):
    token_ids = smollm2_tokenizer(TEXT).input_ids
    quality = quant_quality(smollm2_llm, kept_llm, token_ids)
    print(f"GGUF kept quantized vs dequantized at load: {quality}")
    assert quality.top1_agreement >= 0.99
    assert quality.mean_kl <= 1e-5 and quality.max_kl <= 1e-3


def test_greedy_generation(kept_llm):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    text = kept_llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text


def test_batched_decode_matches_single(kept_llm):
    """1 to 8 rows take the kernel's fused path, with the same arithmetic per output whatever their number
    (tests/unit/test_gguf_cpu_kernel.py): the same tokens alone and together."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "Water boils at", "The largest planet is", "One, two, three,",
               "My favourite colour is"]
    alone = [kept_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in kept_llm.generate(prompts, params, use_tqdm=False)]
    assert together == alone


def test_gguf_dequantize_conflicts_with_quantization_gguf(smollm2_path):
    with pytest.raises(ValueError, match="gguf_dequantize"):
        LLM(smollm2_path, quantization="gguf", gguf_dequantize=True, skip_tokenizer_init=True)


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors"])
def test_a_checkpoint_format_named_for_a_gguf_file_is_refused_naming_gguf(smollm2_path, method):
    """A .gguf holds its own quantized types: naming another checkpoint format said only that the format "needs a
    checkpoint quantized in that format", which this file is (in GGUF's)."""
    with pytest.raises(ValueError, match=f"--quantization {method} loads checkpoints in that format; a .gguf file"):
        LLM(smollm2_path, quantization=method, skip_tokenizer_init=True)


def test_bfloat16_keeps_blocks_and_a_dense_copy(smollm2_path, smollm2_tokenizer):
    """In bfloat16 (dtype auto on CPUs with bfloat16 units) the default model keeps both forms of its linear
    layers: a prompt's many rows take the dense copy, the dequantized model's bfloat16 weights through the
    same oneDNN GEMM (so its predictions are the dequantized engine's), decode rows the blocks. gguf_dequantize
    gives the dense path alone; quantization='gguf' the blocks alone, whose kernel (bfloat16 products with AMX
    / AVX512_BF16 where present, else float32) then stays close to the dense bfloat16 model."""
    from tokenmill.layers.quant.gguf import GGUFLinearMethod
    from tokenmill.layers.quant.unquantized import UnquantizedLinearMethod

    token_ids = smollm2_tokenizer(TEXT)["input_ids"]
    dense = LLM(smollm2_path, kv_cache_space=0.1, max_model_len=512, dtype="bfloat16", gguf_dequantize=True)
    layer = dense.engine.core.executor.driver_worker.model.model.layers[0].mlp.down_proj
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    both = LLM(smollm2_path, kv_cache_space=0.1, max_model_len=512, dtype="bfloat16")
    layer = both.engine.core.executor.driver_worker.model.model.layers[0].mlp.down_proj
    assert isinstance(layer.quant_method, GGUFLinearMethod) and layer.dense_copy is not None
    quality = quant_quality(dense, both, token_ids)
    print(f"bfloat16 blocks and dense copy vs dequantized: {quality}")
    assert quality.top1_agreement == 1.0 and quality.max_kl <= 1e-6, quality
    params = SamplingParams(temperature=0.0, max_tokens=8)
    assert "Paris" in both.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
    del both
    kept = LLM(smollm2_path, kv_cache_space=0.1, max_model_len=512, dtype="bfloat16", quantization="gguf")
    assert model_of(kept).model.layers[0].mlp.down_proj.dense_copy is None
    quality = quant_quality(dense, kept, token_ids)
    print(f"bfloat16 kept vs dequantized: {quality}")
    # Same bfloat16 weights; only the sums' order and rounding differ from oneDNN's.
    assert quality.top1_agreement >= 0.95 and quality.mean_kl < 5e-3, quality
    out = kept.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in out  # greedy: the defaults sample (temperature 1), whose first draw only may say it


def test_the_integer_layout_predicts_as_the_dequantized_model(smollm2_path, smollm2_llm, smollm2_tokenizer,
                                                               monkeypatch):
    """The GPU's form of the blocks (layers.quant.gguf_int, taken here on the CPU through the integer kernels'
    torch path): every Q4_1 layer in the integer layout, the same weights, so float32 predictions match."""
    from tokenmill.layers.quant import gguf

    monkeypatch.setattr(gguf, "uses_int_layout", lambda device: True)
    llm = LLM(smollm2_path, quantization="gguf", dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    layer = model_of(llm).model.layers[0].self_attn.qkv_proj
    assert [bits for _, _, bits, _ in layer.gguf_int_runs] == [4]
    quality = quant_quality(smollm2_llm, llm, smollm2_tokenizer(TEXT).input_ids)
    assert quality.top1_agreement >= 0.99 and quality.mean_kl <= 1e-5 and quality.max_kl <= 1e-3


def tiny_llama_gguf(path, quant_type) -> None:
    """A random Llama with its linear layers in `quant_type`, written as llama.cpp lays GGUF out (the device
    cannot fetch the default model). Weights 15x transformers' default scale: peaked next-token distributions,
    so that rounding does not decide the top token."""
    import transformers

    from tests.models.gguf_checkpoints import write_gguf

    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    write_gguf(transformers.LlamaForCausalLM(config), str(path), quant_type)


@pytest.mark.gpu
@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_gpu_serves_the_blocks_through_the_integer_kernels(tmp_path, quant_type):
    """quantization='gguf' on CUDA: the linear layers in the integer layout (layers.quant.gguf_int), the same
    weight values as the file dequantized at load, so in float16 the predictions stay within rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from gguf import GGMLQuantizationType

    path = tmp_path / f"tiny-{quant_type}.gguf"
    tiny_llama_gguf(path, GGMLQuantizationType[quant_type])
    common = dict(device="cuda", dtype="float16", max_model_len=512, kv_cache_space=0.05, skip_tokenizer_init=True)
    kept = LLM(str(path), quantization="gguf", **common)
    dense = LLM(str(path), gguf_dequantize=True, **common)
    layer = model_of(kept).model.layers[0].mlp.down_proj
    assert [bits for _, _, bits, _ in layer.gguf_int_runs] == [8 if quant_type == "Q8_0" else 4]
    token_ids = torch.randint(3, 1024, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    quality = quant_quality(dense, kept, token_ids)
    print(f"GGUF {quant_type} on the GPU, integer kernels vs dequantized at load (float16): {quality}")
    assert quality.top1_agreement >= 0.97 and quality.mean_kl <= 1e-3
