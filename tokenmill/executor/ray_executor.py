"""RayExecutor: the ranks as Ray actors in a placement group, one bundle per rank, over a Ray cluster's nodes.

Rank 0 (the driver) runs in the engine core's own process, as with the mp executor, so a step's output is
today's PendingOutput and async scheduling overlaps the same way; its bundle is pinned to this node (and
on GPUs held by a placeholder actor, so Ray gives its GPU to no other rank). Ranks 1..N-1 are
`RankActor`s (ray_rank.py). The ranks meet in torch.distributed over a `tcp://` rendezvous at this node's
address and a free port.

Each call goes to every actor: the SchedulerOutput is put in Ray's object store once per step and every
actor gets the reference, so it is serialized once; the actors' results of a step are never waited for.
Failures: each actor has a `wait_for_failure` call in flight, which returns a traceback when the rank
raised and fails when the actor dies; a watchdog thread waits on them, and the driver's next collective
(which fails once the rank is gone) then raises a WorkerFailed naming it, which ends the engine.

Ray is connected to as vLLM does: the cluster this process already joined, else the one running on this
node (`ray start --head` / `ray start --address`), else a local instance started here for this engine.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from transformers import PretrainedConfig

from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import abort_distributed, destroy_distributed, is_distributed
from tokenmill.executor.base import RankGroupExecutor
from tokenmill.executor.multiproc import STARTUP_TIMEOUT_S, WorkerFailed
from tokenmill.executor.ray_rank import DevicePlaceholder, RankActor
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.worker.pending_output import PendingOutput, ReadyOutput
from tokenmill.worker.worker import Worker, resolve_device

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
"""Longest to wait for the cluster to have a free device for every rank."""
_POLL_S = 0.1
_FAILURE_WAIT_S = 5.0
"""How long a failed collective waits for Ray to report the actor's death."""


def connect_ray() -> bool:
    """Join the running Ray cluster, or start a local instance; True when this call started one."""
    if ray.is_initialized():
        return False
    address = _cluster_address()
    if address is not None and not _answers(address):
        if os.environ.get("RAY_ADDRESS"):
            raise RuntimeError(f"no Ray cluster answers at RAY_ADDRESS {address}: start it (`ray start --head`), "
                               f"or unset RAY_ADDRESS to run on a Ray instance of this node's own")
        logger.warning("the Ray cluster last started on this node (%s) does not answer: starting a local Ray instance "
                       "(`ray stop` makes Ray forget the old one)", address)
        address = None
    if address is None:
        ray.init(address="local", include_dashboard=False)
        return True
    ray.init(address="auto")  # (not the address itself: "auto" also finds the cluster's authentication token)
    return False


def ray_cluster_running() -> bool:
    """Whether this process joined a Ray cluster, or could join one running on this node (and now has)."""
    if ray.is_initialized():
        return True
    address = _cluster_address()
    if address is None or not _answers(address):
        return False
    ray.init(address="auto")
    return True


