"""Tiny seeded random-weight Hugging Face checkpoints, one per architecture tokenmill supports,
and their greedy continuations under transformers (the reference the model tests compare to)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers

PROMPT_LENS = (5, 11, 23, 30)
NUM_NEW_TOKENS = 24

# Small enough for CPU CI, with grouped-query attention (4 query heads share 2 kv heads).
COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Far above HF's 0.02: sharp attention and peaked logits, so that scale, soft-capping, rotary
    # or window mistakes change the tokens, and no greedy step is a near tie.
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@dataclass(frozen=True)
class TinyModel:
    config_class: str  # name in transformers
    overrides: dict = field(default_factory=dict)
    max_shard_size: str | None = None  # set to exercise model.safetensors.index.json
    attn_implementation: str | None = None  # transformers' choice when None

    def make_config(self) -> transformers.PretrainedConfig:
        return getattr(transformers, self.config_class)(**{**COMMON, **self.overrides})


# Sliding windows are smaller than the shortest prompt + output, so they change the result.
TINY_MODELS: dict[str, TinyModel] = {
    "llama": TinyModel("LlamaConfig", {"tie_word_embeddings": False}),
    "llama3-rope-sharded": TinyModel(
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            # original_max_position_embeddings is small so every frequency band gets rescaled.
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        max_shard_size="100KB",
    ),
    "mistral-window": TinyModel("MistralConfig", {"sliding_window": 8}),
    "qwen2-bias": TinyModel("Qwen2Config", {"tie_word_embeddings": False}),
    # head_dim * heads != hidden_size, as in the real Qwen3 checkpoints.
    "qwen3-qknorm": TinyModel("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "gemma2-window-softcap": TinyModel(
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,  # not head_dim, so the scale is checked
            "sliding_window": 8,  # layer 0 slides, layer 1 attends fully
            "attn_logit_softcapping": 1.0,  # small enough that tanh bends the scores
            "final_logit_softcapping": 5.0,
            # Tied, the sqrt(hidden)-scaled embeddings dominate and it only repeats its last token.
            "tie_word_embeddings": False,
        },
        # transformers 5.17 (and maybe others) default Gemma 2 to SDPA, which silently drops the
        # attention soft-cap; eager is the implementation that honours it.
        attn_implementation="eager",
    ),
    # Mixtures of experts: routing with initializer_range 0.2 is sharp, so each token's experts are clear
    # choices, and different tokens pick different ones (test_moe.py checks). Qwen3-MoE: top-3 of 8 (three
    # terms, so the order of the sum over experts shows) renormalised, layer 0 dense, sharded checkpoint.
    "qwen3-moe": TinyModel(
        "Qwen3MoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True,
         "mlp_only_layers": [0], "head_dim": 32, "tie_word_embeddings": False},
        max_shard_size="200KB",
    ),
    # Shared expert behind a sigmoid gate, q/k/v bias, top-k weights not renormalised.
    "qwen2-moe": TinyModel(
        "Qwen2MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
         "shared_expert_intermediate_size": 96, "tie_word_embeddings": False},
    ),
    "mixtral": TinyModel("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # LongRoPE as Phi-3.5 and Phi-4-mini have it, with a pretrained context of 16: the two short prompts cross it
    # while generating (short frequencies, then long), the two long ones take the long ones throughout (and a
    # 16-token prefill chunk of theirs too). Its factors differ per band; max_position_embeddings / 16 sets the
    # attention factor.
    "phi3-longrope-partial-rotary": TinyModel(
        "Phi3Config",
        {
            "sliding_window": 12,
            "original_max_position_embeddings": 16,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                "original_max_position_embeddings": 16, "short_factor": [1.0, 1.1, 1.5, 2.0],
                                "long_factor": [1.0, 2.5, 6.0, 12.0]},
        },
    ),
    # Multi-head latent attention: 4 heads, latent 32 + rotary 16 = one 48-wide KV head per token; v_head_dim
    # differs from qk_nope_head_dim. V2-Lite: no q_lora, softmax top-2 of 8 unrenormalised, layer 0 dense.
    "deepseek-v2-lite": TinyModel(
        "DeepseekV2Config",
        {"num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
         "qk_nope_head_dim": 16, "v_head_dim": 24, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "n_shared_experts": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "topk_method": "greedy",
         "routed_scaling_factor": 1.5, "tie_word_embeddings": False},
    ),
    # V3: low-rank q, sigmoid routing with a (randomised) correction bias, top-2 of 8 inside the best 2 of 4
    # groups, renormalised and scaled; yarn rope whose mscale changes both cos/sin and the softmax scale.
    "deepseek-v3": TinyModel(
        "DeepseekV3Config",
        {"num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
         "qk_nope_head_dim": 16, "v_head_dim": 24, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 4,
         "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
                             "beta_fast": 32.0, "beta_slow": 1.0}},
    ),
}


def build_tiny_model(spec: TinyModel, folder: Path | str, seed: int = 0) -> transformers.PreTrainedModel:
    """A seeded random float32 model, saved to folder as safetensors; returns the HF model."""
    folder = Path(folder)
    torch.manual_seed(seed)
    config = spec.make_config()
    kwargs = {"attn_implementation": spec.attn_implementation} if spec.attn_implementation else {}
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        for param in model.parameters():
            # HF initialises norms to a constant and biases to zero: randomise them so that
            # loading the wrong one (or none) changes the output.
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            # DeepSeek-V3's routing bias is a buffer HF zero-inits: random, so that ignoring it shows.
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    if spec.max_shard_size:
        assert (folder / "model.safetensors.index.json").exists(), "expected a sharded checkpoint"
    return model


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """One intra-op thread: these matmuls are tiny, and OpenMP hand-offs made the module 2-3x
    slower on a busy 2-core box; the float results then also do not depend on the core count."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def pytest_generate_tests(metafunc):
    # Tests that take `model_name` run once per tiny model, with the name as the test id.
    if "model_name" in metafunc.fixturenames:
        metafunc.parametrize("model_name", list(TINY_MODELS))


