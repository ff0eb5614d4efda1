"""The `tokenmill` command's failures, as a newcomer meets them: each is one or two lines on stderr
and a non-zero exit status, never a traceback. Real processes, and a real server with an API key (the
shared one of conftest.py)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from server_harness import HOST, SHARED_SERVER_API_KEY, free_port

pytestmark = pytest.mark.slow

API_KEY = SHARED_SERVER_API_KEY
API_KEY_ENV = "TOKENMILL_API_KEY"
QUICK_FAILURE_S = 15
"""Far less than loading a model and starting the engine (~20 s on a small CPU machine)."""


def tokenmill(*argv: str, api_key_env: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if api_key_env is not None:
        env[API_KEY_ENV] = api_key_env
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout)


def serve_in_process(capfd, *argv: str, info: bool = False) -> subprocess.CompletedProcess:
    """`tokenmill serve` through the command's entry function in this process, for failures that come after the
    model path is read: a subprocess would spend seconds importing the server's dependencies, which this process
    holds already (the exit status and stderr of a real process: the tests above). stderr is the file descriptor's,
    so a stray traceback of the engine core's process would show too; `info`: with the start-up's INFO lines."""
    from tokenmill.cli import main

    handler = signal.getsignal(signal.SIGTERM)  # main() makes SIGTERM unwind, for the process it runs in
    capfd.readouterr()
    try:
        returncode = main(["serve", *argv])
    finally:
        signal.signal(signal.SIGTERM, handler)
    out, err = capfd.readouterr()
    if not info:
        err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("INFO"))
    return subprocess.CompletedProcess(["tokenmill", "serve", *argv], returncode, out, err)


def assert_short_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr and 1 <= len(lines) <= 2, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


def test_chat_without_a_server():
    port = free_port()
    result = tokenmill("chat", "--url", f"http://{HOST}:{port}/v1", "-q", "hi")
    assert_short_error(result, f"cannot reach the server at http://{HOST}:{port}: connection refused", "--url")


@pytest.mark.parametrize("argv", [("chat", "--url", "127.0.0.1:8000/v1", "-q", "hi"),
                                  ("bench", "serve", "--base-url", "localhost:8000", "--num-prompts", "1")])
def test_a_server_url_without_its_scheme_is_named(argv):
    """Before: 'cannot reach the server at ://: connection error', which names neither the flag nor the URL."""
    result = tokenmill(*argv, timeout=QUICK_FAILURE_S)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"argument {argv[-4]}: expected a URL that starts with http:// or https://" in result.stderr
    assert repr(argv[-3]) in result.stderr


def test_bench_serve_without_a_server():
    port = free_port()
    result = tokenmill("bench", "serve", "--base-url", f"http://{HOST}:{port}", "--num-prompts", "1")
    assert_short_error(result, f"cannot reach the server at http://{HOST}:{port}", "--base-url")


def test_serve_fails_at_once_on_a_taken_port(smollm2_path):
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        try:
            result = tokenmill("serve", smollm2_path, "--port", str(port), timeout=QUICK_FAILURE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"tokenmill serve on a taken port was still running after {QUICK_FAILURE_S} s")
    assert time.monotonic() - start < QUICK_FAILURE_S
    assert result.returncode != 0
    assert result.stderr == f"error: port {port} on {HOST} is already in use; pass --port\n"


def test_the_port_is_held_from_before_the_model_loads():
    """The engine's processes bind ports of their own while the model loads: bound only when uvicorn started, the
    server's port could be taken by one of them (seen in CI: 'address already in use' after the model loaded)."""
    from tokenmill.server.startup import claim_listen_address

    held = claim_listen_address(HOST, free_port(), None)
    port = held.getsockname()[1]
    with socket.socket() as other, pytest.raises(OSError, match="in use"):
        other.bind((HOST, port))
    held.close()
    with socket.socket() as other:
        other.bind((HOST, port))


def test_serve_reports_a_missing_model_in_one_line(tmp_path, capfd):
    result = serve_in_process(capfd, str(tmp_path / "missing.gguf"), "--port", str(free_port()), info=True)
    assert_short_error(result, "missing.gguf")


def test_serve_reports_an_unsupported_architecture_in_one_line(tmp_path, capfd):
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_embd": 32, "n_head": 2,
              "vocab_size": 100, "bos_token_id": 0, "eos_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = serve_in_process(capfd, str(tmp_path), "--load-format", "dummy", "--port", str(free_port()), info=True)
    assert_short_error(result, "GPT2LMHeadModel", "not supported")


