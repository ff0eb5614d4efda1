"""Quantized checkpoints of a transformers model, written in each format's published layout (tests only).

Each writer saves config.json (with the format's quantization_config) and model.safetensors, plus, as the
reference, the same model with every quantized weight replaced by its dequantized value: what the
quantized checkpoint means, so a loader that misreads the layout cannot match it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.layers.quant.fp8 import FP8, FP8_MAX, dequantize_fp8

TINY_TEXT = list(range(3, 200, 3))  # token ids of a fixed "text" for the tiny models


def tiny_model(seed: int = 0, hidden: int = 64, intermediate: int = 128, num_kv_heads: int = 2):
    """A seeded Llama with HF's initial weights (a larger spread makes two random layers chaotic: any rounding
    flips tokens) and its LM head x 40, so next-token distributions are peaked as a trained model's."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


def tiny_moe_model(seed: int = 0):
    """A seeded Qwen3-MoE (top-2 of 8, both layers sparse) as tiny_model, its router x 20 so that each token's
    experts are clear choices (near-uniform routing would flip experts on any rounding)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(20)
    return model


def per_expert_state(model) -> dict[str, torch.Tensor]:
    """The state dict with transformers 5's all-experts tensors split into the Hub's per-expert layout
    (<prefix>.experts.<e>.{gate,up,down}_proj.weight), as the FP8 releases store them."""
    state = {}
    for name, tensor in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                state[f"{prefix}.{e}.gate_proj.weight"], state[f"{prefix}.{e}.up_proj.weight"] = gate, up
        elif leaf == "down_proj" and prefix.endswith(".experts"):
            for e, down in enumerate(tensor):
                state[f"{prefix}.{e}.down_proj.weight"] = down
        else:
            state[name] = tensor
    return {k: v.detach().clone() for k, v in state.items()}


def engine(path: str, **kwargs) -> LLM:
    """A float32 CPU engine without a tokenizer (the tiny checkpoints have none)."""
    return LLM(path, dtype="float32", kv_cache_space=0.05, max_model_len=256, skip_tokenizer_init=True, **kwargs)


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def greedy_prefix_lengths(reference: LLM, candidate: LLM, max_tokens: int = 32) -> list[int]:
    """For three prefixes of TINY_TEXT: how many greedy tokens the candidate engine gives before its first
    difference from the reference's (decoding's skinny rows, not only the prefill's)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": TINY_TEXT[:n]} for n in (5, 17, 40)]
    ref = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in candidate.generate(prompts, params, use_tqdm=False)]
    same = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got)]
    print(f"greedy tokens equal before the first difference: {same} of {max_tokens}")
    return same


def is_linear_weight(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_NAMES


def fp8_block(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    tiles = weight.float().reshape(n // block, block, k // block, block)
    scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(n, k)
    return q, scale


def fp8_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.float().abs().amax(1, keepdim=True) / FP8_MAX
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.float().abs().max() / FP8_MAX
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.reshape(())


def _save(model, path: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


def write_fp8(model, path: Path, layout: str, block: int = 32, input_scale: float | None = None,
              skip: tuple[str, ...] = (), state: dict[str, torch.Tensor] | None = None,
              weight_only: bool = False) -> tuple[str, str]:
    """(quantized checkpoint, its dequantized dense twin). layout: hf-block | hf-tensor | ct-channel |
    ct-block | ct-tensor (hf: quant_method fp8; ct: compressed-tensors float-quantized). state: the tensors
    to write (default: the model's state dict; per_expert_state for a mixture of experts). weight_only (ct):
    no input_activations (W8A16), which compressed-tensors saves in format naive-quantized."""
    if state is None:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    quantized, dense = {}, {}
    for name, tensor in state.items():
        if not is_linear_weight(name) or any(s in name for s in skip):
            quantized[name] = dense[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        if layout.endswith("block"):
            q, scale = fp8_block(tensor, block)
            dense[name] = dequantize_fp8(q, scale, block).to(tensor.dtype)
            quantized[f"{prefix}.weight_scale_inv" if layout == "hf-block" else f"{prefix}.weight_scale"] = scale
        elif layout == "ct-channel":
            q, scale = fp8_channel(tensor)
            dense[name] = dequantize_fp8(q, scale).to(tensor.dtype)
            quantized[f"{prefix}.weight_scale"] = scale
        else:
            q, scale = fp8_tensor(tensor)
            dense[name] = (q.float() * scale).to(tensor.dtype)
            quantized[f"{prefix}.weight_scale"] = scale if layout == "hf-tensor" else scale.reshape(1)
        quantized[name] = q
        if input_scale is not None:
            quantized[f"{prefix}.input_scale"] = torch.tensor(input_scale if layout == "hf-tensor" else [input_scale])
    if layout.startswith("hf"):
        config = {"quant_method": "fp8", "activation_scheme": "static" if input_scale else "dynamic"}
        if layout == "hf-block":
            config["weight_block_size"] = [block, block]
        if skip:
            config["modules_to_not_convert"] = list(skip)
    else:
        strategy = layout.removeprefix("ct-")
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
        if strategy == "block":
            weights["block_structure"] = [block, block]
        activations = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
                       if input_scale else
                       {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True})
        config = {"quant_method": "compressed-tensors",
                  "format": "naive-quantized" if weight_only else "float-quantized",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                "input_activations": None if weight_only else activations}},
                  "ignore": ["lm_head", *(f"re:.*{s}" for s in skip)], "quantization_status": "compressed"}
    name = f"{layout}-w8a16" if weight_only else layout
    return (_save(model, path / name, quantized, config), _save(model, path / f"{name}-dense", dense, None))
