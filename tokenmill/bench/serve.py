"""`tokenmill bench serve`: load an OpenAI-compatible server (tokenmill's, vLLM's, ...) with streamed
completions of synthetic prompts, and report throughput and latency, with vLLM's `vllm bench serve` flags,
metrics and JSON result keys, so the two can be compared run for run.

Prompts are random token ids drawn from the server's own tokenization of a built-in text, sent as token-id
prompts, so every request has exactly the prompt length drawn; with --ignore-eos every request generates
exactly its output length. The datasets are vLLM's (serve_datasets.py): `random`, with an optional shared
prefix and spread of lengths, and `prefix_repetition`, a few long prefixes each shared by many requests.
Requests arrive at --request-rate per second (all at once by default): Poisson arrivals, or gamma-distributed
gaps with --burstiness other than 1 (as vLLM's); at most --max-concurrency in flight. Every streamed chunk
counts as tokens arriving (for ITL), as vLLM's benchmark counts them. The server's /metrics, read before and
after the run, add the run's speculative decoding acceptance (tokenmill's or vLLM's spec_decode_* counters)
and the server's own mean TTFT and queue time and prefix-cache hit rate (server_metrics.py), where it has them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from tokenmill.bench import serve_datasets, server_metrics, spec_decode
from tokenmill.bench.offline import at_least
from tokenmill.bench.serve_datasets import BenchRequest
from tokenmill.cli.args import http_url

SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog while the river runs past old mills, grinding grain "
    "into flour for bread. Engineers measure throughput and latency, tune batch sizes, and watch caches "
    "fill and drain as requests arrive at random times from many users around the world."
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", type=http_url, default=None, help="the server, without /v1 (default: http://HOST:PORT)")
    parser.add_argument("--host", type=_host, default="127.0.0.1", help="the server's host, without --base-url")
    parser.add_argument("--port", type=int, default=8000, help="the server's port, without --base-url")
    parser.add_argument("--backend", default="openai", choices=["openai", "vllm", "tokenmill"],
                        help="accepted for vLLM's command lines: every choice speaks OpenAI's completions API")
    parser.add_argument("--endpoint", default="/v1/completions", help="the completions route")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None,
                        help="bearer key, if the server wants one (default: $TOKENMILL_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    serve_datasets.add_cli_args(parser)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate every request's whole output length, whatever the model samples")
    parser.add_argument("--request-rate", type=_rates, default=[math.inf],
                        help="requests per second (default: inf, all at once); several, comma-separated "
                             "(4,8,16,inf), sweep: one run per rate, a table, and --plot")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="with several rates: TTFT and TPOT against the rate, drawn with matplotlib")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps: 1 is Poisson, lower is burstier")
    # At least 1: a negative limit left the run waiting forever, 0 meant none.
    parser.add_argument("--max-concurrency", type=at_least(1), default=None, help="most requests in flight")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help="metrics whose percentiles are reported, of ttft, tpot, itl, e2el")
    parser.add_argument("--metric-percentiles", "--percentiles", default="99",
                        help="comma-separated percentiles reported for those metrics (the median always is)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of prompts and arrival times (a sweep's i-th rate uses seed + i)")
    parser.add_argument("--save-result", action="store_true", help="write the results as JSON")
    parser.add_argument("--result-dir", default=".", help="folder of --save-result's file")
    parser.add_argument("--result-filename", default=None,
                        help="name of --save-result's file (default: tokenmill-<rate>qps-<date>.json)")
    parser.add_argument("--result-file", default=None, help="write the results as JSON to this path")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
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


async def _one_request(client, args: argparse.Namespace, model: str, request: BenchRequest) -> RequestResult:
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": args.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(request.prompt_token_ids))
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with client.stream("POST", args.endpoint, json=body) as response:
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


async def _read_metrics(client) -> tuple:
    """The server's speculative decoding counters (a SpecDecodingStats) and server_metrics' series; each None
    when /metrics has none, or cannot be read (a server without it, a key it refuses): the report then
    leaves them out."""
    try:
        response = await client.get("/metrics")
        if response.status_code != 200:
            return None, None
        return spec_decode.from_metrics(response.text), server_metrics.from_metrics(response.text)
    except Exception:  # whatever stops the read, the benchmark itself is not at stake
        return None, None


def _host(text: str) -> str:
    # A URL here became http://http://...: "cannot reach the server at http://http".
    if "://" in text:
        raise argparse.ArgumentTypeError(f"expected a host name or address, got the URL {text!r}: pass it with "
                                         f"--base-url")
    return text


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:  # argparse would name only the function: "invalid _rates value"
        rates = []
    if not rates or any(not rate > 0 for rate in rates):  # nan too: not a rate
        raise argparse.ArgumentTypeError(f"rates must be positive numbers or inf, got {text!r}")
    return rates


def arrival_gaps(num: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds before each request after the first: gamma-distributed with mean 1 / rate (burstiness 1:
    exponential, i.e. Poisson arrivals), or none at an infinite rate."""
    if not math.isfinite(rate):
        return [0.0] * num
    return [0.0] + [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num - 1)]


