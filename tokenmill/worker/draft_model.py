"""Loading a speculative draft model or EAGLE head beside the target: same device and dtype, checked at start-up."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from tokenmill.config import EngineConfig
from tokenmill.layers.attention import Attention
from tokenmill.model.loader import load_hf_config, load_model

logger = logging.getLogger(__name__)


def load_draft_model(config: EngineConfig, target: PretrainedConfig, device: torch.device, dtype: torch.dtype,
                     max_model_len: int) -> nn.Module:
    """The draft model of `speculative_config.model`, loaded as the target is (dtype, load_format, seed)."""
    model_config = dataclasses.replace(config.model_config, model=config.speculative_config.model, tokenizer=None,
                                       quantization=None)  # the draft's own checkpoint says if it is quantized
    draft = load_hf_config(model_config)
    check_fits("the draft model", draft, target, max_model_len)
    start = time.perf_counter()
    model = load_model(model_config, draft, device, dtype)
    logger.info("loaded draft model %s (%s) in %.1f s", type(model).__name__, dtype, time.perf_counter() - start)
    return model


def check_fits(what: str, draft: PretrainedConfig, target: PretrainedConfig, max_model_len: int) -> None:
    """A drafter shares the target's vocabulary and takes every position the target may reach."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{what}'s vocabulary ({draft.vocab_size} tokens) is not the target's "
                         f"({target.vocab_size}): a drafter must share the target's tokenizer")
    draft_len = getattr(draft, "max_position_embeddings", None)
    if draft_len is not None and draft_len < max_model_len:
        raise ValueError(f"{what} takes {draft_len} positions, fewer than max_model_len={max_model_len}: "
                         f"lower max_model_len")


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_bytes_per_block(layers: list[Attention], dtype: torch.dtype, block_size: int) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * layer.num_kv_heads * layer.head_dim * size for layer in layers)


def load_eagle_head(config: EngineConfig, target_config: PretrainedConfig, target: nn.Module, device: torch.device,
                    dtype: torch.dtype, max_model_len: int) -> nn.Module:
    """The EAGLE-1 head of `speculative_config.model`: a folder with config.json and safetensors or
    pytorch_model*.bin tensors in the published layout (spec/eagle.py), sharing the target's embedding
    (unless it brings one) and LM head."""
    from tokenmill.layers.quant import process_weights_after_loading
    from tokenmill.spec.eagle import EagleHead, eagle_tensor_name

    path = Path(config.speculative_config.model)
    head_config = AutoConfig.from_pretrained(path)
    if head_config.hidden_size != target_config.hidden_size:
        raise ValueError(f"the EAGLE head's hidden size ({head_config.hidden_size}) is not the target's "
                         f"({target_config.hidden_size})")
    check_fits("the EAGLE head", head_config, target_config, max_model_len)
    target_embed = getattr(getattr(target, "model", None), "embed_tokens", None)
    if target_embed is None:
        raise ValueError(f"EAGLE needs a target with a Llama-style embedding (model.embed_tokens); "
                         f"{type(target).__name__} has none")
    weights = {eagle_tensor_name(name): tensor for name, tensor in _read_tensors(path)}
    start = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = EagleHead(head_config, set(weights), target_embed, target.compute_logits)
    finally:
        torch.set_default_dtype(previous)
    head.load_weights(weights.items())
    with torch.device(device):
        process_weights_after_loading(head)
    logger.info("loaded EAGLE head (%d layers, %s) in %.1f s", head_config.num_hidden_layers, dtype,
                time.perf_counter() - start)
    return head.eval()


def _read_tensors(path: Path):
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for file in files:
            yield from load_file(str(file)).items()
        return
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin tensors in the EAGLE head folder {path}")
    for file in files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()
