"""How many KV blocks fit: arithmetic over the model's KV shape and the memory granted to the pool."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    bytes_per_token: int
    """Every layer's cache for one token: the sum of the layers' kv_cache_bytes_per_token (K and V of each
    KV head for most layers; one latent row for MLA's)."""
    block_size: int

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass(frozen=True)
class KVCacheSpec:
    shape: KVCacheShape
    num_blocks: int
    long_prompt_len: int | None = None
    """Prompts longer than this write other keys at every position than shorter prompts with the same tokens
    (LongRoPE picks its frequencies by the prompt's length), so the prefix cache keeps the two apart; None: one
    kind of prompt."""

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.shape.block_size

    def max_concurrency(self, max_model_len: int) -> float:
        return self.num_tokens / max_model_len


def make_kv_cache_spec(shape: KVCacheShape, available_bytes: int, max_model_len: int,
                       sized_by: str) -> KVCacheSpec:
    """`sized_by`: the setting that gave `available_bytes`, which the error of a pool too small names."""
    num_blocks = int(available_bytes // shape.bytes_per_block)
    spec = KVCacheSpec(shape, num_blocks)
    if spec.num_tokens < max_model_len:
        raise ValueError(
            f"the KV cache holds {spec.num_tokens} tokens ({num_blocks} blocks of {shape.block_size}), fewer than "
            f"max_model_len={max_model_len}: give the pool more memory ({sized_by}) or lower max_model_len"
        )
    logger.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens); max concurrency %.1fx at %d tokens per request",
        num_blocks, shape.block_size, num_blocks * shape.bytes_per_block / GiB, spec.num_tokens,
        spec.max_concurrency(max_model_len), max_model_len,
    )
    return spec
