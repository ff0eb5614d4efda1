"""argparse flags generated from config dataclasses: each field's name, type, default and docstring
are the one source of truth for its flag. Flags default to "not given", so an omitted flag leaves
the dataclass default in force."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import os
import re
import sys
import textwrap
from typing import Any, NoReturn

from tokenmill.config import (
    STRUCTURED_OUTPUTS_BACKENDS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    ReasoningConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    unsupported_vllm_arg,
)
from tokenmill.sampling_params import SamplingParams

ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, DeviceConfig, ParallelConfig)

FLAG_NAMES = {"policy": "scheduling-policy"}
"""Fields whose vLLM flag is not simply the field name with dashes."""

SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp",
               "api_server_count": "-asc"}
"""vLLM's short spellings."""

_SCALARS = {"str": str, "int": int, "float": float, "bool": bool}

HUMAN_READABLE_INTS = ("max_model_len", "max_num_batched_tokens")
"""Token counts that take vLLM's suffixes: 1k = 1000, 1K = 1024 (m/M, g/G likewise), 25.6k = 25600."""

_HUMAN_READABLE = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")
_MULTIPLIERS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}

API_KEY_ENV = "TOKENMILL_API_KEY"
"""Where `serve`, `chat` and `bench serve` find the API key when --api-key is not given."""

SPECULATIVE_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
"""What --speculative-config looks like (vLLM's spelling)."""

_MENTIONS_DEFAULT = re.compile(r"\bdefault", re.IGNORECASE)


def human_readable_int(text: str) -> int:
    """'32K' -> 32768, '1k' -> 1000, '25.6k' -> 25600, '4096' -> 4096 (a fraction only where the result is whole)."""
    match = _HUMAN_READABLE.fullmatch(text.strip())
    if match is not None:
        number, suffix = match.groups()
        value = float(number) * _MULTIPLIERS[suffix] if "." in number else int(number) * _MULTIPLIERS[suffix]
        if value == int(value):
            return int(value)
    raise argparse.ArgumentTypeError(f"expected a whole number of tokens like 4096, 1k (1000) or 32K (32768), "
                                     f"got {text!r}")


def http_url(text: str) -> str:
    """A server's URL: without its http:// (an easy slip: '127.0.0.1:8000/v1') the client's own error named no URL."""
    if not re.match(r"https?://[^/]", text, re.IGNORECASE):
        raise argparse.ArgumentTypeError(f"expected a URL that starts with http:// or https://, like "
                                         f"http://127.0.0.1:8000, got {text!r}")
    return text


def api_key_or_env(api_key: str | None) -> str | None:
    return api_key or os.environ.get(API_KEY_ENV) or None


def help_with_default(text: str, default: Any) -> str:
    """`text` with the flag's default appended, unless the text already speaks of it or the default is None
    (the flag is then simply unset, and the text says what that means): each default shows once."""
    if default is None or default is argparse.SUPPRESS or _MENTIONS_DEFAULT.search(text):
        return text
    shown = str(default).replace("%", "%%")
    return f"{text} (default: {shown})" if text else f"default: {shown}"


