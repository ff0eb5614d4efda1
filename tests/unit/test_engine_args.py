"""vLLM's engine arguments that tokenmill takes, through `tokenmill serve` flags and `LLM(**kwargs)` alike: each is
honoured with vLLM's meaning, mapped onto tokenmill's own setting, or refused in a line that names it."""

from __future__ import annotations

import pytest

from tokenmill.cli import make_parser
from tokenmill.cli.args import engine_config_from_args
from tokenmill.config import EngineConfig
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.tokenizer import TokenizerInfo
from tokenmill.sampling_params import SamplingParams


def serve_config(*argv: str) -> EngineConfig:
    return engine_config_from_args(make_parser().parse_args(["serve", "m", *argv]))


def test_max_logprobs_and_logprobs_mode_are_flags_and_kwargs():
    config = serve_config("--max-logprobs", "-1", "--logprobs-mode", "raw_logits")
    assert (config.model_config.max_logprobs, config.model_config.logprobs_mode) == (-1, "raw_logits")
    config = EngineConfig.from_kwargs("m", max_logprobs=5, logprobs_mode="raw_logprobs")
    assert (config.model_config.max_logprobs, config.model_config.logprobs_mode) == (5, "raw_logprobs")
    assert EngineConfig.from_kwargs("m").model_config.max_logprobs == 20  # vLLM's default


@pytest.mark.parametrize("kwargs, message", [
    ({"logprobs_mode": "processed_logprobs"}, "logprobs_mode 'processed_logprobs' is not supported .*raw_logits"),
    ({"logprobs_mode": "logits"}, "logprobs_mode 'logits' is not supported; choose one of raw_logprobs"),
    ({"max_logprobs": -2}, "max_logprobs must be -1"),
])
def test_logprobs_settings_without_a_meaning_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("m", **kwargs)


@pytest.mark.parametrize("max_logprobs, allowed", [(20, 20), (3, 3), (-1, 100)])
def test_requests_past_max_logprobs_are_refused_naming_the_field(max_logprobs, allowed):
    processor = InputProcessor(None, TokenizerInfo(frozenset()), 64, 100, max_logprobs=max_logprobs)
    for name in ("logprobs", "prompt_logprobs"):
        processor.validate([1, 2], SamplingParams(**{name: allowed}))
        with pytest.raises(ValueError, match=f"^{name} must be at most (the vocabulary size \\(|){allowed}"):
            processor.validate([1, 2], SamplingParams(**{name: allowed + 1}))


def test_minus_one_logprobs_are_the_vocabulary_allowed_only_where_max_logprobs_is_minus_one():
    """vLLM's -1: the whole vocabulary, past any cap short of it (a message naming the cap)."""
    capped = InputProcessor(None, TokenizerInfo(frozenset()), 64, 100, max_logprobs=20)
    whole = InputProcessor(None, TokenizerInfo(frozenset()), 64, 100, max_logprobs=-1)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{name} -1 asks for the whole vocabulary \\(100 tokens\\), more than "
                                             f"the engine's max_logprobs \\(20\\)"):
            capped.process("r", {"prompt_token_ids": [1, 2]}, SamplingParams(**{name: -1}))
        params = SamplingParams(**{name: -1})
        _, request = whole.process("r", {"prompt_token_ids": [1, 2]}, params)
        assert getattr(request.sampling_params, name) == 100 and getattr(params, name) == -1  # the caller's kept
        with pytest.raises(ValueError, match=f"^{name} must be non-negative or -1"):
            SamplingParams(**{name: -2})


def test_hf_overrides_is_a_json_flag_and_a_kwarg(tiny_llama):
    from tokenmill.engine.frontend import resolve_max_model_len
    from tokenmill.model.loader import load_hf_config

    rope = {"rope_type": "linear", "factor": 2.0}
    config = serve_config("--hf-overrides", '{"max_position_embeddings": 128}', "--hf-overrides.rope_scaling",
                          '{"rope_type": "linear", "factor": 2.0}')
    assert config.model_config.hf_overrides == {"max_position_embeddings": 128, "rope_scaling": rope}
    model_config = EngineConfig.from_kwargs(tiny_llama.path, hf_overrides=config.model_config.hf_overrides).model_config
    hf_config = load_hf_config(model_config)
    assert hf_config.max_position_embeddings == 128
    assert hf_config.rope_scaling == {**rope, "rope_theta": 10000.0}  # the base kept (transformers 5 would drop it)
    assert resolve_max_model_len(None, hf_config) == 256  # 128 positions, stretched twice by the linear RoPE
    assert load_hf_config(EngineConfig.from_kwargs(tiny_llama.path).model_config).max_position_embeddings == 256
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        EngineConfig.from_kwargs("m", hf_overrides=lambda c: c)
    with pytest.raises(ValueError, match="--hf-overrides must be a JSON object"):
        serve_config("--hf-overrides", "[1]")


@pytest.mark.parametrize("argv, kwargs, space", [
    (["--kv-cache-memory", "4G"], {"kv_cache_memory_bytes": 4 * 2**30}, 4.0),
    (["--kv-cache-memory-bytes", "1073741824"], {"kv_cache_memory_bytes": 2**30}, 1.0),
    (["--kv-cache-memory-bytes", "512M"], {"kv_cache_memory_bytes": 2**29}, 0.5),
])
def test_kv_cache_memory_bytes_is_the_kv_cache_space(argv, kwargs, space):
    assert serve_config(*argv).cache_config.kv_cache_space == space
    assert EngineConfig.from_kwargs("m", **kwargs).cache_config.kv_cache_space == space
    with pytest.raises(ValueError, match="both size the KV pool: give one"):
        EngineConfig.from_kwargs("m", kv_cache_space=1, **kwargs)


