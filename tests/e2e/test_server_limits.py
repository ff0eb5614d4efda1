"""Server limits and failures: overload (503), /metrics without auth, profiling (POST /start_profile and
/stop_profile with --profiler-dir: a gzipped chrome trace whose steps are named by their composition; without
the flag the routes are 404s, tests/e2e/test_server.py), the engine-core process dying, and shutdown after
that; and the serve flags of vLLM's that change no test above (--root-path, --enable-log-requests and -outputs,
--response-role, --return-tokens-as-token-ids, --generation-config, --override-generation-config). Dummy weights:
these tests need tokens to flow, not good ones."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import signal
import threading
import time
import uuid

import httpx
import pytest
from server_harness import RemoteServer, descendants, is_alive

from tokenmill.cli import make_parser
from tokenmill.cli.args import given_fields
from tokenmill.server.config import ServerConfig
from tokenmill.server.stats_log import INTERVAL_ENV

pytestmark = pytest.mark.slow

API_KEY = "limits-key"
MAX_NUM_SEQS = 2
MAX_WAITING = 1
ROOT_PATH = "/proxy"
MAX_LOG_LEN = 12
RESPONSE_ROLE = "narrator"
OVERRIDE = {"top_p": 0.95, "min_p": 0.01}
STATS_INTERVAL_S = 0.2
"""What the server's stats lines would come every, but for --disable-log-stats (test_server's server writes them)."""


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles") / "traces"  # created by the server


@pytest.fixture(scope="module")
def server(smollm2_path, trace_dir, tmp_path_factory):
    # Greedy unless a request says otherwise, with the override's top_p and min_p: what --generation-config's
    # tests look for.
    defaults = tmp_path_factory.mktemp("generation-config")
    (defaults / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_p": 0.9,
                                                                 "do_sample": True}))
    server = RemoteServer(
        smollm2_path, "--load-format", "dummy", "--kv-cache-space", "0.1", "--max-model-len", "512",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING), "--metrics-no-auth",
        "--profiler-dir", str(trace_dir), "--root-path", ROOT_PATH, "--enable-log-requests", "--enable-log-outputs",
        "--max-log-len", str(MAX_LOG_LEN), "--response-role", RESPONSE_ROLE, "--return-tokens-as-token-ids",
        "--generation-config", str(defaults), "--override-generation-config", json.dumps(OVERRIDE),
        "--disable-log-stats", "--enable-prompt-tokens-details", "--enable-force-include-usage",
        api_key=API_KEY, env={INTERVAL_ENV: str(STATS_INTERVAL_S)},
    )
    yield server
    server.stop()


def long_stream(http: httpx.Client, server: RemoteServer):
    body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    return http.stream("POST", server.url("/v1/completions"), json=body, headers=server.headers)


def test_metrics_no_auth_opens_only_metrics(server):
    assert httpx.get(server.url("/metrics")).status_code == 200
    assert httpx.get(server.url("/v1/models")).status_code == 401


def post(server, path, body=None):
    return httpx.post(server.url(path), json=body, headers=server.headers, timeout=120)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_stop_before_start_is_a_clear_400(server):
    error = assert_openai_error(post(server, "/stop_profile"), 400)
    assert "not running" in error["message"]


def test_a_trace_of_the_steps_that_ran_while_profiling(server, trace_dir):
    body = {"prompt": "Hello", "max_tokens": 32, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120, headers=server.headers) as http, \
            http.stream("POST", server.url("/v1/completions"), json=body) as stream:
        chunks = stream.iter_lines()
        next(line for line in chunks if line.startswith("data: "))  # the stream is decoding now
        started = post(server, "/start_profile")
        assert started.status_code == 200, started.text
        assert started.json()["profiler_dir"] == str(trace_dir)
        assert_openai_error(post(server, "/start_profile"), 400)  # already running
        # A second request's prompt is prefilled while the first one decodes.
        done = []
        other = threading.Thread(target=lambda: done.append(post(server, "/v1/completions", {
            "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 2})))
        other.start()
        other.join(120)
        assert done and done[0].status_code == 200, done
        stopped = post(server, "/stop_profile")  # the first request is still streaming
        list(chunks)
    assert stopped.status_code == 200, stopped.text
    [trace_file], [table_file] = stopped.json()["trace_files"], stopped.json()["table_files"]
    assert os.path.dirname(trace_file) == str(trace_dir)
    assert re.fullmatch(r"tokenmill-trace-\d+-\d+\.json\.gz", os.path.basename(trace_file))
    with gzip.open(trace_file, "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = [e["name"] for e in events if e.get("name", "").startswith("step prefill_tokens=")]
    counts = [dict(field.split("=") for field in step.split()[1:]) for step in steps]
    assert any(int(c["prefill_tokens"]) > 0 for c in counts), steps  # the second prompt
    assert any(int(c["decode_reqs"]) > 0 for c in counts), steps
    assert "Self CPU" in open(table_file).read()
    # Stopped: a new session can start, and the server serves on.
    assert post(server, "/start_profile").status_code == 200
    assert post(server, "/stop_profile").status_code == 200
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_profiling_needs_the_api_key(server):
    assert httpx.post(server.url("/start_profile"), timeout=30).status_code == 401


def test_overload_answers_503_with_retry_after(server):
    with httpx.Client(timeout=60) as http, contextlib.ExitStack() as streams:
        # Two requests run and one waits: the next would make two wait.
        for _ in range(MAX_NUM_SEQS + MAX_WAITING):
            assert streams.enter_context(long_stream(http, server)).status_code == 200
        refused = http.post(server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 2},
                            headers=server.headers)
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    # Leaving the streams aborted them: there is room again.
    deadline = time.monotonic() + 20
    while True:
        response = httpx.post(server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 2},
                              headers=server.headers, timeout=60)
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert response.status_code == 200, response.text


def test_root_path_serves_with_and_without_the_prefix(server):
    for path in (f"{ROOT_PATH}/v1/models", "/v1/models"):
        assert httpx.get(server.url(path), headers=server.headers).status_code == 200, path
    assert httpx.get(server.url(f"{ROOT_PATH}/health")).status_code == 200  # still open without the key
    assert httpx.get(server.url(f"{ROOT_PATH}/v1/models")).status_code == 401
    spec = httpx.get(server.url(f"{ROOT_PATH}/openapi.json"), headers=server.headers).json()
    assert spec["servers"] == [{"url": ROOT_PATH}]


def test_requests_are_logged_with_their_prompt_cut_to_max_log_len(server):
    prompt = f"log-{uuid.uuid4().hex}"
    response = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]
    line = next(line for line in server.log_tail(100_000).splitlines() if f"request {request_id}: " in line)
    assert f"prompt {prompt[:MAX_LOG_LEN]!r}, prompt_token_ids [" in line and "max_tokens=1" in line, line


def test_disable_log_stats_silences_the_periodic_stats_line(server):
    response = post(server, "/v1/completions", {"prompt": "Count to ten:", "max_tokens": 16, "ignore_eos": True})
    assert response.status_code == 200, response.text
    time.sleep(5 * STATS_INTERVAL_S)  # lines while it ran, and the one that shows it drained, would be out by now
    assert "Avg prompt throughput" not in server.log_tail(10**9)


def log_line(server: RemoteServer, start: str) -> str:
    return next(line for line in server.log_tail(100_000).splitlines() if start in line)


def test_outputs_are_logged_cut_to_max_log_len(server):
    # Not streamed, a completion: its text and token ids (this server names logprobs' tokens by id).
    body = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": MAX_LOG_LEN + 4, "ignore_eos": True,
                                            "logprobs": 0}).json()
    [choice] = body["choices"]
    token_ids = [int(token.removeprefix("token_id:")) for token in choice["logprobs"]["tokens"]]
    assert len(token_ids) == MAX_LOG_LEN + 4
    line = log_line(server, f"request {body['id']} output 0: ")
    assert line.endswith(f"{choice['text'][:MAX_LOG_LEN]!r}, output_token_ids {token_ids[:MAX_LOG_LEN]}, "
                         "finish_reason length"), line
    # Streamed, a chat: once, whole, at its end.
    text, chat_id = "", None
    with httpx.stream("POST", server.url("/v1/chat/completions"), headers=server.headers, timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True,
                            "stream": True}) as stream:
        for data in stream.iter_lines():
            if data.startswith("data: {"):
                chunk = json.loads(data[6:])
                chat_id = chunk["id"]
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    line = log_line(server, f"request {chat_id} output 0: ")
    assert f"output 0: {text[:MAX_LOG_LEN]!r}, output_token_ids [" in line and line.endswith("finish_reason length")
    assert len(json.loads(line[line.index("output_token_ids ") + 17:line.index("], finish") + 1])) == 3


def test_a_beam_search_is_logged_once_not_each_step(server):
    """Before: each step's one-token request of each beam was logged as a request of its own (and its output too),
    one line per beam per token; as vLLM's, the client's request is logged once, with its search's parameters, and
    (--enable-log-outputs) each beam once at the end."""
    body = post(server, "/v1/completions", {"prompt": "Hello", "use_beam_search": True, "n": 2, "max_tokens": 3,
                                            "ignore_eos": True}).json()
    request_id, lines = body["id"], server.log_tail(100_000).splitlines()
    requests = [line for line in lines if re.search(rf"request {re.escape(request_id)}\S*: ", line)]  # steps': -beamN
    assert len(requests) == 1, requests
    assert f"request {request_id}: prompt 'Hello'" in requests[0], requests
    assert "params BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True" in requests[0], requests
    outputs = [line for line in lines if re.search(rf"request {re.escape(request_id)}\S* output \d+: ", line)]
    assert len(outputs) == 2, outputs
    for index, choice in enumerate(body["choices"]):
        assert f"request {request_id} output {index}: {choice['text'][:MAX_LOG_LEN]!r}, " in outputs[index], outputs


def test_response_role_names_the_message_the_model_writes(server):
    hi = [{"role": "user", "content": "Hi"}]
    body = post(server, "/v1/chat/completions", {"messages": hi, "max_tokens": 1}).json()
    assert body["choices"][0]["message"]["role"] == RESPONSE_ROLE
    with httpx.stream("POST", server.url("/v1/chat/completions"), headers=server.headers, timeout=60,
                      json={"messages": hi, "max_tokens": 1, "stream": True}) as stream:
        first = json.loads(next(line for line in stream.iter_lines() if line.startswith("data: "))[6:])
    assert first["choices"][0]["delta"]["role"] == RESPONSE_ROLE
    # Without a generation prompt the model continues the last message, in its role.
    continued = post(server, "/v1/chat/completions", {"messages": [*hi, {"role": "assistant", "content": "So"}],
                                                      "max_tokens": 1, "add_generation_prompt": False,
                                                      "continue_final_message": True}).json()
    assert continued["choices"][0]["message"]["role"] == "assistant"


def test_logprobs_name_tokens_by_id(server):
    body = {"prompt": "Hello", "max_tokens": 2, "logprobs": 2, "echo": True}
    logprobs = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert all(re.fullmatch(r"token_id:\d+", token) for token in logprobs["tokens"]), logprobs
    assert all(re.fullmatch(r"token_id:\d+", token) for top in logprobs["top_logprobs"][1:] for token in top)
    # Text offsets still count the text: "Hello" is one token of 5 characters.
    assert logprobs["text_offset"][:2] == [0, 5]
    as_text = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": False}).json()
    assert as_text["choices"][0]["logprobs"]["tokens"][0] == "Hello"
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                 "logprobs": True, "top_logprobs": 1}).json()
    [entry] = chat["choices"][0]["logprobs"]["content"]
    assert re.fullmatch(r"token_id:\d+", entry["token"]) and entry["bytes"] is not None


def test_usage_details_and_forced_usage_chunks(server):
    """vLLM's --enable-prompt-tokens-details (usage.prompt_tokens_details.cached_tokens: the prompt's tokens the
    prefix cache held) and --enable-force-include-usage (every stream ends with a usage chunk, no stream_options
    needed). Before: both flags were unknown (argparse's error)."""
    prompt = f"{uuid.uuid4()} " + "A prompt long enough to fill a few blocks of the prefix cache. " * 6
    messages = [{"role": "user", "content": prompt}]
    for path, body in (("/v1/completions", {"prompt": prompt}), ("/v1/chat/completions", {"messages": messages})):
        body = {**body, "max_tokens": 2, "ignore_eos": True}
        first, second = (post(server, path, body).json()["usage"] for _ in range(2))
        # The chat template's system prompt, before the question, may be cached from other requests.
        assert first["prompt_tokens_details"]["cached_tokens"] <= (0 if path == "/v1/completions" else 32), first
        cached = second["prompt_tokens_details"]["cached_tokens"]
        assert first["prompt_tokens"] > cached >= first["prompt_tokens"] - 32, second  # all but the last blocks
        with httpx.stream("POST", server.url(path), json={**body, "stream": True}, headers=server.headers,
                          timeout=60) as stream:
            *chunks, done = [json.loads(line[6:]) if line != "data: [DONE]" else line
                             for line in stream.iter_lines() if line.startswith("data: ")]
        assert done == "data: [DONE]" and chunks[-1]["choices"] == [] and chunks[-1]["usage"] == second, chunks[-1]
        assert all("usage" not in chunk for chunk in chunks[:-1])
    # n > 1: the prompt's own hits, not what the other samples took from the first's prompt (all of it but a token).
    fresh = {"prompt": f"{uuid.uuid4()} {prompt}", "max_tokens": 2, "n": 3, "temperature": 1.0}
    assert post(server, "/v1/completions", fresh).json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_generation_config_sets_the_defaults(server):
    """Its temperature 0: requests without one are greedy (with dummy weights, sampled ones differ)."""
    prompt = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    texts = [post(server, "/v1/completions", prompt).json()["choices"][0]["text"] for _ in range(2)]
    greedy = post(server, "/v1/completions", {**prompt, "temperature": 0}).json()["choices"][0]["text"]
    sampled = post(server, "/v1/completions", {**prompt, "temperature": 1, "seed": 1}).json()["choices"][0]["text"]
    assert texts == [greedy, greedy] and sampled != greedy
    # The override replaces the file's top_p and adds min_p (the request's log line shows what it sampled with).
    request_id = post(server, "/v1/completions", prompt).json()["id"]
    line = next(line for line in server.log_tail(100_000).splitlines() if f"request {request_id}: " in line)
    assert "temperature=0.0, top_p=0.95, top_k=0, min_p=0.01," in line, line


def test_generation_config_defaults_and_limit(tmp_path):
    """'auto' reads the model folder's file; max_new_tokens limits every request's max_tokens; the override goes on
    top (null unsets a key), and with 'vllm' alone, as vLLM's do."""
    from tokenmill.engine.generation_config import sampling_defaults
    from tokenmill.server.openai_protocol import CompletionRequest
    from tokenmill.server.sampling import to_sampling_params

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 32, "bos_token_id": 1, "do_sample": True}))
    defaults = sampling_defaults("auto", str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 32}
    assert sampling_defaults("vllm", str(tmp_path)) == {} and sampling_defaults("auto", str(tmp_path / "x")) == {}
    params = to_sampling_params(CompletionRequest(prompt="Hi", top_p=0.5), 100, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.5, 20, 32)
    override = {"temperature": 0.5, "top_k": None, "min_p": 0.1}
    assert sampling_defaults("auto", str(tmp_path), override) == {"temperature": 0.5, "top_p": 0.9, "min_p": 0.1,
                                                                  "max_tokens": 32}
    assert sampling_defaults("vllm", str(tmp_path), override) == {"temperature": 0.5, "min_p": 0.1}
    with pytest.raises(ValueError, match="override_generation_config: min_p must be in"):
        sampling_defaults("vllm", "model", {"min_p": 2})
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match="top_p must be in"):
        sampling_defaults(str(tmp_path), "model")


