"""Requests that may not sample yet: their prompt is computed meanwhile, all but its tail.

A structured-output request cannot sample its first token before its grammar is compiled (milliseconds to
seconds). Its prompt needs no grammar, so it is scheduled at once: the prefill overlaps the compile instead of
following it. It computes the whole blocks before its last token, the part that a later request with the same
prompt finds in the prefix cache; the tail (at most a block, and always the last token, whose logits give the
first output token) waits until the engine core opens the gate. The first token then comes from the same pass
as a repeat of the request with its grammar cached: greedy outputs do not depend on the compile's timing.

A request that has computed its blocks with the gate still closed is skipped while running (it holds its KV
blocks), or, when it has nothing to compute at admission (a prompt shorter than a block, or found in the prefix
cache), parked outside the queue holding nothing, and queued again when the gate opens.

Only where the compile runs beside the forward pass (a GPU's forward leaves the host's cores to the compile):
on the CPU both want the same cores, and the tail's extra step made a lone request's first token later (SmolLM2,
a 230-token prompt and a new 12-field schema each time: 80.8 ms waiting for the grammar, 89.6 ms computing
ahead). There a closed request computes nothing (`compute_ahead` False): it is parked until its grammar is ready.
"""

from __future__ import annotations

from tokenmill.request import Request


class SamplingGate:
    def __init__(self, block_size: int, compute_ahead: bool = True) -> None:
        self.block_size = block_size
        self.compute_ahead = compute_ahead
        self.parked: dict[str, Request] = {}
        """Closed requests with nothing to compute before their last prompt token, out of the queue."""
        self.num_closed = 0
        """Requests in the scheduler whose gate is closed (running, waiting, parked or held as forks)."""

    def added(self, request: Request) -> None:
        if not request.can_sample:
            self.num_closed += 1

    def room(self, request: Request, num_computed: int) -> int | None:
        """How many tokens a request may compute from `num_computed` on: None when its gate is open."""
        if request.can_sample:
            return None
        if not self.compute_ahead:
            return 0
        return (request.num_tokens - 1) // self.block_size * self.block_size - num_computed

    def open(self, request: Request) -> Request | None:
        """Let a request sample from now on; the parked request to queue again, if it was parked."""
        if request.can_sample:
            return None
        request.can_sample = True
        self.num_closed -= 1
        return self.parked.pop(request.request_id, None)

    def park(self, request: Request) -> None:
        self.parked[request.request_id] = request

    def forget(self, request: Request) -> None:
        """A request ended (taken out of the queue, or parked)."""
        if not request.can_sample:
            request.can_sample = True
            self.num_closed -= 1
        self.parked.pop(request.request_id, None)

    def all_waiting(self, running: list[Request], num_queued: int) -> bool:
        """Whether every request is closed with nothing to compute: a step now would compute nothing."""
        if not self.num_closed or num_queued:
            return False
        return all(not r.can_sample and self.room(r, r.num_computed_tokens) <= 0 for r in running)
