"""Loading a speculative draft model beside the target: same device and dtype, checked for fit at start-up."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from torch import nn
from transformers import PretrainedConfig

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
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the target's "
                         f"({target.vocab_size}): a draft model must share the target's tokenizer")
    draft_len = getattr(draft, "max_position_embeddings", None)
    if draft_len is not None and draft_len < max_model_len:
        raise ValueError(f"the draft model takes {draft_len} positions, fewer than max_model_len={max_model_len}: "
                         f"lower max_model_len")
    start = time.perf_counter()
    model = load_model(model_config, draft, device, dtype)
    logger.info("loaded draft model %s (%s) in %.1f s", type(model).__name__, dtype, time.perf_counter() - start)
    return model


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_bytes_per_block(layers: list[Attention], dtype: torch.dtype, block_size: int) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * layer.num_kv_heads * layer.head_dim * size for layer in layers)
