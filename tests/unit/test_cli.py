"""The command line: flags generated from the config dataclasses, with vLLM's spellings."""

import subprocess
import sys

import pytest

from tokenmill.cli import make_parser
from tokenmill.cli.args import engine_config_from_args, field_docs
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig

VLLM_FLAGS = ["--max-model-len", "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens",
              "--enable-prefix-caching", "--no-enable-prefix-caching", "--chat-template", "--dtype",
              "--block-size", "--seed", "--trust-remote-code", "--scheduling-policy", "--served-model-name",
              "--api-key", "--host", "--port"]


def serve_args(*argv):
    return make_parser().parse_args(["serve", *argv])


def test_serve_has_vllm_flags():
    help_text = make_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in VLLM_FLAGS:
        assert flag in help_text, flag


def test_omitted_flags_keep_the_dataclass_defaults():
    config = engine_config_from_args(serve_args("model.gguf"))
    assert config == EngineConfig(ModelConfig(model="model.gguf"))


def test_flags_reach_their_sub_config():
    args = serve_args("m", "--max-model-len", "2048", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "8",
                      "--max-num-batched-tokens", "512", "--no-enable-prefix-caching", "--dtype", "float16",
                      "--scheduling-policy", "priority", "--chat-template", "t.jinja")
    config = engine_config_from_args(args)
    assert config.model_config == ModelConfig(model="m", max_model_len=2048, dtype="float16", chat_template="t.jinja")
    assert config.cache_config == CacheConfig(gpu_memory_utilization=0.5, enable_prefix_caching=False)
    assert config.scheduler_config == SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, policy="priority")


def test_help_comes_from_field_docstrings():
    docs = field_docs(ServerConfig)
    assert set(docs) == {"host", "port", "api_key", "served_model_name", "max_waiting_requests",
                         "max_request_body_bytes", "metrics_no_auth", "uvicorn_log_level"}
    assert "Tokens per KV-cache block" in field_docs(CacheConfig)["block_size"]


def test_bad_values_are_rejected():
    with pytest.raises(SystemExit):
        serve_args("m", "--max-num-seqs", "many")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_config_from_args(serve_args("m", "--gpu-memory-utilization", "2"))


def test_generate_takes_sampling_flags():
    args = make_parser().parse_args(["generate", "Hi", "--max-tokens", "5", "--temperature", "0", "--stop", "a", "b"])
    assert (args.prompts, args.max_tokens, args.temperature, args.stop) == (["Hi"], 5, 0.0, ["a", "b"])


def test_bench_hands_its_arguments_to_the_benchmark_module(capsys):
    from tokenmill.cli import main

    args, extra = make_parser().parse_known_args(["bench", "serve", "--num-prompts", "3"])
    assert args.benchmark == "serve" and extra == ["--num-prompts", "3"]
    with pytest.raises(SystemExit) as exited:
        main(["bench", "serve", "--help"])
    assert exited.value.code == 0 and "--request-rate" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["serve", "--no-such-flag"])


def test_import_tokenmill_needs_no_server_dependencies():
    code = ("import sys, tokenmill; print(sorted(m for m in ('fastapi', 'uvicorn', 'zmq', 'msgspec', "
            "'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
