"""ASGI middleware: API-key check, request-body size limit, request ids, the proxy's root path, the load count.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would buffer streamed responses and
hide client disconnects from the routes.
"""

from __future__ import annotations

import hmac
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import error_response

ALWAYS_OPEN_PATHS = frozenset({"/health", "/ping", "/version"})
"""Routes the API key never protects: liveness probes and version checks carry no data."""


def route_path(scope: Scope) -> str:
    """The path the routes see: without the root path (--root-path) when the request came with it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


class RootPathMiddleware:
    """Serves the app under a proxy's path prefix (--root-path), as FastAPI's root_path does: requests with the
    prefix (a proxy that forwards the whole path) and without it (one that strips it) reach the same routes, and
    /openapi.json gives the prefix as the server's URL."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""The routes whose requests --enable-server-load-tracking counts (those that take the engine's time)."""


class LoadTrackingMiddleware:
    """Counts the generation requests in flight (vLLM's server_load) into `state.server_load`: from when one passes
    the checks before it to its response's last byte, a stream's end included."""

    def __init__(self, app: ASGIApp, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        message = "missing API key" if not given else "invalid API key"
        response = error_response(
            401, f"{message}: send 'Authorization: Bearer <key>'", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


class RequestIdHeaderMiddleware:
    """Echoes a request's X-Request-Id in its response (or a fresh id when it had none), as vLLM's
    --enable-request-id-headers does."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodySizeLimitMiddleware:
    """Answers 413 for bodies past the limit without reading them: at once from Content-Length, and for
    chunked bodies as soon as the limit is passed. (uvicorn discards what the client still sends.)"""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit():  # the HTTP server ends the body where it says
            if int(declared) > self.max_bytes:
                return await self._too_large(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body was complete
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body_sent = False

        async def replay() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then only disconnect notices remain

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413, f"the request body exceeds the limit of {self.max_bytes} bytes", code="request_too_large"
        )
        await response(scope, receive, send)