class IdleEngine:
    last_stats = None

    def get_num_unfinished_seqs(self) -> int:
        return 0


def server_config(*argv: str) -> ServerConfig:
    return ServerConfig(**given_fields(make_parser().parse_args(["serve", *argv]), ServerConfig))


def test_waiting_sequences_are_bounded_by_default():
    from tokenmill.server.errors import APIError
    from tokenmill.server.state import ServerState

    config = server_config()
    limit = config.max_waiting_requests
    assert limit == 1024
    state = ServerState(IdleEngine(), config, "m", max_num_seqs=4)
    state.check_capacity(4 + limit)  # the 4 run, the rest wait: exactly the limit
    with pytest.raises(APIError) as refused:
        state.check_capacity(4 + limit + 1)
    assert refused.value.status == 503 and int(refused.value.headers["Retry-After"]) >= 1
    # The flag raises the bound, or lifts it with -1.
    ServerState(IdleEngine(), server_config("--max-waiting-requests", "4096"), "m", 4).check_capacity(4 + 4096)
    ServerState(IdleEngine(), server_config("--max-waiting-requests", "-1"), "m", 4).check_capacity(10**9)
    with pytest.raises(ValueError, match="max_waiting_requests"):
        server_config("--max-waiting-requests", "-2")


def wait_for_health(server: RemoteServer, status: int, timeout: float) -> float:
    """Seconds until /health answers `status`."""
    start = time.monotonic()
    while (code := httpx.get(server.url("/health"), timeout=5).status_code) != status:
        assert time.monotonic() - start < timeout, f"/health still answers {code} after {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - start


