"""AsyncEngine: the server's engine. Tokenization and detokenization stay in this (the frontend)
process; the EngineCore runs in its own process (core_proc.py) and exchanges messages over ZMQ.

    engine = AsyncEngine(config)            # starts the core process, waits until it is ready
    await engine.start()                    # inside the event loop that serves requests
    async for output in engine.add_request("id", "Hello", SamplingParams()):
        ...                                 # DELTA outputs, the last one finished

Leaving the iteration early (a client disconnecting, a cancelled task) aborts the request in the
core, which frees its KV blocks.
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
    """The engine-core process is gone; no request can be served any more."""


class StatLogger(Protocol):
    def record(self, outputs: list[RequestOutput], stats: SchedulerStats | None) -> None:
        """Called with every batch of outputs delivered and the scheduler stats that came with it."""


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
        self._streams: dict[str, asyncio.Queue] = {}
        self._output_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Begin receiving the core's outputs and watching its process; call once, in the serving loop."""
        self.core.open_output()
        self._output_task = asyncio.create_task(self._output_loop(), name="engine-outputs")
        # The sentinel becomes readable when the process exits: no polling, no thread.
        asyncio.get_running_loop().add_reader(self.core.proc.sentinel, self._on_core_exit)

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
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        for request in requests:
            self.core.add_request(request)
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

    async def _output_loop(self) -> None:
        try:
            while True:
                core_outputs = await self.core.get_outputs()
                outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs)
                # Stop strings are found here, after detokenization: the core must drop those samples.
                self.core.abort_requests(stopped)
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
            self._fail(f"the engine's output processing failed: {e!r}")

    def _record(self, outputs: list[RequestOutput], stats: SchedulerStats | None) -> None:
        if self.stat_logger is not None and (outputs or stats is not None):
            try:
                self.stat_logger.record(outputs, stats)
            except Exception:  # metrics must never break serving
                logger.exception("stat logger failed")

    def _on_core_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.core.proc.sentinel)
        self.core.proc.join()
        self._fail(f"the engine core process exited (exit code {self.core.proc.exitcode})")

    def _fail(self, reason: str, expected: bool = False) -> None:
        """Mark the engine dead and end every open stream with EngineDeadError."""
        if self.dead_reason is None:
            (logger.info if expected else logger.error)("engine stopped: %s", reason)
            self.dead_reason = reason
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError(reason))
        self._streams.clear()
        if self._output_task is not None and not self._output_task.done():
            self._output_task.cancel()

    def shutdown(self) -> None:
        """Stop the core process; idempotent. Open streams end with EngineDeadError."""
        if self._output_task is not None and not self._output_task.get_loop().is_closed():
            self._output_task.get_loop().remove_reader(self.core.proc.sentinel)
            self._fail("the engine was shut down", expected=True)
        self.core.shutdown()
