"""Probes of a structured-outputs run on the engine (benchmarks/structured_outputs.py's throughput section): the
engine's host time per step in pieces (GrammarTimer), with, on a GPU, the device's idle gaps around the forward
pass and the sampler (DEVICE_GAPS); cProfile of a run (profile_run); torch.profiler over a window of engine steps
and the GPU's idle gaps in it (trace_run)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from tokenmill import LLM


def has_cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if has_cuda():
        torch.cuda.synchronize()


def pct(values, q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def timed_generate(llm: LLM, prompts, params) -> tuple[list, float]:
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    return outputs, time.perf_counter() - start


PIECES = {"send tokens": "send_tokens", "start": "start", "host buffer (waits for its last copy)": "_host_buffer",
          "copy + kernel queued": "_apply"}
"""GrammarRows' methods timed as the pieces of a step's grammar work (a piece may run more than once a step)."""
MATCHER_PIECES = {"accept (engine side)": "accept", "fill (engine side)": "fill", "wait for the masks": "take"}
"""The same of its matchers' (in the engine's process: the accept and fill themselves; with a grammar process:
sending them, and the wait for the masks)."""


class GrammarTimer:
    """The engine's host time per runner step, in pieces: `wait for tokens` (the runner waits for the last
    step's tokens before the grammars read them), GrammarRows.apply and the pieces of the grammars' work
    (PIECES, MATCHER_PIECES), the whole `_sample` (logits, masks, sampler launch), and, per engine step, the
    core's wait for the step it updates and the step's wall time. Host time spent waiting shows the GPU was the
    bottleneck; the grammars' time counts fully against throughput only when the host is."""

    def __init__(self, runner, core, engine, llm: LLM | None = None) -> None:
        from tokenmill.worker.pending_output import PendingOutput

        self.records: list[dict] = []  # one per runner step (execute_model)
        self.steps: list[dict] = []  # one per core.step: wall, core wait
        self._record: dict | None = None
        self._in_sample = False
        self._restore = []
        grammar_rows = runner.grammar_rows
        for key, name in [("apply", "apply"), *PIECES.items()]:
            self._wrap(grammar_rows, name, key)
        for key, name in MATCHER_PIECES.items():
            self._wrap(grammar_rows._matchers, name, key)
        self._wrap(runner, "execute_model", "execute", opens=True)
        self._wrap(runner, "_sample", "sample")
        self._wrap(runner, "_finish_sample", "finish sample")  # with a grammar process: in the next step
        self.gpu_marks: list[tuple[str, torch.cuda.Event]] = []
        """On a GPU: events queued around the forward pass (right before the CUDA graph's replay) and the sampler,
        for the device's idle gaps between them (DEVICE_GAPS: the host late to launch what comes next)."""
        if has_cuda():
            for graphs in (runner.cuda_graphs, runner.mixed_cuda_graphs):
                if graphs is not None:
                    self._mark_gpu(graphs, "run", "forward", before=True)
            self._mark_gpu(runner, "_forward", "forward end", before=False)
            self._mark_gpu(runner, "_finish_sample", "sampling", before=True)
            if grammar_rows is not None:
                self._mark_gpu(grammar_rows, "_mask_logits", "masking", before=True)
            self._mark_gpu(runner, "_finish_sample", "sampled", before=False)
            if llm is not None:  # a run's requests added, and its ends
                self._mark_gpu(llm, "generate", "run start", before=True)
                self._mark_gpu(llm, "_run", "steps start", before=True)
                self._mark_gpu(llm, "generate", "run end", before=False)
        original_result = PendingOutput.result
        timer = self

        def result(pending):
            start = time.perf_counter()
            try:
                return original_result(pending)
            finally:
                key = "wait for tokens" if timer._in_sample else "core wait"
                target = timer._record if timer._in_sample else (timer.steps[-1] if timer.steps else None)
                if target is not None:
                    target[key] = target.get(key, 0.0) + time.perf_counter() - start

        PendingOutput.result = result
        self._restore.append(lambda: setattr(PendingOutput, "result", original_result))
        original_step = core.step

        def step():
            self.steps.append({})
            start = time.perf_counter()
            try:
                return original_step()
            finally:
                self.steps[-1]["wall"] = time.perf_counter() - start

        core.step = step
        self._restore.append(lambda: delattr(core, "step"))
        original_engine_step = engine.step

        def engine_step():
            start = time.perf_counter()
            try:
                return original_engine_step()
            finally:
                if self.steps:
                    self.steps[-1]["engine wall"] = time.perf_counter() - start

        engine.step = engine_step
        self._restore.append(lambda: delattr(engine, "step"))

    def _wrap(self, owner, name: str, key: str, opens: bool = False) -> None:
        inner = getattr(owner, name)
        timer = self

        def timed(*args, **kwargs):
            if opens:
                timer._record = {"rows": 0}
                timer.records.append(timer._record)
                timer._in_sample = True
            elif key == "start":
                timer._record["rows"] = len(args[-1])  # the constrained rows
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                timer._record[key] = timer._record.get(key, 0.0) + time.perf_counter() - start
                if opens:
                    timer._in_sample = False

        setattr(owner, name, timed)
        self._restore.append(lambda: delattr(owner, name))

    def _mark_gpu(self, owner, name: str, mark: str, before: bool) -> None:
        inner = getattr(owner, name)
        marks = self.gpu_marks

        def marked(*args, **kwargs):
            if before:
                marks.append((mark, torch.cuda.Event(enable_timing=True)))
                marks[-1][1].record()
            try:
                return inner(*args, **kwargs)
            finally:
                if not before:
                    marks.append((mark, torch.cuda.Event(enable_timing=True)))
                    marks[-1][1].record()

        setattr(owner, name, marked)
        self._restore.append(lambda: setattr(owner, name, inner))  # inner may be another wrapper

    def take(self) -> tuple[list[dict], list[dict], dict[str, list[float]]]:
        """The runner steps' and engine steps' records, and the device's gaps (ms) by DEVICE_GAPS."""
        sync()
        # Where the one-token graphs declined a step's layout and the mixed ones took it, two forward marks: the last.
        following = [kind for kind, _ in self.gpu_marks[1:]] + [""]
        marks = [(kind, event) for (kind, event), next_kind in zip(self.gpu_marks, following)
                 if not (kind == "forward" and next_kind == "forward")]
        gaps = {}
        for name, (start, end) in DEVICE_GAPS.items():
            gaps[name], opened = [], None
            for kind, event in marks:  # from each start mark to the first end mark before the next start
                if kind == start:
                    opened = event
                elif kind == end and opened is not None:
                    gaps[name].append(opened.elapsed_time(event))
                    opened = None
        taken = self.records, self.steps, {name: values for name, values in gaps.items() if values}
        self.records, self.steps, self.gpu_marks[:] = [], [], []
        return taken

    def close(self) -> None:
        for undo in reversed(self._restore):
            undo()


