"""Data-parallel routing: which engine-core replica gets a new request.

Two signals, both known in the frontend without asking the replicas anything:

- load: the sequences the frontend has open on each replica (exact, and current even between steps),
  plus those the replica last reported waiting (a queue: they count twice); a replica whose KV cache is
  nearly full comes last (it is about to preempt), ties go to the emptier KV cache, then round robin, so
  that equal replicas take turns;
- prefix: per replica, a bounded record of the chained block hashes (kv_cache/hashing.py: the very hashes
  its prefix cache keys blocks by) of the prompts recently sent there. The replica that likely holds the
  longest leading part of a new prompt gets it, unless it is overloaded: its load exceeds the least-loaded
  replica's by more than a margin, or its KV cache is nearly full (its cached blocks are being evicted).
  A hot prefix therefore stays on one replica until that one is busy, then spreads: the next replica
  records it too, and among replicas that hold it the least loaded wins.

The record is a guess (the replica evicts blocks on its own schedule), which only costs a missed cache
hit; it never changes what a request computes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.kv_cache.hashing import first_block_extra_keys, hash_block

DEFAULT_RECORD_BLOCKS = 1 << 16
"""Block hashes remembered per replica (about 10 MB each at most)."""
MAX_PREFIX_BLOCKS = 1024
"""Leading blocks of a prompt that are hashed for routing; longer shared prefixes route alike."""


@dataclass(frozen=True)
class ReplicaLoad:
    num_open_seqs: int
    """Sequences (samples) this frontend has sent to the replica and not seen finish."""
    num_waiting: int = 0
    """Sequences the replica last reported waiting for room."""
    kv_usage: float = 0.0
    """Fraction of the replica's KV blocks in use, as last reported."""
    healthy: bool = True

    @property
    def score(self) -> int:
        return self.num_open_seqs + self.num_waiting


class PrefixRecord:
    """Block hashes of prompts recently routed to one replica; the least recently seen go first.

    A prompt's hashes are touched deepest first, so a block is always more recent than any block after
    it in a prompt: eviction takes prompts' tails before their heads, and a remembered block's whole
    prefix is remembered too (which `match` relies on, stopping at the first miss)."""

    def __init__(self, capacity: int = DEFAULT_RECORD_BLOCKS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, hashes: Sequence[bytes]) -> None:
        for block_hash in reversed(hashes[: self.capacity]):
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt with these hashes were seen."""
        for i, block_hash in enumerate(hashes):
            if block_hash not in self._hashes:
                return i
        return len(hashes)

    def clear(self) -> None:
        self._hashes.clear()


class DataParallelBalancer:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        prefix_aware: bool = True,
        record_blocks: int = DEFAULT_RECORD_BLOCKS,
        load_margin: int = 4,
        load_margin_ratio: float = 0.25,
        kv_usage_limit: float = 0.95,
        long_prompt_len: int | None = None,
    ) -> None:
        """A replica holding a prompt's prefix is preferred while its load is at most
        max(load_margin, load_margin_ratio * least load) above the least-loaded replica's and its KV usage
        below `kv_usage_limit`. `prefix_aware` off (no prefix caching, or one replica): load alone.
        `long_prompt_len`: the replicas' KVCacheSpec.long_prompt_len (their caches keep longer prompts apart)."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.prefix_aware = prefix_aware and num_replicas > 1
        self.records = [PrefixRecord(record_blocks) for _ in range(num_replicas)]
        self.load_margin = load_margin
        self.load_margin_ratio = load_margin_ratio
        self.kv_usage_limit = kv_usage_limit
        self.long_prompt_len = long_prompt_len
        self._turn = itertools.count()

    def prefix_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The prompt's leading full blocks' hashes, as the replica's prefix cache computes them."""
        if not self.prefix_aware:
            return []
        size, hashes = self.block_size, []
        first_extra = first_block_extra_keys(cache_salt, len(token_ids), self.long_prompt_len)
        for i in range(min(len(token_ids) // size, MAX_PREFIX_BLOCKS)):
            extra = first_extra if i == 0 else ()
            hashes.append(hash_block(hashes[-1] if i else None, list(token_ids[i * size:(i + 1) * size]), extra))
        return hashes

    def choose(self, loads: Sequence[ReplicaLoad], hashes: Sequence[bytes] = ()) -> int | None:
        """The replica for a prompt with these block hashes; None when no replica is healthy."""
        healthy = [r for r, load in enumerate(loads) if load.healthy]
        if not healthy:
            return None
        turn = next(self._turn) % self.num_replicas
        least_loaded = self._least_loaded(healthy, loads, turn)
        if not hashes:
            return least_loaded
        matches = {r: self.records[r].match(hashes) for r in healthy}
        longest = max(matches.values())
        if longest == 0:
            return least_loaded
        holder = self._least_loaded([r for r in healthy if matches[r] == longest], loads, turn)
        lowest = loads[least_loaded].score
        margin = max(self.load_margin, self.load_margin_ratio * lowest)
        overloaded = loads[holder].score > lowest + margin or loads[holder].kv_usage >= self.kv_usage_limit
        return least_loaded if overloaded else holder

    def _least_loaded(self, candidates: list[int], loads: Sequence[ReplicaLoad], turn: int) -> int:
        def key(r: int) -> tuple:
            load = loads[r]
            return load.kv_usage >= self.kv_usage_limit, load.score, load.kv_usage, (r - turn) % self.num_replicas

        return min(candidates, key=key)

    def record(self, replica: int, hashes: Sequence[bytes]) -> None:
        """The prompt with these hashes was sent to `replica`: its prefix is now (likely) cached there."""
        if hashes:
            self.records[replica].add(hashes)

    def forget(self, replica: int) -> None:
        """The replica restarted with an empty cache."""
        self.records[replica].clear()