def _cluster_address() -> str | None:
    """The address `ray.init(address="auto")` would join (RAY_ADDRESS, else the cluster `ray start` last started on
    this node, else a Ray instance running here), or None. Ray would wait minutes on one that no longer answers (a
    head that died without `ray stop` leaves its address behind), so it is asked first (_answers)."""
    from ray._private.services import get_ray_address_from_environment

    try:
        return get_ray_address_from_environment("auto", None)
    except ConnectionError:
        return None


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something listens at host:port (a Ray Client address's too); True for what does not parse: Ray
    reports those itself."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):  # [IPv6]:port too
            return True
    except ValueError:
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def tcp_rendezvous() -> str:
    """A torch.distributed rendezvous that ranks on any of the cluster's nodes reach: this node's address (the
    process that meets there first, here, serves the store) and a free port."""
    return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"


class RayExecutor(RankGroupExecutor):
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, max_model_len: int) -> None:
        self.world_size = config.parallel_config.world_size
        if is_distributed():
            raise RuntimeError("a tensor- or pipeline-parallel engine is already running in this process: shut it "
                               "down first")
        self._started_ray = connect_ray()
        self._failure: str | None = None
        self._closed = threading.Event()
        self._actors: dict[int, Any] = {}
        self._placeholder = None
        self._group = None
        self._places: dict[int, tuple[int, str, list[str]]] = {}
        """rank -> (pid, node address, GPU ids) of its actor."""
        self._on_gpu = resolve_device(config.device_config.device).type == "cuda"
        atexit.register(self.shutdown)
        try:
            self._start(config, hf_config, max_model_len)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig, hf_config: PretrainedConfig, max_model_len: int) -> None:
        on_gpu = self._on_gpu
        resource = "GPU" if on_gpu else "CPU"
        bundles = [{resource: 1.0} for _ in range(self.world_size)]
        bundles[0][f"node:{ray.util.get_node_ip_address()}"] = 0.001  # the driver's rank runs here, in this process
        self._group = placement_group(bundles, strategy="PACK")
        if not self._group.wait(PLACEMENT_TIMEOUT_S):
            raise RuntimeError(f"the Ray cluster did not give {self.world_size} free {resource}s (one on this node) "
                               f"within {PLACEMENT_TIMEOUT_S:.0f} s: available {ray.available_resources()}")
        driver_gpu = self._hold_driver_gpu() if on_gpu else None
        actor_class = ray.remote(concurrency_groups={"watch": 1})(RankActor)
        for rank in range(1, self.world_size):
            self._actors[rank] = actor_class.options(
                num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0, max_concurrency=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=rank),
            ).remote()
        # Every actor is up before the driver enters the rendezvous, which would wait for a dead one.
        self._places = dict(zip(self._actors, self._get([actor.where.remote() for actor in self._actors.values()])))
        self._watched = {actor.wait_for_failure.remote(): rank for rank, actor in self._actors.items()}
        threading.Thread(target=self._watch, daemon=True, name="ray-watchdog").start()
        init_method = tcp_rendezvous()
        started = [actor.start.remote(config, hf_config, max_model_len, rank, init_method, 0 if on_gpu else None)
                   for rank, actor in self._actors.items()]
        self.driver_worker = Worker(config, hf_config, max_model_len, rank=0, distributed_init_method=init_method,
                                    local_rank=driver_gpu)
        self._get(started)
        logger.info("%d ranks ready on Ray (rendezvous %s; actors %s)", self.world_size, init_method,
                    ", ".join(f"rank {rank}: pid {pid} on {node}" for rank, (pid, node, _) in self._places.items()))

    def _hold_driver_gpu(self) -> int:
        """The index, in this process, of the GPU Ray reserved for the driver's bundle."""
        self._placeholder = ray.remote(DevicePlaceholder).options(
            num_cpus=0, num_gpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=0),
        ).remote()
        (gpu,) = ray.get(self._placeholder.gpu_ids.remote())
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return visible.split(",").index(gpu) if visible else int(gpu)

    # -- the calls ---------------------------------------------------------------------------------
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Run worker.`method`(*args) on every rank at once; returns each rank's result, rank 0 first."""
        self._check()
        refs = [actor.call.remote(method, *args) for actor in self._actors.values()]
        try:
            first = getattr(self.driver_worker, method)(*args)
        except Exception as e:
            self._raise_if_a_rank_failed(e)
            raise
        return [first, *self._get(refs)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingOutput | ReadyOutput:
        """As the mp executor's: every rank runs the step, rank 0's output is returned."""
        self._check()
        shared = ray.put(scheduler_output)  # serialized once for every actor
        for actor in self._actors.values():
            actor.execute_model.remote(shared)
        try:
            return self.driver_worker.execute_model(scheduler_output)
        except Exception as e:
            self._raise_if_a_rank_failed(e)
            raise

    # -- failures -----------------------------------------------------------------------------------
    def _get(self, refs: list) -> list[Any]:
        """The actors' results, in order; raises WorkerFailed as soon as a rank fails meanwhile."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = list(refs)
        while pending:
            self._check()
            if time.monotonic() > deadline:
                raise WorkerFailed(f"Ray actors did not answer within {STARTUP_TIMEOUT_S:.0f} s")
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as e:
            self._raise_if_a_rank_failed(e)
            raise WorkerFailed(f"a Ray actor failed: {e}; the engine cannot continue") from e

    def _watch(self) -> None:
        pending = list(self._watched)
        while pending and not self._closed.is_set():
            try:
                done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            except Exception:  # Ray shut down by shutdown() meanwhile
                return
            if not done or self._closed.is_set():
                continue
            rank = self._watched[done[0]]
            try:
                failure = f"tensor-parallel rank {rank} raised\n--- rank {rank} ---\n{ray.get(done[0]).rstrip()}"
            except ray.exceptions.RayError as e:
                pid, node, _ = self._places[rank]
                failure = (f"tensor-parallel rank {rank} (Ray actor, pid {pid} on {node}) died: "
                           f"{type(e).__name__}: {first_line(e)}")
            self._failure = self._failure or failure
            logger.error("%s", failure)
            if self._on_gpu:
                abort_distributed()  # unblock the driver's collective: NCCL would wait forever
            return

    def _check(self) -> None:
        if self._failure is not None:
            raise WorkerFailed(f"{self._failure}; the engine cannot continue")

    def _raise_if_a_rank_failed(self, error: Exception) -> None:
        """A failed collective on the driver is most likely a rank gone: name it once Ray reports it."""
        deadline = time.monotonic() + _FAILURE_WAIT_S
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if self._failure is not None:
            raise WorkerFailed(f"{self._failure}; the engine cannot continue") from error

    # -- shutdown -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        atexit.unregister(self.shutdown)
        for actor in [*self._actors.values(), *([self._placeholder] if self._placeholder is not None else [])]:
            ray.kill(actor)
        if self._group is not None:
            remove_placement_group(self._group)
        destroy_distributed()
        if self._started_ray:
            ray.shutdown()


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]
