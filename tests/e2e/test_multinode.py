"""Two nodes over a plain torch.distributed rendezvous, simulated on this host (CPU, gloo, TCP).

Node 0 is this process's engine (`--nnodes 2 --node-rank 0`), node 1 a headless `tokenmill serve
--nnodes 2 --node-rank 1` in its own process group; tensor parallelism 2 puts one rank on each, so every
all-reduce crosses between the "nodes". The greedy tokens must be the one-rank engine's; node 1 must exit
by itself when the engine shuts down, and a killed node 1 must end the engine with a clear error in < 10 s.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.e2e.test_tensor_parallel import ENGINE, GREEDY, MODELS, build_model, prompts
from tokenmill import LLM


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_node_1(port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--tensor-parallel-size", "2", "--nnodes", "2",
         "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), *extra],
        start_new_session=True)  # its own process group: "the node" is killed as a whole


def two_node_engine(folder, port: int) -> LLM:
    return LLM(str(folder), **ENGINE, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
               master_port=port)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multinode")
    build_model(folder, MODELS["kv-split"])
    return folder, LLM(str(folder), **ENGINE).generate(prompts(), GREEDY, use_tqdm=False)


def test_two_nodes_give_the_one_rank_greedy_tokens_and_node_1_stops_with_the_engine(model):
    folder, reference = model
    port = free_port()
    node_1 = start_node_1(port)
    try:
        llm = two_node_engine(folder, port)
        try:
            assert llm.engine.core.executor._procs == {}  # rank 1 is node 1's
            actual = llm.generate(prompts(), GREEDY, use_tqdm=False)
        finally:
            llm.engine.core.shutdown()
        for want, got in zip(reference, actual):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert node_1.wait(timeout=10) == 0
    finally:
        if node_1.poll() is None:
            os.killpg(node_1.pid, signal.SIGKILL)
            node_1.wait()


@pytest.mark.parametrize("pause_s", [0.0, 1.0], ids=["at_once", "after_its_connection_closed"])
def test_a_killed_node_ends_the_engine_with_a_clear_error(model, pause_s):
    """Also when the next step comes after the node's connection closed but before its heartbeat is overdue: the
    driver's send to it has no peer then, which must not wait for one forever."""
    folder, _ = model
    port = free_port()
    node_1 = start_node_1(port)
    try:
        llm = two_node_engine(folder, port)
        try:
            os.killpg(node_1.pid, signal.SIGKILL)  # the launcher and its rank, as when the machine goes down
            time.sleep(pause_s)
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"node 1 \(ranks 1-1\) sent no heartbeat"):
                llm.generate(prompts(), GREEDY, use_tqdm=False)
            assert time.monotonic() - start < 10
        finally:
            llm.engine.core.shutdown()
    finally:
        if node_1.poll() is None:
            os.killpg(node_1.pid, signal.SIGKILL)
        node_1.wait()


def test_node_flags_are_checked(model, capsys):
    with pytest.raises(ValueError, match="node_rank must be an integer from 0 to nnodes - 1"):
        LLM("unused", tensor_parallel_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match=r"must be a multiple of nnodes \(4\)"):
        LLM("unused", tensor_parallel_size=2, nnodes=4)
    with pytest.raises(ValueError, match="'ray' places the ranks"):
        LLM("unused", tensor_parallel_size=2, nnodes=2, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="headless needs node_rank > 0"):
        LLM("unused", headless=True)
    folder, _ = model
    with pytest.raises(ValueError, match="runs only its ranks"):
        LLM(str(folder), **ENGINE, tensor_parallel_size=2, nnodes=2, node_rank=1)


def test_a_node_with_other_flags_is_refused(model):
    """Node 1 started with another layout than node 0's says so, and node 0 stops waiting for it."""
    folder, _ = model
    port = free_port()
    node_1 = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--tensor-parallel-size", "4", "--nnodes", "2",
         "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)],
        stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(RuntimeError, match="node 0 runs 2 ranks over 2 nodes, node 1's flags say 4 over 2"):
            two_node_engine(folder, port)
        _, stderr = node_1.communicate(timeout=10)
        assert node_1.returncode == 1
        assert stderr.strip().splitlines()[-1].startswith("error: node 0 runs 2 ranks over 2 nodes")
    finally:
        if node_1.poll() is None:
            node_1.kill()
            node_1.wait()


def test_the_backend_is_chosen_as_vllm_does():
    from tokenmill.config import EngineConfig
    from tokenmill.executor.base import choose_backend

    def backend(**kwargs) -> str:
        return choose_backend(EngineConfig.from_kwargs("unused", **kwargs))

    assert backend() == "uni"
    assert backend(tensor_parallel_size=2) == "mp"  # CPU ranks always fit this node
    assert backend(tensor_parallel_size=2, nnodes=2) == "mp"  # the torch rendezvous runs mp's ranks
    assert backend(tensor_parallel_size=2, distributed_executor_backend="ray") == "ray"
