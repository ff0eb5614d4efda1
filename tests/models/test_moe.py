"""Mixture-of-experts specifics beyond test_models_vs_hf.py's greedy comparison: the tiny models' routing is
not degenerate, a wrong expert mapping changes the tokens (so that comparison catches it), transformers 5's
all-experts tensor layout loads, and quantized experts without a loader (GPTQ, AWQ, compressed-tensors,
per-tensor FP8) are refused rather than misloaded; FP8 experts are tests/e2e/test_quantization_fp8_moe.py's,
GGUF files of MoE models test_gguf_moe.py's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.layers.moe import FusedMoE
from tokenmill.model.loader import iter_safetensors_weights, load_model

MOE_MODELS = ["qwen3-moe", "qwen2-moe", "mixtral"]
ENGINE = {"skip_tokenizer_init": True, "device": "cpu", "dtype": "float32", "kv_cache_space": 0.01}


def greedy(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    llm = LLM(path, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def write_checkpoint(ref_path: str, folder: Path, tensors: dict[str, torch.Tensor]) -> str:
    folder.mkdir()
    shutil.copy(Path(ref_path) / "config.json", folder / "config.json")
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("moe_name", MOE_MODELS)
def test_routing_spreads_tokens_over_experts(references, moe_name):
    """Every expert of every sparse layer gets tokens, and tokens differ in their choice."""
    ref = references(moe_name)
    choices: dict[str, list[torch.Tensor]] = {}

    def record(name):
        def hook(module, args, output):
            choices.setdefault(name, []).append(output[2])  # (logits, weights, indices [tokens, top_k])
        return hook

    routers = [(n, m) for n, m in ref.hf_model.named_modules() if type(m).__name__.endswith("TopKRouter")]
    assert routers, "no router found in the transformers model"
    handles = [m.register_forward_hook(record(n)) for n, m in routers]
    try:
        with torch.no_grad():
            for prompt in ref.prompts:
                ref.hf_model(torch.tensor([prompt]))
    finally:
        for handle in handles:
            handle.remove()
    num_experts = ref.hf_model.config.num_experts
    for name, chosen in choices.items():
        ids = torch.cat(chosen)  # [tokens, top_k]
        assert ids.unique().numel() == num_experts, f"{name}: some experts never chosen"
        assert ids.sort(dim=-1).values.unique(dim=0).shape[0] > 2, f"{name}: (nearly) every token picks the same"


def _swap(names: tuple[str, str]):
    a, b = names
    return lambda name: name.replace(f".{a}.", ".@.").replace(f".{b}.", f".{a}.").replace(".@.", f".{b}.")


@pytest.mark.parametrize("moe_name, swap", [
    ("qwen3-moe", ("gate_proj", "up_proj")),  # gate and up rows of every expert (and the dense layer's)
    ("mixtral", ("w1", "w3")),
    ("qwen3-moe", ("experts.0", "experts.1")),  # two experts' weights exchanged
])
def test_a_wrong_expert_mapping_changes_the_tokens(references, tmp_path, moe_name, swap):
    ref = references(moe_name)
    rename = _swap(swap)
    tensors = {rename(name): t for name, t in iter_safetensors_weights(ref.path)}
    path = write_checkpoint(ref.path, tmp_path / "swapped", tensors)
    assert greedy(path, ref.prompts, len(ref.expected[0])) != ref.expected


@pytest.mark.parametrize("moe_name", MOE_MODELS)
def test_transformers_all_experts_layout_loads(references, tmp_path, moe_name):
    """transformers 5 keeps experts as gate_up_proj [E, 2I, H] / down_proj [E, H, I] (what
    save_pretrained(save_original_format=False) writes): the same tokens as per-expert tensors."""
    ref = references(moe_name)
    state = ref.hf_model.state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state), "expected transformers' fused layout"
    path = write_checkpoint(ref.path, tmp_path / "fused", dict(state))
    assert greedy(path, ref.prompts[:2], len(ref.expected[0])) == ref.expected[:2]


def test_a_missing_expert_is_reported(references, tmp_path):
    ref = references("mixtral")
    tensors = {n: t for n, t in iter_safetensors_weights(ref.path) if ".experts.3.w2." not in n}
    path = write_checkpoint(ref.path, tmp_path / "missing", tensors)
    with pytest.raises(ValueError, match=r"missing weights of .*experts: \['expert 3 down'\]"):
        LLM(path, **ENGINE)


def _with_quant_config(ref_path: str, folder: Path, quant: dict) -> str:
    shutil.copytree(ref_path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return str(folder)


_CT_FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
_CT_FP8_STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


# FP8 experts load with dynamic activations (tests/e2e/test_quantization_fp8_moe.py); static activation scales and
# integer experts do not.
@pytest.mark.parametrize("quant", [
    {"quant_method": "fp8", "activation_scheme": "static"},
    {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
    {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
     "config_groups": {"group_0": {"targets": ["Linear"], "weights": _CT_FP8_CHANNEL,
                                   "input_activations": _CT_FP8_STATIC}}, "ignore": ["lm_head"]},
], ids=lambda q: q["quant_method"])
def test_quantized_experts_are_refused(references, tmp_path, quant):
    path = _with_quant_config(references("qwen3-moe").path, tmp_path / "quantized", quant)
    with pytest.raises(ValueError, match=f"mixture-of-experts weights quantized with '{quant['quant_method']}'"):
        LLM(path, **ENGINE)


def test_online_fp8_quantizes_experts_keeps_router_dense(references):
    from tokenmill.layers.quant.fp8 import FP8, Fp8LinearMethod

    ref = references("qwen3-moe")
    hf_config = ref.hf_model.config
    model = load_model(ModelConfig(model=ref.path, quantization="fp8"), hf_config, torch.device("cpu"),
                       torch.float32)
    sparse = model.model.layers[1].mlp
    assert isinstance(sparse.experts, FusedMoE) and sparse.experts.w13_weight.dtype == FP8
    assert sparse.gate.weight.dtype == torch.float32
    assert isinstance(model.model.layers[1].self_attn.qkv_proj.quant_method, Fp8LinearMethod)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj.quant_method, Fp8LinearMethod)  # the dense layer


def test_experts_a_checkpoint_leaves_unquantized_load(references, tmp_path):
    """An fp8 checkpoint whose exclusion list keeps the experts (and router) dense is not refused."""
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": ["mlp", "self_attn"]}
    path = _with_quant_config(references("qwen3-moe").path, tmp_path / "dense-experts", quant)
    ref = references("qwen3-moe")
    assert greedy(path, ref.prompts[:1], len(ref.expected[0])) == ref.expected[:1]


def test_qwen3_30b_a3b_config_builds_with_dummy_weights(tmp_path):
    """The real Qwen3-30B-A3B config.json, shrunk in size (layers, experts, widths, vocabulary) but with every
    field as the Hub has it, loads with dummy weights and generates."""
    source = Path(__file__).parents[2] / "benchmarks/models/qwen3-30b-a3b/config.json"
    config = json.loads(source.read_text())
    config.update(num_hidden_layers=2, num_experts=8, hidden_size=64, intermediate_size=96, head_dim=16,
                  num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32, vocab_size=256,
                  mlp_only_layers=[1], bos_token_id=1, eos_token_id=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", max_model_len=256, **ENGINE)
    experts = llm.engine.core.executor.driver_worker.model.model.layers[0].mlp.experts
    assert (experts.num_experts, experts.top_k, experts.renormalize) == (8, 8, True)
    assert experts.w13_weight.shape == (8, 64, 64) and experts.w2_weight.shape == (8, 64, 32)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("moe_name", [*MOE_MODELS, "deepseek-v2-lite"])
def test_experts_with_an_activation_other_than_silu_are_refused(moe_name):
    # The expert kernels compute silu(gate) * up whatever the config says: a GELU model would run silently wrong.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tests.models.conftest import TINY_MODELS
    from tokenmill.model.registry import get_model_class

    config = TINY_MODELS[moe_name].make_config()
    config.hidden_act = "gelu"
    model_class = get_model_class([MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]])
    with torch.device("meta"), pytest.raises(ValueError, match="SiLU-gated MLPs; this config's hidden_act is 'gelu'"):
        model_class(config)
