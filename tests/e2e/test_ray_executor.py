"""The ray executor on a local Ray instance (CPU, gloo): rank 1 is a Ray actor in a placement group.

Tensor parallelism over two ranks, one a Ray actor, must give the one-rank engine's greedy tokens (the
features test_tensor_parallel.py composes with TP run here too: async scheduling, chunked prefill, prefix
caching, ngram drafts); a killed actor must end the engine with an error naming it within 10 s.
Skipped where ray is not installed (`pip install -e .[ray]`).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.test_tensor_parallel import ENGINE as ONE_RANK_ENGINE
from tests.e2e.test_tensor_parallel import GREEDY, MODELS, TP_ENGINE, build_model, prompts
from tokenmill import LLM

ray = pytest.importorskip("ray")

ENGINE = dict(TP_ENGINE, distributed_executor_backend="ray")


@pytest.fixture(scope="module")
def ray_case(tmp_path_factory):
    """(one-rank greedy outputs, the two-rank engine on Ray); the executor starts Ray itself (no cluster here),
    and stops it at its shutdown."""
    if ray.is_initialized():
        pytest.skip("a Ray instance is already connected in this process")
    folder = tmp_path_factory.mktemp("ray")
    build_model(folder, MODELS["kv-split"])
    reference = LLM(str(folder), **ONE_RANK_ENGINE).generate(prompts(), GREEDY, use_tqdm=False)
    llm = LLM(str(folder), **ENGINE)
    yield reference, llm
    llm.engine.core.shutdown()


def test_ray_ranks_give_the_one_rank_greedy_tokens(ray_case):
    reference, llm = ray_case
    executor = llm.engine.core.executor
    assert type(executor).__name__ == "RayExecutor" and list(executor._actors) == [1]
    actual = llm.generate(prompts(), GREEDY, use_tqdm=False)
    for want, got in zip(reference, actual):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_killed_actor_ends_the_engine_with_a_clear_error(ray_case):
    # Last in the module: it ends the shared engine.
    _, llm = ray_case
    executor = llm.engine.core.executor
    pid, _, _ = ray.get(executor._actors[1].where.remote())
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(Ray actor, pid \d+ .*\) died"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    llm.engine.core.shutdown()
    assert not ray.is_initialized()  # the executor started Ray, and stopped it


def test_a_ray_cluster_that_no_longer_answers_is_not_waited_for(monkeypatch):
    """A head that died without `ray stop` leaves its address behind, and `ray.init(address="auto")` then waits on
    it for minutes. A dead RAY_ADDRESS is said at once; a dead remembered cluster is passed over: none to join (the
    backend's automatic choice), or a local instance started instead."""
    from ray._private import services

    from tokenmill.executor.ray_executor import connect_ray, free_port, ray_cluster_running

    if ray.is_initialized():
        pytest.skip("a Ray instance is already connected in this process")
    dead = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    monkeypatch.setenv("RAY_ADDRESS", dead)
    assert not ray_cluster_running()
    with pytest.raises(RuntimeError, match=f"no Ray cluster answers at RAY_ADDRESS {dead}: start it"):
        connect_ray()
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: dead)  # what `ray start` wrote down
    assert not ray_cluster_running()
    assert time.monotonic() - start < 10 and not ray.is_initialized()
    try:
        assert connect_ray()  # a local instance, started here
        assert ray.is_initialized()
    finally:
        ray.shutdown()


def test_a_cluster_address_answers_in_either_address_family():
    """The check before joining reads host:port as Ray writes it, an IPv6 host in brackets too."""
    import socket

    from tokenmill.executor.ray_executor import _answers

    for family, host, written in ((socket.AF_INET, "127.0.0.1", "127.0.0.1"), (socket.AF_INET6, "::1", "[::1]")):
        try:
            listener = socket.socket(family)
            listener.bind((host, 0))
        except OSError:
            continue  # no IPv6 on this machine
        with listener:
            listener.listen()
            port = listener.getsockname()[1]
            assert _answers(f"{written}:{port}") and _answers(f"ray://{written}:{port}")
        assert not _answers(f"{written}:{port}")  # closed now