def test_engine_core_death_fails_its_requests_then_the_server_recovers(server):
    core_pid = server.engine_core_pid()
    with httpx.Client(timeout=30) as http, long_stream(http, server) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # generating
        os.kill(core_pid, signal.SIGKILL)
        rest = [line for line in lines if line]  # the stream must end, not hang
    assert any('"code":"engine_dead"' in line for line in rest) and rest[-1] == "data: [DONE]"
    assert httpx.get(server.url("/health")).status_code == 503
    refused = httpx.post(server.url("/v1/completions"), json={"prompt": "Hi"}, headers=server.headers, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
    # A new engine core, with the same configuration, serves again without anyone's help.
    wait_for_health(server, 200, timeout=120)
    assert server.engine_core_pid() != core_pid
    response = httpx.post(server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 3},
                          headers=server.headers, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log_tail(100_000).split("engine core process exited")[-1]


def test_sigterm_while_the_core_restarts_exits_cleanly(server):
    os.kill(server.engine_core_pid(), signal.SIGKILL)
    wait_for_health(server, 503, timeout=10)
    children = descendants(server.proc.pid)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=15) == 0
    time.sleep(0.5)
    assert not [pid for pid in [*children, *descendants(server.proc.pid)] if is_alive(pid)]


def test_requests_still_running_past_the_shutdown_grace_get_a_503(smollm2_path, tmp_path):
    """SIGTERM: uvicorn gives the open requests 3 s; those still running then get the OpenAI-format 503 ("the server
    is shutting down"; a stream its error event, then [DONE]), not uvicorn's plain-text 500 for a cancelled task.
    Served on a Unix socket (--uds), which nothing else needs a server of its own to test."""
    socket_path = str(tmp_path / "tokenmill.sock")
    server = RemoteServer(smollm2_path, "--load-format", "dummy", "--kv-cache-space", "0.1", "--max-model-len", "2048",
                          api_key=API_KEY, uds=socket_path)
    body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True}
    results = {}

    def full() -> None:
        with server.http(timeout=60) as http:
            results["full"] = http.post("/v1/completions", json=body)

    def streamed() -> None:
        with server.http(timeout=60) as http, http.stream("POST", "/v1/completions",
                                                          json={**body, "stream": True}) as s:
            results["stream"] = [line for line in s.iter_lines() if line]

    try:
        threads = [threading.Thread(target=fn) for fn in (full, streamed)]
        for thread in threads:
            thread.start()
        # Both generating (1,500 tokens each: tens of seconds on the CPU), and tokens past the first step.
        with server.http(timeout=10) as http:
            deadline = time.monotonic() + 60
            while not (re.search(r"^tokenmill:num_requests_running\{.*\} 2\.0$", metrics := http.get("/metrics").text,
                                 re.MULTILINE) and re.search(r"^tokenmill:generation_tokens_total\{.*\} [1-9]",
                                                             metrics, re.MULTILINE)):
                assert time.monotonic() < deadline, "the two requests did not both start"
                time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=30)
        assert server.proc.wait(timeout=15) == 0
    finally:
        server.stop()
    error = results["full"].json()["error"]
    assert results["full"].status_code == 503 and error["code"] == "engine_dead", results["full"].text
    assert "the server is shutting down" in error["message"]
    stream = results["stream"]
    assert any('"code":"engine_dead"' in line for line in stream) and stream[-1] == "data: [DONE]"
    assert f"on http over the Unix socket {socket_path}" in server.log_tail(100_000)
