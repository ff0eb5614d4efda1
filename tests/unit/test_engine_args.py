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