DEVICE_GAPS = {"forward pass": ("forward", "forward end"), "logits + gap -> sampler": ("forward end", "sampling"),
               "sampler (mask, draw, its idle)": ("sampling", "sampled"),
               "sampler start -> mask kernel": ("sampling", "masking"), "sampler -> forward": ("sampled", "forward"),
               "adding the requests": ("run start", "steps start"), "to the first forward": ("steps start", "forward"),
               "last sampler -> run end": ("sampled", "run end")}
"""The device's time between two marks (events queued by the host): ~0 where the host queued the second before
the device got there, else the device idle while the host was late. The forward mark precedes the graph's replay
(its inputs copied before it); with a grammar process the sampler is launched at the next execute_model, after
the engine's other host work, and its mask kernel after the wait for the masks."""


def describe_host(records: list[dict], steps: list[dict], gaps: dict[str, list[float]], seconds: float) -> str:
    """The grammar's host pieces: medians at the batch's most constrained rows, and totals over the run; the
    device's gaps (DEVICE_GAPS)."""
    if not records:
        return ""
    rows = np.array([r["rows"] for r in records])
    full = [r for r, n in zip(records, rows) if n == rows.max()]
    parts = []
    for key in ["wait for tokens", "apply", *PIECES, *MATCHER_PIECES, "sample", "finish sample", "execute"]:
        total = sum(r.get(key, 0.0) for r in records)
        if total == 0.0:
            continue
        at_full = np.median([r.get(key, 0.0) for r in full]) * 1e3
        parts.append(f"{key} {total / seconds:.0%} of the run, {at_full:.2f} ms at {rows.max()} rows")
    done = [s for s in steps if "wall" in s]
    walls = [s["wall"] for s in done]
    waits = [s.get("core wait", 0.0) for s in done]
    outside = [s["engine wall"] - s["wall"] for s in done if "engine wall" in s]
    text = f"; {len(records)} sampled steps, {int((rows > 0).sum())} with grammars: " + ", ".join(parts)
    if walls:
        text += (f"; engine steps {len(walls)}: core.step median {np.median(walls) * 1e3:.2f} ms (sum "
                 f"{sum(walls) / seconds:.0%} of the run), of which the core waits for the GPU "
                 f"{np.median(waits) * 1e3:.2f} ms (sum {sum(waits) / seconds:.0%})")
    if outside:
        text += (f"; outside the core (output processing) median {np.median(outside) * 1e3:.2f} ms (sum "
                 f"{sum(outside) / seconds:.0%})")
    for name, values in gaps.items():
        text += (f"; GPU {name}: median {np.median(values):.3f} ms, p90 {pct(values, 90):.3f}, "
                 f"sum {sum(values) / 1e3 / seconds:.1%} of the run")
    return text


