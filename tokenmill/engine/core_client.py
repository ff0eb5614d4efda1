"""The frontend's handle on the engine-core process: start it, wait for its handshake, send it
requests, aborts and profiler commands, receive its outputs (asyncio), and stop it.

Sockets are IPC files in a private temporary folder, so nothing listens on the network.

Importing this module is light (no torch, no transformers): `tokenmill serve` starts the core process before
it imports the server, so that the core's imports and model load run while the frontend imports its own.

With data parallelism each replica's process sees only its own GPUs (CUDA_VISIBLE_DEVICES), so its
ranks find them at cuda:0 to cuda:tp-1, exactly as a lone engine core does.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator

import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.engine.codec import decode_outputs, encode_abort, encode_add, encode_profile, encode_wake
from tokenmill.protocol import EngineCoreOutputs, EngineRequest, ProfileCommand

logger = logging.getLogger(__name__)

_HANDSHAKE_POLL_S = 0.2
_CONNECT_TIMEOUT_MS = 30_000  # after the core said ready: its connection is in flight, not lost
_STOP_TIMEOUT_S = 5.0


class EngineCoreStartError(RuntimeError):
    pass


def replica_cuda_devices(config: EngineConfig) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES of each data-parallel replica: replica r gets GPUs [r*tp, (r+1)*tp) of those
    this process sees. None each on the CPU, and for a single replica (it sees what this process sees)."""
    parallel = config.parallel_config
    num_replicas = parallel.data_parallel_size
    if num_replicas == 1 or config.device_config.device == "cpu":
        return [None] * num_replicas
    import torch

    count = torch.cuda.device_count()  # creates no CUDA context in this (the frontend's) process
    if count == 0:  # CPU replicas (device auto); with device cuda each replica's worker says there is no GPU
        return [None] * num_replicas
    return split_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), count, num_replicas, parallel.world_size)


def split_devices(visible: str | None, count: int, num_replicas: int, ranks_per_replica: int) -> list[str]:
    """`count` GPUs, named by `visible` (CUDA_VISIBLE_DEVICES, ids or UUIDs) if set, split in consecutive
    groups of `ranks_per_replica`."""
    ids = [d.strip() for d in visible.split(",")][:count] if visible else [str(i) for i in range(count)]
    need = num_replicas * ranks_per_replica
    if need > len(ids):
        raise ValueError(f"data_parallel_size {num_replicas} x tensor_parallel_size {ranks_per_replica} needs "
                         f"{need} GPUs; this process sees {len(ids)}")
    return [",".join(ids[r * ranks_per_replica:(r + 1) * ranks_per_replica]) for r in range(num_replicas)]


_ENVIRON_LOCK = threading.Lock()
"""Replicas restart in threads: one at a time may change the environment a child inherits."""


@contextlib.contextmanager
def _child_environ(name: str, value: str | None) -> Iterator[None]:
    """os.environ[name] = value while a child starts (a spawned child inherits this process's environment and
    nothing else can be passed: the variable must be set before the child's first CUDA call)."""
    if value is None:
        yield
        return
    with _ENVIRON_LOCK:
        previous = os.environ.get(name)
        os.environ[name] = value
        try:
            yield
        finally:
            if previous is None:
                del os.environ[name]
            else:
                os.environ[name] = previous


def _run_engine_core(*args) -> None:
    """The child's entry point, importable without the engine's dependencies (this module)."""
    from tokenmill.engine.core_proc import run_engine_core

    run_engine_core(*args)


