"""KVCacheManager: which blocks each request holds, prefix-cache lookups, allocation and freeing.

Pure bookkeeping: block ids only, no tensors. The worker owns the tensors the ids point into.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.kv_cache.block import KVCacheBlock
from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.kv_cache.hashing import first_block_extra_keys, hash_block
from tokenmill.request import Request


@dataclass(frozen=True)
class ComputedBlocks:
    """KV a request can start from instead of computing it: blocks to reuse and the tokens they cover."""

    blocks: list[KVCacheBlock]
    """Full blocks taken by reference."""
    num_tokens: int
    copy_from: KVCacheBlock | None = None
    """A partly filled block whose first `num_tokens % block_size` tokens the request shares (a forked
    sample's leader's last prompt block): copied into the request's first new block rather than shared,
    since the request writes its own tokens there."""
    is_prefix_cache_hit: bool = True
    """False for a fork: counted apart from the prefix cache's hits."""


NO_HIT = ComputedBlocks([], 0)


@dataclass
class PrefixCacheStats:
    requests: int = 0
    """Requests looked up (each admission of a request, its queries and hits counted together)."""
    queries: int = 0
    """Prompt tokens looked up."""
    hits: int = 0
    """Prompt tokens found in the cache."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 long_prompt_len: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.long_prompt_len = long_prompt_len
        """KVCacheSpec.long_prompt_len: longer prompts share cached blocks only among themselves."""
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        """Per request, how many leading blocks are already registered in the prefix cache."""
        self.block_copies: list[tuple[int, int]] = []
        """(source, destination) blocks of forks made since the last take_block_copies()."""
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

    def get_forked_blocks(self, leader: Request, num_tokens: int) -> ComputedBlocks:
        """The leader's KV for its first `num_tokens` tokens, for another sample of the same prompt: full
        blocks shared by reference, a partial last block to be copied (allocate_slots does both)."""
        blocks = self.req_to_blocks[leader.request_id]
        num_full, partial = divmod(num_tokens, self.block_size)
        return ComputedBlocks(blocks[:num_full], num_tokens, copy_from=blocks[num_full] if partial else None,
                              is_prefix_cache_hit=False)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks = NO_HIT
    ) -> list[int] | None:
        """Give the request room for `num_new_tokens` more tokens after its computed ones.

        Returns the ids of blocks newly appended to its block table, or None if the pool cannot
        hold them (nothing changes then). Nothing enters the prefix cache here: the scheduler calls
        cache_blocks once the step that computes the blocks can no longer be taken back.
        """
        held = self.req_to_blocks.setdefault(request.request_id, [])
        num_tokens_after = request.num_computed_tokens + computed.num_tokens + num_new_tokens
        if computed.num_tokens == 0 and num_tokens_after <= len(held) * self.block_size:
            return []  # the common decode step: the last block still has room
        num_new_blocks = max(0, cdiv(num_tokens_after, self.block_size) - len(held) - len(computed.blocks))
        # Hits sitting in the free queue stop being allocatable once we take them.
        num_free_hits = sum(1 for block in computed.blocks if block.ref_count == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            if not held:
                del self.req_to_blocks[request.request_id]
            return None
        if not held:
            # Blocks taken from the cache or a leader are registered already (or will be, by their owner).
            self.num_cached_blocks[request.request_id] = len(computed.blocks)
            if self.enable_caching and computed.is_prefix_cache_hit:
                # Counted once per admission, so a retry after a failed allocation is not counted twice.
                self.prefix_cache_stats.requests += 1
                self.prefix_cache_stats.queries += request.num_tokens
                self.prefix_cache_stats.hits += computed.num_tokens
        self.pool.touch(computed.blocks)
        held.extend(computed.blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        held.extend(new_blocks)
        if computed.copy_from is not None:
            # Before this step's forward pass: the leader's KV there came from earlier steps.
            self.block_copies.append((computed.copy_from.block_id, new_blocks[0].block_id))
        return [block.block_id for block in computed.blocks + new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks among its first `num_computed_tokens` tokens, whose KV is
        computed or is computed by a step that will run (a later reader runs after it, or reads it in the
        same forward pass, after each layer writes its KV). Never earlier: a block scheduled but then
        not computed (its request preempted in the same step) must not be handed out as a hit."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not self.enable_caching or not blocks:
            return
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_computed_tokens, request.num_tokens, len(blocks) * self.block_size) // self.block_size
        if end <= start:
            return
        self._update_block_hashes(request, end * self.block_size)
        for i in range(start, end):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = end

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(source, destination) blocks to copy before the next step's forward pass, drained."""
        copies, self.block_copies = self.block_copies, []
        return copies

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        # Tail blocks first, so the shared prefix is the last to be evicted.
        self.pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request, num_tokens: int | None = None) -> None:
        num_tokens = request.num_tokens if num_tokens is None else num_tokens
        hashes, size = request.block_hashes, self.block_size
        first_extra = first_block_extra_keys(request.cache_salt, request.num_prompt_tokens, self.long_prompt_len)
        for i in range(len(hashes), num_tokens // size):
            extra = first_extra if i == 0 else ()
            tokens = request.token_ids_slice(i * size, (i + 1) * size)
            hashes.append(hash_block(hashes[-1] if i else None, tokens, extra))