class DefaultsOnceFormatter(argparse.HelpFormatter):
    """Shows the default of every hand-written flag, the way the generated flags show theirs."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            return action.help  # a switch like --local: its default is its absence
        return help_with_default(action.help or "", action.default)


class CommandParser(argparse.ArgumentParser):
    """The parser of `tokenmill` and its subcommands (add_subparsers makes children of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsOnceFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        args = self._dotted_keys_joined(sys.argv[1:] if args is None else list(args))
        # Only `serve` has --config, and MODEL as its one positional argument.
        config_file = _config_file_of(args) if "--config" in self._option_string_actions else None
        if config_file is None:
            return super().parse_known_args(args, namespace)
        # vLLM's order: the command line over the file over the defaults. The file's flags are parsed first, into
        # the namespace the command line's then go into: what it gives replaces them, what it leaves out stays (a
        # flag left out sets nothing, its default being "not given"). Apart, so that a list flag of the file does
        # not take the command line's model for one of its items.
        file_args, model = self._config_file_args(config_file)
        # MODEL filled with a stand-in, so that no stray value of the file (an unknown flag's) becomes the model.
        namespace, file_extra = super().parse_known_args(["-", *file_args], namespace)
        del namespace.model
        namespace, extra = super().parse_known_args(args, namespace)
        if model is not None and namespace.model is None:
            namespace.model = model  # the command line's MODEL wins, as in vLLM
        return namespace, file_extra + extra

    def _config_file_args(self, path: str) -> tuple[list[str], str | None]:
        """--config's YAML file as flags (a key is a flag's long name, dashes or underscores; `model` the MODEL
        argument), and its model."""
        import yaml

        try:
            with open(path) as f:
                values = yaml.safe_load(f)
        except OSError as e:
            self.error(f"--config {path}: {e.strerror or e}")
        except yaml.YAMLError as e:
            self.error(f"--config {path}: not valid YAML ({' '.join(str(e).split())})")
        if values is None:
            values = {}
        if not isinstance(values, dict):
            self.error(f"--config {path}: expected a mapping of flag names to values, e.g. 'port: 8001'")
        args, model = [], None
        for key, value in values.items():
            flag = "--" + str(key).replace("_", "-")
            if flag == "--model":
                model = None if value is None else str(value)
            elif flag == "--config":
                self.error(f"--config {path}: a config file cannot name another (config: {value})")
            elif value is None:
                continue  # null: the flag's default
            elif isinstance(value, bool):
                # A switch: --flag, or for false its --no-flag (none: false is its absence, as with --disable-*).
                negated = "--no-" + flag[2:]
                args += [flag] if value else [negated] if negated in self._option_string_actions else []
            elif isinstance(value, list):
                args += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
            else:
                args += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
        return args, model

    def _dotted_keys_joined(self, args: list[str]) -> list[str]:
        """vLLM's dotted spelling of a JSON flag's keys, `--structured-outputs-config.backend guidance` (or
        `...backend=guidance`; `a.b` nests), as the JSON object itself: the value is read as JSON where it is (true,
        4), else as a string; a key with no value after it is true. The keys go onto the flag's JSON object if one
        is given too (theirs win)."""
        json_flags = {flag for action in self._actions if action.metavar == "JSON" for flag in action.option_strings}
        if not json_flags:
            return args
        kept: list[str] = []
        dotted: dict[str, dict[str, Any]] = {}
        i = 0
        while i < len(args):
            arg = args[i]
            name, has_value, value = arg.partition("=")
            flag, _, path = name.partition(".")
            if arg == "--":
                kept += args[i:]
                break
            if flag not in json_flags or not path:
                kept.append(arg)
                i += 1
                continue
            if not has_value:
                given = i + 1 < len(args) and not args[i + 1].startswith("--")
                value = args[i + 1] if given else "true"
                i += given
            i += 1
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                parsed = value
            *parents, last = path.split(".")
            target = dotted.setdefault(flag, {})
            for key in parents:
                if not isinstance(target.get(key), dict):
                    target[key] = {}
                target = target[key]
            target[last] = parsed
        for flag, keys in dotted.items():
            kept = _joined(kept, flag, keys)
        return kept

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            refuse_unknown(getattr(parsed, "command_parser", self), extra)
        return parsed

    def error(self, message: str) -> NoReturn:
        """The error and where the flags are listed, not argparse's usage of every flag (dozens of lines)."""
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the flags)\n")


def _config_file_of(args: list[str]) -> str | None:
    """--config's value (the last one given), if any; the file is read before the other flags are parsed."""
    found = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith("--config="):
            found = arg[len("--config="):]
    return found


def refuse_unknown(parser: argparse.ArgumentParser, extra: list[str]) -> NoReturn:
    """Exits on arguments the command does not take: a vLLM flag of a feature tokenmill lacks in a line naming it
    (its --help would not list it either), others as argparse's unrecognized arguments."""
    for arg in extra:
        flag = arg.partition("=")[0]
        if flag.startswith("--") and (reason := unsupported_vllm_arg(flag[2:].replace("-", "_"), flag)):
            parser.exit(2, f"{parser.prog}: error: {reason}\n")
    parser.error(f"unrecognized arguments: {' '.join(extra)}")


def _joined(args: list[str], flag: str, keys: dict[str, Any]) -> list[str]:
    """`args` with `keys` merged onto the last JSON object given to `flag` (a value that is not one is left for the
    flag's own error), or with `flag` and `keys` added."""
    for i in reversed(range(len(args))):
        inline = args[i].startswith(flag + "=")
        if args[i] != flag and not inline:
            continue
        text = args[i][len(flag) + 1:] if inline else args[i + 1] if i + 1 < len(args) else None
        try:
            whole = json.loads(text) if text is not None else None
        except json.JSONDecodeError:
            whole = None
        if not isinstance(whole, dict):
            return args
        merged = json.dumps(_deep_merge(whole, keys))
        return args[:i] + [flag, merged] + args[i + (1 if inline else 2):]
    return [*args, flag, json.dumps(keys)]


