"""tokenmill: a high-throughput LLM inference and serving engine."""

from tokenmill.config import EngineConfig
from tokenmill.logger import configure_package_logger
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams

configure_package_logger()

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "BeamSearchParams", "EngineConfig", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use, so that `import tokenmill.<module>` (a kernel module in a compile process, the CLI)
    # does not load the engine and transformers: LLM pulls in the whole engine, AsyncEngine also the server
    # extras (pyzmq, msgspec).
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from tokenmill.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
