"""The package logger: INFO lines on stderr unless the application configured `tokenmill` itself."""

from __future__ import annotations

import logging
import os


def configure_package_logger() -> None:
    logger = logging.getLogger("tokenmill")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    # TOKENMILL_LOGGING_LEVEL: debug aid only; it changes what is printed, never behaviour.
    logger.setLevel(os.environ.get("TOKENMILL_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False
