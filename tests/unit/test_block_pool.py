"""KV-cache bookkeeping: block pool LRU order, prefix-cache hits, hashing, no leaks."""

import pytest

from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.kv_cache.hashing import hash_block
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

BLOCK = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def cached(pool: BlockPool, blocks: list) -> list:
    for block in blocks:
        pool.cache_full_block(block, f"h{block.block_id}".encode())
    return blocks


def test_free_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a = cached(pool, pool.get_new_blocks(2))
    b = cached(pool, pool.get_new_blocks(2))
    pool.free_blocks(b)
    pool.free_blocks(a)
    assert pool.free_queue.block_ids() == [b[0].block_id, b[1].block_id, a[0].block_id, a[1].block_id]
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [b[0].block_id, b[1].block_id]


def test_blocks_without_cached_data_are_reused_before_cached_ones():
    """Blocks no prefix could hit are taken first (in the order freed), before never-used ones and before any
    cached block is evicted."""
    pool = BlockPool(num_blocks=6, enable_caching=True)
    a = cached(pool, pool.get_new_blocks(2))  # blocks 0, 1: cached
    b = pool.get_new_blocks(2)  # blocks 2, 3: freed without a hash (a partial block, a preempted step)
    pool.free_blocks(a)
    pool.free_blocks(b)
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 0, 1]
    assert [blk.block_id for blk in pool.get_new_blocks(5)] == [2, 3, 4, 5, 0]
    assert pool.get_cached_block(b"h0") is None and pool.get_cached_block(b"h1") is a[1]


def test_touching_a_free_cached_block_pulls_it_out_of_the_middle_of_the_queue():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_block(blocks[1], b"h1")
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(b"h1")
    assert hit is blocks[1]
    pool.touch([hit])
    assert pool.free_queue.block_ids() == [blocks[0].block_id, blocks[2].block_id]
    assert hit.ref_count == 1


def test_reusing_a_cached_block_for_new_data_evicts_its_hash():
    pool = BlockPool(num_blocks=1, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h")
    pool.free_blocks([block])
    assert pool.get_cached_block(b"h") is block
    pool.get_new_blocks(1)
    assert pool.get_cached_block(b"h") is None and block.block_hash is None


def test_double_free_is_caught():
    pool = BlockPool(num_blocks=2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks)


def test_block_hash_chains_parent_tokens_and_extra_keys():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == h1
    assert hash_block(None, [1, 2, 3, 5]) != h1
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], ("salt",)) != h1


def test_prefix_hit_covers_full_blocks_and_leaves_the_last_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    first = make_request("a", list(range(10)))
    assert kv.get_computed_blocks(first).num_tokens == 0
    assert kv.allocate_slots(first, 10) is not None
    assert kv.get_computed_blocks(make_request("x", list(range(10)))).num_tokens == 0  # not registered yet
    kv.cache_blocks(first, 10)  # the scheduler's call once the step computing them is final
    kv.free(first)

    same_prefix = make_request("b", list(range(9)) + [99, 100])
    hit = kv.get_computed_blocks(same_prefix)
    assert hit.num_tokens == 8  # two full blocks; the third block differs at token 9
    exact = make_request("c", list(range(8)))
    assert kv.get_computed_blocks(exact).num_tokens == 4  # never the whole prompt



def test_blocks_of_a_request_preempted_before_its_step_was_final_never_become_hits():
    """Allocation registers nothing: a request scheduled and then preempted in the same step (priority
    policy) frees blocks it never computed, and no later request may reuse them as its prefix."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    scheduled = make_request("a", list(range(12)))
    assert kv.allocate_slots(scheduled, 12) is not None
    kv.free(scheduled)  # preempted: its step never computes these blocks
    assert kv.get_computed_blocks(make_request("b", list(range(13)))).num_tokens == 0

def test_cache_salt_isolates_requests():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    first = make_request("a", list(range(9)), salt="alice")
    kv.allocate_slots(first, 9, kv.get_computed_blocks(first))
    kv.cache_blocks(first, 9)
    assert kv.get_computed_blocks(make_request("b", list(range(9)), salt="alice")).num_tokens == 8
    assert kv.get_computed_blocks(make_request("c", list(range(9)), salt="bob")).num_tokens == 0
    assert kv.get_computed_blocks(make_request("d", list(range(9)))).num_tokens == 0


def test_allocation_failure_changes_nothing_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None  # 3 blocks
    b = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None  # needs 2, 1 free
    assert kv.pool.num_free_blocks == 1 and kv.get_block_ids("b") == []
    kv.free(a)
    assert kv.pool.num_free_blocks == 4


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.cache_blocks(a, 9)
    b = make_request("b", list(range(9)))
    hit = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 1, hit)
    shared = kv.req_to_blocks["a"][:2]
    assert kv.req_to_blocks["b"][:2] == shared and all(blk.ref_count == 2 for blk in shared)
    kv.free(a)
    assert all(blk.ref_count == 1 for blk in shared)
    kv.free(b)
    assert kv.pool.num_free_blocks == 8
    assert kv.prefix_cache_stats.queries == 18 and kv.prefix_cache_stats.hits == 8
    assert kv.prefix_cache_stats.requests == 2
