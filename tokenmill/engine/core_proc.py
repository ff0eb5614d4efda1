"""Runs an EngineCore in its own process: startup handshake, ZMQ input/output threads, busy loop.

The frontend starts `run_engine_core` in a spawned child. The child loads the model, reports
"ready" (or the startup error) through a pipe, then loops: take requests and aborts from the
input thread, step the core, hand outputs to the output thread. The socket threads encode and
decode while the main thread computes. It exits on SIGTERM, when its parent dies, or on a
fatal error: a step that raises sends the error as its last message, so the frontend fails the
requests at once and starts a new core (it also notices an exit that sent nothing).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.codec import RequestKind, decode_request, encode_outputs
from tokenmill.engine.core import EngineCore
from tokenmill.engine.core_profiler import handle_profile_command
from tokenmill.engine.heap_freeze import freeze_startup_heap
from tokenmill.engine.replica_lockstep import IDLE_POLL_S, ReplicaLockstep
from tokenmill.protocol import EngineCoreOutput, EngineCoreOutputs, EngineRequest
from tokenmill.request import FinishReason

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0
_RECV_POLL_MS = 100
_SEND_LINGER_MS = 1000


def run_engine_core(
    config: EngineConfig, input_address: str, output_address: str, ready: Connection, parent_pid: int
) -> None:
    """Entry point of the engine-core process."""
    # Ctrl-C reaches the whole process group; the frontend owns it and stops us with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True, name="parent-watch").start()
    try:
        from tokenmill.engine.frontend import resolve_max_model_len
        from tokenmill.model.loader import load_hf_config

        hf_config = load_hf_config(config.model_config)
        max_model_len = resolve_max_model_len(config.model_config.max_model_len, hf_config)
        core = EngineCore.from_config(config, hf_config, max_model_len)
        # Replicas that share out the experts step together (engine.replica_lockstep).
        lockstep = ReplicaLockstep(core) if config.parallel_config.replica_world is not None else None
        proc = EngineCoreProc(core, input_address, output_address, lockstep)
    except BaseException:
        # The frontend stops us with SIGTERM once it reads the error: we are leaving anyway, and the signal's
        # SystemExit raised inside the interpreter's exit would print a stray traceback.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ready.send(("error", traceback.format_exc()))
        ready.close()
        raise SystemExit(1) from None
    freeze_startup_heap("engine core")
    # What the frontend must know of the core's KV cache: its router hashes prompts as the cache does.
    ready.send(("ready", {"long_prompt_len": core.scheduler.kv.long_prompt_len}))
    ready.close()
    proc.run()


def _exit_on_signal(signum: int, frame) -> None:
    # Once: a second SIGTERM during the cleanup would raise again inside it (or in an atexit callback).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(0)


def _exit_when_orphaned(parent_pid: int) -> None:
    """A frontend killed with SIGKILL cannot stop us; notice it and leave no orphan behind."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


class EngineCoreProc:
    def __init__(self, core: EngineCore, input_address: str, output_address: str,
                 lockstep: ReplicaLockstep | None = None) -> None:
        self.core = core
        self.lockstep = lockstep
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()
        self.context = zmq.Context()
        self.stopping = threading.Event()
        # Each socket lives in its own thread (ZMQ sockets are not thread-safe).
        self.threads = [
            threading.Thread(target=target, args=(address,), daemon=True, name=target.__name__)
            for target, address in ((self._recv_loop, input_address), (self._send_loop, output_address))
        ]
        for thread in self.threads:
            thread.start()

    def run(self) -> None:
        """The busy loop until SIGTERM; a step that raises is reported to the frontend, then exits 1."""
        try:
            self.run_busy_loop()
        except SystemExit:
            logger.info("engine core shutting down")
        except Exception as e:
            logger.exception("engine core failed; exiting")
            self.outputs.put(EngineCoreOutputs(engine_error=f"{type(e).__name__}: {e}"))
            raise SystemExit(1) from None
        finally:
            self.close()

    def run_busy_loop(self) -> None:
        if self.lockstep is not None:
            self._run_lockstep_loop()
        while True:
            self._handle_inputs(block=not self.core.has_requests())
            if self.core.has_requests():
                self.outputs.put(self.core.step())

    def _run_lockstep_loop(self) -> None:
        """With the other replicas' cores (engine.replica_lockstep): a turn each, together, forever."""
        busy = False
        while True:
            self._handle_inputs(block=not busy, timeout=IDLE_POLL_S)
            busy = self.lockstep.anyone_busy()
            if busy and (outputs := self.lockstep.step()) is not None:
                self.outputs.put(outputs)

    def _handle_inputs(self, block: bool, timeout: float | None = None) -> None:
        """Take every message waiting; `block`: wait for one first (at most `timeout` seconds)."""
        messages = []
        if block:
            with contextlib.suppress(queue.Empty):
                messages.append(self.inputs.get(timeout=timeout))
        while True:
            try:
                messages.append(self.inputs.get_nowait())
            except queue.Empty:
                break
        rejected: list[EngineCoreOutput] = []
        aborted = False
        for kind, payload in messages:
            if kind == RequestKind.ADD:
                rejected += self._add(payload)
            elif kind == RequestKind.ABORT:
                self.core.abort_requests(payload)
                aborted = True
            elif kind == RequestKind.WAKE:
                continue  # it cut the wait short: nothing else to do
            else:  # answered at once, in order with the outputs of the steps before it
                self.outputs.put(EngineCoreOutputs(profile_reply=handle_profile_command(self.core, payload)))
        if rejected or aborted:
            # Aborts change the gauges even when no step follows (the engine may now be idle).
            self.outputs.put(EngineCoreOutputs(rejected, self.core.scheduler.make_stats()))

    def _add(self, request: EngineRequest) -> list[EngineCoreOutput]:
        try:
            self.core.add_request(request)
            return []
        except Exception as e:  # a bad request must not take the engine down
            logger.error("rejected request %s: %s", request.request_id, e)
            return [EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT)]

    def _recv_loop(self, address: str) -> None:
        socket = self.context.socket(zmq.PULL)
        socket.connect(address)
        try:
            while not self.stopping.is_set():
                if not socket.poll(_RECV_POLL_MS):
                    continue
                frames = socket.recv_multipart()
                try:
                    self.inputs.put(decode_request(frames))
                except Exception:
                    logger.exception("dropped an undecodable message")
        finally:
            socket.close(linger=0)

    def _send_loop(self, address: str) -> None:
        socket = self.context.socket(zmq.PUSH)
        socket.connect(address)
        try:
            while (outputs := self.outputs.get()) is not None:
                socket.send(encode_outputs(outputs), copy=False)
        finally:
            socket.close(linger=_SEND_LINGER_MS)

    def close(self) -> None:
        self.stopping.set()
        self.outputs.put(None)
        for thread in self.threads:
            thread.join(timeout=2.0)
        self.core.shutdown()  # after the last message went out; the tensor-parallel ranks must not outlive us
        if not any(thread.is_alive() for thread in self.threads):
            self.context.term()  # would block on a socket still open; the process exits anyway
