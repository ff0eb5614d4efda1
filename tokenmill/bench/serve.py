"""`tokenmill bench serve`: load an OpenAI-compatible server (tokenmill's, vLLM's, ...) with streamed
completions of random prompts, and report throughput and latency percentiles.

Prompts are random token ids drawn from the server's own tokenization of a built-in text, sent as
token-id prompts, so every request has exactly --random-input-len tokens; outputs ignore EOS, so
every request generates exactly --random-output-len tokens. Requests arrive as a Poisson process
at --request-rate (all at once by default), at most --max-concurrency in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np

SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog while the river runs past old mills, grinding grain "
    "into flour for bread. Engineers measure throughput and latency, tune batch sizes, and watch caches "
    "fill and drain as requests arrive at random times from many users around the world."
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None,
                        help="bearer key, if the server wants one (default: $TOKENMILL_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    parser.add_argument("--random-input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--random-output-len", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--percentiles", default="50,90,99", help="comma-separated latency percentiles")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    parser.add_argument("--result-file", default=None, help="also write the results as JSON here")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


async def _get_model_and_vocab(client, args) -> tuple[str, list[int]]:
    model = args.model
    if model is None:
        response = await client.get("/v1/models")
        response.raise_for_status()
        model = response.json()["data"][0]["id"]
    response = await client.post("/tokenize", json={"model": model, "prompt": SEED_TEXT, "add_special_tokens": False})
    response.raise_for_status()
    return model, sorted(set(response.json()["tokens"]))


async def _one_request(client, model: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult()
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # every chunk, its text empty or not, as vLLM's benchmark counts
                    now = time.perf_counter()
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, num_chunks = now, num_chunks + 1
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or num_chunks
        result.ok = num_chunks > 0
    except Exception as e:  # a benchmark reports failures rather than dying on the first one
        result.error = repr(e)
    return result


async def _run(args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    import httpx

    from tokenmill.cli.args import api_key_or_env

    api_key = api_key_or_env(args.api_key)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as client:
        model, vocab = await _get_model_and_vocab(client, args)
        rng = random.Random(args.seed)
        prompts = [[rng.choice(vocab) for _ in range(args.random_input_len)] for _ in range(args.num_prompts)]
        semaphore = asyncio.Semaphore(args.max_concurrency or args.num_prompts)

        async def limited(prompt: list[int]) -> RequestResult:
            async with semaphore:
                return await _one_request(client, model, prompt, args.random_output_len)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float, input_len: int, percentiles: list[float]) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + input_len * len(done)) / duration,
    }
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    series = {"ttft": [r.ttft for r in done], "tpot": tpots, "itl": [x for r in done for x in r.itl],
              "e2el": [r.latency for r in done]}
    for name, values in series.items():
        values_ms = np.array(values or [0.0]) * 1000
        summary[f"mean_{name}_ms"] = float(values_ms.mean())
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(values_ms, p))
    errors = sorted({r.error for r in results if not r.ok and r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def main(args: argparse.Namespace) -> int:
    results, duration = asyncio.run(_run(args))
    percentiles = [float(p) for p in args.percentiles.split(",")]
    summary = summarize(results, duration, args.random_input_len, percentiles)
    print(f"{'=' * 16} tokenmill bench serve {'=' * 16}")
    for key, value in summary.items():
        print(f"{key:<32} {value:>12.2f}" if isinstance(value, float) else f"{key:<32} {value}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({**vars(args), **summary}, f, indent=2, default=str)
    return 0 if summary["completed"] else 1
