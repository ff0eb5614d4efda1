"""Online serving latency (issue 16's S1): start `tokenmill serve`, load it with `tokenmill bench serve`, stop it.

    python3 benchmarks/serve_latency.py --model benchmarks/models/llama-3.1-8b --tokenizer DIR \
        --request-rate 16 --num-prompts 400 --input-len 1024 --output-len 128 [--code DIR] [--profile-frontend]

The model runs on dummy weights. A tokenizer folder (tokenizer.json ...) is copied beside the config, and the
config's vocab_size set to the tokenizer's, so that the frontend detokenizes real text as in production
(the benchmark configs ship without a tokenizer). --code runs another copy of the package (an earlier commit's
`tokenmill/` folder) for an A/B comparison in one call. --profile-frontend records the HTTP process with
py-spy while the load runs and prints where its time goes. The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a folder with config.json")
    parser.add_argument("--tokenizer", required=True, help="a folder with tokenizer.json")
    parser.add_argument("--code", default=None, help="run this copy of the package (a folder holding tokenmill/)")
    parser.add_argument("--request-rate", default="16")
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--profile-frontend", action="store_true")
    parser.add_argument("--label", default="tokenmill")
    args = parser.parse_args()

    model = make_model(args.model, args.tokenizer)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    code = str(Path(args.code).resolve()) if args.code else str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([code, *filter(None, [env.get("PYTHONPATH")])])
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", model, "--load-format", "dummy", "--port", str(port),
         "--max-model-len", str(args.max_model_len), "--uvicorn-log-level", "warning"],
        env=env, cwd=tempfile.gettempdir(),
    )
    profile = None
    try:
        wait_healthy(url, server)
        if args.profile_frontend:
            raw = os.path.join(tempfile.gettempdir(), f"frontend-{port}.txt")
            profile = subprocess.Popen([find_py_spy(), "record", "-p", str(server.pid), "-r", "250", "-f", "raw",
                                        "-o", raw, "--nonblocking"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        result_file = os.path.join(tempfile.gettempdir(), f"bench-{port}.json")
        bench = subprocess.run(
            [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url,
             "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
             "--random-output-len", str(args.output_len), "--request-rate", args.request_rate, "--ignore-eos",
             "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
             "--result-file", result_file],
            env=env, capture_output=True, text=True,
        )
        print(bench.stdout[-4000:], bench.stderr[-2000:])
        if profile is not None:
            profile.send_signal(signal.SIGINT)
            profile.wait(30)
            print("\n".join(summarize_profile(raw)))
        results = json.loads(Path(result_file).read_text()) if os.path.exists(result_file) else {}
        print(json.dumps({"label": args.label, "rate": args.request_rate, **results}))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(model, ignore_errors=True)


if __name__ == "__main__":
    main()
