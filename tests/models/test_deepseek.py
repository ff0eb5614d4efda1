"""DeepSeek-V2/V3 pieces the end-to-end token test (test_models_vs_hf.py) cannot single out: each routing
method's MoE block against transformers' on many tokens, MLA's absorbed weights read back from a quantized
kv_b_proj, the latent KV cache's shape and size, a step mixing MLA's absorbed and expanded forms (the CPU
backend here; the Triton one in tests/kernels/test_mla_attention.py), every multi-token request expanded in the
engine, and the tiny models on the GPU (the Triton MLA path) against transformers' greedy tokens. The MLA kernels
themselves: tests/kernels/test_mla_attention.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.e2e.test_spec_decode import always_draft
from tests.models.conftest import TINY_MODELS, TinyModel, build_tiny_model
from tokenmill.layers.mla import MultiHeadLatentAttention
from tokenmill.layers.quant.fp8 import Fp8Config, dequantize_fp8
from tokenmill.model.loader import iter_safetensors_weights
from tokenmill.model.registry import get_model_class

# One group of two kept: with groups scored by their best expert, keeping as many groups as experts picked
# could never change the choice.
V2_GROUPED = TinyModel(TINY_MODELS["deepseek-v2-lite"].config_class,
                       {**TINY_MODELS["deepseek-v2-lite"].overrides, "topk_method": "group_limited_greedy",
                        "n_group": 2, "topk_group": 1})


@pytest.mark.parametrize("spec", [TINY_MODELS["deepseek-v2-lite"], V2_GROUPED, TINY_MODELS["deepseek-v3"]],
                         ids=["v2-greedy", "v2-group-limited", "v3-sigmoid-bias-groups"])
@torch.no_grad()
def test_moe_block_matches_transformers(tmp_path, spec):
    hf = build_tiny_model(spec, tmp_path)
    model = get_model_class(hf.config.architectures)(hf.config)
    model.load_weights(iter_safetensors_weights(str(tmp_path)))
    hidden = torch.randn(64, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ours, theirs = model.model.layers[1].mlp, hf.model.layers[1].mlp
    # Different tokens take different experts: a routing that ignored its inputs could not pass.
    _, _, expert_ids = theirs.gate(hidden)
    assert len({tuple(sorted(ids)) for ids in expert_ids.tolist()}) > 4
    torch.testing.assert_close(ours(hidden), theirs(hidden), rtol=1e-5, atol=1e-5)


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    """DeepSeek-V3 checkpoints carry an MTP module as layer num_hidden_layers; any other stray tensor still fails."""
    hf = build_tiny_model(TINY_MODELS["deepseek-v3"], tmp_path)
    model = get_model_class(hf.config.architectures)(hf.config)
    mtp = f"model.layers.{hf.config.num_hidden_layers}"
    extra = [(f"{mtp}.eh_proj.weight", torch.zeros(8, 8)), (f"{mtp}.self_attn.kv_b_proj.weight", torch.zeros(8, 8))]
    model.load_weights([*iter_safetensors_weights(str(tmp_path)), *extra])
    with pytest.raises(ValueError, match="no matching parameter"):
        model.load_weights([*iter_safetensors_weights(str(tmp_path)), ("model.layers.0.mlp.eh_proj.weight",
                                                                      torch.zeros(8, 8))])


def test_online_fp8_loads_and_generates(tmp_path):
    """A quantized MoE model is first built on the meta device (its experts checked before memory is taken):
    the yarn rotary table must build there too."""
    from tokenmill import LLM, SamplingParams

    build_tiny_model(TINY_MODELS["deepseek-v3"], tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_space=0.01,
              quantization="fp8")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 8


@torch.no_grad()
def test_absorbed_weights_of_a_quantized_kv_b_proj():
    """MLA folds kv_b_proj's weight into the query and the output; a quantized layer gives it back through its
    own matmul, and the values must be the ones it multiplies with (its dequantized weight)."""
    config = TINY_MODELS["deepseek-v3"].make_config()
    attn = MultiHeadLatentAttention(config, rope_interleaved=True)
    layer = attn.kv_b_proj
    layer.set_quant_method(Fp8Config.online().linear_method("kv_b_proj"))
    layer.weight_loader(layer.weight, torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(0)))
    layer.quant_method.process_weights_after_loading(layer)
    w_uk, w_uv = attn._absorbed_weights()
    expected = dequantize_fp8(layer.weight, layer.weight_scale).view(config.num_attention_heads, -1,
                                                                     config.kv_lora_rank)
    torch.testing.assert_close(w_uk, expected[:, : config.qk_nope_head_dim], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w_uv, expected[:, config.qk_nope_head_dim :], rtol=1e-6, atol=1e-6)


def test_latent_cache_is_one_row_per_token():
    """MLA's layer declares a [num_blocks, block_size, kv_lora_rank + qk_rope] cache, sized at one latent row per
    token (no separate V), and copies whole blocks of it (a forked sample's partial block)."""
    config = TINY_MODELS["deepseek-v3"].make_config()
    layer = MultiHeadLatentAttention(config, rope_interleaved=True).attn
    width = config.kv_lora_rank + config.qk_rope_head_dim
    assert layer.kv_cache_shape(7, 16) == (7, 16, width)
    assert layer.kv_cache_bytes_per_token(torch.bfloat16) == 2 * width
    layer.kv_cache = torch.randn(layer.kv_cache_shape(4, 16))
    before = layer.kv_cache.clone()
    layer.copy_kv_blocks(torch.tensor([2, 0]), torch.tensor([1, 3]))
    assert torch.equal(layer.kv_cache[1], before[2]) and torch.equal(layer.kv_cache[3], before[0])
    assert torch.equal(layer.kv_cache[[0, 2]], before[[0, 2]])


# One step of every query shape, and the form the cost rule gives each at the tiny sizes (kv_lora_rank 32, qk_nope 16,
# qk_rope 16, v_head_dim 24): decodes, a 20-token chunk after a 5-token prefix, a whole prompt, a 1 + 3
# verification over 21 tokens, a 6-token chunk after a 40-token prefix.
MIXED_Q_LENS, MIXED_CONTEXTS = [1, 20, 7, 1, 4, 6], [30, 5, 0, 0, 21, 40]
MIXED_EXPANDED = [False, True, True, False, False, False]


@torch.no_grad()
def run_mixed_mla_step(backend, dtype, device: str, qk_nope_head_dim: int = 16) -> float:
    """One step of MIXED_* through backend.forward_mla with a tiny DeepSeek-V3 MLA module's weights (each request
    in the form the cost rule picks: the expanded and absorbed rows split), against MLA computed as transformers
    does (every key decompressed, float64). Checks the new latent rows and returns the output's relative error.
    qk_nope_head_dim 24 makes the expanded keys 40 wide, not a power of two."""
    from tests.kernels.cases import rel_error
    from tokenmill.attention.backend import BatchLayout
    from tokenmill.attention.mla_split import expanded_attention_ref, prefers_expanded
    from tokenmill.kernels.kv_fp8 import FP8_DTYPE

    g = torch.Generator().manual_seed(0)
    act = torch.float32 if dtype == "fp8" else dtype
    config = TINY_MODELS["deepseek-v3"].make_config()
    config.qk_nope_head_dim = qk_nope_head_dim
    module = MultiHeadLatentAttention(config, rope_interleaved=True)
    for param in module.parameters():
        param.data = (0.2 * torch.randn(param.shape, generator=g)).to(act)
    module.to(device)
    layer = module.attn
    layer.k_scale.fill_(0.5)
    q_lens, contexts, block_size = MIXED_Q_LENS, MIXED_CONTEXTS, 8
    dims = (config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim)
    assert prefers_expanded(np.array(q_lens), np.array(contexts), dims).tolist() == MIXED_EXPANDED
    seq_lens = [q + c for q, c in zip(q_lens, contexts)]
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    block_table = torch.randperm(len(q_lens) * max_blocks, generator=g).view(len(q_lens), max_blocks)
    # Never-written slots hold NaN, as a fresh GPU pool may: no form may read them.
    cache = torch.full(layer.kv_cache_shape(block_table.numel(), block_size), float("nan"))
    positions = np.concatenate([np.arange(c, c + q) for q, c in zip(q_lens, contexts)])
    owners = np.repeat(np.arange(len(q_lens)), q_lens)
    for i, context in enumerate(contexts):  # the cached prefixes
        slots = block_table[i, torch.arange(context) // block_size] * block_size + torch.arange(context) % block_size
        cache.view(-1, cache.shape[2])[slots] = torch.randn(context, cache.shape[2], generator=g)
    layer.kv_cache = cache.to(FP8_DTYPE if dtype == "fp8" else dtype).to(device)
    slots = block_table.numpy()[owners, positions // block_size] * block_size + positions % block_size
    layout = BatchLayout(np.cumsum([0, *q_lens]).astype(np.int32), np.array(seq_lens, dtype=np.int32),
                         block_table.numpy().astype(np.int32), slots.astype(np.int64), block_size)
    num_tokens, num_heads = sum(q_lens), module.num_heads
    new = lambda *shape: torch.randn(*shape, generator=g).to(act).to(device)
    rope = config.qk_rope_head_dim
    q_nope, q_pe = new(num_tokens, num_heads, config.qk_nope_head_dim), new(num_tokens, num_heads, rope)
    c_kv, k_pe = new(num_tokens, config.kv_lora_rank), new(num_tokens, rope)
    metadata = backend.build_metadata(layout, torch.device(device))
    out = backend.forward_mla(layer, q_nope, q_pe, c_kv, k_pe, module, layer.kv_cache, metadata)
    assert out.shape == (num_tokens, num_heads, config.v_head_dim)
    (split,) = metadata.mla_splits.values()
    assert split.expanded.rows.tolist() == np.flatnonzero(np.repeat(MIXED_EXPANDED, q_lens)).tolist()
    stored = layer.kv_cache.view(-1, cache.shape[2])[torch.from_numpy(slots).to(device)].float()
    stored = stored * (0.5 if dtype == "fp8" else 1.0)
    torch.testing.assert_close(stored, torch.cat([c_kv, k_pe], -1).float(), rtol=0.07, atol=0.07 * 0.5)
    ref = expanded_attention_ref(layer.kv_cache, module.kv_b_proj.weight, q_nope, q_pe, layout.query_start_loc.tolist(),
                                 seq_lens, block_table, layer.scale, layer.k_scale)
    return rel_error(out.cpu(), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, "fp8"], ids=str)
def test_torch_backend_mla_forms(dtype):
    """The CPU backend's forward_mla over a mixed step: absorbed rows (decodes, a verification, a short chunk after
    a long prefix) and expanded rows (a prompt, a chunk whose prefix is decompressed from the cache) split, both
    against the decompressed float64 reference; float32 and bfloat16 take the C kernel, float16 and an fp8 cache
    the torch path."""
    from tokenmill.attention.torch_attn import TorchAttentionBackend

    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3, "fp8": 1e-5}[dtype]
    assert run_mixed_mla_step(TorchAttentionBackend(), dtype, "cpu") < tolerance


@pytest.mark.parametrize("setting", ["chunked-prefill", "ngram-chunked-preemption"])
def test_every_multi_token_request_expanded(references, monkeypatch, setting):
    """The cost rule sends few tiny-model chunks after a prefix to the expanded form: with every multi-token
    request expanded (chunks after cached context, recomputation after preemption, draft verification, mixed
    with decodes), transformers' greedy tokens still, in float32."""
    from tests.models.test_models_vs_hf import BASE_ARGS, ENGINE_SETTINGS
    from tokenmill import LLM, SamplingParams
    from tokenmill.attention import mla_split

    built = []
    build_split = mla_split.build_split

    def recording_build_split(*args):
        built.append(build_split(*args))
        return built[-1]

    monkeypatch.setattr(mla_split, "prefers_expanded", lambda q_lens, context_lens, dims: q_lens > 1)
    monkeypatch.setattr(mla_split, "build_split", recording_build_split)
    ref = references("deepseek-v3")
    llm = LLM(ref.path, **BASE_ARGS, **ENGINE_SETTINGS[setting])
    if "ngram" in setting:
        always_draft(llm)  # a random model's drafts gain little: draft every step anyway
    params = SamplingParams(temperature=0, max_tokens=len(ref.expected[0]), ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ref.prompts], params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == ref.expected
    expanded = [split.expanded for split in built if split.expanded is not None]
    assert any(q < n for e in expanded for q, n in zip(np.diff(e.query_start_loc_host), e.seq_lens_host)), \
        "no expanded request attended to cached context"
    assert any(split.absorbed_metadata is not None for split in built if split.expanded is not None), \
        "no step mixed the forms"
    if "ngram" in setting:  # verifications over contexts longer than the step: their keys a few heads at a time
        assert any(e.heads_per_pass(ref.hf_model.config.num_attention_heads) < 4 for e in expanded)


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["default", "chunked-prefill", "ngram-chunked-preemption"])
@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
def test_tiny_models_on_cuda_match_transformers(references, name, setting):
    """float32 on the GPU: the latent cache writer, the decode kernel (CUDA graphs), the absorbed causal kernel for
    draft verification, the expanded form through the prefill kernel for prompts, preemption; transformers' greedy
    tokens exactly."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from tests.models.test_models_vs_hf import BASE_ARGS, ENGINE_SETTINGS
    from tokenmill import LLM, SamplingParams

    ref = references(name)
    llm = LLM(ref.path, **{**BASE_ARGS, "device": "cuda"}, **ENGINE_SETTINGS[setting])
    worker = llm.engine.core.executor.driver_worker
    assert worker.attn_backend.name == "triton"
    width = ref.hf_model.config.kv_lora_rank + ref.hf_model.config.qk_rope_head_dim
    block_size = worker.config.cache_config.block_size
    assert {layer.kv_cache.shape[1:] for layer in worker.attn_layers} == {(block_size, width)}
    if "ngram" in setting:
        always_draft(llm)  # a random model's drafts gain little: draft every step anyway
    params = SamplingParams(temperature=0, max_tokens=len(ref.expected[0]), ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ref.prompts], params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == ref.expected
    if "ngram" in setting:
        assert llm.engine.last_stats.spec_decoding.num_drafts > 0, "no step verified a draft"
