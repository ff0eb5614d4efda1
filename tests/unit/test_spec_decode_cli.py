"""--speculative-config (and --structured-outputs-config): vLLM's JSON flags on every command that builds an
engine, and their mistakes as one-line errors of the CLI's error path."""

import json

import pytest

from tokenmill.cli import main, make_parser
from tokenmill.cli.args import engine_config_from_args, engine_kwargs_from_args
from tokenmill.cli.bench import BENCHMARKS
from tokenmill.config import ReasoningConfig, SpeculativeConfig, StructuredOutputsConfig

VLLM_SPELLING = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def test_the_flag_reaches_the_engine_config():
    config = engine_config_from_args(make_parser().parse_args(["serve", "m", "--speculative-config", VLLM_SPELLING]))
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                          prompt_lookup_min=4, prompt_lookup_max=4)


def test_without_the_flag_speculation_is_off():
    model, kwargs = engine_kwargs_from_args(make_parser().parse_args(["generate", "Hi", "--model", "m"]))
    assert "speculative_config" not in kwargs
    assert engine_config_from_args(make_parser().parse_args(["serve", "m"])).speculative_config is None


@pytest.mark.parametrize("argv", [["generate", "Hi", "--model", "m"], ["chat", "--local", "--model", "m"]])
def test_generate_and_chat_take_it_as_a_dict_for_llm(argv):
    model, kwargs = engine_kwargs_from_args(make_parser().parse_args([*argv, "--speculative-config", VLLM_SPELLING]))
    assert (model, kwargs) == ("m", {"speculative_config": json.loads(VLLM_SPELLING)})


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "bench throughput", "bench latency"])
def test_every_engine_command_offers_it(command, capsys):
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--speculative-config JSON" in help_text and "num_speculative_tokens" in help_text
    # The draft model's or EAGLE head's path, which draft_model, eagle and eagle3 need, is among the keys listed.
    assert "prompt_lookup_max, model, disable_by_batch_size" in help_text


def test_bench_serve_builds_no_engine_and_has_no_such_flag(capsys):
    assert "serve" in BENCHMARKS
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--help"])
    assert "--speculative-config" not in capsys.readouterr().out


