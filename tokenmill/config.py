"""Engine configuration: frozen dataclasses, one per concern, built once from user arguments.

Values discovered at run time (number of KV blocks, EOS ids) are never written back here; they
travel as their own objects (`KVCacheSpec`, `TokenizerInfo`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """Path to a Hugging Face model folder or a .gguf file."""
    tokenizer: str | None = None
    """Tokenizer folder; defaults to the model path (or the GGUF file's embedded tokenizer)."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16. auto: float32 on CPU, the checkpoint's 16-bit type on GPU."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; defaults to the model's max_position_embeddings."""
    load_format: str = "auto"
    """auto (safetensors or GGUF by path) | safetensors | gguf | dummy (random weights)."""
    seed: int = 0
    """Seed for dummy weights and for unseeded sampling."""
    trust_remote_code: bool = False
    """Passed to transformers when reading configs and tokenizers."""
    chat_template: str | None = None
    """Path to a Jinja chat template overriding the model's own."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer: prompts must be token ids and outputs carry no text."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV-cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights + activations + KV pool)."""
    kv_cache_space: float | None = None
    """KV pool size in GiB; the only sizing input on CPU (default 4 GiB), an override on GPU."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks; for tests that need a tiny pool."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int = 8192
    """Token budget of one forward pass (decodes + prefill chunks)."""
    policy: str = "fcfs"
    """fcfs | priority (lower `priority` value runs first, as in vLLM)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while the device runs step N (None: on for CUDA, off for the CPU, where the
    same cores would do both)."""


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"
    """auto | cuda | cpu."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    attention_backend: str | None = None
    """Attention implementation; None picks the platform default."""


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Route vLLM-style flat engine arguments to the sub-config that owns each one."""
        parts: dict[str, dict[str, Any]] = {}
        owners = {
            "model_config": ModelConfig,
            "cache_config": CacheConfig,
            "scheduler_config": SchedulerConfig,
            "device_config": DeviceConfig,
        }
        for key, value in kwargs.items():
            for part, klass in owners.items():
                if key in {f.name for f in dataclasses.fields(klass)}:
                    parts.setdefault(part, {})[key] = value
                    break
            else:
                raise TypeError(f"unknown engine argument {key!r}")
        built = {part: klass(**parts.get(part, {})) for part, klass in owners.items() if part != "model_config"}
        return cls(model_config=ModelConfig(model=model, **parts.get("model_config", {})), **built)

    def __post_init__(self) -> None:
        cache, sched = self.cache_config, self.scheduler_config
        if cache.block_size <= 0 or cache.block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {cache.block_size}")
        if not 0.0 < cache.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {cache.gpu_memory_utilization}")
        if sched.max_num_seqs <= 0 or sched.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if sched.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {sched.policy!r}")
        if self.model_config.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float"):
            raise ValueError(f"unsupported dtype {self.model_config.dtype!r}")
        if self.model_config.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"unsupported load_format {self.model_config.load_format!r}")


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server around an engine (`tokenmill serve`)."""

    host: str = "127.0.0.1"
    """Address to listen on; loopback by default, so nothing is exposed by accident."""
    port: int = 8000
    """TCP port to listen on."""
    api_key: str | None = None
    """Bearer key every route but /health and /version requires (default: $TOKENMILL_API_KEY)."""
    served_model_name: str | None = None
    """The model name clients pass and responses carry; defaults to the model argument."""
    max_waiting_requests: int = 1024
    """Answer 503 (with Retry-After) to requests that would make more than this many sequences wait,
    rather than queue without bound; -1: no limit."""
    max_request_body_bytes: int = 16 * 1024 * 1024
    """Larger request bodies are refused with 413."""
    metrics_no_auth: bool = False
    """Serve /metrics without the API key (for scrapers that cannot send one)."""
    uvicorn_log_level: str = "info"
    """Log level of the HTTP server: critical | error | warning | info | debug | trace."""
    trust_request_chat_template: bool = False
    """Render chat templates sent in requests (`chat_template`); otherwise they are refused with 400. For
    trusted clients only: transformers' sandboxed Jinja keeps a template from the system, not from
    taking unbounded time or memory."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_waiting_requests < -1:
            raise ValueError(f"max_waiting_requests must be non-negative or -1, got {self.max_waiting_requests}")
        if self.max_request_body_bytes <= 0:
            raise ValueError(f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}")
