"""Server-sent events, merging several output streams, and aborting work whose client went away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """A stream that stops (closing its generator, which aborts the engine requests) as soon as the
    client disconnects, rather than at the next write as Starlette does for ASGI spec >= 2.4."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        disconnect = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, disconnect):
                task.cancel()
            await asyncio.gather(stream, disconnect, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[union-attr]
        if stream.done() and not stream.cancelled() and (error := stream.exception()) is not None:
            if not isinstance(error, OSError):  # a write to a closed socket is a disconnect too
                raise error


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Decided by the watcher: how cancelled work ends depends on its kind (a gather() future ends
        # with a CancelledError exception rather than cancelled()).
        disconnected = watcher.done()
        for future in (task, watcher):
            future.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if disconnected:
        raise ClientDisconnected()
    return task.result()


async def merge_streams(streams: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with their stream's index."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as e:
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
