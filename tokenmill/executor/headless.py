"""A node other than node 0 (--nnodes, --node-rank N): runs only its ranks, which node 0's engine drives.

It reads from node 0's store (master_addr:master_port, waiting for node 0 to come up) where the driver
listens, starts one `worker_proc` per rank of this node connected there over TCP (the model, the engine
configuration and the process group's rendezvous then come from node 0), and watches them: it sends node 0
a heartbeat, tells it when a rank exits, and stops its ranks when node 0's engine is gone (the heartbeat's
connection drops: ZMQ's own keep-alive notices a node 0 that vanished without closing it).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenmill.config import ParallelConfig
from tokenmill.executor.multinode import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    LAYOUT_KEY,
    node_ranks,
    rendezvous_store,
)

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 5.0


def read_layout(parallel: ParallelConfig) -> dict:
    """Node 0's published layout (waiting for node 0 to publish it)."""
    store = rendezvous_store(parallel, is_master=False)
    return json.loads(store.get(LAYOUT_KEY))


def layout_mismatch(parallel: ParallelConfig, layout: dict) -> str | None:
    ours = {"world_size": parallel.world_size, "nnodes": parallel.nnodes}
    theirs = {key: layout[key] for key in ours}
    if theirs == ours:
        return None
    return (f"node 0 runs {theirs['world_size']} ranks over {theirs['nnodes']} nodes, node {parallel.node_rank}'s "
            f"flags say {ours['world_size']} over {ours['nnodes']}: give every node the same "
            "--tensor-parallel-size, --pipeline-parallel-size and --nnodes")


def run_headless_node(parallel: ParallelConfig) -> int:
    """Run this node's ranks until node 0's engine shuts down (0) or something fails (1)."""
    logger.info("node %d of %d: waiting for node 0 at %s:%d", parallel.node_rank, parallel.nnodes,
                parallel.master_addr, parallel.master_port)
    layout = read_layout(parallel)
    address = f"tcp://{parallel.master_addr}"
    context = zmq.Context()
    heartbeat = context.socket(zmq.PUSH)
    heartbeat.setsockopt(zmq.LINGER, 1000)
    heartbeat.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_INTERVAL_S * 1000))
    heartbeat.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
    monitor = heartbeat.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    heartbeat.connect(f"{address}:{layout['heartbeat_port']}")
    procs: dict[int, subprocess.Popen] = {}
    try:
        mismatch = layout_mismatch(parallel, layout)
        if mismatch is not None:
            heartbeat.send(pickle.dumps(("failed", parallel.node_rank, mismatch)))  # node 0 stops waiting
            raise ValueError(mismatch)
        outbox = f"{address}:{layout['outbox_port']}"
        for rank in node_ranks(parallel, parallel.node_rank):
            procs[rank] = subprocess.Popen([sys.executable, "-m", "tokenmill.executor.worker_proc",
                                            f"{address}:{layout['inbox_ports'][str(rank)]}", outbox, str(rank),
                                            str(os.getpid())])
        logger.info("node %d: ranks %s started (pids %s)", parallel.node_rank, ", ".join(map(str, procs)),
                    ", ".join(str(p.pid) for p in procs.values()))
        return _watch(parallel.node_rank, procs, heartbeat, monitor)
    finally:
        _stop(procs)
        heartbeat.disable_monitor()
        monitor.close(linger=0)
        heartbeat.close()
        context.term()


def _watch(node_rank: int, procs: dict[int, subprocess.Popen], heartbeat: zmq.Socket, monitor: zmq.Socket) -> int:
    def send(*message) -> None:
        try:
            heartbeat.send(pickle.dumps((message[0], node_rank, *message[1:])), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected (yet, or any more): the monitor's events decide

    connected = False
    while True:
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED and connected:
                return _after_node_0(procs)
            connected = connected or event == zmq.EVENT_CONNECTED
        if connected:
            send("alive")
        codes = {rank: proc.poll() for rank, proc in procs.items()}
        failed = {rank: code for rank, code in codes.items() if code not in (None, 0)}
        if failed:
            rank, code = next(iter(failed.items()))
            send("failed", f"tensor-parallel rank {rank} (pid {procs[rank].pid}) exited with code {code}")
            logger.error("rank %d exited with code %d: stopping this node's ranks", rank, code)
            return 1
        if all(code == 0 for code in codes.values()):
            logger.info("node 0's engine shut down: every rank of this node has stopped")
            return 0
        time.sleep(HEARTBEAT_INTERVAL_S)


def _after_node_0(procs: dict[int, subprocess.Popen]) -> int:
    """Node 0 is gone: after a shutdown its ranks here are stopping by themselves; otherwise stop them."""
    deadline = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < deadline and any(proc.poll() is None for proc in procs.values()):
        time.sleep(0.1)
    if all(proc.poll() == 0 for proc in procs.values()):
        logger.info("node 0's engine shut down: every rank of this node has stopped")
        return 0
    logger.error("node 0's engine is gone: stopping this node's ranks")
    return 1


def _stop(procs: dict[int, subprocess.Popen]) -> None:
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