@dataclass
class Concurrency:
    """Requests in flight, and the most there were at once."""

    now: int = 0
    peak: int = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1


async def _run(args: argparse.Namespace) -> tuple[list[RequestResult], float, int, dict]:
    """The requests' results, the run's duration, the peak concurrency, and the run's spec_decode.summary()
    and server_metrics.summary()."""
    import httpx

    from tokenmill.cli.args import api_key_or_env

    api_key = api_key_or_env(args.api_key)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # Idle connections expire here before any server closes them (uvicorn's default keep-alive is 5 s, as is
    # httpx's expiry): a request sent on a connection being closed fails with ReadError.
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts, max_keepalive_connections=None,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as client:
        model, vocab = await _get_model_and_vocab(client, args)
        rng = random.Random(args.seed)
        requests = serve_datasets.make_requests(args, vocab, rng)
        gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, rng)
        semaphore = asyncio.Semaphore(args.max_concurrency or len(requests))
        in_flight = Concurrency()

        async def limited(request: BenchRequest) -> RequestResult:
            async with semaphore:
                in_flight.enter()
                try:
                    return await _one_request(client, args, model, request)
                finally:
                    in_flight.leave()

        spec_before, server_before = await _read_metrics(client)
        start = time.perf_counter()
        tasks = []
        for request, gap in zip(requests, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        spec_after, server_after = await _read_metrics(client)
        run_summary = {**spec_decode.summary(spec_decode.difference(spec_before, spec_after)),
                       **server_metrics.summary(server_metrics.difference(server_before, server_after))}
        return results, duration, in_flight.peak, run_summary


METRICS = ("ttft", "tpot", "itl", "e2el")


def summarize(results: list[RequestResult], duration: float, metrics: list[str], percentiles: list[float],
              peak_concurrency: int = 0) -> dict:
    """vLLM's result keys: throughputs, then mean / median / std / chosen percentiles (ms) of each metric."""
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + input_tokens) / duration,
        "max_concurrent_requests": peak_concurrency,
    }
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    series = {"ttft": [r.ttft for r in done], "tpot": tpots, "itl": [x for r in done for x in r.itl],
              "e2el": [r.latency for r in done]}
    for name in metrics:
        values_ms = np.array(series[name] or [0.0]) * 1000
        summary[f"mean_{name}_ms"] = float(values_ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(values_ms))
        summary[f"std_{name}_ms"] = float(values_ms.std())
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(values_ms, p))
    errors = sorted({r.error for r in results if not r.ok and r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def format_result_line(key: str, value) -> str:
    if isinstance(value, float):
        return f"{key:<32} {value:>12.2f}"
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return f"{key:<32} {', '.join(f'{v:.2f}' for v in value)}"  # the per-position acceptance rates
    return f"{key:<32} {value}"


def result_path(args: argparse.Namespace, sweep: bool = False) -> str | None:
    """Where this rate's JSON goes; in a sweep a named file gets the rate before its extension (one per rate)."""
    rate = "inf" if not math.isfinite(args.request_rate) else f"{args.request_rate:g}"
    if args.result_file:
        path = args.result_file
    elif not args.save_result:
        return None
    else:
        path = os.path.join(args.result_dir,
                            args.result_filename or f"tokenmill-{rate}qps-{time.strftime('%Y%m%d-%H%M%S')}.json")
        if not args.result_filename:
            return path
    if not sweep:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}-{rate}qps{ext}"


def run_one_rate(args: argparse.Namespace, metrics: list[str], percentiles: list[float], sweep: bool = False) -> dict:
    results, duration, peak, run_summary = asyncio.run(_run(args))
    summary = {**summarize(results, duration, metrics, percentiles, peak), **run_summary}
    print(f"{'=' * 16} tokenmill bench serve, {args.request_rate:g} req/s {'=' * 16}")
    print(format_result_line("dataset", serve_datasets.describe(args)))
    for key, value in summary.items():
        print(format_result_line(key, value))
    path = result_path(args, sweep)
    if path is not None:
        with open(path, "w") as f:
            json.dump({**vars(args), "request_rate": str(args.request_rate),
                       "dataset_params": serve_datasets.dataset_params(args), **summary}, f, indent=2, default=str)
    return summary


def plot_sweep(rates: list[float], summaries: list[dict], path: str) -> None:
    """Median and p99 TTFT and TPOT against the request rate: where the server saturates."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    finite = [r for r in rates if math.isfinite(r)]
    shown = [r if math.isfinite(r) else 2 * max(finite, default=1) for r in rates]  # inf: drawn past the last
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for stat in ("median", "p99"):
            values = [s.get(f"{stat}_{metric}_ms") for s in summaries]
            if all(v is not None for v in values):
                ax.plot(shown, values, marker="o", label=stat)
        ax.set_xlabel("request rate (req/s; the last point is inf)" if len(finite) < len(rates) else "request rate")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_xticks(shown, [f"{r:g}" for r in rates])
        ax.grid(True, alpha=0.3)
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(args: argparse.Namespace) -> int:
    args.base_url = args.base_url or f"http://{args.host}:{args.port}"
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = sorted(set(metrics) - set(METRICS))
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(unknown)}; choose from {', '.join(METRICS)}")
    if not 0 < args.burstiness < math.inf:  # nan passed '<= 0' and its gaps left the run waiting forever
        raise ValueError(f"--burstiness must be a positive number, got {args.burstiness}")
    serve_datasets.check_args(args)
    if (note := serve_datasets.rounding_note(args)) is not None:
        print(note, file=sys.stderr)
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    if args.plot and not {"ttft", "tpot"} <= set(metrics):
        raise ValueError("--plot draws TTFT and TPOT: keep both in --percentile-metrics")
    rates, summaries, seed = args.request_rate, [], args.seed
    for i, rate in enumerate(rates):
        # Each rate draws its own prompts: the same ones again would be answered from the prefix cache.
        args.request_rate, args.seed = rate, seed + i
        summaries.append(run_one_rate(args, metrics, percentiles, sweep=len(rates) > 1))
    args.seed = seed
    if len(rates) > 1:
        print(f"{'rate':>8} {'out tok/s':>10} {'TTFT med':>9} {'TPOT med':>9} {'ITL mean':>9}")
        for rate, summary in zip(rates, summaries):
            cells = [summary.get(k, float("nan")) for k in ("output_throughput", "median_ttft_ms",
                                                              "median_tpot_ms", "mean_itl_ms")]
            print(f"{rate:>8g} " + " ".join(f"{c:>9.1f}" for c in cells))
    if args.plot:
        plot_sweep(rates, summaries, args.plot)
    return 0 if all(s["completed"] for s in summaries) else 1
