"""A rank other than the driver: `python -m tokenmill.executor.worker_proc FOLDER RANK PARENT_PID`.

It builds its Worker (joining the group, loading its shard), then runs whatever the driver sends, in
order. Steps return nothing: each step's tokens are resolved after the next step is launched, as the
async engine core does, so this rank's device never idles for them (its rows need a step's tokens on
the host only before the step after next reads them, which the model runner itself ensures).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback

import zmq

from tokenmill.executor.multiproc import addresses

_PARENT_POLL_S = 1.0


def _exit_when_orphaned(parent_pid: int) -> None:
    """A driver killed with SIGKILL cannot stop us; leave no orphan behind."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def main(folder: str, rank: int, parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group: the driver decides when this rank stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True, name="parent-watch").start()
    context = zmq.Context()
    inbox_address, outbox_address = addresses(folder, rank)
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
        pending = None
        while True:
            method, args = pickle.loads(inbox.recv())
            if method == "shutdown":
                break
            if method == "execute_model":
                launched = worker.execute_model(*args)
                if pending is not None:
                    pending.result()
                pending = launched
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
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
