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
    "phi3-partial-rotary": TinyModel(
        "Phi3Config",
        {
            "sliding_window": 12,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
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
def greedy_hf(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    # One prompt at a time: batching would add padding, which changes HF's numerics.
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=NUM_NEW_TOKENS,
        # Like ignore_eos: EOS neither ends the output nor is banned (min_new_tokens would ban it).
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def tiny_model_architectures() -> set[str]:
    """The HF architecture names the tiny models cover."""
    names = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return {names[spec.make_config().model_type] for spec in TINY_MODELS.values()}
