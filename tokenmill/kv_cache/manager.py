"""KVCacheManager: which blocks each request holds, prefix-cache lookups, allocation and freeing.

Pure bookkeeping: block ids only, no tensors. The worker owns the tensors the ids point into.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.kv_cache.block import KVCacheBlock
from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.kv_cache.hashing import hash_block
from tokenmill.request import Request


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix-cache hit: blocks to reuse and the number of tokens they cover."""

    blocks: list[KVCacheBlock]
    num_tokens: int


NO_HIT = ComputedBlocks([], 0)


@dataclass
class PrefixCacheStats:
    queries: int = 0
    """Prompt tokens looked up."""
    hits: int = 0
    """Prompt tokens found in the cache."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        """Per request, how many leading blocks are already registered in the prefix cache."""
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of a request that holds no blocks yet.

        At least one prompt token is always left to compute, since its logits pick the next token.
        """
        if not self.enable_caching:
            return NO_HIT
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks = NO_HIT
    ) -> list[int] | None:
        """Give the request room for `num_new_tokens` more tokens after its computed ones.

        Returns the ids of blocks newly appended to its block table, or None if the pool cannot
        hold them (nothing changes then).
        """
        held = self.req_to_blocks.setdefault(request.request_id, [])
        num_tokens_after = request.num_computed_tokens + computed.num_tokens + num_new_tokens
        if not computed.blocks and num_tokens_after <= len(held) * self.block_size:
            # The common decode step: the last block still has room, so only newly full blocks need caching.
            num_cached = self.num_cached_blocks.get(request.request_id, 0)
            if self.enable_caching and num_tokens_after // self.block_size > num_cached:
                self._cache_full_blocks(request, held, min(num_tokens_after, request.num_tokens))
            return []
        num_new_blocks = max(0, cdiv(num_tokens_after, self.block_size) - len(held) - len(computed.blocks))
        # Hits sitting in the free queue stop being allocatable once we take them.
        num_free_hits = sum(1 for block in computed.blocks if block.ref_count == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            if not held:
                del self.req_to_blocks[request.request_id]
            return None
        if not held and self.enable_caching:
            # Counted once per admission, so a retry after a failed allocation is not counted twice.
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += computed.num_tokens
        self.pool.touch(computed.blocks)
        held.extend(computed.blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        held.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, held, min(num_tokens_after, request.num_tokens))
        return [block.block_id for block in computed.blocks + new_blocks]

    def can_fork(self, num_tokens: int) -> bool:
        return num_tokens % self.block_size == 0 or self.pool.num_free_blocks > 0

    def fork(self, parent: Request, child: Request, num_tokens: int) -> tuple[int, int] | None:
        """Give `child` the parent's KV for its first `num_tokens` tokens: full blocks are shared
        (one more reference each), a partial last block is copied into a new block of the child's
        (copy-on-write, done at once since the child's next token goes there). Needs can_fork().

        Returns the (source, destination) block ids the worker must copy before the child's first
        step, or None when every shared block is full.
        """
        parent_blocks = self.req_to_blocks[parent.request_id]
        num_full, partial = divmod(num_tokens, self.block_size)
        shared = parent_blocks[:num_full]
        self.pool.touch(shared)
        held = self.req_to_blocks[child.request_id] = list(shared)
        child.block_hashes = parent.block_hashes[:num_full]
        self.num_cached_blocks[child.request_id] = num_full
        if not partial:
            return None
        held.extend(self.pool.get_new_blocks(1))
        return parent_blocks[num_full].block_id, held[-1].block_id

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        # Tail blocks first, so the shared prefix is the last to be evicted.
        self.pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register the request's full blocks, whose token ids are final once scheduled."""
        self._update_block_hashes(request, num_tokens)
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        for i in range(start, end):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def _update_block_hashes(self, request: Request, num_tokens: int | None = None) -> None:
        num_tokens = request.num_tokens if num_tokens is None else num_tokens
        hashes, size = request.block_hashes, self.block_size
        for i in range(len(hashes), num_tokens // size):
            extra = (request.cache_salt,) if i == 0 and request.cache_salt is not None else ()
            tokens = request.token_ids_slice(i * size, (i + 1) * size)
            hashes.append(hash_block(hashes[-1] if i else None, tokens, extra))