@pytest.mark.parametrize("argv, eager, largest", [
    (["-O0"], True, None),
    (["-O", "3"], False, None),
    (["--compilation-config", "0"], True, None),
    (["--compilation-config", '{"level": 3}'], False, None),
    (["--compilation-config", '{"mode": "NONE", "cudagraph_mode": "FULL"}'], False, None),
    (["--compilation-config", '{"cudagraph_mode": "NONE"}'], True, None),
    (["--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'], False, 0),
    (["--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4, 512]}'], False, 512),
    (["--compilation-config.max_cudagraph_capture_size", "256"], False, 256),
    (["--cuda-graph-sizes", "64"], False, 64),
    (["--cuda-graph-sizes", "1", "2", "128"], False, 128),
])
def test_compilation_config_maps_onto_the_cuda_graph_settings(argv, eager, largest):
    device = serve_config(*argv).device_config
    assert (device.enforce_eager, device.max_cudagraph_capture_size) == (eager, largest)


@pytest.mark.parametrize("kwargs, message", [
    ({"compilation_config": {"mode": 1}}, "mode 1 .*has no counterpart: tokenmill runs its own kernels"),
    ({"compilation_config": {"level": 2}}, "mode 2 .*has no counterpart"),
    ({"compilation_config": {"backend": "inductor", "splitting_ops": []}},
     r"keys \['backend', 'splitting_ops'\] have no counterpart"),
    ({"compilation_config": {"cudagraph_mode": "SOMETIMES"}}, "cudagraph_mode 'SOMETIMES' is not one of"),
    ({"compilation_config": {"max_cudagraph_capture_size": 64}, "cuda_graph_sizes": [128]}, "disagree"),
    ({"optimization_level": 0, "enforce_eager": False}, "enforce_eager=False disagrees"),
    ({"optimization_level": 4}, "optimization_level"),
])
def test_compilation_settings_without_a_counterpart_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("m", **kwargs)


def test_long_prefill_token_threshold_reaches_the_scheduler_config_from_flags_and_kwargs():
    assert serve_config("--long-prefill-token-threshold", "256").scheduler_config.long_prefill_token_threshold == 256
    config = EngineConfig.from_kwargs("m", long_prefill_token_threshold=64)  # what LLM(**kwargs) builds
    assert config.scheduler_config.long_prefill_token_threshold == 64


def test_vllm_flags_that_change_nothing_here_are_accepted_and_said(caplog):
    config = serve_config("--swap-space", "4", "--revision", "main", "--tokenizer-revision", "v1", "--code-revision",
                          "x", "--download-dir", "/tmp", "--disable-custom-all-reduce", "--disable-cascade-attn",
                          "--tokenizer-mode", "auto", "--prefix-caching-hash-algo", "sha256_cbor",
                          "--max-num-partial-prefills", "1", "--max-long-partial-prefills", "1",
                          "--long-prefill-token-threshold", "0", "--no-calculate-kv-scales",
                          "--safetensors-load-strategy", "lazy")
    assert config == EngineConfig.from_kwargs("m")
    said = caplog.text
    assert "swap_space is ignored" in said and "revision='main' is ignored" in said
    assert "download_dir='/tmp' is ignored" in said and "disable_cascade_attn: nothing to disable" in said


@pytest.mark.parametrize("kwargs, message", [
    ({"tokenizer_mode": "slow"}, "tokenizer_mode other than 'auto' is not supported: .*ignores use_fast=False"),
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode other than 'auto'"),
    ({"max_num_partial_prefills": 2}, "max_num_partial_prefills other than 1 is not supported"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be 0 .* or a positive number"),
    ({"long_prefill_token_threshold": 64, "enable_chunked_prefill": False},
     "long_prefill_token_threshold caps each step's prompt chunk, which needs chunked prefill"),
    ({"calculate_kv_scales": True}, "calculate_kv_scales other than False .*--kv-cache-dtype int8"),
    ({"safetensors_load_strategy": "eager"}, "safetensors_load_strategy other than 'lazy'"),
    ({"prefix_caching_hash_algo": "xxhash"}, "prefix_caching_hash_algo 'xxhash' is not supported; choose one of "
                                             "sha256, sha256_cbor"),
    ({"disable_cascade_attn": "yes"}, "disable_cascade_attn must be true or false"),
])
def test_vllm_values_that_would_matter_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("m", **kwargs)


def test_reasoning_parser_gives_the_offline_engine_its_markers():
    """vLLM's LLM(reasoning_parser=...): the parser's markers become the reasoning_config (what thinking_token_budget
    counts between) unless reasoning_config names its own; an unknown parser is refused by name."""
    from tokenmill.config import ReasoningConfig

    assert EngineConfig.from_kwargs("m", reasoning_parser="deepseek_r1").reasoning_config == ReasoningConfig(
        "<think>", "</think>")
    given = {"reasoning_start_str": "<t>", "reasoning_end_str": "</t>"}
    assert EngineConfig.from_kwargs("m", reasoning_parser="qwen3", reasoning_config=given).reasoning_config == \
        ReasoningConfig("<t>", "</t>")
    assert EngineConfig.from_kwargs("m").reasoning_config == ReasoningConfig()
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        EngineConfig.from_kwargs("m", reasoning_parser="nope")
