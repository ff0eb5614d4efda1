"""Node 0's side of the ranks on other nodes (--nnodes): the rendezvous point and their liveness.

Node 0 hosts torch.distributed's store at master_addr:master_port, the one port the user names. The
executor's ZMQ sockets for the other nodes' ranks bind random ports, published in that store as the
`LAYOUT_KEY` entry, which a headless node reads before starting its ranks (headless.py); the ranks' process
group then meets in the same store (torch's `tcp://` rendezvous shares this process's store server).

Each headless node sends a heartbeat every HEARTBEAT_INTERVAL_S and a message when one of its ranks
exits: a node silent for HEARTBEAT_TIMEOUT_S (killed, or cut off) ends the engine like a dead local rank.
The nodes trust each other, as torch.distributed does: what crosses between them is pickled.
"""

from __future__ import annotations

import datetime
import json
import pickle
import time

import torch.distributed as dist
import zmq

from tokenmill.config import ParallelConfig

LAYOUT_KEY = "tokenmill/layout"
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 3.0
STORE_TIMEOUT_S = 600.0
"""Longest the store waits for a node (node 0 may start before the others, or after)."""


def node_ranks(parallel: ParallelConfig, node_rank: int) -> range:
    """The global ranks `node_rank` runs."""
    per_node = parallel.ranks_per_node
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def node_of(parallel: ParallelConfig, rank: int) -> int:
    return rank // parallel.ranks_per_node


def rendezvous_store(parallel: ParallelConfig, is_master: bool) -> dist.TCPStore:
    # multi_tenant: the process group's own `tcp://` rendezvous in this process reuses this server.
    return dist.TCPStore(parallel.master_addr, parallel.master_port, is_master=is_master, multi_tenant=True,
                         wait_for_workers=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))


class RemoteNodes:
    """The executor's view of nodes 1..nnodes-1: addresses their ranks connect to, and their heartbeats."""

    def __init__(self, parallel: ParallelConfig, context: zmq.Context, results: zmq.Socket) -> None:
        self._parallel = parallel
        try:
            self._store = rendezvous_store(parallel, is_master=True)
        except Exception as e:  # e.g. the port is taken: name it, not torch's socket error alone
            raise RuntimeError(f"cannot host the rendezvous at {parallel.master_addr}:{parallel.master_port} "
                               f"(--master-addr/--master-port): {e}") from e
        self._heartbeats = context.socket(zmq.PULL)
        self._layout = {
            "world_size": parallel.world_size,
            "nnodes": parallel.nnodes,
            "outbox_port": results.bind_to_random_port("tcp://*"),
            "heartbeat_port": self._heartbeats.bind_to_random_port("tcp://*"),
            "inbox_ports": {},
        }
        self._last_heard: dict[int, float] = {}

    @property
    def init_method(self) -> str:
        return f"tcp://{self._parallel.master_addr}:{self._parallel.master_port}"

    def bind_inbox(self, inbox: zmq.Socket, rank: int) -> None:
        self._layout["inbox_ports"][str(rank)] = inbox.bind_to_random_port("tcp://*")

    def publish(self) -> None:
        """Let the headless nodes start their ranks: every address is bound."""
        self._store.set(LAYOUT_KEY, json.dumps(self._layout))

    def check(self) -> str | None:
        """Why the engine cannot go on (a node's rank exited, or a node fell silent), or None; the watchdog's
        thread only."""
        while self._heartbeats.poll(0):
            message = pickle.loads(self._heartbeats.recv())
            node = message[1]
            self._last_heard[node] = time.monotonic()
            if message[0] == "failed":
                return f"node {node}: {message[2]}"
        now = time.monotonic()
        for node, heard in self._last_heard.items():
            if now - heard > HEARTBEAT_TIMEOUT_S:
                ranks = node_ranks(self._parallel, node)
                return (f"node {node} (ranks {ranks.start}-{ranks.stop - 1}) sent no heartbeat for "
                        f"{HEARTBEAT_TIMEOUT_S:.0f} s: it stopped or cannot be reached")
        return None

    def close(self) -> None:
        self._heartbeats.close(linger=0)
        self._store = None  # stops the server: the headless nodes see node 0 is gone and stop their ranks
