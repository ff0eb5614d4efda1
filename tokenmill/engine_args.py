"""vLLM's engine arguments that have no config field of their own here: each is mapped onto tokenmill's setting of
the same effect, accepted as the no-op it is here (with a warning where the user may expect an effect), or refused
in a line that names it. EngineConfig.from_kwargs runs these first, so `tokenmill serve` flags and `LLM(**kwargs)`
behave alike."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

GiB = 1 << 30

COMPILATION_MODES = {"NONE": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_TRACE_ONCE": 2, "VLLM_COMPILE": 3, "PIECEWISE": 3}
"""vLLM's compilation modes (and the older levels' names) by number."""

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

NO_OPS = {
    "disable_custom_all_reduce": "tokenmill's all-reduce is torch.distributed's (NCCL or gloo) always",
    "disable_cascade_attn": "tokenmill has no cascade attention",
}
"""vLLM switches that turn off something tokenmill does not have: accepted, with no effect."""

HUB_ARGS = ("revision", "tokenizer_revision", "code_revision", "download_dir")
"""Hugging Face Hub arguments: tokenmill loads local folders and files only, for which they mean nothing."""

DEFAULT_ONLY = {
    "max_num_partial_prefills": (1, "prompts are prefilled within each step's token budget, a chunk per prompt of "
                                    "at most --long-prefill-token-threshold where given (vLLM's v1 engine refuses "
                                    "it too)"),
    "max_long_partial_prefills": (1, "prompts are prefilled within each step's token budget, a chunk per prompt of "
                                     "at most --long-prefill-token-threshold where given (vLLM's v1 engine refuses "
                                     "it too)"),
    "calculate_kv_scales": (False, "fp8 KV caches take the checkpoint's k_scale/v_scale (1.0 without them); for "
                                   "scales computed from the data, use --kv-cache-dtype int8 (a scale per token and "
                                   "KV head, computed as each token is written)"),
    "safetensors_load_strategy": ("lazy", "safetensors files are memory-mapped and read tensor by tensor, vLLM's "
                                          "'lazy'"),
    "tokenizer_mode": ("auto", "the tokenizer is transformers' AutoTokenizer, which in transformers 5 is the fast "
                               "one always (it ignores use_fast=False)"),
}
"""vLLM arguments accepted at the value that describes what tokenmill does; another value is refused with why."""

PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor")
"""What tokenmill's block hashes are: SHA-256 over a fixed little-endian encoding of the token ids (not pickle),
so reproducible across processes and runs as vLLM's sha256_cbor is; vLLM's xxhash variants are refused."""


def vllm_engine_kwargs(model: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with vLLM's arguments above replaced by tokenmill's (ValueError for a value with no counterpart)."""
    kwargs = dict(kwargs)
    _kv_cache_memory(kwargs)
    _reasoning_parser(kwargs)
    _compilation(kwargs)
    for name, why in NO_OPS.items():
        value = kwargs.pop(name, False)
        if type(value) is not bool:
            raise ValueError(f"{name} must be true or false, got {value!r}")
        if value:
            logger.info("%s: nothing to disable (%s)", name, why)
    for name in HUB_ARGS:
        value = kwargs.pop(name, None)
        if value is not None:
            where = "" if os.path.exists(model) else f"; {model!r} is not a local path either"
            logger.warning("%s=%r is ignored: tokenmill loads local folders and files only, not the Hugging Face "
                           "Hub%s", name, value, where)
    if kwargs.pop("swap_space", None) is not None:
        logger.warning("swap_space is ignored: preempted requests are recomputed, never swapped to the CPU (as in "
                       "vLLM's v1 engine)")
    for name, (default, why) in DEFAULT_ONLY.items():
        if name in kwargs and kwargs.pop(name) not in (default, None):
            raise ValueError(f"{name} other than {default!r} is not supported: {why}")
    algo = kwargs.pop("prefix_caching_hash_algo", "sha256")
    if algo not in PREFIX_CACHING_HASH_ALGOS:
        raise ValueError(f"prefix_caching_hash_algo {algo!r} is not supported; choose one of "
                         f"{', '.join(PREFIX_CACHING_HASH_ALGOS)} (tokenmill's block hashes are SHA-256 of a fixed "
                         f"encoding of the tokens)")
    return kwargs


def _reasoning_parser(kwargs: dict[str, Any]) -> None:
    """vLLM's reasoning_parser engine argument (offline, `LLM(..., reasoning_parser="qwen3")`): its markers as the
    reasoning_config's, what a thinking_token_budget counts between, unless reasoning_config gives them. (Splitting
    reasoning_content off is the server's: `tokenmill serve --reasoning-parser NAME`.)"""
    name = kwargs.pop("reasoning_parser", None)
    if not name:
        return
    from tokenmill.config import ReasoningConfig

    markers = ReasoningConfig.of_parser(name)  # an unknown parser is refused even where reasoning_config is given
    if not ReasoningConfig.from_dict(kwargs.get("reasoning_config")).has_markers:
        kwargs["reasoning_config"] = markers


