"""Chained block hashes: a block's hash covers its tokens, its parent's hash and extra keys.

Two requests share a cached block only if every token before it, and the extra keys (cache salt,
later LoRA id or multimodal hashes), are the same.
"""

from __future__ import annotations

import hashlib
import struct


def hash_block(parent_hash: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    digest = hashlib.sha256()
    digest.update(parent_hash or b"root")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


def first_block_extra_keys(cache_salt: str | None, num_prompt_tokens: int, long_prompt_len: int | None) -> tuple:
    """The extra keys of a prompt's first block (the chain carries them to every later block): its cache salt,
    and for a prompt longer than KVCacheSpec.long_prompt_len (a LongRoPE model's pretrained context, past which
    positions take other frequencies) a mark that keeps its blocks apart from shorter prompts'."""
    extra = () if cache_salt is None else (cache_salt,)
    if long_prompt_len is not None and num_prompt_tokens > long_prompt_len:
        extra += ("long prompt",)
    return extra
