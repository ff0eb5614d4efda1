"""tokenmill: a high-throughput LLM inference and serving engine."""

from tokenmill.logger import configure_package_logger

configure_package_logger()

from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine.llm import LLM  # noqa: E402
from tokenmill.outputs import CompletionOutput, RequestOutput  # noqa: E402
from tokenmill.sampling_params import BeamSearchParams, SamplingParams  # noqa: E402

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "BeamSearchParams", "EngineConfig", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # AsyncEngine needs the server extras (pyzmq, msgspec): imported on first use, so `import tokenmill` never does.
    if name == "AsyncEngine":
        from tokenmill.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