@dataclass
class Reference:
    path: str
    hf_model: torch.nn.Module
    prompts: list[list[int]]
    expected: list[list[int]]  # transformers' greedy continuation of each prompt


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """name -> Reference, built on first use and shared by every test in the module."""
    cache: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            hf_model = build_tiny_model(TINY_MODELS[name], folder)
            generator = torch.Generator().manual_seed(1)
            vocab_size = hf_model.config.vocab_size
            # Token ids from 3 up: no pad/bos/eos in the middle of a prompt.
            prompts = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]
            expected = [greedy_hf(hf_model, p) for p in prompts]
            cache[name] = Reference(str(folder), hf_model, prompts, expected)
        return cache[name]

    return get


@torch.no_grad()
def greedy_hf(model: torch.nn.Module, prompt: list[int], use_cache: bool = True) -> list[int]:
    if (model.config.rope_parameters or {}).get("rope_type") == "longrope":
        return greedy_hf_keeping_the_cache(model, prompt)
    # One prompt at a time: batching would add padding, which changes HF's numerics.
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=NUM_NEW_TOKENS,
        # Like ignore_eos: EOS neither ends the output nor is banned (min_new_tokens would ban it).
        eos_token_id=None,
        use_cache=use_cache,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def greedy_hf_keeping_the_cache(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    """Greedy tokens from transformers' forward pass, one token a step after the prompt, its KV cache kept
    throughout. For LongRoPE: Phi-3's `generate` drops the cache when a sequence first grows past the pretrained
    context and recomputes every key with the long frequencies; tokenmill, as vLLM, keeps the keys computed
    before (layers/rotary.py)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for position in range(len(prompt), len(prompt) + NUM_NEW_TOKENS - 1):
        out = model(torch.tensor([tokens[-1:]]), position_ids=torch.tensor([[position]]),
                    past_key_values=out.past_key_values, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.fixture
def tiny_model_architectures() -> set[str]:
    """The HF architecture names the tiny models cover."""
    names = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return {names[spec.make_config().model_type] for spec in TINY_MODELS.values()}
