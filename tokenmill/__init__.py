"""tokenmill: a high-throughput LLM inference and serving engine."""

from tokenmill.config import EngineConfig
from tokenmill.engine.llm import LLM
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
