"""`tokenmill bench serve`: load an OpenAI-compatible server (tokenmill's, vLLM's, ...) with streamed completions of
synthetic prompts, and report throughput and latency, with vLLM's `vllm bench serve` flags, metrics and JSON
result keys, so the two can be compared run for run.

Prompts are random token ids drawn from the server's own tokenization of a built-in text, sent as token-id
prompts, so every request has exactly the prompt length drawn; the random dataset ignores EOS (as vLLM's does),
and so does any with --ignore-eos, so every request generates exactly its output length. Requests are greedy
(temperature 0) unless --temperature is given, and carry --top-p, ... where given (as vLLM's). The datasets are
vLLM's (serve_datasets.py): `random`, with an optional shared prefix and spread of lengths, and
`prefix_repetition`, a few long prefixes each shared by many requests. Requests arrive at --request-rate per
second (all at once by default): Poisson arrivals, or gamma-distributed gaps with --burstiness other than 1 (as
vLLM's); at most --max-concurrency in flight. Every streamed chunk counts as tokens arriving (for ITL and the peak
output throughput), as vLLM's benchmark counts them. The report and the result file are vLLM's: its printed lines,
its JSON keys (with --save-detailed, its per-request lists), its file name. The server's /metrics, read before and
after the run, add the run's speculative decoding acceptance (tokenmill's or vLLM's spec_decode_* counters) and
the server's own mean TTFT and queue time and prefix-cache hit rate (server_metrics.py), where it has them.
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
from datetime import datetime

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
    parser.add_argument("--served-model-name", default=None, help="with --model: the name to send instead")
    parser.add_argument("--api-key", default=None,
                        help="bearer key, if the server wants one (default: $TOKENMILL_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    serve_datasets.add_cli_args(parser)
    parser.add_argument("--input-len", type=int, default=None, help="sets --random-input-len (as vLLM's)")
    parser.add_argument("--output-len", type=int, default=None,
                        help="sets --random-output-len and --prefix-repetition-output-len (as vLLM's)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate every request's whole output length, whatever the model samples (the "
                             "random dataset always does, as vLLM's)")
    sampling = parser.add_argument_group("sampling parameters (default: temperature 0, the others the server's)")
    for flag, kind in SAMPLING_FLAGS.items():
        sampling.add_argument(f"--{flag.replace('_', '-')}", type=kind, default=None)
    parser.add_argument("--request-rate", type=_rates, default=[math.inf],
                        help="requests per second (default: inf, all at once); several, comma-separated "
                             "(4,8,16,inf), sweep: one run per rate, a table, and --plot")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="with several rates: TTFT and TPOT against the rate, drawn with matplotlib")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps: 1 is Poisson, lower is burstier, inf is even gaps")
    # At least 1: a negative limit left the run waiting forever, 0 meant none.
    parser.add_argument("--max-concurrency", type=at_least(1), default=None, help="most requests in flight")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help="metrics whose percentiles are reported, of ttft, tpot, itl, e2el")
    parser.add_argument("--metric-percentiles", "--percentiles", type=_percentiles, default=[99.0],
                        help="comma-separated percentiles reported for those metrics (the median always is)")
    parser.add_argument("--goodput", nargs="+", type=_slo, default=None, metavar="KEY:VALUE",
                        help="objectives (ms) of ttft, tpot, e2el: request_goodput counts the requests within all")
    parser.add_argument("--num-warmups", type=int, default=0,
                        help="requests of the first prompt sent before the run, not counted")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of prompts and arrival times (a sweep's i-th rate uses seed + i)")
    parser.add_argument("--save-result", action="store_true", help="write the results as JSON")
    parser.add_argument("--save-detailed", action="store_true",
                        help="with the results, each request's input and output length, TTFT, ITLs, start time, "
                             "text and error")
    parser.add_argument("--result-dir", default=".", help="folder of --save-result's file (made if missing)")
    parser.add_argument("--result-filename", default=None,
                        help="name of --save-result's file (default, as vLLM's: "
                             "LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    parser.add_argument("--label", default=None, help="first part of the result file's name (default: --backend)")
    parser.add_argument("--metadata", nargs="*", type=_key_value, default=[], metavar="KEY=VALUE",
                        help="pairs written into the result file")
    parser.add_argument("--result-file", default=None, help="write the results as JSON to this path")
    parser.add_argument("--disable-tqdm", action="store_true",
                        help="accepted for vLLM's command lines: there is no progress bar")


SAMPLING_FLAGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "frequency_penalty": float,
                  "presence_penalty": float, "repetition_penalty": float}


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    start_time: float = 0.0
    """time.perf_counter() when the request was sent."""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""


async def _get_model_and_vocab(client, args) -> tuple[str, str, list[int]]:
    """The model name to send, the model's id for the result (as vLLM's: the server's first model's root, its
    path, or --model), and the vocabulary of the prompts."""
    name, model_id = args.served_model_name or args.model, args.model
    if model_id is None:
        response = await client.get("/v1/models")
        response.raise_for_status()
        card = response.json()["data"][0]
        name, model_id = card["id"], card.get("root") or card["id"]
    response = await client.post("/tokenize", json={"model": name, "prompt": SEED_TEXT, "add_special_tokens": False})
    response.raise_for_status()
    return name, model_id, sorted(set(response.json()["tokens"]))


def request_body(args: argparse.Namespace, model: str, request: BenchRequest) -> dict:
    sampling = {flag: getattr(args, flag) for flag in SAMPLING_FLAGS if getattr(args, flag) is not None}
    sampling.setdefault("temperature", 0.0)  # vLLM's benchmark defaults to greedy decoding
    return {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "ignore_eos": args.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}


async def _one_request(client, args: argparse.Namespace, model: str, request: BenchRequest) -> RequestResult:
    body = request_body(args, model, request)
    start = last = time.perf_counter()
    result = RequestResult(prompt_len=len(request.prompt_token_ids), start_time=start)
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
                    result.generated_text += chunk["choices"][0].get("text") or ""
                    now = time.perf_counter()
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, num_chunks = now, num_chunks + 1
        result.latency = last - start  # as vLLM's: at the last chunk of text, not the usage chunk or [DONE]
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


def _percentiles(text: str) -> list[float]:
    try:
        percentiles = [float(part) for part in text.split(",")]
    except ValueError:
        percentiles = []
    if not percentiles or not all(0 <= p <= 100 for p in percentiles):  # nan too
        raise argparse.ArgumentTypeError(f"percentiles must be numbers from 0 to 100, got {text!r}")
    return percentiles


def _slo(text: str) -> tuple[str, float]:
    key, _, value = text.partition(":")
    try:
        objective = float(value)
    except ValueError:
        objective = -1.0
    if key not in ("ttft", "tpot", "e2el") or not objective >= 0:
        raise argparse.ArgumentTypeError(f"expected KEY:VALUE, KEY one of ttft, tpot, e2el, VALUE milliseconds "
                                         f"(at least 0), got {text!r}")
    return key, objective


def _key_value(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def arrival_times(num: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds after the start at which each request is sent, as vLLM's: gaps (the first request's too)
    gamma-distributed with mean 1 / rate (burstiness 1: exponential, i.e. Poisson arrivals; inf: even), then
    scaled so that the last request goes at num / rate; all at 0 at an infinite rate."""
    if not math.isfinite(rate):
        return [0.0] * num
    if math.isinf(burstiness):
        gaps = [1.0 / rate] * num
    else:
        gaps = [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num)]
    times = list(np.cumsum(gaps))
    return [float(t * (num / rate) / times[-1]) for t in times]


