"""Cold cost of the sampler warm-up at start-up (GPU): kernels compiled as launched, precompiled together in
threads, and compiled by a background process (as the worker does, there overlapped with loading the model).

Each mode runs in its own process with an empty Triton cache, as on a machine that never compiled them.

    python3 benchmarks/sampler_warmup.py [--vocab-size 128256]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys, time, torch
from tokenmill.sample.sampler import Sampler
from tokenmill.worker import sampler_warmup as w
mode, vocab_size, device = sys.argv[1], int(sys.argv[2]), torch.device("cuda", 0)
torch.zeros(1, device=device)  # CUDA initialised outside the timing
start = time.perf_counter()
if mode == "one after another":
    with torch.inference_mode():
        for params in (w.MIXED, w.SMALL_TOP_K):
            for penalised in (False, True):
                Sampler()(*w._make_case(params, penalised, vocab_size, torch.bfloat16, device))
        torch.cuda.synchronize(device)
elif mode == "background process":
    background = w.compile_sampler_in_background(vocab_size, torch.bfloat16, device)
    background.wait()
    waited = time.perf_counter() - start
    w.warm_up_sampler(Sampler(), vocab_size, torch.bfloat16, device)
    print(f"  (the background process took {waited:.1f} s of it)")
else:
    w.warm_up_sampler(Sampler(), vocab_size, torch.bfloat16, device)
print(f"{mode}: {time.perf_counter() - start:.1f} s from an empty Triton cache, {vocab_size}-token vocabulary")
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab-size", type=int, default=128256)  # Llama-3.1-8B's, W5's model
    args = parser.parse_args()
    for mode in ("one after another", "precompiled", "background process"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
            subprocess.run([sys.executable, "-c", CHILD, mode, str(args.vocab_size)], cwd=ROOT, env=env, check=True)


if __name__ == "__main__":
    main()
