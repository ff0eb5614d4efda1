"""The FastAPI app: routes only. The work lives in serving_*.py; auth and limits in middleware.py."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

import tokenmill
from tokenmill.engine.heap_freeze import freeze_startup_heap
from tokenmill.server.errors import bad_request, error_response, install_error_handlers
from tokenmill.server.middleware import (
    ALWAYS_OPEN_PATHS,
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    LoadTrackingMiddleware,
    RequestIdHeaderMiddleware,
    RootPathMiddleware,
)
from tokenmill.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.server.openapi import openapi_spec
from tokenmill.server.profiling import start_profile, stop_profile
from tokenmill.server.responses_protocol import ResponsesRequest
from tokenmill.server.serving_chat import create_chat_completion, render_messages
from tokenmill.server.serving_completion import create_completion
from tokenmill.server.serving_responses import create_response
from tokenmill.server.state import ServerState
from tokenmill.server.stats_log import LoggingStatLogger
from tokenmill.server.streaming import ClientDisconnected

CLIENT_CLOSED_REQUEST = 499  # nginx's code; nobody reads it, the client is gone


def build_app(state: ServerState, registry: CollectorRegistry, stats_log: LoggingStatLogger | None = None) -> FastAPI:
    """`stats_log`: writes its periodic stats lines while the app runs (None: --disable-log-stats)."""
    engine = state.engine

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        freeze_startup_heap("server")
        stats_task = None if stats_log is None else asyncio.create_task(stats_log.run(), name="stats-log")
        yield
        if stats_task is not None:
            stats_task.cancel()
        state.tokenizer_executor.shutdown(wait=False, cancel_futures=True)
        state.long_text_executor.shutdown(wait=False, cancel_futures=True)
        state.grammar_checker.shutdown()
        engine.shutdown()

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan)
    install_error_handlers(app)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_spec(app, engine.input_processor.max_logprobs)
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            return error_response(503, f"the engine is not running: {engine.dead_reason}", code="engine_dead")
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (Amazon SageMaker's health check): /health's answer."""
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": tokenmill.__version__}

    @app.get("/load")
    async def load() -> dict:
        """vLLM's: the generation requests in flight (with --enable-server-load-tracking; else 0)."""
        return {"server_load": state.server_load}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "tokenmill",
                "root": engine.config.model_config.model, "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(name) for name in state.model_names]}

    @app.get("/v1/models/{model_id:path}")  # served names may hold slashes (paths, "org/model")
    async def model(model_id: str) -> dict:
        state.check_model(model_id)
        return model_card(model_id)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(state, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(state, req, raw)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request):
        return await create_response(state, req, raw)

    @app.api_route("/v1/responses/{response_id:path}", methods=["GET", "POST", "DELETE"])
    async def stored_response(response_id: str) -> Response:
        """Retrieve, cancel, delete and input_items: each needs a stored response."""
        return error_response(404, f"no response {response_id.split('/')[0]!r}: this server stores no responses "
                              "(every response is answered whole, or streamed, when it is created)",
                              code="response_not_found")

    @app.post("/invocations")
    async def invocations(raw: Request):
        """vLLM's (Amazon SageMaker's one route): a chat completion's body (it has messages) or a completion's."""
        try:
            body = await raw.json()
        except ValueError:
            raise bad_request("the body is not JSON") from None
        if not isinstance(body, dict) or ("messages" in body) == ("prompt" in body):
            raise bad_request("an /invocations body is a chat completion's (with messages) or a completion's (with "
                              "prompt)")
        kind = ChatCompletionRequest if "messages" in body else CompletionRequest
        try:
            req = kind.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        create = create_chat_completion if kind is ChatCompletionRequest else create_completion
        return await create(state, req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("pass exactly one of prompt and messages")
        if req.messages is not None:
            _, token_ids = await render_messages(state, req)
        elif engine.tokenizer is None:
            raise bad_request("this server was started without a tokenizer")
        else:
            token_ids = await state.tokenize(lambda tokenizer, text, **kwargs: tokenizer.encode(text, **kwargs),
                                             req.prompt, text_chars=len(req.prompt),
                                             add_special_tokens=req.add_special_tokens is not False)
        body = {"count": len(token_ids), "max_model_len": engine.max_model_len, "tokens": token_ids}
        if req.return_token_strs:
            body["token_strs"] = await state.off_loop(engine.tokenizer.convert_ids_to_tokens, token_ids)
        return JSONResponse(body)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        state.check_model(req.model)
        if engine.tokenizer is None:
            raise bad_request("this server was started without a tokenizer")
        vocab_size = engine.hf_config.vocab_size
        if any(not 0 <= t < vocab_size for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {vocab_size})", param="tokens")
        return JSONResponse({"prompt": await state.off_loop(engine.tokenizer.decode, req.tokens)})

    @app.post("/start_profile")
    async def start_profiler() -> dict:
        return await start_profile(state)

    @app.post("/stop_profile")
    async def stop_profiler() -> dict:
        return await stop_profile(state)

    if state.config.enable_server_load_tracking:  # innermost: requests refused on the way in are not counted
        app.add_middleware(LoadTrackingMiddleware, state=state)
    # Added last, so it runs first: a request without the key is refused before its body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=state.config.max_request_body_bytes)
    if state.config.api_key:
        open_paths = ALWAYS_OPEN_PATHS | ({"/metrics"} if state.config.metrics_no_auth else set())
        app.add_middleware(APIKeyMiddleware, api_key=state.config.api_key, open_paths=frozenset(open_paths))
    if state.config.enable_request_id_headers:  # outside the key check: refusals carry the id too
        app.add_middleware(RequestIdHeaderMiddleware)
    if state.config.allowed_origins:
        # Outermost: browsers' preflight OPTIONS carry no API key, and refusals need the CORS headers to be readable.
        app.add_middleware(CORSMiddleware, allow_origins=state.config.allowed_origins,
                           allow_methods=state.config.allowed_methods, allow_headers=state.config.allowed_headers,
                           allow_credentials=state.config.allow_credentials)
    if state.config.root_path:  # outermost: every layer within matches paths without it
        app.add_middleware(RootPathMiddleware, root_path=state.config.root_path)
    return app
