"""A rank other than the driver: `python -m tokenmill.executor.worker_proc INBOX OUTBOX RANK PARENT_PID`.

INBOX and OUTBOX are the driver's ZMQ addresses for this rank (ipc:// on the driver's node, tcp:// from
another node); PARENT_PID is the process that started it (the executor, or a headless node's launcher).

It builds its Worker (joining the group, loading its shard), then runs whatever the driver sends, in
order. Steps return nothing: each step's tokens are resolved after the next step is launched (with k pipeline
micro-batches in flight, after the next k - 1), as the engine core does, so this rank never idles for them:
a step needs them on the host only when the engine scheduled it after updating from theirs, hence launched
it later (async scheduling's next step reads them on the device, as the model runner ensures).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import deque

import zmq

_PARENT_POLL_S = 1.0


def _exit_when_orphaned(parent_pid: int) -> None:
    """A driver killed with SIGKILL cannot stop us; leave no orphan behind."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def main(inbox_address: str, outbox_address: str, rank: int, parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group: the driver decides when this rank stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True, name="parent-watch").start()
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(inbox_address)
    outbox.connect(outbox_address)

    def reply(kind: str, value=None) -> None:
        outbox.send(pickle.dumps((kind, rank, value), protocol=pickle.HIGHEST_PROTOCOL))

    reply("hello")
    try:
        from tokenmill.distributed.parallel_state import destroy_distributed
        from tokenmill.worker.worker import Worker

        method, (config, hf_config, max_model_len, init_method) = pickle.loads(inbox.recv())
        worker = Worker(config, hf_config, max_model_len, rank=rank, distributed_init_method=init_method)
        reply("result")
        pending = deque()
        max_unresolved = max(1, config.parallel_config.num_batches_in_flight - 1)
        while True:
            method, args = pickle.loads(inbox.recv())
            if method == "shutdown":
                break
            if method == "execute_model":
                pending.append(worker.execute_model(*args))
                if len(pending) > max_unresolved:
                    pending.popleft().result()
            else:
                reply("result", getattr(worker, method)(*args))
        destroy_distributed()
    except BaseException:
        reply("error", traceback.format_exc())
        outbox.close(linger=2000)  # let the traceback reach the driver
        os._exit(1)
    inbox.close(linger=0)
    outbox.close(linger=1000)
    context.term()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    # Stopped cleanly, its sockets closed: skip the interpreter's teardown of torch and the model (0.5-3 s per rank
    # on a busy CPU), which the driver's shutdown waits for and which leaves nothing the OS does not reclaim.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