def _deep_merge(base: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in keys.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _deep_merge(merged[key], value) if both else value
    return merged


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (Python keeps them only in the source)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _flag_type(annotation: Any) -> tuple[type, bool] | None:
    """(element type, is a list) for annotations a flag can express: 'int | None', 'str | list[str] | None'."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts = [p.strip() for p in text.split("|") if p.strip() != "None"]
    lists = [p[len("list["):-1] for p in parts if p.startswith("list[") and p.endswith("]")]
    if lists:
        element = _SCALARS.get(lists[0])
        return (element, True) if element in (str, int, float) else None
    if len(parts) == 1 and parts[0] in _SCALARS:
        return _SCALARS[parts[0]], False
    return None


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_dataclass_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
    defaults: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
    unset: dict[str, str] | None = None,
) -> None:
    """One flag per field; `defaults` replaces a field's own default for this command, `helps` gives the
    help of fields that have no docstring, `unset` says what a flag left out means where that is not the field's
    default (shown as its default; the flag stays unset)."""
    defaults, unset = defaults or {}, unset or {}
    docs = {**(helps or {}), **field_docs(cls)}
    for f in dataclasses.fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        flag_type = _flag_type(f.type)
        if flag_type is None:
            continue  # dicts, callables, enums: not for the command line
        element, is_list = flag_type
        default = defaults.get(f.name, _default_of(f))
        doc = docs.get(f.name, "").replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": f.name, "default": default if f.name in defaults else argparse.SUPPRESS,
                                  "help": help_with_default(doc, default)}
        if f.name in unset:
            kwargs["help"] = f"{doc} (default: {unset[f.name]})"
        if element is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = human_readable_int if f.name in HUMAN_READABLE_INTS else element
            if is_list:
                kwargs["nargs"] = "+"
        flag = FLAG_NAMES.get(f.name, f.name.replace("_", "-"))
        if element is not bool:
            kwargs["metavar"] = flag.upper().replace("-", "_")
        parser.add_argument("--" + flag, *([SHORT_FLAGS[f.name]] if f.name in SHORT_FLAGS else []), **kwargs)


def given_fields(
    args: argparse.Namespace, cls: type, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The fields of `cls` set on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in skip and (only is None or f.name in only) and hasattr(args, f.name)}


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool) -> None:
    """Every engine flag; the model is `[MODEL]` (serve) or `--model` (generate, chat)."""
    if model_positional:
        parser.add_argument("model", nargs="?", default=None,
                            help="Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    else:
        parser.add_argument("--model", default=None,
                            help="Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    for cls in ENGINE_CONFIGS:
        group = parser.add_argument_group(f"engine: {cls.__name__}")
        add_dataclass_args(group, cls, skip=("model",))
    # Dict-typed fields, which add_dataclass_args leaves out: a JSON object, as vLLM spells it. Parsed by
    # engine_kwargs_from_args, so a bad value is the one-line ValueError of the CLI's error path.
    parser.add_argument_group("engine: ModelConfig").add_argument(
        "--hf-overrides", dest="hf_overrides", default=argparse.SUPPRESS, metavar="JSON",
        help=f"{field_docs(ModelConfig)['hf_overrides']} Or one key at a time: --hf-overrides.max_position_embeddings "
             f"4096 (default: none)".replace("%", "%%"))
    parser.add_argument_group("engine: SpeculativeConfig").add_argument(
        "--speculative-config", dest="speculative_config", default=None, metavar="JSON",
        help=f"Speculative decoding: a JSON object of vLLM's speculative_config keys ({_speculative_keys()}), "
             f"e.g. {SPECULATIVE_EXAMPLE!r} (default: off)")
    group = parser.add_argument_group("engine: vLLM arguments mapped onto tokenmill's (engine_args.py)")
    for flags, dest, keywords, text in _vllm_only_flags():
        group.add_argument(*flags, dest=dest, default=argparse.SUPPRESS, help=text.replace("%", "%%"), **keywords)
    group = parser.add_argument_group("engine: StructuredOutputsConfig")
    group.add_argument(
        "--structured-outputs-config", dest="structured_outputs_config", default=None, metavar="JSON",
        help='Structured outputs: a JSON object of vLLM\'s structured_outputs_config keys, e.g. \'{"backend": '
             '"guidance"}\', or one key at a time: --structured-outputs-config.backend guidance. backend: auto '
             '(xgrammar, llguidance for a JSON schema only it enforces whole), xgrammar or guidance (llguidance); '
             'disable_fallback true: auto never hands a schema to llguidance; disable_any_whitespace false: any '
             'whitespace between JSON tokens (unlike vLLM, true unless set: compact JSON); '
             'disable_additional_properties true: llguidance keeps objects to the properties they name, as xgrammar '
             '(default: {"backend": "auto"})')
    group.add_argument("--guided-decoding-backend", dest="guided_decoding_backend", default=None,
                       choices=STRUCTURED_OUTPUTS_BACKENDS, help="vLLM's older name of --structured-outputs-config's "
                                                                 "backend")
    parser.add_argument_group("engine: ReasoningConfig").add_argument(
        "--reasoning-config", dest="reasoning_config", default=None, metavar="JSON",
        help='The reasoning block\'s markers, which a request\'s thinking_token_budget counts between: a JSON object '
             'of vLLM\'s reasoning_config keys, e.g. \'{"reasoning_start_str": "<think>", "reasoning_end_str": '
             '"</think>"}\' (default: none; `serve --reasoning-parser NAME` takes its parser\'s)')


def _vllm_only_flags() -> list[tuple[tuple[str, ...], str, dict[str, Any], str]]:
    """vLLM's engine flags without a config field of their own (engine_args.py maps or refuses each):
    (flags, dest, argparse keywords, help)."""
    from tokenmill.engine_args import DEFAULT_ONLY, HUB_ARGS, NO_OPS, PREFIX_CACHING_HASH_ALGOS

    boolean = {"action": argparse.BooleanOptionalAction}
    flags = [
        (("--kv-cache-memory-bytes", "--kv-cache-memory"), "kv_cache_memory_bytes", {"type": human_readable_int},
         "KV pool size per device in bytes (vLLM's suffixes: 4G = 4 GiB, 4g = 4e9), in place of "
         "gpu_memory_utilization's sizing: kv_cache_space in bytes"),
        (("--compilation-config",), "compilation_config", {"metavar": "JSON"},
         "vLLM's compilation_config: a mode (0: eager, no CUDA graphs; 3: CUDA graphs) or a JSON object of mode "
         "(or level), cudagraph_mode (NONE = eager, FULL_DECODE_ONLY = graphs for decode-only steps alone, FULL, "
         "PIECEWISE, FULL_AND_PIECEWISE = graphs for every step), cudagraph_capture_sizes / max_cudagraph_capture_size "
         "(their largest is max_cudagraph_capture_size); other keys are refused. tokenmill never torch.compiles "
         "the model: modes 1 and 2 are refused"),
        (("-O", "--optimization-level"), "optimization_level", {"metavar": "0-3"},
         "vLLM's optimization level: -O0 runs eagerly (no CUDA graphs); 1-3 are tokenmill's default"),
        (("--cuda-graph-sizes",), "cuda_graph_sizes", {"type": int, "nargs": "+"},
         "vLLM's older CUDA graph sizes: their largest is max_cudagraph_capture_size (tokenmill picks the sizes "
         "below it)"),
        (("--swap-space",), "swap_space", {"type": float},
         "Ignored with a warning: preempted requests are recomputed, never swapped (as in vLLM's v1 engine)"),
        (("--prefix-caching-hash-algo",), "prefix_caching_hash_algo", {"choices": PREFIX_CACHING_HASH_ALGOS},
         "Block hashes are SHA-256 of a fixed encoding of the tokens (reproducible, like vLLM's sha256_cbor): "
         "both names are accepted, xxhash is not"),
    ]
    flags += [((f"--{name.replace('_', '-')}",), name, boolean, f"Accepted, no effect: {why}")
              for name, why in NO_OPS.items()]
    flags += [((f"--{name.replace('_', '-')}",), name, {}, "Ignored with a warning: tokenmill loads local folders "
               "and files only, not the Hugging Face Hub") for name in HUB_ARGS]
    for name, (default, why) in DEFAULT_ONLY.items():
        keywords = boolean if isinstance(default, bool) else {"type": type(default)}
        flags.append(((f"--{name.replace('_', '-')}",), name, keywords,
                      f"Only vLLM's {default!r}, what tokenmill does: {why}"))
    return flags


def add_generation_config_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--generation-config of the offline commands (the server's is ServerConfig.generation_config)."""
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="where sampling flags left out take their values from: 'auto' the model folder's "
                             "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                             "max_new_tokens as max_tokens), 'vllm' none, or a folder's generation_config.json")


