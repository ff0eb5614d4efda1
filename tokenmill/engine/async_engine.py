"""AsyncEngine: the server's engine. Tokenization and detokenization stay in this (the frontend)
process; the EngineCore runs in its own process (core_proc.py) and exchanges messages over ZMQ.

    engine = AsyncEngine(config)            # starts the core process, waits until it is ready
    await engine.start()                    # inside the event loop that serves requests
    async for output in engine.add_request("id", "Hello", SamplingParams()):
        ...                                 # DELTA outputs, the last one finished

Leaving the iteration early (a client disconnecting, a cancelled task) aborts the request in the
core, which frees its KV blocks.

When the core fails (a step raised, or the process died), every open stream ends with
EngineDeadError at once, the engine reports itself unhealthy, and a new core process with the same
configuration is started; once it is ready the engine serves again. Only a core that cannot start
again leaves the engine dead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import CoreProcessClient
from tokenmill.engine.frontend import load_frontend
from tokenmill.engine.input_processor import PromptType
from tokenmill.outputs import RequestOutput
from tokenmill.protocol import SchedulerStats
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is not running (it failed and is restarting, or it is gone); the request is lost."""


class StatLogger(Protocol):
    def record(self, outputs: list[RequestOutput], stats: SchedulerStats | None) -> None:
        """Called with every batch of outputs delivered and the scheduler stats that came with it."""


RESTART_DELAYS_S = (0.0, 2.0, 10.0)
"""Seconds before each attempt to start a new core after a failure; then the engine stays dead."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, stat_logger: StatLogger | None = None) -> None:
        self.config = config
        self.stat_logger = stat_logger
        # The core loads the weights while this process loads the tokenizer.
        self.core = CoreProcessClient(config)
        try:
            self.frontend = frontend = load_frontend(config.model_config)
            self.core.wait_ready()
        except BaseException:
            self.core.shutdown()
            raise
        self.hf_config, self.max_model_len = frontend.hf_config, frontend.max_model_len
        self.tokenizer = frontend.tokenizer
        self.input_processor, self.output_processor = frontend.input_processor, frontend.output_processor
        self.last_stats: SchedulerStats | None = None
        self.dead_reason: str | None = None
        self.num_restarts = 0
        self._streams: dict[str, asyncio.Queue] = {}
        self._output_task: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None
        self._starting: CoreProcessClient | None = None
        """A core being started by a restart (in a thread), which shutdown() must stop too."""
        self._shut_down = False

    async def start(self) -> None:
        """Begin receiving the core's outputs and watching its process; call once, in the serving loop."""
        self._attach(self.core)

    def _attach(self, core: CoreProcessClient) -> None:
        core.open_output()
        self._output_task = asyncio.create_task(self._output_loop(core), name="engine-outputs")
        # The sentinel becomes readable when the process exits: no polling, no thread.
        asyncio.get_running_loop().add_reader(core.proc.sentinel, self._on_core_exit, core)

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None

    def get_num_unfinished_seqs(self) -> int:
        """Sequences (samples) the core holds for this frontend: running or waiting."""
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
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        requests = self.frontend.prepare(request_id, prompt, params, priority, cache_salt, RequestOutputKind.DELTA)
        try:
            self.core.add_requests(requests)  # all samples or none
        except Exception:
            self.output_processor.abort_requests([request_id])
            raise
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        return self._iterate(request_id, stream)

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
        sample_ids = [sid for rid in request_ids for sid in self.output_processor.sample_ids(rid)]
        if sample_ids and self.dead_reason is None:
            self.core.abort_requests(sample_ids)
        finals = self.output_processor.abort_requests(request_ids)
        for output in finals:  # a consumer still waiting gets the finished ("abort") output
            stream = self._streams.pop(output.request_id, None)
            if stream is not None:
                stream.put_nowait(output)
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        self._record(finals, None)

    async def _output_loop(self, core: CoreProcessClient) -> None:
        try:
            while True:
                core_outputs = await core.get_outputs()
                if core_outputs.engine_error is not None:
                    self._on_core_failure(core, f"the engine core failed: {core_outputs.engine_error}")
                    return
                outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs)
                # Stop strings are found here, after detokenization: the core must drop those samples.
                core.abort_requests(stopped)
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream.put_nowait(output)
                        if output.finished:
                            del self._streams[output.request_id]
                if core_outputs.scheduler_stats is not None:
                    self.last_stats = core_outputs.scheduler_stats
                self._record(outputs, core_outputs.scheduler_stats)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("the output loop failed")
            self._on_core_failure(core, f"the engine's output processing failed: {e!r}")

    def _record(self, outputs: list[RequestOutput], stats: SchedulerStats | None) -> None:
        if self.stat_logger is not None and (outputs or stats is not None):
            try:
                self.stat_logger.record(outputs, stats)
            except Exception:  # metrics must never break serving
                logger.exception("stat logger failed")

    def _on_core_exit(self, core: CoreProcessClient) -> None:
        asyncio.get_running_loop().remove_reader(core.proc.sentinel)
        core.proc.join()
        self._on_core_failure(core, f"the engine core process exited (exit code {core.proc.exitcode})")

    def _on_core_failure(self, core: CoreProcessClient, reason: str) -> None:
        """Fail what the core held and start a new one; a second report of the same failure is ignored."""
        if core is not self.core or self.dead_reason is not None or self._shut_down:
            return
        self._fail(f"{reason}; restarting it")
        self._restart_task = asyncio.create_task(self._restart(core), name="engine-restart")

    async def _restart(self, failed: CoreProcessClient) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(failed.proc.sentinel)
        await asyncio.to_thread(failed.shutdown)  # it may still be exiting: SIGTERM, then SIGKILL
        for attempt, delay in enumerate(RESTART_DELAYS_S, start=1):
            await asyncio.sleep(delay)
            try:
                core = await asyncio.to_thread(self._start_core)
            except Exception as e:
                logger.error("engine core restart %d of %d failed: %s", attempt, len(RESTART_DELAYS_S), e)
                continue
            if self._shut_down:
                core.shutdown()
                return
            self.core, self.last_stats, self.dead_reason = core, None, None
            self.num_restarts += 1
            self._attach(core)
            logger.warning("engine core restarted; serving again")
            return
        self.dead_reason = "the engine core failed and could not be restarted: see the log; restart the server"
        logger.error(self.dead_reason)

    def _start_core(self) -> CoreProcessClient:
        """A new core process, ready (runs in a thread: loading the model takes seconds)."""
        core = self._starting = CoreProcessClient(self.config)
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

    def _fail(self, reason: str, expected: bool = False) -> None:
        """Mark the engine dead, end every open stream with EngineDeadError and forget every request."""
        if self.dead_reason is None:
            (logger.info if expected else logger.error)("engine stopped: %s", reason)
            self.dead_reason = reason
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError(reason))
        self._streams.clear()
        self._record(self.output_processor.abort_requests(list(self.output_processor.parents)), None)
        if self._output_task is not None and not self._output_task.done():
            self._output_task.cancel()

    def shutdown(self) -> None:
        """Stop the core process; idempotent. Open streams end with EngineDeadError."""
        self._shut_down = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        if self._starting is not None:
            self._starting.shutdown()  # its wait_ready() then fails at once, ending the restart's thread
        if self._output_task is not None and not self._output_task.get_loop().is_closed():
            self._output_task.get_loop().remove_reader(self.core.proc.sentinel)
            self._fail("the engine was shut down", expected=True)
        self.core.shutdown()
