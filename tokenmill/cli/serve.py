"""`tokenmill serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os

from tokenmill.cli.args import (
    add_dataclass_args,
    add_engine_args,
    api_key_or_env,
    engine_config_from_args,
    given_fields,
)
from tokenmill.config import ServerConfig


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...).",
    )
    add_engine_args(parser, model_positional=True)
    add_dataclass_args(parser.add_argument_group("server"), ServerConfig)
    parser.set_defaults(handler=run)


def served_model_name(args: argparse.Namespace, model_path: str) -> str:
    if getattr(args, "served_model_name", None):
        return args.served_model_name
    if args.model is not None:
        return args.model
    return os.path.basename(model_path).removesuffix(".gguf")


def run(args: argparse.Namespace) -> int:
    from tokenmill.server.launch import check_port_free, run_server  # the server's dependencies load only here

    server_kwargs = given_fields(args, ServerConfig)
    server_kwargs.setdefault("api_key", api_key_or_env(None))
    server_config = ServerConfig(**server_kwargs)
    # Before the default model is resolved, which may mean downloading it (run_server checks again).
    check_port_free(server_config.host, server_config.port)
    engine_config = engine_config_from_args(args)
    run_server(engine_config, server_config, served_model_name(args, engine_config.model_config.model))
    return 0
