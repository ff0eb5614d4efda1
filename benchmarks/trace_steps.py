"""Where a serving engine's time goes, from a torch.profiler trace of its steps (POST /start_profile, /stop_profile).

    python3 benchmarks/trace_steps.py TRACE.json.gz

Each engine step is a named range ("step prefill_tokens=P decode_reqs=D ..."; engine/core_profiler.py). With
async scheduling a range launches step N+1 and then waits for step N's tokens, so the host range of a step is
not its GPU time: the GPU ranges (`gpu_user_annotation`, the kernels launched inside the range) are. Printed:
steps by kind with their host and GPU milliseconds, how busy the GPU was, its idle gaps, and the kernels that
take the most GPU time in prefill and in decode steps.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import re
import sys

STEP = re.compile(r"step prefill_tokens=(\d+) decode_reqs=(\d+)")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def kind_of(prefill_tokens: int) -> str:
    if prefill_tokens == 0:
        return "decode only"
    for bound in (256, 1024, 2048, 4096):
        if prefill_tokens <= bound:
            return f"prefill <= {bound}"
    return "prefill > 4096"


def _busy(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Union length of [start, end) intervals and the gaps between them."""
    busy, gaps, end = 0.0, [], None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, gaps


def summarize(events: list[dict], top: int = 12) -> list[str]:
    host = [e for e in events if e.get("cat") == "user_annotation" and STEP.match(e.get("name", ""))]
    gpu = [e for e in events if e.get("cat") == "gpu_user_annotation" and STEP.match(e.get("name", ""))]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not host:
        return ["no engine steps in this trace"]
    lines = [f"{len(host)} steps recorded; {len(kernels)} kernels"]
    rows = collections.defaultdict(lambda: [0, 0.0, 0.0, 0, 0])  # count, host us, GPU us, prefill tokens, decodes
    for e in host:
        p, d = map(int, STEP.match(e["name"]).groups())
        row = rows[kind_of(p)]
        row[0] += 1
        row[1] += e["dur"]
        row[3] += p
        row[4] += d
    for e in gpu:
        rows[kind_of(int(STEP.match(e["name"]).group(1)))][2] += e["dur"]
    lines.append(f"{'steps':<16}{'count':>6}{'host ms':>9}{'GPU ms':>9}{'prefill tok':>12}{'decodes':>9}")
    for kind in sorted(rows, key=lambda k: (k != "decode only", k)):
        n, h, g, p, d = rows[kind]
        lines.append(f"{kind:<16}{n:>6}{h / n / 1e3:>9.2f}{g / n / 1e3:>9.2f}{p / n:>12.0f}{d / n:>9.1f}")
    if kernels:
        window = (min(e["ts"] for e in host), max(e["ts"] + e["dur"] for e in host))
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if window[0] <= e["ts"] <= window[1]]
        busy, gaps = _busy(spans)
        length = window[1] - window[0]
        gaps.sort()
        lines.append(f"GPU busy {busy / length:.1%} of {length / 1e3:.0f} ms; idle gaps: {len(gaps)}, total "
                     f"{sum(gaps) / 1e3:.1f} ms, over 50 us: {sum(g > 50 for g in gaps)} "
                     f"({sum(g for g in gaps if g > 50) / 1e3:.1f} ms), largest {gaps[-1] / 1e3 if gaps else 0:.2f} ms")
        lines += _top_kernels(gpu, kernels, top)
    return lines


def _top_kernels(gpu: list[dict], kernels: list[dict], top: int) -> list[str]:
    """The kernels of prefill steps and of decode-only steps, by GPU time per step."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"], int(STEP.match(e["name"]).group(1)) > 0) for e in gpu)
    totals = {True: collections.Counter(), False: collections.Counter()}
    steps = collections.Counter(r[2] for r in ranges)
    starts = [r[0] for r in ranges]

    for e in kernels:
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] < ranges[i][1]:
            totals[ranges[i][2]][e["name"][:70]] += e["dur"]
    lines = []
    for is_prefill, label in ((True, "prefill steps"), (False, "decode-only steps")):
        if not steps[is_prefill]:
            continue
        lines.append(f"kernels of {label} (ms per step):")
        lines += [f"  {us / steps[is_prefill] / 1e3:8.3f}  {name}" for name, us in totals[is_prefill].most_common(top)]
    return lines


if __name__ == "__main__":
    print("\n".join(summarize(load(sys.argv[1]))))
