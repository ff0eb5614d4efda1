"""The rows' matchers in a process of their own: `python -m tokenmill.structured.grammar_process FD COMPILE_FD
PARENT_PID`.

The engine's host is its bottleneck at large batches, and xgrammar's accept and fill (~1.7 ms a step at 256 rows
on the H200's host) cannot overlap the engine's Python from a thread (the GIL). Here they run on another core:
the engine sends a step's new tokens as soon as it has them and the request for the step's masks once it knows
its rows and drafts, does its other host work (the rest of the step's launch; with async scheduling also the
engine core's update, outputs and scheduling, since the runner launches such a step's sampler first thing in its
next step: worker/pending_output.py's DeferredSample), and only then waits for the masks, which the process
writes into shared memory (the engine's host buffers, memory files mapped by both: registered as pinned memory on
a GPU, so the copy to the device reads them directly).

The process also compiles the grammars (each spec once: the engine's compiler `delegate`s to it) and reports
each compile's end (success with the grammars' vocabulary, or the error) over a second socket pair, the compile
channel, which a thread of the engine's reads: the requests waiting for their grammar are released from there,
and the replies to the fills never queue behind a compile's.

Messages go over a socket pair, in order, one way but for the reply to each fill. A plain subprocess (not
multiprocessing's): the server's engine core is a daemon process, which multiprocessing forbids children. It
leaves when the engine does (the socket closes, or the parent is gone), and a failure in it reaches the engine
as an error at its next wait, never as a hang.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

import numpy as np

logger = logging.getLogger(__name__)

_POLL_S = 1.0
"""How often a wait for the masks checks that the grammar process still runs."""


class GrammarProcessError(RuntimeError):
    pass


class GrammarProcess:
    """The engine's side: starts the process and speaks to it; the host buffers live in shared memory."""

    def __init__(self, compiler, tree_parent: np.ndarray | None = None) -> None:
        """`compiler`: the engine's GrammarCompiler, whose grammars the process compiles from now on (it compiles
        none itself). `tree_parent`: the draft tree's shape (MatcherSet's), sent once: a step's fill names only
        node counts."""
        ours, theirs = socket.socketpair()
        compiles_ours, compiles_theirs = socket.socketpair()
        # This engine's tokenmill, wherever it was imported from (a benchmark puts the repository on sys.path).
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.structured.grammar_process", str(theirs.fileno()),
             str(compiles_theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno(), compiles_theirs.fileno()], env=env,
        )
        theirs.close()
        compiles_theirs.close()
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()  # a compile may come from the thread that takes requests
        self._memory: list[mmap.mmap] = []
        self._pinned: list[int] = []  # the buffers' addresses registered with CUDA
        self._send("init", compiler, tree_parent)
        self._finalizer = weakref.finalize(self, _shut, self._conn, self._proc, self._memory, self._pinned)
        # The reader holds the compiler weakly: this object (which the compiler holds) goes with the engine.
        threading.Thread(target=_read_compiles, args=(Connection(compiles_ours.detach()), weakref.ref(compiler)),
                         daemon=True, name="grammar-compiles").start()
        compiler.delegate(self.compile)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def new_buffers(self, num_int32: int, pinned: bool) -> list:
        """Two shared host buffers of `num_int32` int32 each (as torch tensors), which the process fills. The
        last ones are released: the caller holds no view of them any more and their copies have run."""
        import torch

        _release(self._memory, self._pinned)
        # Anonymous memory files, handed over through the socket: no /dev/shm (a container's is often 64 MB).
        files = [os.memfd_create("tokenmill-grammar-masks") for _ in range(2)]
        for fd in files:
            os.ftruncate(fd, 4 * num_int32)
        self._memory += [mmap.mmap(fd, 4 * num_int32) for fd in files]
        buffers = [torch.frombuffer(memory, dtype=torch.int32, count=num_int32) for memory in self._memory]
        if pinned:
            for buffer in buffers:
                error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), 4 * num_int32, 0))
                if error != 0:
                    raise GrammarProcessError(f"could not pin the grammar masks' shared memory (cudaError {error})")
                self._pinned.append(buffer.data_ptr())  # in place: the finalizer holds the lists
        try:
            with self._lock:
                self._conn.send(("buffers", 4 * num_int32))
                for fd in files:
                    send_handle(self._conn, fd, self._proc.pid)
        except OSError:
            raise self._died() from None
        finally:
            for fd in files:
                os.close(fd)  # the mappings keep the memory
        return buffers

    def add(self, row: int, params, stop_tokens: list[int]) -> None:
        self._send("add", row, params, stop_tokens)

    def compile(self, params) -> None:
        """Compile a spec (ahead of its first add): its end comes back on the compile channel. Called from the
        thread that takes requests (`_send` locks)."""
        try:
            if self._conn.closed or self._proc.poll() is not None:
                raise OSError
            with self._lock:
                self._conn.send(("compile", params))
        except OSError:  # not `_died`, which reads the replies: the step's thread does
            raise GrammarProcessError("the grammar process is gone: it cannot compile the grammar") from None

    def accept(self, rows: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        self._send_step(pack_step(ACCEPT, (), (rows, counts, tokens)))

    def fill(self, turn: int, offset: int, bitmask: np.ndarray, rows: np.ndarray, num_drafts: np.ndarray,
             drafts: np.ndarray, accept: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """Start filling the masks into buffer `turn`'s [offset, offset + bitmask.size) (`bitmask`: its view),
        after accepting `accept` (rows, counts, tokens) if given: one message for both."""
        header = (turn, offset, *bitmask.shape)
        if accept is None:
            self._send_step(pack_step(FILL, header, (rows, num_drafts, drafts)))
        else:
            self._send_step(pack_step(ACCEPT_FILL, header, (*accept, rows, num_drafts, drafts)))

    def take(self) -> None:
        """Wait until the last fill is written."""
        while not self._conn.poll(_POLL_S):
            if self._proc.poll() is not None:
                raise self._died()
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            raise self._died() from None
        if reply[0] == "error":
            raise GrammarProcessError(f"the grammar process failed:\n{reply[1]}")

    def close(self) -> None:
        self._finalizer()

    def _send(self, *message) -> None:
        try:
            with self._lock:
                self._conn.send(message)
        except OSError:
            raise self._died() from None

    def _send_step(self, message: bytes) -> None:
        try:
            with self._lock:
                self._conn.send_bytes(message)
        except OSError:
            raise self._died() from None

    def _died(self) -> GrammarProcessError:
        try:  # its last words, if it could send them
            while self._conn.poll(0):
                reply = self._conn.recv()
                if reply[0] == "error":
                    return GrammarProcessError(f"the grammar process failed:\n{reply[1]}")
        except (EOFError, OSError):
            pass
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # alive, its socket broken: it cannot serve us any more
            self._proc.kill()
            code = self._proc.wait()
        return GrammarProcessError(f"the grammar process exited (code {code}): structured outputs cannot go on")


# A step's messages (accept, fill) are raw bytes, not pickles: pickling the arrays cost more than the rest of the
# engine's side of a step. Layout: kind, number of ints, number of arrays (int64 each), the ints, each array's
# length, then the arrays' int64 data one after the other. Pickled messages (rare ones) start with pickle's own
# protocol byte, never one of these kinds.
ACCEPT, FILL, ACCEPT_FILL = 1, 2, 3


def pack_step(kind: int, ints: tuple[int, ...], arrays: tuple[np.ndarray, ...]) -> bytes:
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in arrays]
    head = np.array([kind, len(ints), len(arrays), *ints, *(a.size for a in arrays)], dtype=np.int64)
    return b"".join([head.tobytes(), *(a.tobytes() for a in arrays)])


def unpack_step(message: bytes) -> tuple[int, list[int], list[np.ndarray]]:
    words = np.frombuffer(message, dtype=np.int64)
    kind, num_ints, num_arrays = (int(x) for x in words[:3])
    ints = words[3 : 3 + num_ints].tolist()
    lengths = words[3 + num_ints : 3 + num_ints + num_arrays].tolist()
    arrays, at = [], 3 + num_ints + num_arrays
    for length in lengths:
        arrays.append(words[at : at + length])
        at += length
    return kind, ints, arrays


def _release(memory: list[mmap.mmap], pinned: list[int]) -> None:
    if pinned:
        import torch

        for address in pinned:
            torch.cuda.cudart().cudaHostUnregister(address)
        pinned.clear()
    for block in memory:
        try:
            block.close()
        except BufferError:  # a tensor still views it: the mapping goes with the last view
            pass
    memory.clear()


def _shut(conn: Connection, proc: subprocess.Popen, memory: list[mmap.mmap], pinned: list[int]) -> None:
    """Close the socket (the process leaves at once), wait for it, free the shared memory."""
    conn.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _release(memory, pinned)


def _read_compiles(conn: Connection, compiler_ref: weakref.ref) -> None:
    """The engine's side of the compile channel: each compile's end to the compiler (its futures), until the
    process is gone, which fails the compiles still pending (their requests, never the engine: a step's wait
    reports the process's end)."""
    while True:
        try:
            key, error, vocab_size = conn.recv()
        except (EOFError, OSError):
            break
        compiler = compiler_ref()
        if compiler is None:
            break
        compiler.compiled(key, error, vocab_size)
        del compiler  # not held while waiting
    conn.close()
    compiler = compiler_ref()
    if compiler is not None:
        compiler.elsewhere_gone(GrammarProcessError("the grammar process is gone: it cannot compile the grammar"))


def _exit_when_orphaned(parent_pid: int) -> None:
    """An engine killed with SIGKILL cannot close our socket before we notice: leave no orphan behind."""
    while True:
        time.sleep(_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def serve(conn: Connection, compiles: Connection) -> None:
    from tokenmill.structured.compiler import compiled_vocab_size, spec_key
    from tokenmill.structured.matcher_set import MatcherSet

    _, compiler, tree_parent = conn.recv()
    report_lock = threading.Lock()  # compiles end on the compiler's threads

    def report(key, future) -> None:
        error = future.exception()
        message = (key, None, compiled_vocab_size(future.result())) if error is None else (key, str(error), None)
        try:
            with report_lock:
                compiles.send(message)
        except OSError:  # the engine is gone: the main loop sees it too
            pass

    matchers = MatcherSet(tree_parent)
    attached: list[mmap.mmap] = []
    buffers: list[np.ndarray] = []
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the engine is gone
        if message[0] in (ACCEPT, FILL, ACCEPT_FILL):
            kind, ints, arrays = unpack_step(message)
            if kind != FILL:
                matchers.accept(*arrays[:3])
            if kind != ACCEPT:
                turn, offset, num_masks, words = ints
                bitmask = buffers[turn][offset : offset + num_masks * words].reshape(num_masks, words)
                matchers.fill(*arrays[-3:], bitmask)
                conn.send(("filled",))
            continue
        kind, *args = pickle.loads(message)
        if kind == "add":
            row, params, stop_tokens = args
            matchers.add(row, compiler.get(params), stop_tokens)
        elif kind == "compile":
            key = spec_key(args[0])
            compiler.submit(args[0]).add_done_callback(lambda future, key=key: report(key, future))
        elif kind == "buffers":
            buffers = []  # views first: a mapping closes only once nothing views it
            for memory in attached:
                memory.close()
            attached = []
            for _ in range(2):
                fd = recv_handle(conn)
                attached.append(mmap.mmap(fd, args[0]))
                os.close(fd)
            buffers = [np.ndarray(args[0] // 4, dtype=np.int32, buffer=memory) for memory in attached]


def main(fd: int, compiles_fd: int, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the engine decides
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True, name="parent-watch").start()
    conn = Connection(fd)
    try:
        serve(conn, Connection(compiles_fd))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise


if __name__ == "__main__":
    logging.basicConfig(format="grammar process: %(levelname)s %(message)s")
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