@pytest.mark.parametrize("flag, value, message", [
    ("--max-model-len", "0", "max_model_len must be positive"),
    ("--kv-cache-space", "-1", "kv_cache_space must be a positive"),
    ("--num-gpu-blocks-override", "0", "num_gpu_blocks_override must be a positive number of blocks, got 0"),
    ("--uvicorn-log-level", "loud", "uvicorn_log_level must be one of critical | error | warning")])
def test_serve_refuses_a_bad_size_at_once(tmp_path, flag, value, message):
    result = tokenmill("serve", str(tmp_path / "any.gguf"), flag, value, "--port", str(free_port()),
                       timeout=QUICK_FAILURE_S)
    assert_short_error(result, message)


@pytest.mark.parametrize("flag, value, message", [
    ("--ssl-keyfile", "key.pem", "--ssl-keyfile needs --ssl-certfile (HTTPS)"),
    ("--ssl-certfile", "missing.pem", "cannot serve HTTPS with --ssl-certfile {tmp}/missing.pem: no such file"),
    ("--uds", "no-such-folder/serve.sock", "uds: the folder '{tmp}/no-such-folder' of the socket path does not exist"),
    ("--generation-config", "", "generation_config: no generation_config.json in '{tmp}'")])
def test_serve_refuses_a_bad_transport_or_generation_config_at_once(tmp_path, flag, value, message):
    result = tokenmill("serve", str(tmp_path / "any.gguf"), flag, str(tmp_path / value), "--port", str(free_port()),
                       timeout=QUICK_FAILURE_S)
    assert_short_error(result, message.format(tmp=tmp_path))


def test_serve_over_https(tiny_llama, tmp_path):
    pytest.importorskip("cryptography", reason="the self-signed certificate is made with the cryptography package, "
                                               "which this environment lacks")
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now)
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST))]), False)
                   .sign(key, hashes.SHA256()))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (tmp_path / "cert.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", tiny_llama.path, "--load-format",
                                "dummy", "--skip-tokenizer-init", "--port", str(port), "--ssl-keyfile",
                                str(tmp_path / "key.pem"), "--ssl-certfile", str(tmp_path / "cert.pem")],
                               stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=f"https://{HOST}:{port}", timeout=60,
                          verify=ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))) as http:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            response = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert response.status_code == 200, response.text
    finally:
        process.terminate()
        process.communicate(timeout=30)


def test_an_engine_that_fails_to_start_reports_it_in_one_line(tmp_path, tiny_llama, capfd):
    """The engine core's process fails after loading (an AWQ method on a 16-bit checkpoint) and the frontend
    stops it: its error, and no stray traceback from that stop."""
    # Past the start-up's own INFO lines (the engine got that far), the error alone.
    result = serve_in_process(capfd, tiny_llama.path, "--load-format", "dummy", "--quantization", "awq",
                              "--skip-tokenizer-init", "--port", str(free_port()))
    assert_short_error(result, "the engine failed to start", "awq")


def test_a_pool_too_small_names_the_block_override_that_sized_it(tiny_llama, capfd):
    """Not the memory settings, which the override makes moot."""
    result = serve_in_process(capfd, tiny_llama.path, "--load-format", "dummy", "--skip-tokenizer-init",
                              "--num-gpu-blocks-override", "2", "--port", str(free_port()))
    assert_short_error(result, "the KV cache holds 32 tokens (2 blocks of 16), fewer than max_model_len=256: give "
                               "the pool more memory (num_gpu_blocks_override) or lower max_model_len")


def test_serve_refuses_a_chat_template_that_is_no_jinja(tmp_path, smollm2_path, capfd):
    """It used to start, then answer every chat request with a 400 blaming the request."""
    template = tmp_path / "broken.jinja"
    template.write_text("{% for message in messages %}{{ message.content }\n")
    result = serve_in_process(capfd, smollm2_path, "--chat-template", str(template), "--port", str(free_port()))
    assert_short_error(result, f"chat template file '{template}' is not valid Jinja: unexpected '}}' (line 1)")


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def test_chat_with_a_wrong_key(server):
    result = tokenmill("chat", "--url", server.url("/v1"), "--api-key", "wrong", "-q", "hi")
    assert_short_error(result, "the server refused the API key (401)", "--api-key", API_KEY_ENV)


def test_chat_with_a_model_the_server_does_not_serve(server):
    result = tokenmill("chat", "--url", server.url("/v1"), "--model-name", "no-such-model", "-q", "hi",
                       api_key_env=API_KEY)
    assert_short_error(result, "no-such-model", "404", "--model-name")


def test_chat_with_a_url_without_v1(server):
    """Before: 'the server answered 404: Not Found', with no word of the URL (tokenmill's own 404 hid the hint)."""
    result = tokenmill("chat", "--url", server.base_url, "-q", "hi", api_key_env=API_KEY)
    assert_short_error(result, "404", f"{server.base_url}/models, which is no OpenAI-compatible route", "--url")