class CoreProcessClient:
    def __init__(self, config: EngineConfig, cuda_devices: str | None = None) -> None:
        """`cuda_devices`: the child's CUDA_VISIBLE_DEVICES (a data-parallel replica's GPUs); None: inherited."""
        self._tmpdir = tempfile.mkdtemp(prefix="tokenmill-")
        input_address = f"ipc://{os.path.join(self._tmpdir, 'input')}"
        self._output_address = f"ipc://{os.path.join(self._tmpdir, 'output')}"
        # Bound before the child exists; the child connects. A bound PUSH socket has nowhere to queue a message
        # until that connection is up, so wait_ready() also waits for it.
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self._input.bind(input_address)
        self._output: zmq.asyncio.Socket | None = None
        self._closed = False
        self.long_prompt_len: int | None = None
        """The core's KVCacheSpec.long_prompt_len, known once it is ready."""
        # spawn, not fork: a forked copy of a process that already holds threads, CUDA or an
        # event loop is unsafe.
        mp = multiprocessing.get_context("spawn")
        self._ready, child_end = mp.Pipe(duplex=False)
        self.proc = mp.Process(
            target=_run_engine_core,
            args=(config, input_address, self._output_address, child_end, os.getpid()),
            name="tokenmill-engine-core",
            daemon=True,
        )
        with _child_environ("CUDA_VISIBLE_DEVICES", cuda_devices):
            self.proc.start()
        child_end.close()

    def wait_ready(self) -> None:
        """Block until the core has loaded the model; raise with its traceback if it could not."""
        while not self._ready.poll(_HANDSHAKE_POLL_S):
            if not self.proc.is_alive():
                raise EngineCoreStartError(f"the engine core exited during startup (exit code {self.proc.exitcode})")
        try:
            status, info = self._ready.recv()
        except EOFError:
            raise EngineCoreStartError("the engine core exited during startup") from None
        if status != "ready":
            raise EngineCoreStartError(f"the engine core failed to start:\n{info}")
        self.long_prompt_len = info["long_prompt_len"]
        # The core connected before it said ready, but this side may not have seen the connection yet (a
        # loaded machine): until it has, a non-blocking send would fail with EAGAIN.
        if not self._input.poll(_CONNECT_TIMEOUT_MS, zmq.POLLOUT):
            raise EngineCoreStartError("the engine core is ready but its input socket never connected")

    def open_output(self) -> None:
        """Bind the output socket; must run inside the event loop that will read it."""
        self._output = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._output.bind(self._output_address)

    async def get_outputs(self) -> EngineCoreOutputs:
        assert self._output is not None, "open_output() first"
        return decode_outputs(await self._output.recv())

    def add_requests(self, requests: list[EngineRequest]) -> None:
        """Send the samples of one request, all or none: each is encoded before any is sent."""
        messages = [encode_add(request) for request in requests]
        for message in messages:
            self._input.send_multipart(message, flags=zmq.NOBLOCK)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._input.send_multipart(encode_abort(request_ids), flags=zmq.NOBLOCK)

    def wake(self) -> None:
        """Have a core that steps with other replicas take its next turn now (engine.replica_lockstep); a hint, so
        a core going away meanwhile is no error."""
        with contextlib.suppress(zmq.ZMQError):
            self._input.send_multipart(encode_wake(), flags=zmq.NOBLOCK)

    def send_profile_command(self, command: ProfileCommand) -> None:
        """The reply comes back among the outputs (EngineCoreOutputs.profile_reply)."""
        self._input.send_multipart(encode_profile(command), flags=zmq.NOBLOCK)

    @property
    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def request_stop(self) -> None:
        """SIGTERM without waiting: several cores then stop together (shutdown() still waits for this one)."""
        if not self._closed and self.proc.is_alive():
            self.proc.terminate()

    def shutdown(self) -> None:
        """Stop the core (SIGTERM, then SIGKILL after a grace period) and release the sockets."""
        if self._closed:
            return
        self._closed = True
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(_STOP_TIMEOUT_S)
            if self.proc.is_alive():
                logger.warning("engine core did not stop in %.0f s; killing it", _STOP_TIMEOUT_S)
                self.proc.kill()
                self.proc.join()
        if self._output is not None:
            self._output.close(linger=0)
            self._output = None
        self._input.close(linger=0)
        self._context.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
