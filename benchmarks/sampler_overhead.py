"""What the sampler costs per decode step at batch 256 (Qwen3-0.6B, dummy weights), on the GPU.

Runs 256 requests to steady-state decoding, then times engine steps (the median of their wall times: in
steady state that is the step time, whether or not the engine overlaps scheduling with the GPU),
the sampler's kernels (CUDA events around Sampler.forward) and the host-side build of its metadata.

    python3 benchmarks/sampler_overhead.py [--model benchmarks/models/qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
import warnings

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.offline import with_num_layers
from tokenmill.sample.sampler import Sampler
from tokenmill.sample.state import SamplingState

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "top-p": dict(temperature=0.8, top_p=0.95),
    "top-k+top-p": dict(temperature=0.8, top_k=50, top_p=0.95),
    "penalties+min_p": dict(temperature=0.8, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2),
    "penalties+top-p": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1),
}


class Timers:
    def __init__(self) -> None:
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_s: list[float] = []
        self.forward_host_s: list[float] = []  # the host's time in Sampler.forward: mostly kernel launches
        self.cpu_ms: list[float] = []
        self.last_call: tuple | None = None  # (sampler, logits, metadata) of the last step, for --profile

    def sampler_ms(self) -> float:
        times = [s.elapsed_time(e) for s, e in self.events] or self.cpu_ms
        return sum(times) / len(times)

    def wrap(self) -> None:
        sampler_forward, build = Sampler.forward, SamplingState.build_metadata

        def timed_forward(sampler, logits, metadata):
            self.last_call = (sampler, logits, metadata)
            if not logits.is_cuda:  # CPU dry run: wall time is the sampler's time
                t = time.perf_counter()
                out = sampler_forward(sampler, logits, metadata)
                self.cpu_ms.append((time.perf_counter() - t) * 1e3)
                return out
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            out = sampler_forward(sampler, logits, metadata)
            self.forward_host_s.append(time.perf_counter() - t)
            end.record()
            self.events.append((start, end))
            return out

        def timed_build(state, rows, states):
            t = time.perf_counter()
            out = build(state, rows, states)
            self.host_s.append(time.perf_counter() - t)
            return out

        Sampler.forward, SamplingState.build_metadata = timed_forward, timed_build

    def reset(self) -> None:
        self.events.clear()
        self.host_s.clear()
        self.forward_host_s.clear()
        self.cpu_ms.clear()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_kernels(call: tuple, repeats: int = 5) -> None:
    """GPU time per kernel of one Sampler.forward, averaged over `repeats` calls on a step's inputs."""
    sampler, logits, metadata = call
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            Sampler.forward(sampler, logits, metadata)
        sync()
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(event.name[:60], []).append(event.device_time / 1e3)
    for name, values in sorted(times.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"    {sum(values) / repeats:8.3f} ms  x{len(values) // repeats:<3} {name}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="benchmarks/models/qwen3-0.6b")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers, for a quick CPU dry run")
    parser.add_argument("--profile", action="store_true", help="print each case's sampler kernels (GPU)")
    parser.add_argument("--host-profile", action="store_true",
                        help="cProfile each case's timed steps, and report the ops that synchronise with the GPU")
    args = parser.parse_args()
    model = with_num_layers(args.model, args.num_layers)
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=args.batch_size,
              max_model_len=2048, max_num_batched_tokens=8192,
              kv_cache_space=None if torch.cuda.is_available() else 1.0)
    engine = llm.engine
    timers = Timers()
    timers.wrap()
    rows = []
    for name, extra in [("warm-up", CASES["greedy"]), *CASES.items()]:  # the first case's steps run slower
        params = SamplingParams(max_tokens=args.steps + 40, ignore_eos=True, seed=None, **extra)
        for i in range(args.batch_size):
            prompt = [(i * 131 + j * 7) % 150000 + 1 for j in range(128)]
            engine.add_request(f"{name}-{i}", {"prompt_token_ids": prompt}, params)
        while engine.core.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.scheduler.running
        ):
            engine.step()  # prefill
        for _ in range(5):
            engine.step()  # warm decode steps
        timers.reset()
        sync()
        step_times = []
        profiler = cProfile.Profile() if args.host_profile else None
        with warnings.catch_warnings(record=True) as syncs:
            if args.host_profile and torch.cuda.is_available():
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            for _ in range(args.steps):
                start = time.perf_counter()
                if profiler:
                    profiler.enable()
                engine.step()
                if profiler:
                    profiler.disable()
                step_times.append(time.perf_counter() - start)
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
        if profiler:
            print(f"{name}: host time per step by function (cProfile, tottime)")
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(12)
            places = {}
            for w in syncs:
                places[f"{w.filename}:{w.lineno}"] = places.get(f"{w.filename}:{w.lineno}", 0) + 1
            print(f"{name}: synchronising calls in {args.steps} steps: {places or 'none'}")
        step_ms = statistics.median(step_times) * 1e3  # the median: robust to a stray host pause
        sync()
        sampler_ms = timers.sampler_ms()
        host_ms = sum(timers.host_s) / len(timers.host_s) * 1e3
        forward_ms = sum(timers.forward_host_s) / max(1, len(timers.forward_host_s)) * 1e3
        engine.abort_request([f"{name}-{i}" for i in range(args.batch_size)])
        if args.profile and torch.cuda.is_available():
            print(f"{name}: sampler kernels per step")
            profile_kernels(timers.last_call)
        if name != "warm-up":
            rows.append((name, step_ms, sampler_ms, host_ms, forward_ms))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\nbatch {args.batch_size}, {args.model}, {device}")
    # GPU share: the sampler's kernels against the step. With host: the metadata's host time added, as if the
    # host were the bottleneck (async scheduling overlaps it with the GPU when the GPU is). Launch host ms: the
    # host's time in Sampler.forward (launching its kernels), the other host cost a sampled step adds.
    print(f"{'case':<18}{'step ms':>9}{'sampler GPU ms':>16}{'metadata host ms':>18}{'launch host ms':>16}"
          f"{'GPU share':>11}{'with host':>11}")
    for name, step_ms, sampler_ms, host_ms, forward_ms in rows:
        print(f"{name:<18}{step_ms:>9.2f}{sampler_ms:>16.3f}{host_ms:>18.3f}{forward_ms:>16.3f}"
              f"{sampler_ms / step_ms:>10.1%}{(sampler_ms + host_ms) / step_ms:>10.1%}")


if __name__ == "__main__":
    main()