async def _run(args: argparse.Namespace) -> tuple[str, list[RequestResult], float, dict]:
    """The model's id, the requests' results, the run's duration, and the run's spec_decode.summary() and
    server_metrics.summary()."""
    import httpx

    from tokenmill.cli.args import api_key_or_env

    api_key = api_key_or_env(args.api_key)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # Idle connections expire here before any server closes them (uvicorn's default keep-alive is 5 s, as is
    # httpx's expiry): a request sent on a connection being closed fails with ReadError.
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts, max_keepalive_connections=None,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as client:
        model, model_id, vocab = await _get_model_and_vocab(client, args)
        rng = random.Random(args.seed)
        requests = serve_datasets.make_requests(args, vocab, rng)
        times = arrival_times(len(requests), args.request_rate, args.burstiness, rng)
        semaphore = asyncio.Semaphore(args.max_concurrency or len(requests))

        async def limited(request: BenchRequest) -> RequestResult:
            async with semaphore:
                return await _one_request(client, args, model, request)

        await asyncio.gather(*(limited(requests[0]) for _ in range(args.num_warmups)))

        spec_before, server_before = await _read_metrics(client)
        start = time.perf_counter()
        tasks = []
        for request, send_at in zip(requests, times):
            await asyncio.sleep(start + send_at - time.perf_counter())  # at its time, whatever the loop's delays
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        spec_after, server_after = await _read_metrics(client)
        run_summary = {**spec_decode.summary(spec_decode.difference(spec_before, spec_after)),
                       **server_metrics.summary(server_metrics.difference(server_before, server_after))}
        return model_id, results, duration, run_summary


