"""POST /start_profile and /stop_profile on a real `tokenmill serve --profiler-dir`: the engine core writes a
gzipped chrome trace whose steps are named by their composition. Dummy weights: the trace needs steps to
run, not good tokens. (Without --profiler-dir the routes are 404s: tests/e2e/test_server.py.)"""

from __future__ import annotations

import gzip
import json
import os
import re
import threading

import httpx
import pytest
from server_harness import RemoteServer

pytestmark = pytest.mark.slow

API_KEY = "profile-key"


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles") / "traces"  # created by the server


@pytest.fixture(scope="module")
def server(smollm2_path, trace_dir):
    server = RemoteServer(smollm2_path, "--load-format", "dummy", "--kv-cache-space", "0.1", "--max-model-len", "512",
                          "--profiler-dir", str(trace_dir), api_key=API_KEY)
    yield server
    server.stop()


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
