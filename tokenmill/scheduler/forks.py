"""Parallel samples (n > 1, best_of) computing their shared prompt once.

The frontend sends one core request per sample; every sample after the first names the first as
`fork_of`. Those followers wait here, outside the scheduler's queue, until the first sample (the
leader) has its prompt scheduled. They then join the queue, holding no blocks, like any waiting
request. When one is admitted while its leader still runs with its prompt's KV in place, it starts
from the leader's KV for all prompt tokens but the last (`KVCacheManager.get_forked_blocks`: full
blocks shared by reference, the partial last block copied into a block of its own), and computes only
its last prompt token, whose logits give it its own first token. This works with prefix caching off,
and shares the partial block the cache cannot.

Forking at admission, not when the leader's prompt is scheduled, keeps the invariant the scheduler's
progress rests on: a waiting request holds no KV blocks, so preempting running requests can always
make room. Followers whose leader is gone (finished, or preempted) compute their prompt themselves.
"""

from __future__ import annotations

from tokenmill.request import Request, RequestStatus


class PendingForks:
    def __init__(self) -> None:
        self.followers: dict[str, list[Request]] = {}
        """Leader id -> its followers still held back (the leader's prompt is not scheduled yet)."""
        self.leader_of: dict[str, Request] = {}
        """Follower id -> its leader, for followers released into the queue and not admitted yet.
        The leader object, not its id: the id may name a new request once the leader ends."""

    def hold(self, request: Request, leader: Request | None) -> bool:
        """Keep a follower until its leader's prompt is scheduled; False if it must run on its own."""
        if leader is None or leader.status != RequestStatus.WAITING or leader.num_preemptions:
            return False
        self.followers.setdefault(leader.request_id, []).append(request)
        return True

    def release_followers(self, leader: Request) -> list[Request]:
        """The followers of a leader whose whole prompt is now scheduled, to be queued: they may fork
        from it from the next step on, once the step writing its KV is ahead of theirs."""
        if leader.request_id not in self.followers or leader.num_computed_tokens < leader.num_prompt_tokens:
            return []
        followers = self.followers.pop(leader.request_id)
        for follower in followers:
            self.leader_of[follower.request_id] = leader
        return followers

    def get_leader_to_share(self, follower: Request) -> Request | None:
        """The leader whose prompt KV a waiting follower can start from now, if any: running, with its
        whole prompt scheduled in an earlier step (or taken from the prefix cache)."""
        leader = self.leader_of.get(follower.request_id)
        if leader is None or leader.status != RequestStatus.RUNNING:
            return None
        if leader.num_computed_tokens < leader.num_prompt_tokens:
            return None
        return leader

    def admitted(self, request: Request) -> None:
        """The request got its blocks: from now on it is an ordinary request (preempted, it recomputes)."""
        self.leader_of.pop(request.request_id, None)

    def release(self, request: Request) -> list[Request]:
        """A request ended: drop it if it was a waiting follower; return its own held followers, if any,
        which must now compute their prompt themselves."""
        if self.is_held(request):
            held = [r for r in self.followers[request.fork_of] if r is not request]
            if held:
                self.followers[request.fork_of] = held
            else:
                del self.followers[request.fork_of]
        self.leader_of.pop(request.request_id, None)
        return self.followers.pop(request.request_id, [])

    def is_held(self, request: Request) -> bool:
        return any(r is request for r in self.followers.get(request.fork_of, ()))
