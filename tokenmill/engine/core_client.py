"""The frontend's handle on the engine-core process: start it, wait for its handshake, send it
requests and aborts, receive its outputs (asyncio), and stop it.

Sockets are IPC files in a private temporary folder, so nothing listens on the network.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile

import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.engine.codec import decode_outputs, encode_abort, encode_add
from tokenmill.engine.core_proc import run_engine_core
from tokenmill.protocol import EngineCoreOutputs, EngineRequest

logger = logging.getLogger(__name__)

_HANDSHAKE_POLL_S = 0.2
_STOP_TIMEOUT_S = 5.0


class EngineCoreStartError(RuntimeError):
    pass


class CoreProcessClient:
    def __init__(self, config: EngineConfig) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="tokenmill-")
        input_address = f"ipc://{os.path.join(self._tmpdir, 'input')}"
        self._output_address = f"ipc://{os.path.join(self._tmpdir, 'output')}"
        # Bind before the child exists: it connects, and ZMQ queues whatever is sent meanwhile.
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self._input.bind(input_address)
        self._output: zmq.asyncio.Socket | None = None
        self._closed = False
        # spawn, not fork: a forked copy of a process that already holds threads, CUDA or an
        # event loop is unsafe.
        mp = multiprocessing.get_context("spawn")
        self._ready, child_end = mp.Pipe(duplex=False)
        self.proc = mp.Process(
            target=run_engine_core,
            args=(config, input_address, self._output_address, child_end, os.getpid()),
            name="tokenmill-engine-core",
            daemon=True,
        )
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

    @property
    def is_alive(self) -> bool:
        return self.proc.is_alive()

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
