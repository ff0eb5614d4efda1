"""The failures a user can fix (no server, a refused key, an unknown model, a bad flag, a missing model
path, a taken port), as the one or two lines `tokenmill` prints instead of a traceback. Anything else
is a bug and keeps its traceback."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from tokenmill.cli.args import API_KEY_ENV


def _loaded(module: str, name: str) -> type | tuple[()]:
    """The class `module.name` if that module was imported, else () (which no error is an instance of): an
    error of a module never imported cannot have been raised, and importing openai or uvicorn only to test
    for their errors would slow every failure down."""
    found = sys.modules.get(module)
    return getattr(found, name) if found is not None else ()


def _causes(error: BaseException) -> list[BaseException]:
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _connection_reason(error: BaseException) -> str:
    """'connection refused', 'name or service not known', ...: the innermost OS error of the chain."""
    for cause in reversed(_causes(error)):
        if isinstance(cause, socket.gaierror) and cause.strerror:
            return cause.strerror.lower()
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno).lower()
    return str(error).rstrip(".").lower() or type(error).__name__


def _unreachable_server(error: BaseException, args: argparse.Namespace) -> str | None:
    if not isinstance(error, (_loaded("openai", "APIConnectionError"), _loaded("httpx", "TransportError"))):
        return None
    try:
        url = error.request.url
    except RuntimeError:  # an httpx error raised outside any request: not a server that is down
        return None
    return (f"cannot reach the server at {url.scheme}://{url.netloc.decode()}: {_connection_reason(error)}. "
            f"Start one with `tokenmill serve`, or pass {getattr(args, 'url_flag', '--url')}.")


def _server_error(response) -> dict:
    """The OpenAI-shaped error body tokenmill's server (and vLLM's) sends; {} from other servers or proxies."""
    try:
        body = response.json()
    except Exception:  # a body that is not JSON, or a stream never read
        return {}
    if not isinstance(body, dict):
        return {}
    return body["error"] if isinstance(body.get("error"), dict) else body  # older vLLM: the fields at the top


def _refused_request(error: BaseException, args: argparse.Namespace) -> str | None:
    if not isinstance(error, (_loaded("openai", "APIStatusError"), _loaded("httpx", "HTTPStatusError"))):
        return None
    response = error.response
    if response.status_code == 401:
        return f"the server refused the API key (401): pass --api-key or set {API_KEY_ENV}"
    server_error = _server_error(response)
    message = f"the server answered {response.status_code}: {server_error.get('message') or response.reason_phrase}"
    if server_error.get("code") == "model_not_found":
        message += f"; pass a name it serves with {getattr(args, 'model_flag', '--model')}"
    elif not server_error.get("code") and response.status_code in (404, 405):
        # No error code (tokenmill's own servers say 'Not Found' with none, vLLM's no OpenAI error at all): a route
        # the server does not have (another kind of server, or a URL without /v1).
        message += (f" for {response.request.url}, which is no OpenAI-compatible route; pass the server's "
                    f"address with {getattr(args, 'url_flag', '--url')}")
    return message


def _failed_startup(error: BaseException, args: argparse.Namespace) -> str | None:
    if isinstance(error, _loaded("tokenmill.engine.core_client", "EngineCoreStartError")):
        # The message ends with the engine process's traceback, whose last line is the error itself.
        return f"the engine failed to start: {str(error).strip().splitlines()[-1]}"
    # Errors whose own message already says what is wrong: bad engine arguments (ValueError), a model
    # path that does not exist, a taken port, a failed download of the default model.
    user_errors = (ValueError, FileNotFoundError, _loaded("tokenmill.server.startup", "CannotListenError"),
                   _loaded("tokenmill.default_model", "DownloadError"))
    return str(error) if isinstance(error, user_errors) else None


def user_message(error: BaseException, args: argparse.Namespace) -> str | None:
    """What to print (after 'error: ') for a failure the user can fix; None for a bug."""
    for describe in (_unreachable_server, _refused_request, _failed_startup):
        if (message := describe(error, args)) is not None:
            return message
    return None
