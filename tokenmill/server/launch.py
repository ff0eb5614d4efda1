"""`tokenmill serve`: start the engine core, then serve the app with uvicorn until SIGINT/SIGTERM.

Shutdown order: uvicorn stops accepting and gives open requests a short grace period, the app's
lifespan stops the engine core (SIGTERM, then SIGKILL), and the process exits. The core also
exits by itself if this process dies without that chance.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn
from prometheus_client import CollectorRegistry

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.api_server import build_app
from tokenmill.server.metrics import PrometheusStatLogger
from tokenmill.server.state import ServerState

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 3


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def run_server(engine_config: EngineConfig, server_config: ServerConfig, model_name: str) -> None:
    # Until uvicorn takes the signals over, SIGTERM unwinds like Ctrl-C: the core is stopped on the way out.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    registry = CollectorRegistry()
    engine = AsyncEngine(engine_config, stat_logger=PrometheusStatLogger(model_name, registry))
    try:
        state = ServerState(engine, server_config, model_name, engine_config.scheduler_config.max_num_seqs)
        app = build_app(state, registry)
        config = uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level=server_config.uvicorn_log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = uvicorn.Server(config)
        # uvicorn re-raises the signal that stopped it once it is done; make that a no-op so the
        # cleanup below runs and the exit status is 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        logger.info("serving %s on http://%s:%d", model_name, server_config.host, server_config.port)
        asyncio.run(server.serve())
    finally:
        engine.shutdown()