METRICS = ("ttft", "tpot", "itl", "e2el")


def peaks(done: list[RequestResult]) -> tuple[float, int]:
    """vLLM's peak output throughput and peak concurrency: the most chunks that arrived within one second
    (counted from the first request's start), and the most requests running at some time within one second."""
    if not done:
        return 0.0, 0
    first = min(r.start_time for r in done)
    seconds = int(math.ceil(max(r.start_time + r.latency for r in done) - first)) + 1
    chunks, running = np.zeros(seconds), np.zeros(seconds)
    for r in done:
        for arrival in np.cumsum([r.start_time - first + r.ttft, *r.itl]):
            chunks[int(arrival)] += 1
        running[int(r.start_time - first):int(r.start_time - first + r.latency) + 1] += 1
    return float(chunks.max()), int(running.max())


def tpot(r: RequestResult) -> float:
    """vLLM's time per output token: after the first, over the rest; 0 for a one-token request."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def summarize(results: list[RequestResult], duration: float, metrics: list[str], percentiles: list[float],
              goodput: dict[str, float] | None = None) -> dict:
    """vLLM's result keys: throughputs (with `goodput`'s objectives in ms, the goodput) and peaks, then mean /
    median / std / chosen percentiles (ms) of each metric."""
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    max_output_tokens_per_s, max_concurrent_requests = peaks(done)

    def within_slos(r: RequestResult) -> bool:
        return all(1000 * {"ttft": r.ttft, "tpot": tpot(r), "e2el": r.latency}[key] <= slo
                   for key, slo in goodput.items())

    summary = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "request_goodput": None if goodput is None else sum(map(within_slos, done)) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + input_tokens) / duration,
        "max_output_tokens_per_s": max_output_tokens_per_s,
        "max_concurrent_requests": max_concurrent_requests,
    }
    tpots = [tpot(r) for r in done if r.output_tokens > 1]
    series = {"ttft": [r.ttft for r in done], "tpot": tpots, "itl": [x for r in done for x in r.itl],
              "e2el": [r.latency for r in done]}
    for name in metrics:
        values_ms = np.array(series[name] or [0.0]) * 1000
        summary[f"mean_{name}_ms"] = float(values_ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(values_ms))
        summary[f"std_{name}_ms"] = float(values_ms.std())
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(values_ms, p))
    return summary


HEADERS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}

REPORT_LINES = (("Benchmark duration (s):", "duration"), ("Total input tokens:", "total_input_tokens"),
                ("Total generated tokens:", "total_output_tokens"),
                ("Request throughput (req/s):", "request_throughput"),
                ("Output token throughput (tok/s):", "output_throughput"),
                ("Peak output token throughput (tok/s):", "max_output_tokens_per_s"),
                ("Peak concurrent requests:", "max_concurrent_requests"),
                ("Total token throughput (tok/s):", "total_token_throughput"))


def format_report(args: argparse.Namespace, summary: dict, metrics: list[str], percentiles: list[float],
                  extras: dict | None = None) -> str:
    """vLLM's printed result: its lines, in its order and format; then `extras` (the server's own figures and
    the speculative decoding acceptance), one line each."""

    def line(label: str, value) -> str:  # counts as they are, the rest with 2 decimals
        return f"{label:<40} {value:<10}" if isinstance(value, int) else f"{label:<40} {value:<10.2f}"

    lines = [" Serving Benchmark Result ".center(50, "="), line("Successful requests:", summary["completed"]),
             line("Failed requests:", summary["failed"])]
    if args.max_concurrency is not None:
        lines.append(line("Maximum request concurrency:", args.max_concurrency))
    if math.isfinite(args.request_rate):
        lines.append(line("Request rate configured (RPS):", float(args.request_rate)))
    for label, key in REPORT_LINES:
        if key == "output_throughput" and summary["request_goodput"] is not None:
            lines.append(line("Request goodput (req/s):", summary["request_goodput"]))
        # vLLM prints the peak concurrency, a count, with decimals
        lines.append(line(label, float(summary[key]) if key == "max_concurrent_requests" else summary[key]))
    for name in metrics:
        lines.append(HEADERS[name].center(50, "-"))
        lines += [line(f"{stat.capitalize()} {name.upper()} (ms):", summary[f"{stat}_{name}_ms"])
                  for stat in ("mean", "median")]
        lines += [line(f"P{p:g} {name.upper()} (ms):", summary[f"p{p:g}_{name}_ms"]) for p in percentiles]
    if extras:
        lines += ["Server".center(50, "-"), *(format_result_line(key, value) for key, value in extras.items())]
    return "\n".join(lines + ["=" * 50])


def format_result_line(key: str, value) -> str:
    if isinstance(value, float):
        return f"{key:<32} {value:>12.2f}"
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return f"{key:<32} {', '.join(f'{v:.2f}' for v in value)}"  # the per-position acceptance rates
    return f"{key:<32} {value}"


def result_path(args: argparse.Namespace, model_id: str, date: str, sweep: bool = False) -> str | None:
    """Where this rate's JSON goes: --result-file, or with --save-result vLLM's name in --result-dir; in a sweep
    a named file gets the rate before its extension (one per rate)."""
    if args.result_file:
        path = args.result_file
    elif not args.save_result:
        return None
    else:
        concurrency = "" if args.max_concurrency is None else f"-concurrency{args.max_concurrency}"
        name = f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"
        path = os.path.join(args.result_dir, args.result_filename or name)
        if not args.result_filename:
            return path
    if not sweep:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}-{args.request_rate:g}qps{ext}"


def result_record(args: argparse.Namespace, model_id: str, summary: dict, results: list[RequestResult],
                  date: str) -> dict:
    """The result file's contents: vLLM's keys (with --save-detailed, its per-request lists), then ours."""
    record = {"date": date, "endpoint_type": args.backend, "backend": args.backend, "label": args.label,
              "model_id": model_id, "tokenizer_id": model_id, "num_prompts": args.num_prompts,
              "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
              "dataset_name": args.dataset_name, "dataset_params": serve_datasets.dataset_params(args),
              "ignore_eos": args.ignore_eos, "seed": args.seed, **dict(args.metadata), **summary}
    if args.save_detailed:
        record.update(input_lens=[r.prompt_len for r in results],
                      output_lens=[r.output_tokens if r.ok else 0 for r in results],
                      ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                      start_times=[r.start_time for r in results],
                      generated_texts=[r.generated_text for r in results], errors=[r.error for r in results])
    return record


def run_one_rate(args: argparse.Namespace, metrics: list[str], percentiles: list[float], sweep: bool = False) -> dict:
    print(format_result_line("dataset", serve_datasets.describe(args)))
    print(f"Traffic request rate: {args.request_rate}")
    arrivals = "Poisson process" if args.burstiness == 1 else "Gamma distribution"
    print(f"Burstiness factor: {args.burstiness} ({arrivals})")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    model_id, results, duration, run_summary = asyncio.run(_run(args))
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    goodput = None if args.goodput is None else dict(args.goodput)
    summary = {**summarize(results, duration, metrics, percentiles, goodput), **run_summary}
    errors = [r.error for r in results if not r.ok]
    if errors:
        print("Failed requests during benchmark run detected (capping to 10):")
        print("\n".join(f"Error {i}: {error}" for i, error in enumerate(errors[:10])))
    print(format_report(args, summary, metrics, percentiles, run_summary))
    path = result_path(args, model_id, date, sweep)
    if path is not None:
        with open(path, "w") as f:
            json.dump(result_record(args, model_id, summary, results, date), f, indent=2)
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


def apply_vllm_defaults(args: argparse.Namespace) -> None:
    """As vLLM's: --input-len and --output-len set the datasets' lengths, and the random dataset ignores EOS."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.prefix_repetition_output_len = args.output_len
    args.ignore_eos = args.ignore_eos or args.dataset_name == "random"


def main(args: argparse.Namespace) -> int:
    args.base_url = args.base_url or f"http://{args.host}:{args.port}"
    apply_vllm_defaults(args)
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = sorted(set(metrics) - set(METRICS))
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(unknown)}; choose from {', '.join(METRICS)}")
    if not args.burstiness > 0:  # nan passed '<= 0' and its gaps left the run waiting forever
        raise ValueError(f"--burstiness must be a positive number, got {args.burstiness}")
    serve_datasets.check_args(args)
    if (note := serve_datasets.rounding_note(args)) is not None:
        print(note, file=sys.stderr)
    percentiles = args.metric_percentiles
    if args.plot and not {"ttft", "tpot"} <= set(metrics):
        raise ValueError("--plot draws TTFT and TPOT: keep both in --percentile-metrics")
    if args.save_result:  # before the run, as vLLM's: a folder that cannot be made fails now, not after it
        os.makedirs(args.result_dir, exist_ok=True)
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
