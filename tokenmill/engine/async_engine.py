"""AsyncEngine: the server's engine. Tokenization and detokenization stay in this (the frontend)
process; each EngineCore runs in its own process (core_proc.py) and exchanges messages over ZMQ.

    engine = AsyncEngine(config)            # starts the core process(es), waits until they are ready
    await engine.start()                    # inside the event loop that serves requests
    async for output in engine.add_request("id", "Hello", SamplingParams()):
        ...                                 # DELTA outputs, the last one finished

Leaving the iteration early (a client disconnecting, a cancelled task) aborts the request in the
core, which frees its KV blocks.

With data parallelism (`data_parallel_size` N) there are N core processes (replicas), each with the
whole model; the DataParallelBalancer sends each request to one, by load and by the prompt prefix it
likely holds in its cache, and aborts go where their request went. When a core fails (a step raised,
or the process died) the streams of its requests end with EngineDeadError at once and a new core
process with the same configuration is started (core_replica.py); the other replicas serve on. The
engine is unhealthy only while no replica can serve. Replicas that share out a mixture-of-experts model's
experts (enable_expert_parallel: engine.replica_lockstep) step together instead: the failure of one stops them
all, and they start again together.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import CoreProcessClient, replica_cuda_devices
from tokenmill.engine.core_replica import CoreReplica, EngineDeadError
from tokenmill.engine.dp_balancer import DataParallelBalancer, ReplicaLoad
from tokenmill.engine.frontend import load_frontend
from tokenmill.engine.input_processor import PromptType
from tokenmill.engine.replica_lockstep import replica_configs, replicas_share_experts
from tokenmill.model.loader import load_hf_config
from tokenmill.outputs import RequestOutput
from tokenmill.protocol import EngineCoreOutputs, ProfileReply, SchedulerStats
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "ProfilerError", "StatLogger"]

logger = logging.getLogger(__name__)


class StatLogger(Protocol):
    def record(self, outputs: list[RequestOutput], stats: SchedulerStats | None, engine_index: int = 0) -> None:
        """Called with every batch of outputs delivered and the scheduler stats that came with them, from
        replica `engine_index`. A replica that failed reports empty stats (its counters restart at zero)."""


class ProfilerError(RuntimeError):
    def __init__(self, message: str, is_misuse: bool) -> None:
        super().__init__(message)
        self.is_misuse = is_misuse
        """The caller's error (start while running, stop while not), not the profiler's."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, stat_logger: StatLogger | None = None,
                 started_core: CoreProcessClient | None = None) -> None:
        """`started_core`: the one replica's core process, already started with `config` (`tokenmill serve` starts it
        before it imports the server); it is shut down with the engine, or here if the engine fails to start."""
        self.config = config
        self.stat_logger = stat_logger
        num_replicas = config.parallel_config.data_parallel_size
        if started_core is not None and num_replicas != 1:
            started_core.shutdown()
            raise ValueError("a core started ahead serves one replica; let the engine start its replicas")
        devices = replica_cuda_devices(config)  # before any process starts: too few GPUs fail at once
        self.replicas: list[CoreReplica] = []
        self._shutting_down = False
        self._lockstep_restart: asyncio.Task | None = None
        self._rendezvous_dir: str | None = None
        """The private folder where replicas that share the experts meet (None: they do not)."""
        configs = [config] * num_replicas
        hf_config = load_hf_config(config.model_config) if num_replicas > 1 else None  # the frontend's too
        if hf_config is not None and replicas_share_experts(config, hf_config):
            self._rendezvous_dir = tempfile.mkdtemp(prefix="tokenmill-replicas-")
            configs = self._replica_configs(0)
            parallel = config.parallel_config
            logger.info("the %d data-parallel replicas share out the routed experts: %d ranks hold each layer's "
                        "(dp x tp), the engine cores stepping together", num_replicas,
                        num_replicas * parallel.tensor_parallel_size)
            if devices[0] is not None and not config.device_config.enforce_eager:  # GPU replicas
                logger.info("enable_expert_parallel over data-parallel replicas: CUDA graphs are off")
        try:
            # The cores load the weights while this process loads the tokenizer.
            for index in range(num_replicas):
                name = "the engine core" if num_replicas == 1 else f"the replica-{index} engine core"
                self.replicas.append(CoreReplica(index, configs[index], self, devices[index], name, started_core))
            self.frontend = frontend = load_frontend(config.model_config, hf_config,
                                                     config.structured_outputs_config, config.reasoning_config)
            for replica in self.replicas:
                replica.wait_ready()
        except BaseException:
            for replica in self.replicas:
                replica.shutdown()
            if started_core is not None:
                started_core.shutdown()  # a no-op once its replica has shut it down
            self._remove_rendezvous()
            raise
        self.hf_config, self.max_model_len = frontend.hf_config, frontend.max_model_len
        self.tokenizer = frontend.tokenizer
        self.input_processor, self.output_processor = frontend.input_processor, frontend.output_processor
        self.balancer = DataParallelBalancer(num_replicas, config.cache_config.block_size,
                                             prefix_aware=config.cache_config.enable_prefix_caching,
                                             long_prompt_len=self.replicas[0].core.long_prompt_len)
        self._streams: dict[str, asyncio.Queue] = {}
        self._routes: dict[str, tuple[int, int]] = {}
        """Open request id -> (its replica's index, its number of samples)."""
        self._open_seqs = [0] * num_replicas
        """Per replica: samples of the open requests sent to it."""

    async def start(self) -> None:
        """Begin receiving the cores' outputs and watching their processes; call once, in the serving loop."""
        for replica in self.replicas:
            replica.start()

    @property
    def core(self):
        """The first replica's core client (the only one without data parallelism)."""
        return self.replicas[0].core

    @property
    def is_healthy(self) -> bool:
        return any(replica.is_healthy for replica in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        """Why no replica can serve (None while one can)."""
        if self.is_healthy:
            return None
        if len(self.replicas) == 1:
            return self.replicas[0].dead_reason
        return "; ".join(replica.dead_reason for replica in self.replicas)

    @property
    def num_restarts(self) -> int:
        return sum(replica.num_restarts for replica in self.replicas)

    @property
    def last_stats(self) -> SchedulerStats | None:
        """The latest scheduler stats: the core's, or the sum over the replicas (KV usage: their mean)."""
        reported = [r.last_stats for r in self.replicas if r.last_stats is not None]
        if len(self.replicas) == 1 or not reported:
            return self.replicas[0].last_stats
        return SchedulerStats(
            num_running_reqs=sum(s.num_running_reqs for s in reported),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in reported),
            kv_cache_usage=sum(s.kv_cache_usage for s in reported) / len(reported),
            prefix_cache_requests=sum(s.prefix_cache_requests for s in reported),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in reported),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in reported),
            num_preemptions=sum(s.num_preemptions for s in reported),
        )

    def get_num_unfinished_seqs(self) -> int:
        """Sequences (samples) the cores hold for this frontend: running or waiting."""
        return len(self.output_processor.samples)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate and enqueue now (ValueError for bad input); iterate the result for DELTA outputs."""
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason)
        requests = self.frontend.prepare(request_id, prompt, params, priority, cache_salt, RequestOutputKind.DELTA)
        hashes = self.balancer.prefix_hashes(requests[0].prompt_token_ids, requests[0].cache_salt)
        index = self.balancer.choose(self._loads(), hashes)
        try:
            self.replicas[index].core.add_requests(requests)  # all samples or none
        except Exception:
            self.output_processor.abort_requests([request_id])
            raise
        if self._rendezvous_dir is not None:  # idle replicas that step together: all take a turn now
            for other in self.replicas:
                if other.index != index and other.is_healthy:
                    other.core.wake()
        self.balancer.record(index, hashes)
        self._routes[request_id] = (index, len(requests))
        self._open_seqs[index] += len(requests)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        return self._iterate(request_id, stream)

    def _loads(self) -> list[ReplicaLoad]:
        loads = []
        for replica, open_seqs in zip(self.replicas, self._open_seqs):
            stats = replica.last_stats
            loads.append(ReplicaLoad(open_seqs, stats.num_waiting_reqs if stats else 0,
                                     stats.kv_cache_usage if stats else 0.0, replica.is_healthy))
        return loads

    async def _iterate(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if request_id in self._streams:  # left before the end
                self.abort([request_id])

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests (caller ids); their streams end. Unknown or finished ids are ignored."""
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            route = self._routes.get(request_id)
            if route is not None:
                by_replica.setdefault(route[0], []).append(request_id)
        for index, ids in by_replica.items():
            replica = self.replicas[index]
            sample_ids = [sid for rid in ids for sid in self.output_processor.sample_ids(rid)]
            if sample_ids and replica.is_healthy:
                replica.core.abort_requests(sample_ids)
            finals = self.output_processor.abort_requests(ids)
            for output in finals:  # a consumer still waiting gets the finished ("abort") output
                stream = self._streams.pop(output.request_id, None)
                if stream is not None:
                    stream.put_nowait(output)
            self._record(finals, None, index)
        for request_id in request_ids:
            self._streams.pop(request_id, None)
            self._forget(request_id)

    def end_all_requests(self, reason: str) -> None:
        """End every open request now, its stream with EngineDeadError(reason) (the server's 503), and abort it in its
        core: the server shutting down past its grace period."""
        open_ids = list(self._streams)
        for request_id in open_ids:
            self._streams[request_id].put_nowait(EngineDeadError(reason))
        self.abort(open_ids)

    def _forget(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is not None:
            self._open_seqs[route[0]] -= route[1]

    async def start_profile(self, output_dir: str) -> None:
        """Start every serving core's torch profiler (core_profiler.py); its traces go to `output_dir`."""
        await self._profile(start=True, output_dir=output_dir)

    async def stop_profile(self) -> list[ProfileReply]:
        """Stop the profilers; returns once each core has written its trace (one reply per core)."""
        return await self._profile(start=False)

    async def _profile(self, start: bool, output_dir: str = "") -> list[ProfileReply]:
        serving = [replica for replica in self.replicas if replica.is_healthy]
        if not serving:
            raise EngineDeadError(self.dead_reason)
        replies = await asyncio.gather(*(replica.profile(start, output_dir) for replica in serving))
        errors = [(replica, reply) for replica, reply in zip(serving, replies) if reply.error is not None]
        if errors:
            message = "; ".join(reply.error if len(serving) == 1 else f"{replica.name}: {reply.error}"
                                for replica, reply in errors)
            raise ProfilerError(message, is_misuse=all(reply.is_misuse for _, reply in errors))
        return replies

    def handle_outputs(self, replica: CoreReplica, core_outputs: EngineCoreOutputs) -> None:
        """A batch of one replica's outputs: detokenize, deliver, and stop what hit a stop string."""
        outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs)
        # Stop strings are found here, after detokenization: the core must drop those samples.
        replica.core.abort_requests(stopped)
        for output in outputs:
            if output.finished:
                self._forget(output.request_id)
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)
                if output.finished:
                    del self._streams[output.request_id]
        self._record(outputs, core_outputs.scheduler_stats, replica.index)

    def replica_failed(self, replica: CoreReplica, reason: str) -> None:
        """End the streams of the replica's requests with EngineDeadError and forget those requests."""
        ids = [rid for rid, (index, _) in self._routes.items() if index == replica.index]
        for request_id in ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put_nowait(EngineDeadError(reason))
            self._forget(request_id)
        # Empty stats: the replica's gauges drop to zero, and its next core counts from zero.
        self._record(self.output_processor.abort_requests(ids), SchedulerStats(), replica.index)
        self.balancer.forget(replica.index)
        if not replica.restartable and not self._shutting_down and self._lockstep_restart is None:
            # The others wait for it in their next exchange: all stop, and start again together.
            self._lockstep_restart = asyncio.create_task(self._restart_lockstep(), name="engine-restart-replicas")
            for other in self.replicas:
                other.stop(f"{replica.name} failed")

    async def _restart_lockstep(self) -> None:
        try:
            await CoreReplica.restart_together(self.replicas, self._replica_configs)
        finally:
            self._lockstep_restart = None

    def _record(self, outputs: list[RequestOutput], stats: SchedulerStats | None, engine_index: int) -> None:
        if self.stat_logger is not None and (outputs or stats is not None):
            try:
                self.stat_logger.record(outputs, stats, engine_index)
            except Exception:  # metrics must never break serving
                logger.exception("stat logger failed")

    def shutdown(self) -> None:
        """Stop the core processes; idempotent. Open streams end with EngineDeadError."""
        self._shutting_down = True
        if self._lockstep_restart is not None:
            self._lockstep_restart.cancel()
        if len(self.replicas) > 1:
            for replica in self.replicas:
                replica.core.request_stop()  # all at once: each takes a moment to exit
        for replica in self.replicas:
            replica.shutdown()
        self._remove_rendezvous()

    def _replica_configs(self, start: int) -> list[EngineConfig]:
        """The configs of replicas that share the experts at their `start`-th start (0: the first): a new
        rendezvous each time."""
        return replica_configs(self.config, self._rendezvous_dir, start)

    def _remove_rendezvous(self) -> None:
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
