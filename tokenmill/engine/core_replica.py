"""One engine-core process behind the AsyncEngine (one per data-parallel replica) and its lifecycle.

It receives the core's outputs (handing them to its owner, the AsyncEngine), watches the process, and
when the core fails (a step raised, or the process died) it marks itself dead, has the owner fail the
requests it held, and starts a new core process with the same configuration; once that is ready it
serves again. Only a core that cannot start again leaves the replica dead. Replicas fail and restart
independently of one another, except those that share out a model's experts (engine.replica_lockstep): they
step together, so one that fails stops them all, and they start again together (restart_together).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import CoreProcessClient
from tokenmill.protocol import EngineCoreOutputs, ProfileCommand, ProfileReply, SchedulerStats

logger = logging.getLogger(__name__)

RESTART_DELAYS_S = (0.0, 2.0, 10.0)
"""Seconds before each attempt to start a new core after a failure; then the replica stays dead."""


class EngineDeadError(RuntimeError):
    """The engine core is not running (it failed and is restarting, or it is gone); the request is lost."""


class ReplicaOwner(Protocol):
    def handle_outputs(self, replica: CoreReplica, outputs: EngineCoreOutputs) -> None:
        """Deliver a batch of the core's outputs; raising counts as the core's failure."""

    def replica_failed(self, replica: CoreReplica, reason: str) -> None:
        """End every request the replica held (with EngineDeadError: `reason`)."""


class CoreReplica:
    def __init__(self, index: int, config: EngineConfig, owner: ReplicaOwner, cuda_devices: str | None = None,
                 name: str = "the engine core", started: CoreProcessClient | None = None) -> None:
        """Starts the core process (or takes `started`, one already started with `config`); wait_ready() waits for
        it, start() (in the serving loop) attaches to it."""
        self.index = index
        self.config = config
        self.owner = owner
        self.cuda_devices = cuda_devices
        self.name = name
        """How logs and errors name it ("the engine core", or "engine core 1 of 2")."""
        self.restartable = config.parallel_config.replica_world is None
        """False for replicas that share out the experts: they restart together (restart_together)."""
        self.core = started if started is not None else CoreProcessClient(config, cuda_devices)
        self.last_stats: SchedulerStats | None = None
        self.dead_reason: str | None = None
        self.num_restarts = 0
        self._output_task: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None
        self._starting: CoreProcessClient | None = None
        """A core being started by a restart (in a thread), which shutdown() must stop too."""
        self._shut_down = False
        self._profile_calls: dict[int, asyncio.Future[ProfileReply]] = {}
        """Profiler commands sent and not answered yet, by call id."""
        self._call_ids = itertools.count()

    def wait_ready(self) -> None:
        self.core.wait_ready()

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None

    def start(self) -> None:
        """Begin receiving the core's outputs and watching its process; call once, in the serving loop."""
        self._attach(self.core)

    def _attach(self, core: CoreProcessClient) -> None:
        core.open_output()
        self._output_task = asyncio.create_task(self._output_loop(core), name=f"engine-outputs-{self.index}")
        # The sentinel becomes readable when the process exits: no polling, no thread.
        asyncio.get_running_loop().add_reader(core.proc.sentinel, self._on_core_exit, core)

    async def _output_loop(self, core: CoreProcessClient) -> None:
        try:
            while True:
                core_outputs = await core.get_outputs()
                if core_outputs.engine_error is not None:
                    self._on_core_failure(core, f"{self.name} failed: {core_outputs.engine_error}")
                    return
                if core_outputs.scheduler_stats is not None:
                    self.last_stats = core_outputs.scheduler_stats
                if core_outputs.profile_reply is not None:
                    self._settle_profile_call(core_outputs.profile_reply)
                self.owner.handle_outputs(self, core_outputs)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("the output loop of %s failed", self.name)
            self._on_core_failure(core, f"the engine's output processing failed: {e!r}")

    async def profile(self, start: bool, output_dir: str = "") -> ProfileReply:
        """Start or stop the core's torch profiler; returns once the core has done it (a stop: written the
        trace). EngineDeadError if the core fails meanwhile."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        future = self._profile_calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            self.core.send_profile_command(ProfileCommand(call_id, start, output_dir))
            return await future
        finally:
            self._profile_calls.pop(call_id, None)

    def _settle_profile_call(self, reply: ProfileReply) -> None:
        future = self._profile_calls.pop(reply.call_id, None)
        if future is not None and not future.done():  # the caller may have left (a client hung up)
            future.set_result(reply)

    def _on_core_exit(self, core: CoreProcessClient) -> None:
        asyncio.get_running_loop().remove_reader(core.proc.sentinel)
        core.proc.join()
        self._on_core_failure(core, f"{self.name} process exited (exit code {core.proc.exitcode})")

    def _on_core_failure(self, core: CoreProcessClient, reason: str) -> None:
        """Fail what the core held and start a new one; a second report of the same failure is ignored."""
        if core is not self.core or self.dead_reason is not None or self._shut_down:
            return
        if not self.restartable:  # the owner restarts it with the others
            self.stop(reason)
            return
        self._fail(f"{reason}; restarting it")
        self._restart_task = asyncio.create_task(self._restart(core), name=f"engine-restart-{self.index}")

    async def _restart(self, failed: CoreProcessClient) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(failed.proc.sentinel)
        await asyncio.to_thread(failed.shutdown)  # it may still be exiting: SIGTERM, then SIGKILL
        for attempt, delay in enumerate(RESTART_DELAYS_S, start=1):
            await asyncio.sleep(delay)
            try:
                core = await asyncio.to_thread(self.start_core)
            except Exception as e:
                logger.error("%s: restart %d of %d failed: %s", self.name, attempt, len(RESTART_DELAYS_S), e)
                continue
            if self._shut_down:
                core.shutdown()
                return
            self.resume(core)
            return
        self.give_up()

    def resume(self, core: CoreProcessClient) -> None:
        """Serve again from `core`, a new process started by start_core."""
        self.core, self.last_stats, self.dead_reason = core, None, None
        self.num_restarts += 1
        self._attach(core)
        logger.warning("%s restarted; serving again", self.name)

    def give_up(self) -> None:
        self.dead_reason = f"{self.name} failed and could not be restarted: see the log; restart the server"
        logger.error(self.dead_reason)

    def start_core(self) -> CoreProcessClient:
        """A new core process, ready (runs in a thread: loading the model takes seconds)."""
        core = self._starting = CoreProcessClient(self.config, self.cuda_devices)
        try:
            core.wait_ready()
            if self._shut_down:  # the server stopped meanwhile: nobody would stop this one
                raise EngineDeadError("the engine was shut down")
        except BaseException:
            core.shutdown()
            raise
        finally:
            self._starting = None
        return core

    @staticmethod
    async def restart_together(replicas: list[CoreReplica], configs: Callable[[int], list[EngineConfig]]) -> None:
        """Restart replicas that step together, all stopped (CoreReplica.stop), as one: attempt k starts them from
        configs(k) (a new rendezvous), and a core that fails to start ends the others' attempt at once (they would
        wait for it)."""
        await asyncio.gather(*(asyncio.to_thread(replica.core.shutdown) for replica in replicas))
        for attempt, delay in enumerate(RESTART_DELAYS_S, start=1):
            await asyncio.sleep(delay)
            for replica, config in zip(replicas, configs(attempt)):
                replica.config = config
            starts = [asyncio.create_task(asyncio.to_thread(replica.start_core)) for replica in replicas]
            _, pending = await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
            while pending:  # one failed: the others would wait for it in the rendezvous
                for replica in replicas:
                    if replica._starting is not None:
                        replica._starting.shutdown()  # its wait_ready() fails at once
                _, pending = await asyncio.wait(pending, timeout=0.5)
            errors = [task.exception() for task in starts if task.exception() is not None]
            if errors or any(replica._shut_down for replica in replicas):
                for task in starts:
                    if task.exception() is None:
                        task.result().shutdown()
                if not errors:
                    return  # the server is stopping
                logger.error("data-parallel replicas: restart %d of %d failed: %s", attempt, len(RESTART_DELAYS_S),
                             errors[0])
                continue
            for replica, task in zip(replicas, starts):
                replica.resume(task.result())
            return
        for replica in replicas:
            replica.give_up()

    def _fail(self, reason: str, expected: bool = False) -> None:
        """Mark the replica dead and have the owner end every request it held."""
        if self.dead_reason is None:
            (logger.info if expected else logger.error)("%s stopped: %s", self.name, reason)
            self.dead_reason = reason
        self.last_stats = None
        self.owner.replica_failed(self, reason)
        for future in self._profile_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._profile_calls.clear()
        if self._output_task is not None and not self._output_task.done():
            self._output_task.cancel()

    def stop(self, reason: str) -> None:
        """Fail what the replica holds and stop its core (replicas that step together stop and restart together:
        the owner does both); nothing if it is already dead or shut down."""
        if self.dead_reason is not None or self._shut_down:
            return
        self._fail(f"{reason}; the data-parallel replicas that share the experts step together: restarting them all")
        asyncio.get_running_loop().remove_reader(self.core.proc.sentinel)

    def shutdown(self) -> None:
        """Stop the core process; idempotent. Its open requests end with EngineDeadError."""
        self._shut_down = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        if self._starting is not None:
            self._starting.shutdown()  # its wait_ready() then fails at once, ending the restart's thread
        if self._output_task is not None and not self._output_task.get_loop().is_closed():
            self._output_task.get_loop().remove_reader(self.core.proc.sentinel)
            self._fail("the engine was shut down", expected=True)
        self.core.shutdown()

