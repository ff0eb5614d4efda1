"""The data-parallel balancer: least load with round robin among equals, prefix affinity within a load
margin, the bounded prefix record's invariants (hypothesis), and the GPUs each replica is given."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.core_client import split_devices
from tokenmill.engine.dp_balancer import DataParallelBalancer, PrefixRecord, ReplicaLoad
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

BLOCK = 16
IDLE = ReplicaLoad(0)


def prompt(seed: int, length: int = 4 * BLOCK) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 for i in range(length)]


def route(balancer: DataParallelBalancer, loads: list[ReplicaLoad], tokens: list[int], salt=None) -> int:
    hashes = balancer.prefix_hashes(tokens, salt)
    replica = balancer.choose(loads, hashes)
    balancer.record(replica, hashes)
    return replica


def test_idle_replicas_take_turns_and_the_least_loaded_wins():
    balancer = DataParallelBalancer(3, BLOCK, prefix_aware=False)
    assert [balancer.choose([IDLE] * 3) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    loads = [ReplicaLoad(5), ReplicaLoad(2), ReplicaLoad(2, num_waiting=1)]
    assert balancer.choose(loads) == 1
    # Equal sequence counts: the emptier KV cache.
    assert balancer.choose([ReplicaLoad(2, kv_usage=0.5), ReplicaLoad(2, kv_usage=0.1), ReplicaLoad(9)]) == 1
    # A nearly full KV cache (about to preempt) comes last, whatever its sequence count.
    assert balancer.choose([ReplicaLoad(1, kv_usage=0.99), ReplicaLoad(4, kv_usage=0.2), ReplicaLoad(6)]) == 1


def test_unhealthy_replicas_get_nothing():
    balancer = DataParallelBalancer(2, BLOCK)
    dead = ReplicaLoad(0, healthy=False)
    assert {route(balancer, [dead, ReplicaLoad(50)], prompt(i)) for i in range(4)} == {1}
    assert balancer.choose([dead, dead], balancer.prefix_hashes(prompt(0))) is None


def test_a_shared_prefix_stays_on_its_replica_until_it_is_overloaded():
    balancer = DataParallelBalancer(2, BLOCK, load_margin=4)
    system = prompt(1, 3 * BLOCK)
    first = route(balancer, [IDLE, IDLE], system + prompt(2))
    other = 1 - first
    loads = [IDLE, IDLE]
    for i in range(5):  # within the margin: the replica that holds the prefix, though busier
        loads[first] = ReplicaLoad(i)
        assert route(balancer, loads, system + prompt(10 + i)) == first
    loads[first] = ReplicaLoad(5)  # 5 > 0 + 4: overloaded
    assert route(balancer, loads, system + prompt(20)) == other
    # Now both hold it: the least loaded of them.
    assert route(balancer, [ReplicaLoad(3), ReplicaLoad(1)], system + prompt(21)) == 1
    assert route(balancer, [ReplicaLoad(1), ReplicaLoad(3)], system + prompt(22)) == 0


def test_the_longest_match_wins_and_a_full_kv_cache_loses_its_preference():
    balancer = DataParallelBalancer(2, BLOCK)
    base = prompt(3, 2 * BLOCK)
    balancer.record(0, balancer.prefix_hashes(base))
    balancer.record(1, balancer.prefix_hashes(base + prompt(4, 2 * BLOCK)))
    hashes = balancer.prefix_hashes(base + prompt(4, 2 * BLOCK) + prompt(5))
    assert balancer.choose([IDLE, ReplicaLoad(3)], hashes) == 1
    assert balancer.choose([IDLE, ReplicaLoad(3, kv_usage=0.97)], hashes) == 0
    # The margin grows with the load: 25% of the least load.
    assert balancer.choose([ReplicaLoad(40), ReplicaLoad(50)], hashes) == 1
    assert balancer.choose([ReplicaLoad(40), ReplicaLoad(51)], hashes) == 0


def test_salt_and_partial_blocks_and_forgetting():
    balancer = DataParallelBalancer(2, BLOCK)
    tokens = prompt(6)
    assert len(balancer.prefix_hashes(tokens[: BLOCK - 1])) == 0  # only full blocks are cached
    replica = route(balancer, [IDLE, IDLE], tokens)
    assert balancer.records[replica].match(balancer.prefix_hashes(tokens)) == 4
    assert balancer.records[replica].match(balancer.prefix_hashes(tokens, "salt")) == 0
    balancer.forget(replica)
    assert len(balancer.records[replica]) == 0
    assert DataParallelBalancer(1, BLOCK).prefix_hashes(tokens) == []  # one replica: nothing to choose


def test_hashes_are_the_prefix_cache_own():
    """The record must speak of the blocks the replica's KV cache keys by (salt included)."""
    balancer = DataParallelBalancer(2, BLOCK)
    tokens = prompt(7, 3 * BLOCK + 5)
    manager = KVCacheManager(16, BLOCK, enable_caching=True)
    request = Request("r", tokens, SamplingParams(max_tokens=1), cache_salt="s")
    manager.get_computed_blocks(request)
    assert request.block_hashes == balancer.prefix_hashes(tokens, "s")


