"""Online serving latency (issue 16's S1): start `tokenmill serve`, load it with `tokenmill bench serve`, stop it.

    python3 benchmarks/serve_latency.py --model benchmarks/models/llama-3.1-8b --tokenizer DIR \
        --request-rate 16 --num-prompts 400 --input-len 1024 --output-len 128 [--code DIR] [--profile-frontend] \
        [BENCH SERVE FLAGS, e.g. --dataset-name prefix_repetition --prefix-repetition-prefix-len 768 ...]

The model runs on dummy weights. A tokenizer folder (tokenizer.json ...) is copied beside the config, and the
config's vocab_size set to the tokenizer's, so that the frontend detokenizes real text as in production
(the benchmark configs ship without a tokenizer). --code runs another copy of the package (an earlier commit's
`tokenmill/` folder) for an A/B comparison in one call. --profile-frontend (--profile-core) records the HTTP
process (the engine core) with py-spy while the load runs and prints where its time goes; --profile-engine S
records S seconds of the engine core with torch.profiler (POST /start_profile, /stop_profile) and prints
trace_steps.py's summary of its steps; --server-args passes flags to `tokenmill serve` (e.g.
"--max-num-batched-tokens 2048"). Flags this script does not know go to
`tokenmill bench serve` as they are (its datasets: --dataset-name prefix_repetition, --random-prefix-len, ...).

The server's /metrics, read before and after the load, give its own mean TTFT and queue time (histogram sum /
count) and prefix-cache hit rate, printed next to the client's TTFT: the client's TTFT splits into queueing,
the rest of the server's TTFT (prefill), and what lies outside the server (HTTP, frontend). These are read
here rather than taken from the client's result, so that a --code copy whose client lacks them has them too.
The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trace_steps  # noqa: E402  (beside this file)

from tokenmill.bench import server_metrics  # noqa: E402


def make_model(config_dir: str, tokenizer_dir: str) -> str:
    folder = tempfile.mkdtemp(prefix="serve-model-")
    config = json.loads(Path(config_dir, "config.json").read_text())
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), folder)
    spec = json.loads(Path(tokenizer_dir, "tokenizer.json").read_text())
    ids = [*spec["model"]["vocab"].values(), *(token["id"] for token in spec.get("added_tokens", []))]
    config["vocab_size"] = max(ids) + 1  # every id the model can sample has text
    Path(folder, "config.json").write_text(json.dumps(config))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become healthy")


def find_py_spy() -> str:
    """On PATH, beside this Python, or in a --target install on PYTHONPATH (how the GPU machine gets it)."""
    places = [Path(sys.executable).parent, *(Path(p) / "bin" for p in os.environ.get("PYTHONPATH", "").split(":") if p)]
    found = shutil.which("py-spy") or next((str(d / "py-spy") for d in places if (d / "py-spy").exists()), None)
    if found is None:
        raise FileNotFoundError("py-spy is not installed (pip install py-spy)")
    return found


def engine_core_pid(server_pid: int) -> int:
    """The server's child with the most resident memory: the engine core, which holds the model."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()

    def resident_pages(pid: str) -> int:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1])

    return int(max(children, key=resident_pages))


def summarize_profile(raw: str, top: int = 30) -> list[str]:
    """py-spy's raw (collapsed) stacks -> the functions with the most inclusive and self time."""
    inclusive, own, total = collections.Counter(), collections.Counter(), 0
    for line in Path(raw).read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        frames = []
        for frame in stack.split(";"):
            name, _, where = frame.partition(" (")
            frames.append(f"{name} {where.split(':')[0].rsplit('/', 1)[-1]}")
        total += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
        own[frames[-1]] += int(count)
    lines = [f"{total} samples; inclusive:"]
    lines += [f"  {100 * n / total:5.1f}% {f}" for f, n in inclusive.most_common(top)]
    lines += ["self:"] + [f"  {100 * n / total:5.1f}% {f}" for f, n in own.most_common(top)]
    return lines


KEY_METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "mean_tpot_ms", "mean_itl_ms", "p99_itl_ms",
               "median_e2el_ms", "output_throughput")


def read_metrics(url: str) -> dict[str, float] | None:
    import httpx

    return server_metrics.from_metrics(httpx.get(url + "/metrics", timeout=30).text)


def server_side_lines(server: dict, client: dict, num_rates: int) -> list[str]:
    """server_metrics.summary() of the load, beside the client's mean TTFT (one rate only: with several the
    server's figures cover them all, the client's result file only the last)."""
    lines = []
    if "server_mean_ttft_ms" in server:
        ttft, queue = server["server_mean_ttft_ms"], server.get("server_mean_queue_time_ms", 0.0)
        lines.append(f"server mean TTFT {ttft:.1f} ms = queue {queue:.1f} ms + scheduled to first token "
                     f"{ttft - queue:.1f} ms")
        if num_rates == 1 and "mean_ttft_ms" in client:
            lines.append(f"client mean TTFT {client['mean_ttft_ms']:.1f} ms = server {ttft:.1f} ms + outside the "
                         f"server (HTTP, frontend) {client['mean_ttft_ms'] - ttft:.1f} ms")
    if "server_prefix_cache_hit_rate" in server:
        lines.append(f"prefix cache hit rate {server['server_prefix_cache_hit_rate']:.1%} "
                     f"({server['server_prefix_cache_hits']} of {server['server_prefix_cache_queries']} prompt tokens)")
    return lines