@pytest.mark.parametrize(("value", "fragments"), [
    ('{"method": "ngram", "num_speculative_tokens": 4', ["is not valid JSON", "Expecting", VLLM_SPELLING]),
    ("ngram", ["is not valid JSON"]),
    ('[4]', ["must be a JSON object"]),
    ('{"method": "ngram"}', ["needs 'method' (or a 'model') and 'num_speculative_tokens'"]),
    ('{"method": "medusa", "num_speculative_tokens": 4}', ["'medusa' is not supported", "ngram"]),
    ('{"method": "eagle3", "num_speculative_tokens": 4}', ["'eagle3' needs a 'model'"]),
    ('{"method": "eagle", "num_speculative_tokens": 4}', ["'eagle' needs a 'model'"]),
    ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}', ["unknown speculative_config keys",
                                                                         "['lookahead']"]),
    ('{"method": "ngram", "num_speculative_tokens": 0}', ["num_speculative_tokens must be an integer in [1, 32]"]),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": "4"}',
     ['prompt_lookup_max must be an integer, got "4"']),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     ["prompt_lookup_min <= prompt_lookup_max"]),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 0}',  # not "unset"
     ["need 1 <= prompt_lookup_min <= prompt_lookup_max, got None and 0"]),
])
def test_a_bad_value_is_a_one_line_error(value, fragments, capsys):
    # Checked before the model is even looked for: no model path needed, nothing loaded.
    assert main(["generate", "Hi", "--model", "/no/such/model", "--speculative-config", value]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --speculative-config") and len(err.strip().splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_bench_throughput_reports_a_bad_value_the_same_way(capsys):
    assert main(["bench", "throughput", "--model", "/no/such/model", "--speculative-config", "{"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --speculative-config is not valid JSON") and err.count("\n") == 1, err


@pytest.mark.parametrize(("flags", "backend"), [
    ([], "auto"),
    (["--structured-outputs-config", '{"backend": "guidance"}'], "guidance"),
    (["--guided-decoding-backend", "xgrammar"], "xgrammar"),  # vLLM's older spelling
])
def test_structured_outputs_backend_reaches_the_engine_config(flags, backend):
    config = engine_config_from_args(make_parser().parse_args(["serve", "m", *flags]))
    assert config.structured_outputs_config.backend == backend


@pytest.mark.parametrize(("flags", "expected"), [
    (["--structured-outputs-config", '{"disable_any_whitespace": false, "disable_additional_properties": true, '
      '"disable_fallback": true}'], dict(disable_any_whitespace=False, disable_additional_properties=True,
                                          disable_fallback=True)),
    # vLLM's dotted spelling: a key at a time, its value read as JSON, or (tokenmill's) a bare key as true.
    (["--structured-outputs-config.backend", "guidance", "--structured-outputs-config.disable_any_whitespace=false",
      "--structured-outputs-config.disable_additional_properties", "--port", "8001"],
     dict(backend="guidance", disable_any_whitespace=False, disable_additional_properties=True)),
    # With the JSON object too: the dotted keys go onto it.
    (["--structured-outputs-config.disable_fallback", "true", "--structured-outputs-config", '{"backend": "xgrammar"}'],
     dict(backend="xgrammar", disable_fallback=True)),
    # vLLM's reasoning keys at vLLM's defaults (as a dump of vLLM's config has them) mean nothing here.
    (["--structured-outputs-config", '{"reasoning_parser": "", "enable_in_reasoning": false}'], {}),
])
def test_structured_outputs_options_reach_the_engine_config(flags, expected):
    config = engine_config_from_args(make_parser().parse_args(["serve", "m", *flags])).structured_outputs_config
    assert config == StructuredOutputsConfig(**expected)
    assert StructuredOutputsConfig().disable_any_whitespace  # tokenmill's default: compact JSON (vLLM's: not)


@pytest.mark.parametrize(("value", "fragment"), [
    ('{"backend": "outlines"}', "'outlines' is not supported; choose one of auto, xgrammar, guidance"),
    ('{"backnd": "guidance"}', "unknown structured_outputs_config keys ['backnd']"),
    ("{", "is not valid JSON"),
    ('{"disable_any_whitespace": "yes"}', "disable_any_whitespace must be true or false"),
    ('{"reasoning_parser": "qwen3"}', "reasoning_parser is not supported: tokenmill's reasoning parser is the "
                                      "server's: `tokenmill serve --reasoning-parser NAME`"),
    ('{"enable_in_reasoning": true}', "enable_in_reasoning is not supported: with --reasoning-parser"),
])
def test_a_bad_structured_outputs_config_is_a_one_line_error(value, fragment, capsys):
    assert main(["generate", "Hi", "--model", "/no/such/model", "--structured-outputs-config", value]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --structured-outputs-config") and len(err.strip().splitlines()) == 1, err
    assert fragment in err, err


def test_a_bad_dotted_structured_outputs_key_is_a_one_line_error(capsys):
    assert main(["generate", "Hi", "--model", "/no/such/model", "--structured-outputs-config.backnd", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --structured-outputs-config: unknown structured_outputs_config keys ['backnd']")
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("flags", "expected"), [
    ([], ReasoningConfig()),
    (["--reasoning-config", '{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}'],
     ReasoningConfig("<think>", "</think>")),
    (["--reasoning-config.reasoning_start_str", "[THINK]", "--reasoning-config.reasoning_end_str", "[/THINK]"],
     ReasoningConfig("[THINK]", "[/THINK]")),
])
def test_reasoning_markers_reach_the_engine_config(flags, expected):
    assert engine_config_from_args(make_parser().parse_args(["serve", "m", *flags])).reasoning_config == expected


def test_serve_takes_the_reasoning_parsers_markers_unless_given():
    from tokenmill.cli.serve import server_config_from_args, serving_engine_config, with_reasoning_markers

    def markers(*flags):
        args = make_parser().parse_args(["serve", "m", *flags])
        return with_reasoning_markers(serving_engine_config(args), server_config_from_args(args)).reasoning_config

    assert markers() == ReasoningConfig()
    assert markers("--reasoning-parser", "mistral") == ReasoningConfig("[THINK]", "[/THINK]")
    assert markers("--reasoning-parser", "qwen3", "--reasoning-config",
                   '{"reasoning_start_str": "<t>", "reasoning_end_str": "</t>"}') == ReasoningConfig("<t>", "</t>")


@pytest.mark.parametrize(("value", "fragment"), [
    ('{"reasoning_start_str": "<think>"}', "needs both reasoning_start_str and reasoning_end_str"),
    ('{"think_start_str": "<think>"}', "unknown reasoning_config keys ['think_start_str']"),
    ('{"reasoning_parser": "qwen3"}', "the reasoning parser is the server's --reasoning-parser"),
    ('{"reasoning_end_str": 3, "reasoning_start_str": "a"}', "reasoning_end_str must be a string"),
    ("[1]", "must be a JSON object"),
])
def test_a_bad_reasoning_config_is_a_one_line_error(value, fragment, capsys):
    assert main(["generate", "Hi", "--model", "/no/such/model", "--reasoning-config", value]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --reasoning-config") and len(err.strip().splitlines()) == 1, err
    assert fragment in err, err