def prompt_tokens(server) -> float:
    metrics = httpx.get(server.url("/metrics"), headers=server.headers).text
    [value] = re.findall(r"^tokenmill:prompt_tokens_total\{.*\} (\S+)$", metrics, re.MULTILINE)
    return float(value)


def test_bench_serve_takes_the_key_from_the_environment_and_vllms_flags(server, tmp_path):
    host, port = server.base_url.removeprefix("http://").split(":")
    before = prompt_tokens(server)
    result = tokenmill("bench", "serve", "--backend", "vllm", "--host", host, "--port", port, "--dataset-name",
                       "random", "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4",
                       "--ignore-eos", "--request-rate", "50", "--burstiness", "0.5", "--percentile-metrics",
                       "ttft,e2el", "--metric-percentiles", "90,99", "--save-result", "--result-dir", str(tmp_path),
                       "--result-filename", "r.json", "--save-detailed", "--num-warmups", "3", api_key_env=API_KEY)
    assert result.returncode == 0, result.stderr
    assert prompt_tokens(server) - before == (3 + 2) * 8  # the 3 warm-up requests (the first prompt), then the run
    assert "Successful requests:                     2" in result.stdout
    assert "Request rate configured (RPS):           50.00" in result.stdout
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 2 and saved["total_output_tokens"] == 8 and saved["max_concurrent_requests"] >= 1
    assert saved["request_rate"] == 50.0 and saved["backend"] == "vllm" and saved["model_id"] == saved["tokenizer_id"]
    # vLLM's E2E latency ends at the last text chunk (before: at the end of the stream, after the usage chunk).
    e2els = [ttft + sum(itls) for ttft, itls in zip(saved["ttfts"], saved["itls"])]
    assert saved["mean_e2el_ms"] == pytest.approx(1000 * sum(e2els) / 2, rel=1e-9)
    assert saved["output_lens"] == [4, 4] and saved["errors"] == ["", ""]
    assert {"median_ttft_ms", "p90_e2el_ms", "p99_ttft_ms"} <= set(saved) and "mean_itl_ms" not in saved


def test_bench_serve_sweeps_rates_into_a_table_and_a_plot(server, tmp_path):
    plot = tmp_path / "sweep.png"
    result = tokenmill("bench", "serve", "--base-url", server.base_url, "--num-prompts", "3",
                       "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos",
                       "--request-rate", "20,inf", "--plot", str(plot), api_key_env=API_KEY)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Successful requests:                     3") == 2
    table = result.stdout[result.stdout.index("out tok/s"):].splitlines()
    assert [row.split()[0] for row in table[1:3]] == ["20", "inf"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

def test_bench_serve_prefix_repetition_hits_the_servers_prefix_cache(server, tmp_path):
    def prefix_cache_hits() -> float:
        metrics = httpx.get(server.url("/metrics"), headers=server.headers).text
        [value] = re.findall(r"^tokenmill:prefix_cache_hits_total\{.*\} (\S+)$", metrics, re.MULTILINE)
        return float(value)

    hits_before = prefix_cache_hits()
    # One at a time: each request finds the 64-token prefix (4 blocks of 16) its predecessors left in the cache.
    result = tokenmill("bench", "serve", "--base-url", server.base_url, "--dataset-name", "prefix_repetition",
                       "--num-prompts", "4", "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len",
                       "8", "--prefix-repetition-num-prefixes", "1", "--prefix-repetition-output-len", "2",
                       "--ignore-eos", "--max-concurrency", "1", "--seed", "7", "--result-file",
                       str(tmp_path / "r.json"), api_key_env=API_KEY)
    assert result.returncode == 0, result.stderr
    assert prefix_cache_hits() - hits_before == 3 * 64
    assert "dataset                          prefix_repetition (prefix_len=64, suffix_len=8, num_prefixes=1, " \
           "output_len=2)" in result.stdout
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["dataset_name"] == "prefix_repetition" and saved["dataset_params"] == {
        "prefix_len": 64, "suffix_len": 8, "num_prefixes": 1, "output_len": 2}
    assert saved["completed"] == 4 and saved["total_input_tokens"] == 4 * 72 and saved["total_output_tokens"] == 8
    assert saved["server_prefix_cache_hits"] == 3 * 64 and saved["server_prefix_cache_queries"] == 4 * 72
    assert saved["server_mean_ttft_ms"] > saved["server_mean_queue_time_ms"] >= 0


def test_bench_serve_with_a_wrong_key(server):
    result = tokenmill("bench", "serve", "--base-url", server.base_url, "--num-prompts", "1", api_key_env="wrong")
    assert_short_error(result, "the server refused the API key (401)")
