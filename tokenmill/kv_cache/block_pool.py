"""BlockPool: owns every KV-cache block, the free queue and the hash -> cached block map."""

from __future__ import annotations

from tokenmill.kv_cache.block import FreeBlockQueue, KVCacheBlock


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue, evicting whatever cached data they held."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free_blocks(self, blocks_in_eviction_order: list[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the free queue's tail, cached data intact, or its head
        if they hold nothing a prefix could hit (no hash): reused before any cached block is evicted."""
        worthless = []
        for block in blocks_in_eviction_order:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} freed twice"
            if block.ref_count == 0:
                if block.block_hash is None:
                    worthless.append(block)
                else:
                    self.free_queue.append(block)
        if worthless:
            self.free_queue.prepend(worthless)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        # A block with the same content may already be cached (two requests computed the same
        # prefix at once); keep the first and let this one be recycled without a hash.
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True