def _kv_cache_memory(kwargs: dict[str, Any]) -> None:
    """vLLM's kv_cache_memory_bytes: the KV pool's size per device, in place of gpu_memory_utilization's sizing:
    tokenmill's kv_cache_space (GiB), which does the same on the GPU and is the only sizing on the CPU."""
    size = kwargs.pop("kv_cache_memory_bytes", None)
    if size is None:
        return
    if type(size) is not int or size <= 0:
        raise ValueError(f"kv_cache_memory_bytes must be a positive number of bytes, got {size!r}")
    if kwargs.get("kv_cache_space") is not None:
        raise ValueError("kv_cache_memory_bytes and kv_cache_space both size the KV pool: give one")
    kwargs["kv_cache_space"] = size / GiB


def _compilation(kwargs: dict[str, Any]) -> None:
    """vLLM's compilation_config, -O (optimization_level) and cuda_graph_sizes, onto tokenmill's CUDA-graph
    settings: enforce_eager (no graphs) and max_cudagraph_capture_size (the largest step with prefills that replays
    a graph; decode-only steps replay theirs up to max_num_seqs). tokenmill never torch.compiles the model (its
    kernels are its own Triton kernels): vLLM's VLLM_COMPILE mode is what it does, the other compiling modes have
    no counterpart."""
    level = kwargs.pop("optimization_level", None)
    config = kwargs.pop("compilation_config", None)
    sizes = kwargs.pop("cuda_graph_sizes", None)
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            config = config.strip()
    if isinstance(config, int) or (isinstance(config, str) and config.isdigit()):
        config = {"mode": int(config)}
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"compilation_config must be a mode (0-3) or a dict of its keys, got {config!r}")
    config = dict(config or {})
    unknown = sorted(set(config) - {"level", "mode", "cudagraph_mode", "cudagraph_capture_sizes",
                                    "max_cudagraph_capture_size"})
    if unknown:
        raise ValueError(f"compilation_config keys {unknown} have no counterpart in tokenmill (it takes level/mode, "
                         f"cudagraph_mode, cudagraph_capture_sizes and max_cudagraph_capture_size)")
    if level is not None:
        if str(level) not in ("0", "1", "2", "3"):
            raise ValueError(f"optimization_level (-O) must be 0, 1, 2 or 3, got {level!r}")
        if int(level) == 0:  # vLLM's -O0: no compilation, no CUDA graphs, start at once
            config.setdefault("mode", 0)
    eager = _eager_by_mode(config)
    graph_mode = config.get("cudagraph_mode")
    if graph_mode is not None:
        graph_mode = str(graph_mode).upper()
        if graph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"compilation_config cudagraph_mode {config['cudagraph_mode']!r} is not one of "
                             f"{', '.join(CUDAGRAPH_MODES)}")
        eager = graph_mode == "NONE"
        if graph_mode == "FULL_DECODE_ONLY":
            _set(kwargs, "max_cudagraph_capture_size", 0, "cudagraph_mode FULL_DECODE_ONLY")
    if eager:
        _set(kwargs, "enforce_eager", True, "compilation_config")
    largest = _largest_size(config, sizes)
    if largest is not None:
        _set(kwargs, "max_cudagraph_capture_size", largest, "the CUDA graph sizes")


def _eager_by_mode(config: dict[str, Any]) -> bool:
    if "level" in config and "mode" in config and config["level"] != config["mode"]:
        raise ValueError("compilation_config: give mode or its older name level, not both")
    mode = config.get("mode", config.get("level"))
    if mode is None:
        return False
    number = COMPILATION_MODES.get(str(mode).upper(), mode)
    if number not in (0, 1, 2, 3):
        raise ValueError(f"compilation_config mode must be 0-3 or one of {', '.join(COMPILATION_MODES)}, got "
                         f"{mode!r}")
    if number in (1, 2):
        raise ValueError(f"compilation_config mode {mode!r} (torch.compile of the model) has no counterpart: "
                         f"tokenmill runs its own kernels; use 3 (the default: CUDA graphs) or 0 (eager)")
    # vLLM: without VLLM_COMPILE the CUDA graphs are off unless cudagraph_mode says otherwise.
    return number == 0


def _largest_size(config: dict[str, Any], sizes: Any) -> int | None:
    """The largest step to capture, from cudagraph_capture_sizes, max_cudagraph_capture_size or cuda_graph_sizes
    (vLLM's older flag: one value is the largest size, several are the sizes). tokenmill picks its own sizes up to
    it (powers of two, then multiples of 16 or 64)."""
    given = []
    for name, value in (("cudagraph_capture_sizes", config.get("cudagraph_capture_sizes")),
                        ("cuda_graph_sizes", sizes)):
        if value is None:
            continue
        values = [value] if isinstance(value, int) else value
        if not isinstance(values, (list, tuple)) or not values or not all(
                type(v) is int and v > 0 for v in values):
            raise ValueError(f"{name} must be a list of positive integers, got {value!r}")
        given.append(max(values))
    if config.get("max_cudagraph_capture_size") is not None:
        largest = config["max_cudagraph_capture_size"]
        if type(largest) is not int or largest < 0:
            raise ValueError(f"max_cudagraph_capture_size must be a non-negative integer, got {largest!r}")
        given.append(largest)
    if len(set(given)) > 1:
        raise ValueError(f"the CUDA graph sizes given disagree on the largest one ({sorted(set(given))})")
    return given[0] if given else None


def _set(kwargs: dict[str, Any], name: str, value: Any, source: str) -> None:
    if kwargs.get(name) is not None and kwargs[name] != value:
        raise ValueError(f"{name}={kwargs[name]!r} disagrees with {source} (which means {name}={value!r})")
    kwargs[name] = value
