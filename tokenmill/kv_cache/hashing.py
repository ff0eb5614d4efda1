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

