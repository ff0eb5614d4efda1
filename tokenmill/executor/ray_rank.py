"""A rank other than the driver as a Ray actor (the ray executor): its Worker, and the calls in order.

The executor makes it a Ray actor placed in its rank's bundle. Calls run one at a time in the order the
driver sent them (Ray's default for an actor); only `wait_for_failure` runs beside them, in a group of its
own, so the driver learns at once that this rank raised. A rank that raised then exits, which breaks the
collectives the driver may be waiting in (as a dead rank of the mp executor does).
"""

from __future__ import annotations

import os
import threading
import traceback
from typing import Any

import ray

_EXIT_DELAY_S = 1.0
"""Time for the traceback to reach the driver before this rank exits."""


class RankActor:
    def __init__(self) -> None:
        self._worker = None
        self._pending = None
        self._failed = threading.Event()
        self._traceback: str | None = None

    def where(self) -> tuple[int, str, list]:
        """(pid, node address, GPU ids Ray gave this actor): it is up."""
        return os.getpid(), ray.util.get_node_ip_address(), [str(i) for i in ray.get_gpu_ids()]

    def start(self, config, hf_config, max_model_len: int, rank: int, init_method: str,
              local_rank: int | None) -> None:
        from tokenmill.worker.worker import Worker

        self._worker = self._guard(Worker, config, hf_config, max_model_len, rank=rank,
                                   distributed_init_method=init_method, local_rank=local_rank)

    def call(self, method: str, *args: Any) -> Any:
        return self._guard(getattr(self._worker, method), *args)

    def execute_model(self, scheduler_output) -> None:
        """Launch the step, then resolve the previous one (as the mp ranks do): nothing is returned."""
        launched = self._guard(self._worker.execute_model, scheduler_output)
        if self._pending is not None:
            self._guard(self._pending.result)
        self._pending = launched

    @ray.method(concurrency_group="watch")
    def wait_for_failure(self) -> str:
        """Returns this rank's traceback once a call raised (never, while all is well)."""
        self._failed.wait()
        return self._traceback

    def _guard(self, function, *args, **kwargs):
        try:
            return function(*args, **kwargs)
        except BaseException:
            self._traceback = traceback.format_exc()
            self._failed.set()
            threading.Timer(_EXIT_DELAY_S, os._exit, (1,)).start()
            raise


class DevicePlaceholder:
    """Holds the driver's bundle (its GPU) on the driver's node, so Ray gives that GPU to no other rank, and
    says which GPU it is."""

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]
