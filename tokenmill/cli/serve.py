"""`tokenmill serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenmill.cli.args import (
    add_dataclass_args,
    add_engine_args,
    api_key_or_env,
    engine_config_from_args,
    field_docs,
    given_fields,
    json_object_flag,
)
from tokenmill.config import EngineConfig, ParallelConfig, ReasoningConfig, check_model_path
from tokenmill.server.config import ServerConfig

if TYPE_CHECKING:
    from tokenmill.engine.core_client import CoreProcessClient

PROFILER_DIR_ENV = "TOKENMILL_TORCH_PROFILER_DIR"
"""Where `serve` finds the profiler folder when --profiler-dir is not given (vLLM's VLLM_TORCH_PROFILER_DIR)."""

SERVE_TARGET_STEP_MS = 20.0
"""The server's default SchedulerConfig.target_step_ms: streamed tokens come at most ~20 ms apart while prompts
arrive (on an H200, Llama-3.1-8B at 16 requests a second: inter-token p99 21 ms, against 34 with 8,192 tokens a
step). Offline generation keeps the fixed budget, whose longer steps give more throughput."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...).",
    )
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="Flags from a YAML file, as vLLM's: each key a flag's long name (e.g. max-model-len: "
                             "4096; model: the MODEL argument); flags given on the command line win")
    add_engine_args(parser, model_positional=True)
    server = parser.add_argument_group("server")
    add_dataclass_args(server, ServerConfig)
    server.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                        default=argparse.SUPPRESS, help="vLLM's older spelling of --no-enable-log-requests")
    # Dict-typed fields, which add_dataclass_args leaves out: JSON objects, as vLLM spells them.
    for name, example in (("override_generation_config", '{"temperature": 0.5}'),
                          ("default_chat_template_kwargs", '{"enable_thinking": false}')):
        flag = "--" + name.replace("_", "-")
        server.add_argument(flag, dest=name, type=json_object(flag, example), default=argparse.SUPPRESS,
                            metavar="JSON", help=field_docs(ServerConfig)[name].replace("%", "%%"))
    parser.set_defaults(handler=run)


def json_object(flag: str, example: str) -> Callable[[str], dict]:
    def parse(text: str) -> dict:
        try:
            return json_object_flag(text, flag, example)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def served_model_names(args: argparse.Namespace, model_path: str) -> list[str]:
    if getattr(args, "served_model_name", None):
        return args.served_model_name  # a list: the flag takes several names, as vLLM's does
    if args.model is not None:
        return [args.model]
    return [os.path.basename(model_path).removesuffix(".gguf")]


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The flags given, and the environment's API key and profiler folder for those not given."""
    server_kwargs = given_fields(args, ServerConfig)
    server_kwargs.setdefault("api_key", api_key_or_env(None))
    server_kwargs.setdefault("profiler_dir", os.environ.get(PROFILER_DIR_ENV) or None)
    return ServerConfig(**server_kwargs)


def serving_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The flags' engine config, with the server's own default: steps bounded in time (SERVE_TARGET_STEP_MS)
    unless a token budget or another step time was given."""
    if not hasattr(args, "max_num_batched_tokens") and not hasattr(args, "target_step_ms"):
        args.target_step_ms = SERVE_TARGET_STEP_MS
    return engine_config_from_args(args)


def with_reasoning_markers(engine_config: EngineConfig, server_config: ServerConfig) -> EngineConfig:
    """The engine's reasoning_config from --reasoning-parser's markers where --reasoning-config gave none: what a
    request's thinking_token_budget counts between."""
    if server_config.reasoning_parser is None or engine_config.reasoning_config.has_markers:
        return engine_config
    return engine_config.with_parts(reasoning_config=ReasoningConfig.of_parser(server_config.reasoning_parser))


def run(args: argparse.Namespace) -> int:
    parallel = ParallelConfig(**given_fields(args, ParallelConfig))
    if parallel.is_headless:
        # Another node of --nnodes: only its ranks; node 0 sends them the model and the configuration.
        from tokenmill.executor.headless import run_headless_node

        return run_headless_node(parallel)
    from tokenmill.server.startup import claim_listen_address

    server_config = server_config_from_args(args)
    # Before the default model is resolved, which may mean downloading it; held until uvicorn listens on it.
    listen_socket = claim_listen_address(server_config.host, server_config.port, server_config.uds)
    try:
        engine_config = with_reasoning_markers(serving_engine_config(args), server_config)
        check_model_path(engine_config.model_config.model)  # at once, not after the core's start and the imports
        # Until uvicorn takes the signals over, SIGTERM unwinds like Ctrl-C (cli.main): the core started below stops.
        core = start_core_ahead(engine_config)
        try:
            from tokenmill.server.launch import run_server  # the server's dependencies load while the core starts

            run_server(engine_config, server_config, served_model_names(args, engine_config.model_config.model),
                       core, listen_socket)
        finally:
            if core is not None:
                core.shutdown()  # a no-op once the engine has shut it down
    finally:
        if listen_socket is not None:
            listen_socket.close()
    return 0


def start_core_ahead(engine_config: EngineConfig) -> CoreProcessClient | None:
    """One replica's engine core, started before the server's imports (torch, transformers, fastapi: seconds),
    which then run beside the core's own imports and model load; None with several replicas (the engine starts
    those, after reading the model's config)."""
    if engine_config.parallel_config.data_parallel_size != 1:
        return None
    from tokenmill.engine.core_client import CoreProcessClient

    return CoreProcessClient(engine_config)
