"""How many threads torch computes with on the CPU, chosen by the engine unless the user chose.

torch's intra-op (OpenMP) threads spin while they wait for each other, so one busy core slows every
step down to that core's pace: with the frontend process (HTTP, tokenizing, detokenizing) or anything
else running, a step on all cores takes several times longer than on one fewer. Measured on 2 cores
(BENCHMARKS.md, CPU section): 2.1-2.9x faster with one thread while another process is busy, 0.25x with
both cores at batch 64 while one is busy. But on an idle machine both cores give ~1.5x at batch 64
(the GEMMs split over the cores), and vLLM-CPU, which reserves a core, leaves that on the table.

So a single-rank engine chooses per step (`CpuThreads`): all cores while the other processes on this
machine used less than `OTHERS_BUSY_CORES` of a core over the last window (from /proc/stat, our own CPU
time taken out), one core fewer otherwise. With the CPU kernels of issue 23 (C attention, norms and GGUF
GEMMs that split their rows or columns over the threads) both cores pay at every batch size on 2 cores,
batch 1 included (1.3-1.5x; BENCHMARKS.md, "All cores while the machine is idle"). Tensor-parallel ranks
share the cores left over and keep a fixed count.
OMP_NUM_THREADS, or a torch.set_num_threads() below the core count, is left alone.
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

# Other processes using at least this much of a core make a step on all cores wait for the busy one.
OTHERS_BUSY_CORES = 0.3
# How often /proc/stat is read: long enough that its 10 ms ticks are a small error, short enough to follow.
WINDOW_S = 0.5

_set_by_engine: int | None = None  # the count an engine of this process last set: not the user's choice


def _set_threads(num_threads: int) -> None:
    global _set_by_engine
    torch.set_num_threads(num_threads)
    _set_by_engine = num_threads


def choose_cpu_threads(num_ranks: int = 1) -> CpuThreads | None:
    """Set torch's thread count for `num_ranks` processes sharing this machine's cores.

    Returns the per-step chooser for a single rank on an unpinned thread count, else None (fixed count:
    `num_ranks` tensor-parallel processes share the cores left, each taking its part, at least one).
    """
    num_cpus = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or num_cpus < 2 or threads < num_cpus and threads != _set_by_engine:
        return None
    fewer = max(1, (num_cpus - 1) // num_ranks)
    if num_ranks > 1 or not OthersLoad.readable():
        _set_threads(fewer)
        logger.info("CPU: torch computes with %d threads of %d cores, one left for the rest (OMP_NUM_THREADS "
                    "overrides)", fewer, num_cpus)
        return None
    logger.info("CPU: torch computes with all %d cores while no other process is busy, else %d (OMP_NUM_THREADS "
                "overrides)", num_cpus, fewer)
    return CpuThreads(num_cpus, fewer)


class OthersLoad:
    """Cores' worth of CPU time the rest of the machine used on this process's cores since the last look
    (steal included)."""

    def __init__(self) -> None:
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")
        self._cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        self._last = self._sample()

    @staticmethod
    def readable() -> bool:
        try:
            with open("/proc/stat") as f:
                return f.readline().startswith("cpu ")
        except OSError:
            return False

    def _sample(self) -> tuple[float, float, float]:
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name in self._cpus:
                    # user nice system idle iowait irq softirq steal (guest time is inside user already)
                    values = [int(v) for v in fields]
                    busy += sum(values[:3]) + sum(values[5:8])
        return time.monotonic(), busy / self._ticks_per_s, time.process_time()

    def since_last(self) -> float:
        now, busy, own = self._sample()
        last_now, last_busy, last_own = self._last
        self._last = (now, busy, own)
        return max(0.0, (busy - last_busy) - (own - last_own)) / max(now - last_now, 1e-3)


class CpuThreads:
    """Per step: all cores while the rest of the machine is idle, one fewer otherwise."""

    def __init__(self, num_cpus: int, fewer: int) -> None:
        self.all_cores, self.fewer = num_cpus, fewer
        self.current = fewer
        _set_threads(fewer)
        self.others = OthersLoad()
        self._others_idle = False  # until the first window has been measured
        self._window_end = time.monotonic() + WINDOW_S

    def before_step(self) -> None:
        now = time.monotonic()
        if now >= self._window_end:
            self._others_idle = self.others.since_last() < OTHERS_BUSY_CORES
            self._window_end = now + WINDOW_S
        wanted = self.all_cores if self._others_idle else self.fewer
        if wanted != self.current:
            _set_threads(wanted)
            self.current = wanted
