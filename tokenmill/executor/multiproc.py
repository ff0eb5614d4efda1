"""MultiprocExecutor: one process per rank (tensor_parallel_size x pipeline_parallel_size) on this host.

Rank 0 (the driver) runs in the engine core's own process, so its step output is today's PendingOutput:
no copy of the tokens between processes, and async scheduling overlaps exactly as with one rank (with
pipeline micro-batches on the CPU it computes its share of a step when the tokens are awaited, so that the
other stages get the next batch first: deferred_driver.py). Ranks 1..N-1 are child processes (`python -m
tokenmill.executor.worker_proc`: plain subprocesses, since the server's engine-core process is a daemon,
which multiprocessing forbids to have children).

Each call goes to every rank over ZMQ (one PUSH socket per rank, ipc:// paths in a private temporary
folder: no ports, no fixed names), pickled once. Why pickle over ZMQ: the SchedulerOutput is small (diffs
after a request's first step), made of plain dataclasses that pickle in tens of microseconds, and the
send returns at once (ZMQ's I/O thread delivers it) so the driver starts its own step without waiting
for the others; the ranks then meet in the model's collectives. A shared-memory ring as in vLLM can
replace the transport later behind the same `_send`.

With --nnodes N, this host runs the first world_size / N ranks and headless nodes the others
(headless.py): their inboxes and the driver's outbox also listen on TCP ports published in node 0's
torch.distributed store (multinode.py), where the process group meets too.

Failures: a rank that raises reports its traceback and exits; a rank that dies is noticed by a watchdog
thread. The driver's next collective fails (gloo sees the closed connection at once; NCCL's group is
aborted by the watchdog, since it would wait forever) and the step raises a RuntimeError naming the
rank, which ends the engine (the server's restart path starts a new one). Shutdown stops every child,
and a child whose parent died exits by itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import zmq
from transformers import PretrainedConfig

from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import (
    abort_distributed,
    destroy_distributed,
    get_tp_group,
    is_distributed,
)
from tokenmill.executor.base import RankGroupExecutor
from tokenmill.executor.deferred_driver import DeferredDriverSteps
from tokenmill.executor.multinode import HEARTBEAT_TIMEOUT_S, RemoteNodes
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.worker.pending_output import PendingOutput, ReadyOutput
from tokenmill.worker.worker import Worker

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
"""Longest a rank may take to start and load its shard."""
_WATCH_INTERVAL_S = 0.2
_POLL_MS = 100
_STOP_GRACE_S = 5.0


def addresses(folder: str, rank: int) -> tuple[str, str]:
    """(the rank's inbox, every rank's outbox to the driver)."""
    return f"ipc://{folder}/to-rank-{rank}", f"ipc://{folder}/to-driver"


class WorkerFailed(RuntimeError):
    """A tensor-parallel rank raised or died: the engine cannot go on."""


class MultiprocExecutor(RankGroupExecutor):
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, max_model_len: int) -> None:
        self.world_size = config.parallel_config.world_size
        if config.parallel_config.is_headless:
            raise ValueError("a node with node_rank > 0 runs only its ranks (`tokenmill serve --node-rank N`); "
                             "the engine runs on node 0")
        if is_distributed():
            raise RuntimeError("a tensor- or pipeline-parallel engine is already running in this process: shut it "
                               "down first")
        self._folder = tempfile.mkdtemp(prefix="tokenmill-tp-")
        self._context = zmq.Context()
        self._results = self._context.socket(zmq.PULL)
        self._results.bind(addresses(self._folder, 0)[1])
        self._inboxes: list[zmq.Socket] = []
        self._procs: dict[int, subprocess.Popen] = {}
        self._failure: str | None = None
        self._errors: dict[int, str] = {}
        self._closed = threading.Event()
        self._remote: RemoteNodes | None = None
        self._deferred: DeferredDriverSteps | None = None
        """Pipeline micro-batches on the CPU: the driver computes a step when its tokens are awaited."""
        atexit.register(self.shutdown)
        try:
            self._start(config, hf_config, max_model_len)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig, hf_config: PretrainedConfig, max_model_len: int) -> None:
        parallel = config.parallel_config
        if parallel.nnodes > 1:
            self._remote = RemoteNodes(parallel, self._context, self._results)
        for rank in range(1, self.world_size):
            inbox = self._context.socket(zmq.PUSH)
            inbox.setsockopt(zmq.SNDHWM, 0)  # never block the driver on a slow (or dead) rank
            inbox.setsockopt(zmq.LINGER, 0)
            self._inboxes.append(inbox)
            if rank >= parallel.ranks_per_node:  # another node's: it connects over TCP
                self._remote.bind_inbox(inbox, rank)
                continue
            inbox_address, outbox_address = addresses(self._folder, rank)
            inbox.bind(inbox_address)
            self._procs[rank] = subprocess.Popen([sys.executable, "-m", "tokenmill.executor.worker_proc",
                                                  inbox_address, outbox_address, str(rank), str(os.getpid())])
        threading.Thread(target=self._watch, daemon=True, name="tp-watchdog").start()
        init_method = f"file://{self._folder}/rendezvous"
        if self._remote is not None:
            self._remote.publish()
            init_method = self._remote.init_method
            logger.info("waiting for nodes 1-%d to join at %s", parallel.nnodes - 1, init_method)
        # Every rank says hello once it has imported and connected, so the driver never waits in the
        # rendezvous for a rank that already died.
        self._collect("hello")
        self._send("init", config, hf_config, max_model_len, init_method)
        self.driver_worker = Worker(config, hf_config, max_model_len, rank=0, distributed_init_method=init_method)
        self._collect("result")
        parallel = config.parallel_config
        # Not when replicas share out the experts: a driver that deferred its share of a step would hold back the
        # other replicas' last-stage ranks in that step's exchanges while it waits for them in the next turn.
        if (parallel.num_batches_in_flight > 1 and self.driver_worker.device.type == "cpu"
                and parallel.replica_world is None):
            self._deferred = DeferredDriverSteps(self._execute_on_driver)
        logger.info("%d ranks ready (tensor parallel %d x pipeline stages %d; children %s)", self.world_size,
                    parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                    ", ".join(str(p.pid) for p in self._procs.values()))

    # -- the calls ---------------------------------------------------------------------------------
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Run worker.`method`(*args) on every rank at once; returns each rank's result, rank 0 first."""
        if self._deferred is not None:
            self._deferred.run_queued()
        self._send(method, *args)
        try:
            first = getattr(self.driver_worker, method)(*args)
        except Exception as e:
            self._raise_if_a_rank_failed(e)
            raise
        return [first, *self._collect("result")]

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingOutput | ReadyOutput:
        """The last stage's ranks sample the same tokens from the same gathered logits (same seed, same RNG
        draws) and the other stages' ranks are sent them (worker/stage_tokens.py), so each keeps its own rows
        right; only rank 0's output is returned."""
        self._send("execute_model", scheduler_output)
        if self._deferred is not None:
            return self._deferred.launch(scheduler_output)
        return self._execute_on_driver(scheduler_output)

    def _execute_on_driver(self, scheduler_output: SchedulerOutput) -> PendingOutput | ReadyOutput:
        try:
            return self.driver_worker.execute_model(scheduler_output)
        except Exception as e:
            self._raise_if_a_rank_failed(e)
            raise

    # -- transport ------------------------------------------------------------------------------------
    def _send(self, method: str, *args: Any) -> None:
        if self._failure is not None:
            raise WorkerFailed(self._failure_message())
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for inbox in self._inboxes:
            while True:
                try:
                    inbox.send(message, copy=False, flags=zmq.NOBLOCK)
                    break
                except zmq.Again:  # no peer left (its node went down): a send would wait for one forever
                    if self._failure is not None:  # the watchdog's verdict (an exit, a stopped heartbeat)
                        raise WorkerFailed(self._failure_message()) from None
                    inbox.poll(_POLL_MS, zmq.POLLOUT)

    def _collect(self, kind: str) -> list[Any]:
        """One `kind` message from every other rank, in rank order; raises if a rank fails meanwhile."""
        results: dict[int, Any] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(results) < self.world_size - 1:
            if self._failure is not None:
                raise WorkerFailed(self._failure_message())
            if time.monotonic() > deadline:
                raise WorkerFailed(f"tensor-parallel ranks did not answer within {STARTUP_TIMEOUT_S:.0f} s")
            if not self._results.poll(_POLL_MS):
                continue
            got, rank, value = pickle.loads(self._results.recv())
            if got == "error":
                self._errors[rank] = value
                self._failure = self._failure or f"tensor-parallel rank {rank} raised"
            elif got == kind:
                results[rank] = value
        return [results[rank] for rank in sorted(results)]

    def _watch(self) -> None:
        while not self._closed.wait(_WATCH_INTERVAL_S):
            try:
                failure = self._remote.check() if self._remote is not None else None
            except zmq.ZMQError:  # its socket closed by a shutdown meanwhile
                return
            for rank, proc in self._procs.items():
                code = proc.poll()
                if code is not None:
                    failure = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
            if failure is not None:
                self._failure = self._failure or failure
                logger.error("%s", self._failure)
                if get_tp_group().backend == "nccl":
                    abort_distributed()  # unblock the driver's collective: NCCL would wait forever
                return

    def _raise_if_a_rank_failed(self, error: Exception) -> None:
        """A failed collective on the driver is most likely a rank gone: name it (waiting a moment for the
        watchdog to see the exit, or another node's heartbeat stop)."""
        deadline = time.monotonic() + (2.0 if self._remote is None else HEARTBEAT_TIMEOUT_S + 1.0)
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(_WATCH_INTERVAL_S / 2)
        if self._failure is not None:
            raise WorkerFailed(self._failure_message()) from error

    def _failure_message(self) -> str:
        while self._results.poll(0):  # a rank that raised sent its traceback before exiting
            got, rank, value = pickle.loads(self._results.recv())
            if got == "error":
                self._errors[rank] = value
        details = "".join(f"\n--- rank {rank} ---\n{tb.rstrip()}" for rank, tb in sorted(self._errors.items()))
        return f"{self._failure}; the engine cannot continue{details}"

    # -- shutdown -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        atexit.unregister(self.shutdown)
        if self._deferred is not None and self._failure is None:
            self._deferred.finish()  # the other stages wait for the driver's share of the steps they ran
        for inbox in self._inboxes:
            try:
                inbox.send(pickle.dumps(("shutdown", ())), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # stuck in a collective with a rank that is gone
                proc.wait()
        for socket in (*self._inboxes, self._results):
            # Another node's inbox: let the "shutdown" above cross the network first.
            socket.close(linger=1000 if self._remote is not None else 0)
        if self._remote is not None:
            self._remote.close()
        self._context.term()
        destroy_distributed()
        shutil.rmtree(self._folder, ignore_errors=True)
