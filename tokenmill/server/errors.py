"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, for every failure path."""

from __future__ import annotations

import logging
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.request import NO_TOKEN_LEFT, FinishReason

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}
MAX_ERRORS_DESCRIBED = 5
"""A list of a million bad token ids is one error message of reasonable size."""


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(
    status: int, message: str, code: str | None = None, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


def choice_failed(choices) -> dict | None:
    """The error of a request one of whose choices (anything with finish_reason and stop_reason) ended with
    finish_reason "error", found only once it ran; None if none did. No token was left to sample (its own bans and
    its grammar excluded every token), or what its stop_reason says (a grammar that did not compile in the engine).
    A full response is then this 400; a stream sends it as its last event."""
    for choice in choices:
        if choice.finish_reason == FinishReason.ERROR.value:
            if isinstance(choice.stop_reason, str):
                return error_body(400, choice.stop_reason, code="structured_outputs_failed")
            return error_body(400, NO_TOKEN_LEFT, code="no_token_left")
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI clients expect 400 for a malformed body.
        errors = exc.errors()
        first = errors[0] if errors else {}
        # A body that is no JSON has no field at fault: its loc holds the character position, no param.
        loc = [] if first.get("type") == "json_invalid" else [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(_describe(e) for e in errors[:MAX_ERRORS_DESCRIBED]) or "invalid request"
        if len(errors) > MAX_ERRORS_DESCRIBED:
            message += f"; and {len(errors) - MAX_ERRORS_DESCRIBED} more errors"
        # An error of the whole body (a model validator's) may name its field in its context.
        param = ".".join(loc) or (first.get("ctx") or {}).get("param")
        return error_response(400, message, code=first.get("type"), param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's "error parsing the body": say which
            message = _unparsable_body(exc.__cause__) or message
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, f"the engine is not running: {exc}", code="engine_dead")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal server error: {exc!r}", code="internal_error")


def _unparsable_body(cause: BaseException) -> str | None:
    """What made a body unreadable, where FastAPI says only that it could not parse it."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid UTF-8: byte 0x{cause.object[cause.start]:02x} at position {cause.start}"
    if isinstance(cause, RecursionError):
        return "the body's JSON nests too deeply"
    if isinstance(cause, ValueError):  # not a JSONDecodeError (FastAPI's json_invalid): Python's limit on digits
        return f"the body's JSON holds an integer of more than {sys.get_int_max_str_digits()} digits"
    return None


def _describe(error: dict) -> str:
    if error.get("type") == "json_invalid":
        position = "".join(f" at position {part}" for part in error.get("loc", ())[1:2])
        return f"the body is not valid JSON{position}: {error.get('ctx', {}).get('error', 'decode error')}"
    loc = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
    return f"{loc}: {error.get('msg')}" if loc else str(error.get("msg"))
