"""Data parallelism through the real server: `tokenmill serve -dp 2` on a tiny seeded random Llama (float32,
with SmolLM2's tokenizer so that prompts are text), driven through the openai SDK and /metrics.

Greedy text must be the one engine's (the offline LLM on the same folder), requests must spread over both
replicas, prompts that share a prefix must land on the replica that holds it, an abort must reach the
replica of its request, and killing one replica's process must fail only its requests while the other
serves on and the dead one restarts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import RemoteServer, cmdline, descendants

pytestmark = pytest.mark.slow

ENGINE = {"dtype": "float32", "max_model_len": 2048, "kv_cache_space": 0.05}
MODEL = "tiny"
SERVER_ARGS = ("--served-model-name", MODEL, "-dp", "2", "--dtype", "float32", "--max-model-len", "2048",
               "--kv-cache-space", "0.05")
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,", "Once upon a time",
           "def main():", "The weather today", "Water boils at", "My favourite colour"]
"""Shorter than a KV block: no prefix to route by, so load alone decides."""
LONG = {"max_tokens": 1500, "temperature": 0.0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_tokenizer) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = smollm2_tokenizer
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         initializer_range=0.2)  # peaked logits: no greedy step is a near tie
    folder = tmp_path_factory.mktemp("tiny-dp")
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_the_offline_llm_refuses_data_parallelism():
    from tokenmill import LLM

    with pytest.raises(ValueError, match="behind the server only"):
        LLM("unused", data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        LLM("unused", data_parallel_size=0)


@pytest.fixture(scope="module")
def server(tiny_model):
    # Stats lines every half second: test_greedy_text_matches... reads them.
    server = RemoteServer(tiny_model, *SERVER_ARGS, env={"TOKENMILL_LOG_STATS_INTERVAL": "0.5"})
    yield server
    server.stop()


def engine_cores(server: RemoteServer) -> list[int]:
    return [pid for pid in descendants(server.proc.pid) if "spawn_main" in cmdline(pid)]


def per_engine(server: RemoteServer, name: str) -> dict[str, float]:
    """engine index -> value of tokenmill:engine_<name>."""
    text = httpx.get(server.url("/metrics"), timeout=10).text
    return {s.labels["engine"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == f"tokenmill:engine_{name}"}


def finished(server: RemoteServer) -> dict[str, float]:
    return per_engine(server, "requests_finished_total")


def running(server: RemoteServer) -> dict[str, float]:
    return per_engine(server, "num_requests_running")


def wait_for(condition, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


STATS_LINE = re.compile(r"Engine (\d{3}): Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
                        r"([\d.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, "
                        r"Prefix cache hit rate: [\d.]+%")


def stats_lines(server: RemoteServer) -> list[tuple[str, float]]:
    """(engine, generation tokens/s) of each periodic stats line the server logged."""
    return [(m[1], float(m[2])) for m in STATS_LINE.finditer(server.log_tail(10_000_000))]


def complete(server: RemoteServer, prompt: str, max_tokens: int = 12) -> str:
    response = server.openai_client().completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                         temperature=0.0, extra_body={"ignore_eos": True})
    return response.choices[0].text


def test_greedy_text_matches_one_engine_and_spreads_over_both_replicas(server, tiny_model):
    from tokenmill import LLM, SamplingParams

    reference = LLM(tiny_model, **ENGINE).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    before = finished(server)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: complete(server, p), PROMPTS))
    assert texts == [output.outputs[0].text for output in reference]
    after = finished(server)
    assert sum(after.values()) - sum(before.values()) == len(PROMPTS)
    assert all(after[e] > before[e] for e in ("0", "1")), (before, after)
    # Each replica's periodic stats line (vLLM's) shows the tokens it served.
    wait_for(lambda: {"000", "001"} <= {engine for engine, generated in stats_lines(server) if generated > 0},
             "a stats line of each replica with generated tokens")


def test_a_shared_prefix_lands_on_one_replica(server):
    system = "You are a careful assistant. Answer briefly and cite the facts you rely on. " * 3  # ~50 tokens
    questions = ("Why is the sky blue?", "What is 2 + 2?", "Name a prime.", "Who wrote Hamlet?", "Hi")
    before = finished(server)
    for question in questions:  # one at a time: both replicas idle, so load alone would alternate
        complete(server, system + question, max_tokens=4)
    after = finished(server)
    assert sorted(after[e] - before[e] for e in ("0", "1")) == [0, len(questions)], (before, after)


@contextlib.contextmanager
def long_streams(server: RemoteServer, num: int):
    """`num` long greedy streams, one per idle replica, each open once it runs: (replica, response, lines) each."""
    with httpx.Client(timeout=60) as http, contextlib.ExitStack() as stack:
        streams = []
        for i in range(num):
            idle = {engine for engine, count in running(server).items() if count == 0}
            body = {"model": MODEL, "prompt": PROMPTS[i], **LONG}
            response = stack.enter_context(http.stream("POST", server.url("/v1/completions"), json=body))
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            # Where it runs: the replica that was idle and is not now (the stream has a long way to go).
            replica = wait_for(lambda idle=idle: [e for e, n in running(server).items() if e in idle and n == 1],
                               f"stream {i} running")
            assert len(replica) == 1, replica
            streams.append((replica[0], response, lines))
        yield streams


def test_an_abort_reaches_the_replica_of_its_request(server):
    with long_streams(server, 2) as streams:
        left, response, _ = streams[0]
        response.close()  # the client leaves: its request is aborted where it runs, the other runs on
        wait_for(lambda: running(server)[left] == 0, "the aborted request's replica idle")
        assert per_engine(server, "kv_cache_usage_perc")[left] == 0
    wait_for(lambda: set(running(server).values()) == {0}, "both idle")


def test_killing_one_replica_fails_only_its_requests_and_it_restarts(server):
    cores = engine_cores(server)
    assert len(cores) == 2
    with long_streams(server, 2) as streams:
        os.kill(cores[0], signal.SIGKILL)
        # The log names the replica that died; its gauges dropped to zero as it failed.
        exited = re.compile(r"the replica-(\d+) engine core process exited")
        dead = wait_for(lambda: exited.search(server.log_tail(10_000_000)), "the exit logged")[1]
        assert running(server)[dead] == 0
        # Its stream ends with engine_dead, the other one runs to its end.
        for replica, _, lines in streams:
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            ending = "engine_dead" if "error" in events[-1] else events[-1]["choices"][0]["finish_reason"]
            assert ending == ("engine_dead" if replica == dead else "length"), (replica, dead)
    # The server stayed healthy: the other replica served meanwhile.
    assert httpx.get(server.url("/health")).status_code == 200
    assert complete(server, "Still serving") is not None
    # The killed replica comes back (a new process) and takes requests again.
    wait_for(lambda: len(engine_cores(server)) == 2 and cores[0] not in engine_cores(server), "a new core", 60)
    served_by_dead = finished(server)[dead]
    wait_for(lambda: complete(server, "Are you back?", 2) is not None and finished(server)[dead] > served_by_dead,
             "the restarted replica to serve", 120)
    assert "Traceback" not in server.log_tail(100_000).split("engine core process exited")[-1]


def visible_devices(pid: int) -> str | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    value = env.get(b"CUDA_VISIBLE_DEVICES")
    return None if value is None else value.decode()


@pytest.mark.gpu
@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (2, 2)])
def test_each_replica_runs_on_its_own_gpus(tiny_model, dp, tp):
    """Replica r sees GPUs r*tp to (r+1)*tp-1 alone (its tensor-parallel ranks too), every one of them is used,
    and the greedy text is the one-GPU engine's."""
    import torch

    from tokenmill import LLM, SamplingParams

    if torch.cuda.device_count() < dp * tp or "CUDA_VISIBLE_DEVICES" in os.environ:
        pytest.skip(f"needs {dp * tp} GPUs, all visible")
    engine = dict(ENGINE, kv_cache_space=0.5)
    reference = LLM(tiny_model, **engine).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    free_before = [torch.cuda.mem_get_info(i)[0] for i in range(dp * tp)]
    server = RemoteServer(tiny_model, "--served-model-name", MODEL, "-dp", str(dp), "-tp", str(tp),
                          "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-space", "0.5")
    try:
        cores = engine_cores(server)
        assert len(cores) == dp
        groups = sorted(visible_devices(pid) for pid in cores)
        assert groups == [",".join(str(r * tp + i) for i in range(tp)) for r in range(dp)]
        for pid in cores:  # the tensor-parallel ranks inherit their replica's GPUs
            assert all(visible_devices(child) == visible_devices(pid) for child in descendants(pid))
        used = [before - torch.cuda.mem_get_info(i)[0] for i, before in enumerate(free_before)]
        assert all(u > 256 * 2**20 for u in used), used
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(lambda p: complete(server, p), PROMPTS))
        assert texts == [output.outputs[0].text for output in reference]
        assert all(n > 0 for n in finished(server).values())
    finally:
        server.stop()