def profile_run(llm: LLM, prompts, params, name: str, folder: str) -> None:
    """cProfile of one more run (slower under the profiler; for where the host's time goes, not for rates):
    the functions by own time, into `folder`/profile_<name>.txt, the first lines printed."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    _, seconds = timed_generate(llm, prompts, params)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    # The engine's own functions by cumulative time: where a step's host time goes, piece by piece.
    engine = r"tokenmill/(worker|structured|sample)"
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(engine, 60)
    Path(folder, f"profile_{name}.txt").write_text(text.getvalue())
    print(f"== profile, {name} run ({seconds:.2f} s under cProfile), by own time:\n"
          + "\n".join(text.getvalue().splitlines()[:40]), flush=True)


def trace_run(llm: LLM, prompts, params, name: str, folder: str, skip_steps: int = 40,
              num_steps: int = 12) -> None:
    """torch.profiler over `num_steps` engine steps after `skip_steps` (the batch full, mid-run): the chrome trace
    into `folder`/trace_<name>.json.gz, and printed: the device kernels by total time, and the GPU's idle time
    between kernels with the host's top-level work during the longest gaps (what the GPU waited for)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    core = llm.engine.core
    original_step = core.step
    path = str(Path(folder, f"trace_{name}.json.gz"))
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=skip_steps, warmup=2, active=num_steps, repeat=1),
                   on_trace_ready=lambda p: p.export_chrome_trace(path))

    def step():
        try:
            return original_step()
        finally:
            prof.step()

    core.step = step
    try:
        with prof:
            timed_generate(llm, prompts, params)
    finally:
        del core.step
    print(f"== trace, {name} run: {num_steps} engine steps after {skip_steps}, by device time\n"
          + prof.key_averages().table(sort_by="self_device_time_total", row_limit=18), flush=True)
    print(describe_gpu_gaps(path), flush=True)


def describe_gpu_gaps(path: str, num_gaps: int = 6) -> str:
    """From a chrome trace: the window's span, the GPU's busy time, its idle gaps over 20 us (count and sum), and
    for the longest gaps the host's ranges running meanwhile (the deepest user annotations and Python calls)."""
    import gzip

    events = json.loads(gzip.open(path).read())["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    if not kernels:
        return "no device events in the trace"
    busy, gaps, end = 0.0, [], kernels[0][0]
    for start, stop in kernels:
        if start - end > 20:
            gaps.append((start - end, end, start))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - kernels[0][0]
    host = [e for e in events if e.get("cat") in ("python_function", "user_annotation", "cpu_op") and "dur" in e]
    lines = [f"GPU window {span / 1e3:.2f} ms: busy {busy / 1e3:.2f} ms ({busy / span:.0%}), {len(gaps)} gaps over "
             f"20 us summing {sum(g[0] for g in gaps) / 1e3:.2f} ms"]
    for length, start, stop in sorted(gaps, reverse=True)[:num_gaps]:
        during = [e for e in host if e["ts"] < stop and e["ts"] + e["dur"] > start and e["dur"] < 4 * length + 2000]
        names = sorted({e["name"][:70] for e in during if e["ts"] + e["dur"] >= start + 0.5 * length} or
                       {e["name"][:70] for e in during})[:8]
        lines.append(f"  gap {length:.0f} us: host in {names}")
    return "\n".join(lines)