def profile_engine(url: str, args, bench: subprocess.Popen) -> list[str]:
    """Record the engine for --profile-engine seconds once the load has reached its steady state (a third of
    the first rate's arrivals in); returns the trace files."""
    import httpx

    first_rate = float(args.request_rate.split(",")[0])
    time.sleep(min(args.num_prompts / first_rate / 3, 20.0) if first_rate != float("inf") else 2.0)
    if bench.poll() is not None:
        return []
    httpx.post(url + "/start_profile", timeout=60).raise_for_status()
    time.sleep(args.profile_engine)
    reply = httpx.post(url + "/stop_profile", timeout=600)
    reply.raise_for_status()
    return reply.json()["trace_files"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", required=True, help="a folder with config.json")
    parser.add_argument("--tokenizer", required=True, help="a folder with tokenizer.json")
    parser.add_argument("--code", default=None, help="run this copy of the package (a folder holding tokenmill/)")
    parser.add_argument("--request-rate", default="16")
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--profile-frontend", action="store_true", help="py-spy the HTTP process during the load")
    parser.add_argument("--profile-core", action="store_true",
                        help="py-spy the engine core process (the server's busiest child) during the load")
    parser.add_argument("--profile-engine", type=float, default=0.0, metavar="SECONDS",
                        help="record the engine core with torch.profiler for SECONDS in the middle of the load "
                             "(POST /start_profile, /stop_profile) and print trace_steps.py's summary")
    parser.add_argument("--trace-dir", default=None, help="keep the engine trace here (default: a temporary folder)")
    parser.add_argument("--label", default="tokenmill")
    parser.add_argument("--server-args", default="", help="more `tokenmill serve` flags, one string "
                        "(e.g. \"--max-num-batched-tokens 1024\")")
    args, bench_args = parser.parse_known_args()

    model = make_model(args.model, args.tokenizer)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    code = str(Path(args.code).resolve()) if args.code else str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([code, *filter(None, [env.get("PYTHONPATH")])])
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="engine-trace-")
    profiler_args = ["--profiler-dir", trace_dir] if args.profile_engine else []
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", model, "--load-format", "dummy", "--port", str(port),
         "--max-model-len", str(args.max_model_len), "--uvicorn-log-level", "warning", *profiler_args,
         *shlex.split(args.server_args)],
        env=env, cwd=tempfile.gettempdir(),
    )
    profile = None
    try:
        wait_healthy(url, server)
        if args.profile_frontend or args.profile_core:
            raw = os.path.join(tempfile.gettempdir(), f"py-spy-{port}.txt")
            pid = engine_core_pid(server.pid) if args.profile_core else server.pid
            profile = subprocess.Popen([find_py_spy(), "record", "-p", str(pid), "-r", "250", "-f", "raw",
                                        "-o", raw, "--nonblocking"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        result_file = os.path.join(tempfile.gettempdir(), f"bench-{port}.json")
        metrics_before = read_metrics(url)
        bench = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url,
             "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
             "--random-output-len", str(args.output_len), "--request-rate", args.request_rate, "--ignore-eos",
             "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
             "--result-file", result_file, *bench_args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        traces = profile_engine(url, args, bench) if args.profile_engine else []
        stdout, stderr = bench.communicate()
        print(stdout[-4000:], stderr[-2000:])
        for trace in traces:
            print("\n".join(trace_steps.summarize(trace_steps.load(trace))))
        if profile is not None:
            profile.send_signal(signal.SIGINT)
            profile.wait(30)
            print("\n".join(summarize_profile(raw, top=45)))
        rates = args.request_rate.split(",")
        files = [result_file] if len(rates) == 1 else [
            result_file.replace(".json", f"-{'inf' if r.strip() == 'inf' else f'{float(r):g}'}qps.json") for r in rates]
        per_rate = [json.loads(Path(f).read_text()) for f in files if os.path.exists(f)]
        for result in per_rate:
            print(f"rate {result['request_rate']}: " + ", ".join(
                f"{key} {result[key]:.1f}" for key in KEY_METRICS if key in result))
        results = per_rate[-1] if per_rate else {}
        server_side = server_metrics.summary(server_metrics.difference(metrics_before, read_metrics(url)))
        print("\n".join(server_side_lines(server_side, results, len(args.request_rate.split(",")))))
        print(json.dumps({"label": args.label, "rate": args.request_rate, **results, "server_side": server_side}))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(model, ignore_errors=True)


if __name__ == "__main__":
    main()
