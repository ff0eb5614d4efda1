"""Mixture-of-experts GGUF files (llama.cpp's layout: stacked experts, arch "llama" with experts for Mixtral)
against transformers in float32 on the same weights.

Tiny seeded Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral models are written as GGUF at test time
(gguf_checkpoints.py) in F32 and in Q8_0 (routers F32, as llama.cpp's quantizer leaves them). The reference is
transformers' model of the class holding what the file means (the Q8_0 values dequantized), and for the Qwen
families transformers' own GGUF reader, given the true config, reads exactly those weights back: an
independent check of the tensor names. (transformers reads a Mixtral GGUF as a dense Llama, so it cannot
check that one; and it leaves out the experts' widths of Qwen files, which tokenmill reads: see the config
test.) On the CPU in float32 the Q8_0 experts stay in their blocks (layers.quant.gguf_moe) and are multiplied
by the GGUF kernel; gguf_dequantize loads them dense. Every layer is sparse: llama.cpp's qwen2moe / qwen3moe
have no dense layers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, dequantize

from tests.models.conftest import TinyModel, build_tiny_model, greedy_hf
from tests.models.gguf_checkpoints import write_gguf
from tests.unit.test_gguf_cpu_kernel import random_blocks
from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.distributed import parallel_state
from tokenmill.layers import moe
from tokenmill.layers.moe import FusedMoE
from tokenmill.layers.moe_routing import fused_experts_torch, select_experts
from tokenmill.layers.quant.gguf import tag_ggml
from tokenmill.layers.quant.gguf_cpu import load_kernel
from tokenmill.layers.quant.gguf_moe import GGUFMoEMethod
from tokenmill.model.gguf_moe import is_expert_tensor
from tokenmill.model.loader import load_hf_config, load_model

Q8_0 = GGMLQuantizationType.Q8_0
SPECS = {
    "qwen3-moe": TinyModel("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                                              "norm_topk_prob": True, "head_dim": 32, "tie_word_embeddings": False}),
    # Widths that are whole Q8_0 blocks (32), and not transformers' defaults.
    "qwen2-moe": TinyModel("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                              "shared_expert_intermediate_size": 96, "tie_word_embeddings": False}),
    "mixtral": TinyModel("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
PROMPTS = [[5, 9, 33, 100, 7, 250, 3], list(range(3, 120, 3))]
NUM_TOKENS = 16
ENGINE = {"skip_tokenizer_init": True, "dtype": "float32", "kv_cache_space": 0.01, "max_model_len": 256}


class Case:
    """One tiny model, its GGUF files and transformers' greedy tokens on what each file means."""

    def __init__(self, name: str, folder) -> None:
        self.hf_model = build_tiny_model(SPECS[name], folder / "hf")
        self.paths, self.meant, self._expected = {}, {}, {}
        for quant in (None, Q8_0):
            key = quant.name if quant is not None else "F32"
            self.paths[key] = str(folder / f"{name}-{key}.gguf")
            self.meant[key] = write_gguf(self.hf_model, self.paths[key], quant)

    def expected(self, key: str) -> list[list[int]]:
        if key not in self._expected:
            ref = transformers.AutoModelForCausalLM.from_config(self.hf_model.config, dtype=torch.float32).eval()
            ref.load_state_dict(self.meant[key])
            self._expected[key] = [greedy_hf(ref, p)[:NUM_TOKENS] for p in PROMPTS]
        return self._expected[key]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    cache: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in cache:
            cache[name] = Case(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    # The first prompt twice: the second copy decodes after a prefix-cache hit on its blocks.
    outputs = llm.generate([{"prompt_token_ids": p} for p in [*PROMPTS, PROMPTS[0]]], params, use_tqdm=False)
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    assert tokens[-1] == tokens[0]
    return tokens[:-1]


def experts_of(llm: LLM) -> FusedMoE:
    return llm.engine.core.executor.driver_worker.model.model.layers[1].mlp.experts


@pytest.mark.parametrize("name", SPECS)
def test_config_has_the_experts_fields(cases, name):
    """The experts' widths (which transformers' GGUF reader leaves at its defaults) and Mixtral's class."""
    case = cases(name)
    config = load_hf_config(ModelConfig(model=case.paths["F32"]))
    original = case.hf_model.config
    assert config.architectures == [type(case.hf_model).__name__]
    fields = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_experts_per_tok", "tie_word_embeddings"]
    fields += {"qwen3-moe": ["num_experts", "moe_intermediate_size", "norm_topk_prob"],
               "qwen2-moe": ["num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                             "norm_topk_prob"],
               "mixtral": ["num_local_experts", "intermediate_size"]}[name]

    def values(c):  # head_dim None means hidden_size / heads
        return {f: getattr(c, f, None) or (c.hidden_size // c.num_attention_heads if f == "head_dim" else None)
                for f in fields}

    assert values(config) == values(original)


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
@pytest.mark.parametrize("name", SPECS)
def test_greedy_tokens_match_transformers(cases, name, quant):
    """Q8_0 experts stay in their blocks (the GGUF kernel multiplies them); F32 experts load dense."""
    case = cases(name)
    llm = LLM(case.paths[quant], **ENGINE)
    experts = experts_of(llm)
    assert isinstance(experts.quant_method, GGUFMoEMethod)
    kept = quant == "Q8_0" and load_kernel() is not None  # without a compiler: dequantized at load
    assert experts.w13_weight.dtype == (torch.uint8 if kept else torch.float32)
    assert generate(llm) == case.expected(quant)


@pytest.mark.parametrize("name", ["qwen2-moe", "mixtral"])
def test_dequantized_at_load_holds_the_files_values(cases, name):
    """gguf_dequantize: dense experts equal to the dequantized blocks, exactly, and the same tokens."""
    case = cases(name)
    llm = LLM(case.paths["Q8_0"], gguf_dequantize=True, **ENGINE)
    experts = experts_of(llm)
    assert experts.quant_method is None
    meant = case.meant["Q8_0"]
    assert torch.equal(experts.w13_weight, meant["model.layers.1.mlp.experts.gate_up_proj"])
    assert torch.equal(experts.w2_weight, meant["model.layers.1.mlp.experts.down_proj"])
    assert generate(llm) == case.expected("Q8_0")


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe"])
def test_transformers_gguf_reader_reads_the_same_weights(cases, name):
    """transformers' own GGUF loader (its tensor-name map, the true config given) finds in the Q8_0 file
    exactly the weights the reference holds: the writer lays the file out as transformers expects."""
    case = cases(name)
    path = case.paths["Q8_0"]
    folder, file = path.rsplit("/", 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, config=case.hf_model.config,
                                                           dtype=torch.float32)
    state = hf.state_dict()
    assert state.keys() == case.meant["Q8_0"].keys()
    for tensor_name, values in case.meant["Q8_0"].items():
        assert torch.equal(state[tensor_name], values), tensor_name


def _stacked_blocks(ggml_type: GGMLQuantizationType, experts: int, rows: int, cols: int,
                    rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw blocks [E, rows, row_bytes] tagged with the type, the float32 values [E, rows, cols] they mean)."""
    raw = random_blocks(ggml_type, experts * rows, cols, rng)
    values = torch.from_numpy(dequantize(raw, ggml_type)).reshape(experts, rows, cols)
    return tag_ggml(torch.from_numpy(raw).reshape(experts, rows, -1), int(ggml_type)), values


@pytest.mark.skipif(load_kernel() is None, reason="no C compiler: GGUF experts are dequantized at load")
@pytest.mark.parametrize("types, hidden, inter, ranks", [
    (("Q8_0", "Q4_0", "Q4_1"), 64, 64, 2),
    (("Q4_K", "Q5_K", "Q6_K"), 256, 256, 1),  # llama.cpp's Q4_K_M experts (Q6_K down in some layers)
], ids=["legacy-two-ranks", "k-quants"])
def test_layer_of_mixed_types(monkeypatch, types, hidden, inter, ranks):
    """Gate, up and down of three types (gate and up apart: two GEMMs per expert), sliced over the
    tensor-parallel ranks: the partial outputs sum to the unquantized path on the dequantized weights, through
    the kernel (few rows) and the dequantized tile (an expert with 128+ rows)."""
    num_experts, top_k = 4, 2
    rng = np.random.default_rng(0)
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    parts = {shard: _stacked_blocks(GGMLQuantizationType[t], num_experts, *shapes[shard], rng)
             for shard, t in zip(shapes, types)}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, hidden, generator=g)
    logits = torch.randn(300, num_experts, generator=g)
    w13 = torch.cat([parts["gate"][1], parts["up"][1]], dim=1)
    routing = select_experts(logits, top_k, True)
    assert max(torch.bincount(routing[1].flatten()).tolist()) >= 128
    expected = fused_experts_torch(x, w13, parts["down"][1], *routing)
    monkeypatch.setattr(moe, "tp_all_reduce", lambda t: t)  # each rank's partial output
    partials = []
    for rank in range(ranks):
        monkeypatch.setattr(parallel_state, "_TP_GROUP", parallel_state.TensorParallelGroup(rank, ranks))
        layer = FusedMoE(num_experts, top_k, hidden, inter, renormalize=True)
        layer.set_quant_method(GGUFMoEMethod())
        for shard, (raw, _) in parts.items():
            param = layer.w2_weight if shard == "down" else layer.w13_weight
            for e in range(num_experts):
                param.weight_loader(param, tag_ggml(raw[e], raw.ggml_type), shard, e)
        assert layer.missing_weights() == []
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.gguf_w13_types == (parts["gate"][0].ggml_type, parts["up"][0].ggml_type)
        assert layer.gguf_w2_type == parts["down"][0].ggml_type
        partials.append(layer(x, logits))
    scale = expected.abs().max().item()
    torch.testing.assert_close(sum(partials), expected, rtol=1e-4, atol=1e-5 * scale)


def test_a_rank_split_that_cuts_blocks_is_refused(monkeypatch):
    monkeypatch.setattr(parallel_state, "_TP_GROUP", parallel_state.TensorParallelGroup(0, 4))
    layer = FusedMoE(4, 2, 64, 64, renormalize=True)  # 16 intermediate features per rank
    layer.set_quant_method(GGUFMoEMethod())
    raw, _ = _stacked_blocks(GGMLQuantizationType.Q8_0, 1, 64, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="16 intermediate features per rank do not split into whole blocks of 32"):
        layer.w2_weight.weight_loader(layer.w2_weight, tag_ggml(raw[0], raw.ggml_type), "down", 0)


def test_unsupported_moe_families_and_layouts_are_refused():
    config = transformers.DeepseekV2Config(vocab_size=64, hidden_size=64, num_hidden_layers=1, n_routed_experts=4,
                                           architectures=["DeepseekV2ForCausalLM"])
    with pytest.raises(ValueError, match="GGUF files of mixture-of-experts models .* load for Qwen3MoeForCausalLM"):
        load_model(ModelConfig(model="unused.gguf", load_format="gguf"), config, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="one tensor per expert is llama.cpp's layout before April 2024"):
        is_expert_tensor("blk.0.ffn_gate.3.weight")
    assert is_expert_tensor("blk.12.ffn_down_exps.weight") and not is_expert_tensor("blk.0.ffn_down_shexp.weight")
