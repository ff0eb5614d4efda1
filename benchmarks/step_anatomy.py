"""Where a throughput run's time goes, step by step: host stages, and how long the host waits for the GPU.

With async scheduling the host prepares step N+1 while the GPU runs step N and then waits for step N's
tokens. A step whose wait is near zero was host-bound (the GPU idled); a long wait means GPU-bound.

    PYTHONPATH=. python3 benchmarks/step_anatomy.py                     # W3: Qwen3-0.6B, 256 x [100, 1024]
    PYTHONPATH=. python3 benchmarks/step_anatomy.py --num-prompts 8 --num-layers 1 --max-len 64   # CPU dry run
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import time
import warnings

import numpy as np

from tokenmill import LLM, SamplingParams
from tokenmill.bench.offline import draw_lengths, random_prompts, with_num_layers
from tokenmill.engine.core import EngineCore
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.pending_output import PendingOutput

STAGES = collections.defaultdict(float)
STEPS: list[dict] = []


def timed(cls, name: str, key: str) -> None:
    original = getattr(cls, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            STAGES[key] += time.perf_counter() - start

    setattr(cls, name, wrapper)


def instrument(profiler: cProfile.Profile | None = None, profile_decode: bool = False) -> None:
    timed(Scheduler, "schedule", "scheduler.schedule")
    timed(Scheduler, "update_from_output", "scheduler.update_from_output")
    timed(ModelRunner, "execute_model", "model_runner.execute_model (launch)")
    timed(OutputProcessor, "process_outputs", "output_processor")
    timed(PendingOutput, "result", "pending.result (wait + host copy-out)")
    original_step = EngineCore.step

    def step(core):
        wait_before = STAGES["pending.result (wait + host copy-out)"]
        start = time.perf_counter()
        num_running = len(core.scheduler.running)
        # The steps to profile: those admitting requests (prefills), or else the pure decode steps.
        profiled = profiler is not None and (len(core.scheduler.waiting) > 0) != profile_decode
        if profiled:
            profiler.enable()
        out = original_step(core)
        if profiled:
            profiler.disable()
        so = core._in_flight[0] if core._in_flight is not None else None  # the step just launched
        STEPS.append(dict(
            wall=time.perf_counter() - start,
            wait=STAGES["pending.result (wait + host copy-out)"] - wait_before,
            running=num_running,
            tokens=so.total_num_scheduled_tokens if so is not None else 0,
        ))
        return out

    EngineCore.step = step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="benchmarks/models/qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers, for a CPU dry run")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--profile-admission", action="store_true",
                        help="cProfile the steps taken while requests still wait for admission (the prefills)")
    parser.add_argument("--profile-decode", action="store_true", help="cProfile the steps after admission")
    parser.add_argument("--sync-check", action="store_true",
                        help="report where the host synchronises with the GPU (torch's sync debug mode)")
    args = parser.parse_args()
    model = with_num_layers(args.model, args.num_layers)
    import torch

    on_gpu = torch.cuda.is_available()
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, async_scheduling=args.async_scheduling,
              kv_cache_space=None if on_gpu else 2.0, max_model_len=2 * args.max_len + 16)
    rng = np.random.default_rng(0)
    vocab = llm.engine.hf_config.vocab_size

    def workload():
        in_lens = draw_lengths(rng, 0, [args.min_len, args.max_len], args.num_prompts)
        out_lens = draw_lengths(rng, 0, [args.min_len, args.max_len], args.num_prompts)
        prompts = random_prompts(rng, in_lens, vocab)
        params = [SamplingParams(temperature=1.0, max_tokens=int(n), ignore_eos=True) for n in out_lens]
        return prompts, params, int(out_lens.sum())

    llm.generate(*workload()[:2], use_tqdm=False)  # warm-up
    profiler = cProfile.Profile() if args.profile_admission or args.profile_decode else None
    instrument(profiler, args.profile_decode)
    prompts, params, num_out = workload()
    with warnings.catch_warnings(record=True) as syncs:
        if args.sync_check and on_gpu:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        total = time.perf_counter() - start
        if on_gpu:
            torch.cuda.set_sync_debug_mode(0)
    if args.sync_check:
        places = collections.Counter(f"{w.filename}:{w.lineno}" for w in syncs)
        print("synchronising calls:", dict(places.most_common(12)) or "none")

    steps = len(STEPS)
    print(f"\n{args.num_prompts} prompts, lengths [{args.min_len}, {args.max_len}], {model}, "
          f"{torch.cuda.get_device_name() if on_gpu else 'cpu'}")
    print(f"total {total:.2f} s, {steps} steps, {num_out / total:.0f} out tok/s, {total / steps * 1e3:.2f} ms/step")
    print(f"{'stage':45s} {'total s':>8s} {'ms/step':>8s}")
    for key, value in sorted(STAGES.items(), key=lambda kv: -kv[1]):
        print(f"{key:45s} {value:8.2f} {value / steps * 1e3:8.3f}")
    wall = np.array([s["wall"] for s in STEPS]) * 1e3
    wait = np.array([s["wait"] for s in STEPS]) * 1e3
    running = np.array([s["running"] for s in STEPS])
    tokens = np.array([s["tokens"] for s in STEPS])
    print(f"\n{'steps':>18s} {'count':>6s} {'wall ms':>8s} {'wait ms':>8s} {'host ms':>8s}")
    buckets = [("prefill (>running)", tokens > running)]
    for lo, hi in ((193, 256), (129, 192), (65, 128), (1, 64)):
        buckets.append((f"decode B {lo}-{hi}", (tokens <= running) & (running >= lo) & (running <= hi)))
    for name, mask in buckets:
        if mask.any():
            print(f"{name:>18s} {mask.sum():6d} {wall[mask].mean():8.2f} {wait[mask].mean():8.2f} "
                  f"{(wall[mask] - wait[mask]).mean():8.2f}")
    if profiler is not None:
        print(f"\n{'decode steps' if args.profile_decode else 'steps while requests waited for admission'}, "
              "by cumulative time:")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

