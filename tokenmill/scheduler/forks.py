"""Parallel samples (n > 1, best_of) computing their shared prompt once.

The frontend sends one core request per sample; every sample after the first names the first as
`fork_of`. Those followers wait here, outside the scheduler's queue, until the first sample (the
leader) has its prompt scheduled. Each follower then takes the leader's KV blocks for all prompt
tokens but the last: full blocks shared by reference, the partial last block copied into a block of
its own. It then joins the queue with one prompt token left to compute, whose logits give it its own
first token. This works with prefix caching off, and shares the partial block the cache cannot.

Followers of a leader that ends before its prompt is done join the queue as ordinary requests.
"""

from __future__ import annotations

from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.request import Request, RequestStatus


class PendingForks:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.followers: dict[str, list[Request]] = {}
        """Leader id -> its followers not yet forked."""
        self.block_copies: dict[str, tuple[int, int]] = {}
        """Follower id -> (source, destination) block to copy before the follower's first step."""

    def hold(self, request: Request, leader: Request | None) -> bool:
        """Keep a follower until its leader's prompt is scheduled; False if it must run on its own."""
        if leader is None or leader.status != RequestStatus.WAITING or leader.num_preemptions:
            return False
        self.followers.setdefault(leader.request_id, []).append(request)
        return True

    def fork_ready(self, leader: Request) -> list[Request]:
        """Followers forked off a leader whose whole prompt is now scheduled (the step that writes
        its KV runs before any step they are in); returns them, to be queued."""
        if leader.request_id not in self.followers or leader.num_computed_tokens < leader.num_prompt_tokens:
            return []
        ready = []
        followers = self.followers.pop(leader.request_id)
        num_shared = leader.num_prompt_tokens - 1
        for follower in followers:
            if self.kv.can_fork(num_shared):
                copy = self.kv.fork(leader, follower, num_shared)
                if copy is not None:
                    self.block_copies[follower.request_id] = copy
                follower.num_computed_tokens = num_shared
            ready.append(follower)  # without a free block for the copy, it computes its prompt itself
        return ready

    def release(self, request: Request) -> list[Request]:
        """A request ended: drop it if it was a waiting follower; return its own followers, if any,
        which must now compute their prompt themselves."""
        if self.is_held(request):
            held = [r for r in self.followers[request.fork_of] if r is not request]
            if held:
                self.followers[request.fork_of] = held
            else:
                del self.followers[request.fork_of]
        self.block_copies.pop(request.request_id, None)
        return self.followers.pop(request.request_id, [])

    def is_held(self, request: Request) -> bool:
        return any(r is request for r in self.followers.get(request.fork_of, ()))

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self.block_copies = list(self.block_copies.values()), {}
        return copies