def test_long_prompts_hash_apart_as_the_cache_keeps_them():
    """With a LongRoPE model (KVCacheSpec.long_prompt_len) a longer prompt shares no block with a shorter one that
    starts alike: the replica caching the short one holds nothing for the long one, nor the other way round."""
    long_prompt_len = 2 * BLOCK + 3
    balancer = DataParallelBalancer(2, BLOCK, long_prompt_len=long_prompt_len)
    for salt in (None, "s"):
        for length in (long_prompt_len, long_prompt_len + 1, 4 * BLOCK):  # at the limit, past it, well past it
            tokens = prompt(11, length)
            manager = KVCacheManager(16, BLOCK, enable_caching=True, long_prompt_len=long_prompt_len)
            request = Request("r", tokens, SamplingParams(max_tokens=1), cache_salt=salt)
            manager.get_computed_blocks(request)
            assert request.block_hashes == balancer.prefix_hashes(tokens, salt), (salt, length)
    short, long = prompt(11, long_prompt_len), prompt(11, 4 * BLOCK)
    first = route(balancer, [IDLE, IDLE], short)
    assert route(balancer, [IDLE, IDLE], long) == 1 - first  # no match on `first`: round robin's next turn
    assert balancer.records[first].match(balancer.prefix_hashes(long)) == 0
    # A model without the limit: one prefix.
    plain = DataParallelBalancer(2, BLOCK)
    assert plain.prefix_hashes(long)[:2] == plain.prefix_hashes(short)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12),
       st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=30))
def test_the_record_is_bounded_and_keeps_whole_prefixes(capacity, prompts):
    """Prompts over a tiny alphabet of blocks share prefixes often; whatever is evicted, a remembered
    block's prefix is remembered, the record never exceeds its capacity, and the last prompt's leading
    blocks (up to the capacity) are all there."""
    balancer = DataParallelBalancer(2, 1, record_blocks=capacity)
    record = balancer.records[0]
    seen: list[list[bytes]] = []
    for tokens in prompts:
        hashes = balancer.prefix_hashes(tokens)
        record.add(hashes)
        seen.append(hashes)
        assert len(record) <= capacity
        assert record.match(hashes) == min(len(hashes), capacity)
        for chain in seen:
            held = [h in record._hashes for h in chain]
            assert held == sorted(held, reverse=True), "a block is remembered without its prefix"


def test_prefix_record_rejects_a_zero_capacity():
    with pytest.raises(ValueError, match="capacity"):
        PrefixRecord(0)


def test_each_replica_gets_its_own_gpus():
    assert split_devices(None, 4, 2, 2) == ["0,1", "2,3"]
    assert split_devices(None, 8, 4, 1) == ["0", "1", "2", "3"]
    assert split_devices("4,5,6,7", 4, 2, 2) == ["4,5", "6,7"]
    assert split_devices("GPU-a, GPU-b,GPU-c", 3, 3, 1) == ["GPU-a", "GPU-b", "GPU-c"]
    with pytest.raises(ValueError, match="needs 4 GPUs; this process sees 3"):
        split_devices("0,1,2", 3, 2, 2)