def cli_sampling_params(model_defaults: dict[str, Any], given: dict[str, Any],
                        fallback: dict[str, Any] | None = None) -> SamplingParams:
    """The sampling parameters of an offline command, by vLLM's rule: the flags given, the model's
    generation_config.json defaults (LLM.sampling_defaults) for those left out, and the command's own `fallback`
    where neither sets one."""
    return SamplingParams(**{**(fallback or {}), **model_defaults, **given})


def _speculative_keys() -> str:
    return ", ".join(f.name for f in dataclasses.fields(SpeculativeConfig))


def json_object_flag(text: str, flag: str, example: str) -> dict[str, Any]:
    """A flag's JSON object; ValueError in a line (naming the flag and an example) for bad JSON or another type."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON ({e}); expected e.g. '{example}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. '{example}'")
    return value


def parse_speculative_config(text: str | None) -> dict[str, Any] | None:
    """--speculative-config's JSON object, checked against SpeculativeConfig's keys and values; a bad one
    raises a ValueError that says what is wrong in a line."""
    if text is None:
        return None
    value = json_object_flag(text, "--speculative-config", SPECULATIVE_EXAMPLE)
    try:
        SpeculativeConfig.from_dict(value)
    except ValueError as e:
        raise ValueError(f"--speculative-config: {e}") from None
    return value


def parse_structured_outputs_config(text: str | None) -> dict[str, Any] | None:
    """--structured-outputs-config's JSON object, checked; a bad one raises a one-line ValueError."""
    if text is None:
        return None
    value = json_object_flag(text, "--structured-outputs-config", '{"backend": "guidance"}')
    try:
        StructuredOutputsConfig.from_dict(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--structured-outputs-config: {e}") from None
    return value


def parse_reasoning_config(text: str) -> dict[str, Any]:
    """--reasoning-config's JSON object, checked; a bad one raises a one-line ValueError."""
    value = json_object_flag(text, "--reasoning-config", '{"reasoning_start_str": "<think>", "reasoning_end_str": '
                                                         '"</think>"}')
    try:
        ReasoningConfig.from_dict(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--reasoning-config: {e}") from None
    return value


def resolve_model(model: str | None) -> str:
    if model is not None:
        return model
    from tokenmill.default_model import default_model_path

    return default_model_path()


def engine_kwargs_from_args(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The model path and the engine arguments given on the command line, as `LLM(model, **kwargs)` takes them."""
    kwargs: dict[str, Any] = {}
    for cls in ENGINE_CONFIGS:
        kwargs.update(given_fields(args, cls, skip=("model",)))
    kwargs.update({dest: getattr(args, dest) for _, dest, _, _ in _vllm_only_flags() if hasattr(args, dest)})
    if getattr(args, "hf_overrides", None) is not None:
        kwargs["hf_overrides"] = json_object_flag(args.hf_overrides, "--hf-overrides",
                                                  '{"max_position_embeddings": 4096}')
    speculative = parse_speculative_config(getattr(args, "speculative_config", None))
    if speculative is not None:
        kwargs["speculative_config"] = speculative
    structured = parse_structured_outputs_config(getattr(args, "structured_outputs_config", None))
    if structured is not None:
        kwargs["structured_outputs_config"] = structured
    if getattr(args, "guided_decoding_backend", None) is not None:
        kwargs["guided_decoding_backend"] = args.guided_decoding_backend
    if getattr(args, "reasoning_config", None) is not None:
        kwargs["reasoning_config"] = parse_reasoning_config(args.reasoning_config)
    return resolve_model(args.model), kwargs


def check_text_prompts(kwargs: dict[str, Any], command: str) -> None:
    """generate and chat --local take text, which a tokenizer must encode: said before the model loads."""
    if kwargs.get("skip_tokenizer_init"):
        raise ValueError(f"tokenmill {command} takes text, which needs the tokenizer: drop --skip-tokenizer-init")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    model, kwargs = engine_kwargs_from_args(args)
    return EngineConfig.from_kwargs(model, **kwargs)
