"""Requests whose grammar is compiling: the scheduler computes their prompt but holds their first sample until it is
ready (scheduler/sampling_gate.py), so the batch never waits for a grammar and the prefill overlaps the compile."""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait

from tokenmill.request import Request
from tokenmill.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
"""How long an otherwise idle core waits for a compilation before looking again (instead of spinning)."""


class AwaitingGrammar:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._requests: dict[str, tuple[Request, Future]] = {}

    def __bool__(self) -> bool:
        return bool(self._requests)

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = (request, self.compiler.submit(request.sampling_params.structured_outputs))

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def take_ready(self, idle: bool) -> tuple[list[Request], dict[str, BaseException]]:
        """The requests whose grammar compiled, and why each of the others' failed, by id (logged; the frontend
        validated the spec, so this is rare). `idle`: nothing else to do, so wait a little first."""
        if idle:
            wait([future for _, future in self._requests.values()], timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        ready, failed = [], {}
        for request_id, (request, future) in list(self._requests.items()):
            if not future.done():
                continue
            del self._requests[request_id]
            if future.exception() is not None:
                logger.error("request %s: its grammar failed to compile: %s", request_id, future.exception())
                failed[request_id] = future.exception()
            else:
                ready.append(request)
        return ready, failed
