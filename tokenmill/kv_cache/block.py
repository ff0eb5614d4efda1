"""KVCacheBlock and the LRU free queue (an intrusive doubly linked list)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    """Set while the block holds a full, hashed block that the prefix cache may hand out."""
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Free blocks in the order they are taken: the least recently freed block comes out first, but for blocks
    freed without cached data (which nothing could hit), taken before any that a prefix could still hit: no
    cached prefix is evicted while such a block is free, and on the CPU memory already mapped is reused first.

    A linked list rather than a deque because a prefix-cache hit must pull a block out of the middle of the
    queue in O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise RuntimeError("no free KV-cache block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not in the queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def prepend(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the head, in their order: they are taken next."""
        after = self._head
        for block in blocks:
            self._insert_after(after, block)
            after = block

    def _insert_after(self, prev: KVCacheBlock | None, block: KVCacheBlock) -> None:
        assert prev is not None and prev.next_free is not None
        block.prev_free, block.next_free = prev, prev.next_free
        prev.next_free.prev_free = block
        prev.next_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Ids in the order they are taken (for tests and debugging)."""
        ids, block = [], self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids
