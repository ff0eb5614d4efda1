"""`tokenmill serve`: start the engine core, then serve the app with uvicorn until SIGINT/SIGTERM.

Shutdown order: uvicorn stops accepting and gives open requests a short grace period, the app's
lifespan stops the engine core (SIGTERM, then SIGKILL), and the process exits. The core also
exits by itself if this process dies without that chance.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvicorn
from prometheus_client import CollectorRegistry

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.core_client import CoreProcessClient
from tokenmill.engine.generation_config import sampling_defaults
from tokenmill.server.api_server import build_app
from tokenmill.server.config import ServerConfig
from tokenmill.server.metrics import PrometheusStatLogger
from tokenmill.server.profiling import prepare_profiler_dir
from tokenmill.server.startup import claim_listen_address
from tokenmill.server.state import ServerState
from tokenmill.server.stats_log import LoggingStatLogger, StatLoggers, log_stats_interval

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 10
GRACEFUL_SHUTDOWN_S = 3
ENDED_BEFORE_CANCEL_S = 0.5
"""How long before the grace period's end the requests still running are ended with a 503: time for their handlers
to answer, before uvicorn cancels them (a cancelled task's answer is a plain-text 500)."""


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose requests still running near the end of the shutdown's grace period get the OpenAI-format
    503 ("the server is shutting down": streams end with that error event) rather than uvicorn's plain-text 500."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None) -> None:
        delay = max(0.0, self.config.timeout_graceful_shutdown - ENDED_BEFORE_CANCEL_S)
        ending = asyncio.get_running_loop().call_later(delay, self.engine.end_all_requests,
                                                         "the server is shutting down")
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()


def run_server(engine_config: EngineConfig, server_config: ServerConfig, model_names: list[str],
               started_core: CoreProcessClient | None = None, listen_socket: socket.socket | None = None) -> None:
    """`started_core`: the engine core, already started with `engine_config` (one replica), which the engine adopts;
    `listen_socket`: the TCP port, bound already (startup.claim_listen_address), where uvicorn listens."""
    if listen_socket is None:
        listen_socket = claim_listen_address(server_config.host, server_config.port, server_config.uds)
    if server_config.profiler_dir is not None:
        prepare_profiler_dir(server_config.profiler_dir)
    num_engines = engine_config.parallel_config.data_parallel_size
    stats_log = None if server_config.disable_log_stats else LoggingStatLogger(num_engines, log_stats_interval())
    registry = CollectorRegistry()
    speculative = engine_config.speculative_config
    model_name, *also_served_as = model_names
    stat_logger = PrometheusStatLogger(model_name, registry,
                                       None if speculative is None else speculative.num_speculative_tokens,
                                       num_engines=num_engines)
    engine = AsyncEngine(engine_config, stat_logger=stat_logger if stats_log is None
                         else StatLoggers(stat_logger, stats_log), started_core=started_core)
    try:
        # Every data-parallel replica runs max_num_seqs sequences.
        max_num_seqs = engine_config.scheduler_config.max_num_seqs * engine_config.parallel_config.data_parallel_size
        defaults = sampling_defaults(server_config.generation_config, engine_config.model_config.model,
                                     server_config.override_generation_config)
        state = ServerState(engine, server_config, model_name, max_num_seqs, tuple(also_served_as), defaults)
        app = build_app(state, registry, stats_log)
        config = uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level=server_config.uvicorn_log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            # Longer than httpx's (the openai client's) 5 s pool expiry: with equal timeouts a client may send a
            # request on a connection the server is closing at that moment, and the request fails.
            timeout_keep_alive=KEEP_ALIVE_S,
            uds=server_config.uds,
            ssl_keyfile=server_config.ssl_keyfile,
            ssl_certfile=server_config.ssl_certfile,
            ssl_ca_certs=server_config.ssl_ca_certs,
            ssl_cert_reqs=server_config.ssl_cert_reqs,
        )
        server = GracefulServer(config, engine)
        # uvicorn re-raises the signal that stopped it once it is done; make that a no-op so the
        # cleanup below runs and the exit status is 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        logger.info("serving %s on %s", model_name, listen_address(server_config))
        # On uvloop with httptools when installed (uvicorn picks them), else asyncio and h11.
        server.run(sockets=None if listen_socket is None else [listen_socket])
    finally:
        engine.shutdown()


def listen_address(config: ServerConfig) -> str:
    scheme = "https" if config.ssl_certfile is not None else "http"
    if config.uds is not None:
        return f"{scheme} over the Unix socket {config.uds}"
    return f"{scheme}://{config.host}:{config.port}"
