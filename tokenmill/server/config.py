"""The OpenAI-compatible HTTP server's configuration (`tokenmill serve`'s server flags): one frozen dataclass
beside the engine's (tokenmill/config.py), which knows nothing of HTTP."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import CONTENT_FORMATS

TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "chat_template", "add_generation_prompt",
                                "continue_final_message", "tokenize"})
"""What render_chat and the template already get from the request: in chat_template_kwargs each would collide
with it (a TypeError naming internal functions)."""
UNIX_SOCKET_PATH_MAX = 108
"""sockaddr_un's sun_path on Linux, its terminating NUL included."""
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server around an engine (`tokenmill serve`)."""

    host: str = "127.0.0.1"
    """Address to listen on; loopback by default, so nothing is exposed by accident."""
    port: int = 8000
    """TCP port to listen on."""
    api_key: str | None = None
    """Bearer key every route but /health and /version requires (default: $TOKENMILL_API_KEY)."""
    served_model_name: str | list[str] | None = None
    """The model name clients pass and responses carry; defaults to the model argument. Several names: requests
    may give any, responses and metrics carry the first."""
    max_waiting_requests: int = 1024
    """Answer 503 (with Retry-After) to requests that would make more than this many sequences wait,
    rather than queue without bound; -1: no limit."""
    max_request_body_bytes: int = 16 * 1024 * 1024
    """Larger request bodies are refused with 413."""
    metrics_no_auth: bool = False
    """Serve /metrics without the API key (for scrapers that cannot send one)."""
    enable_request_id_headers: bool = False
    """Answer every request with an X-Request-Id header: the request's own, else a fresh one (for tracing through
    proxies). Completions' ids follow a request's X-Request-Id either way."""
    allowed_origins: list[str] = field(default_factory=list)
    """Origins whose web pages may call the API from a browser (CORS), '*' for any. Default: none, unlike vLLM's
    '*', so that no web page a user visits can drive a local server."""
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    """HTTP methods those origins may use (CORS)."""
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    """Request headers those origins may send (CORS)."""
    allow_credentials: bool = False
    """Let those origins send credentials (cookies, HTTP authentication) (CORS)."""
    uvicorn_log_level: str = "info"
    """Log level of the HTTP server: critical | error | warning | info | debug | trace."""
    trust_request_chat_template: bool = False
    """Render chat templates sent in requests (`chat_template`); otherwise they are refused with 400. For
    trusted clients only: transformers' sandboxed Jinja keeps a template from the system, not from
    taking unbounded time or memory."""
    enable_auto_tool_choice: bool = False
    """Let the model decide when to call tools (tool_choice "auto", the default with tools); needs
    --tool-call-parser."""
    tool_parser_plugin: str | None = None
    """A Python file run at start-up that registers tool parsers for --tool-call-parser (as vLLM's): it subclasses
    tokenmill.server.tool_parsers.ToolParser, sets the class's `name` and passes it to register_tool_parser."""
    tool_call_parser: str | None = None
    """How the model writes tool calls, for tool_choice "auto": deepseek_v3 | deepseek_v31 | glm45 | granite |
    hermes | kimi_k2 | llama3_json | llama4_json | llama4_pythonic | mistral | phi4_mini_json | pythonic |
    qwen3_coder."""
    reasoning_parser_plugin: str | None = None
    """A Python file run at start-up that registers reasoning parsers for --reasoning-parser (as vLLM's): it subclasses
    tokenmill.server.reasoning_parsers.ReasoningParser, sets the class's `name` and passes it to
    register_reasoning_parser."""
    reasoning_parser: str | None = None
    """Split the model's reasoning into reasoning_content: deepseek_r1 | deepseek_v3 | glm45 | granite | mistral |
    qwen3."""
    profiler_dir: str | None = None
    """Folder for torch profiler traces of the engine core(s), recorded between POST /start_profile and POST
    /stop_profile (vLLM's torch_profiler_dir); default: $TOKENMILL_TORCH_PROFILER_DIR; unset: those routes
    answer 404."""
    enable_log_requests: bool = False
    """Log each generation request as it is added (its id, prompt, prompt token ids and sampling parameters);
    --disable-log-requests, vLLM's older flag, keeps this off."""
    enable_log_outputs: bool = False
    """With --enable-log-requests, also log each request's output once it has finished (per choice: its text,
    token ids and finish reason)."""
    max_log_len: int | None = None
    """With --enable-log-requests, the most characters and token ids of the prompt a request's log line shows
    (and of the output with --enable-log-outputs); unset: all."""
    root_path: str | None = None
    """The path prefix under which a proxy serves this server (e.g. '/llm'): the OpenAPI document's server URL
    carries it, and routes answer with or without it (proxies that strip it and proxies that do not)."""
    uds: str | None = None
    """Listen on this Unix domain socket path instead of --host and --port."""
    ssl_keyfile: str | None = None
    """Serve HTTPS: the private key's PEM file (needs --ssl-certfile)."""
    ssl_certfile: str | None = None
    """Serve HTTPS: the certificate chain's PEM file (with the key too, unless --ssl-keyfile)."""
    ssl_ca_certs: str | None = None
    """With HTTPS, the CA certificates' PEM file that client certificates are checked against."""
    ssl_cert_reqs: int = 0
    """With HTTPS, whether clients must present a certificate: 0 no, 1 optional, 2 required (Python's ssl
    CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)."""
    response_role: str = "assistant"
    """The role of chat completions' messages when the request has add_generation_prompt (true unless set false);
    without it, the role of the request's last message."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name tokens 'token_id:N' rather than by their text (which may not be valid UTF-8, or not tell
    tokens apart); a request's own return_tokens_as_token_ids overrides it."""
    generation_config: str = "auto"
    """Where sampling parameters come from when requests leave them unset: 'auto' (the default) reads temperature,
    top_p, top_k, min_p and repetition_penalty, and max_new_tokens (a limit on every request's output), from the
    model folder's generation_config.json (a GGUF file has none); 'vllm' reads none (temperature 1, top_p 1, no
    top_k, as vLLM then); a folder: its generation_config.json."""
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    """Sampling defaults set on top of --generation-config's (a JSON object of its keys, e.g. '{"temperature":
    0.5}'; null unsets one); with 'vllm', the only ones, as vLLM's flag."""
    chat_template_content_format: str = "auto"
    """How a message's content reaches the chat template: string (one string, text parts joined with newlines),
    openai (a list of {"type": "text", "text": ...} parts, a string content too) or auto (openai for a template that
    loops over a message's content, else string)."""
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables every chat request's template gets (a JSON object, e.g. '{"enable_thinking": false}'); a request's
    chat_template_kwargs win over them."""
    enable_server_load_tracking: bool = False
    """Count the completions and chat completions in flight (a stream until it ends): GET /load answers
    {"server_load": N} (0 without this flag)."""
    disable_log_stats: bool = False
    """Turn off the periodic stats lines: every $TOKENMILL_LOG_STATS_INTERVAL seconds (vLLM's
    VLLM_LOG_STATS_INTERVAL; default 10) while requests run, each engine core's "Engine 000: Avg prompt throughput:
    ..." line (and its speculative decoding acceptance, while speculating), as vLLM's."""
    enable_prompt_tokens_details: bool = False
    """Usage objects carry prompt_tokens_details: {"cached_tokens": N}, the prompt's tokens found in the prefix
    cache (0 without one; completions, chat, streamed or not)."""
    enable_force_include_usage: bool = False
    """Every stream ends with a usage chunk, as if each request had stream_options {"include_usage": true}."""
    api_server_count: int = 1
    """API server processes: tokenmill runs one (over all -dp replicas); another count is refused."""

    def __post_init__(self) -> None:
        if self.api_server_count != 1:
            raise ValueError(f"--api-server-count {self.api_server_count}: tokenmill runs one API server process "
                             "(it serves every --data-parallel-size replica); leave the flag out")
        # The parsers' registries import nothing heavy (no fastapi): checked here, at start-up, after the plugins
        # have registered theirs.
        if self.tool_parser_plugin is not None:
            load_plugin(self.tool_parser_plugin, "--tool-parser-plugin")
        if self.reasoning_parser_plugin is not None:
            load_plugin(self.reasoning_parser_plugin, "--reasoning-parser-plugin")
        if self.tool_call_parser is not None:
            from tokenmill.server.tool_parsers import get_tool_parser

            get_tool_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
        if self.reasoning_parser is not None:
            from tokenmill.server.reasoning_parsers import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_waiting_requests < -1:
            raise ValueError(f"max_waiting_requests must be non-negative or -1, got {self.max_waiting_requests}")
        if self.max_request_body_bytes <= 0:
            raise ValueError(f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            # vLLM's flags take one JSON list ('["http://a", "http://b"]'); ours take the items as well.
            items = []
            for text in getattr(self, name):
                if not text.lstrip().startswith("["):
                    items.append(text)
                    continue
                try:
                    listed = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{name}: {text!r} is not a JSON list ({e})") from None
                if not all(isinstance(item, str) for item in listed):
                    raise ValueError(f"{name}: {text!r} is not a JSON list of strings")
                items.extend(listed)
            object.__setattr__(self, name, items)
        self._check_transport()
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("--enable-log-outputs needs --enable-log-requests")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be non-negative, got {self.max_log_len}")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {' | '.join(CONTENT_FORMATS)}, got "
                             f"{self.chat_template_content_format!r}")
        if taken := sorted((TEMPLATE_ARGUMENTS | {"tools"}) & self.default_chat_template_kwargs.keys()):
            raise ValueError(f"default_chat_template_kwargs may not set {', '.join(taken)}: the server passes these "
                             "itself")
        from tokenmill.engine.generation_config import check_override, generation_config_file

        generation_config_file(self.generation_config, None)  # a folder without the file: said before the model loads
        check_override(self.override_generation_config)
        # uvicorn checks its level only once the model is loaded, and then fails with a bare KeyError.
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {' | '.join(UVICORN_LOG_LEVELS)}, "
                             f"got {self.uvicorn_log_level!r}")

    def _check_transport(self) -> None:
        """TLS files that load and a socket path that can be had, said at once rather than once the model has
        loaded (uvicorn's errors come then, as tracebacks)."""
        if self.ssl_certfile is None:
            tls_only = {"--ssl-keyfile": self.ssl_keyfile, "--ssl-ca-certs": self.ssl_ca_certs,
                        "--ssl-cert-reqs": self.ssl_cert_reqs or None}
            if given := [flag for flag, value in tls_only.items() if value is not None]:
                raise ValueError(f"{given[0]} needs --ssl-certfile (HTTPS)")
        else:
            import ssl

            if self.ssl_cert_reqs not in (0, 1, 2):
                raise ValueError(f"ssl_cert_reqs must be 0 (none), 1 (optional) or 2 (required), got "
                                 f"{self.ssl_cert_reqs}")
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                # A key with a passphrase: refused, not prompted for on the terminal.
                context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, password=lambda: b"")
                if self.ssl_ca_certs is not None:
                    context.load_verify_locations(self.ssl_ca_certs)
            except OSError as e:
                # ssl.SSLError's own words ('[SSL] PEM lib (_ssl.c:3905)') say little.
                reason = (e.strerror or str(e)).lower()
                if isinstance(e, ssl.SSLError):
                    reason = "no PEM certificate with its unencrypted private key could be read" + (
                        f" ({e.reason.lower().replace('_', ' ')})" if e.reason else "")
                raise ValueError(f"cannot serve HTTPS with --ssl-certfile {self.ssl_certfile}"
                                 f"{'' if self.ssl_keyfile is None else f' --ssl-keyfile {self.ssl_keyfile}'}"
                                 f"{'' if self.ssl_ca_certs is None else f' --ssl-ca-certs {self.ssl_ca_certs}'}: "
                                 f"{reason}") from None
        if self.uds is not None:
            folder = os.path.dirname(os.path.abspath(self.uds))
            if not os.path.isdir(folder):
                raise ValueError(f"uds: the folder {folder!r} of the socket path does not exist")
            if len(os.fsencode(self.uds)) >= UNIX_SOCKET_PATH_MAX:  # bind's 'AF_UNIX path too long', but later
                raise ValueError(f"uds: the socket path {self.uds!r} is longer than Unix sockets allow "
                                 f"({UNIX_SOCKET_PATH_MAX - 1} bytes); pass a shorter one")
            if os.path.exists(self.uds) and not stat.S_ISSOCK(os.stat(self.uds).st_mode):
                raise ValueError(f"uds: {self.uds!r} exists and is not a socket; pass another path")


def load_plugin(path: str, flag: str) -> None:
    """Runs a plugin file, whose code registers what it brings (a parser) as it is imported, as vLLM's do."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no file {path!r}")
    module_name = f"tokenmill_plugin_{os.path.splitext(os.path.basename(path))[0]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{flag}: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so that its classes pickle and dataclasses resolve their module
    spec.loader.exec_module(module)
