"""Compile the Triton kernels that a piece of start-up work needs, all at once, before running it.

On a machine without Triton's disk cache each kernel otherwise compiles when first launched, one after
another: tens of seconds of start-up on a slow host. Both functions here first run `work` once with
Triton's cache hook answering "skip": a launch that would compile records its kernel's specialisation and
launches nothing, everything else runs as usual. The recording run must not read device results on the
host: the skipped kernels' outputs are garbage. Then:

- `precompile(work)` compiles the recorded variants in threads (Triton's front end holds the GIL; LLVM,
  ptxas and the C compiler of each launcher do not) into Triton's caches; the caller runs `work` for real
  afterwards, and it compiles nothing;
- `compile_in_background(work)` hands them to a separate process (kernels/compile_worker.py) that compiles
  them into the disk cache while this process goes on with other start-up work; a later `precompile` of
  the same work then only loads them.

If a variant is missed, or its compile fails here, it still compiles (or raises) at its first launch.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

Variants = dict[tuple[int, str], object]
"""(id of the kernel, Triton's specialisation JSON) -> the JITFunction."""


def record_variants(work: Callable[[], object], device: torch.device) -> Variants:
    """The kernel variants `work` would compile, found by running it with every compile (and launch) skipped."""
    try:
        from triton import knobs  # triton >= 3.4
    except ImportError:
        return {}  # no triton (the torch paths run), or one without the hook: kernels compile as launched

    recorded: Variants = {}

    def record(*, fn, compile, **_) -> bool:
        recorded.setdefault((id(fn.jit_function), compile["specialization_data"]), fn.jit_function)
        return True  # skip the compile, and with it the launch

    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, record
    try:
        work()
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - only an optimisation: the real run compiles, or raises, as without it
        logger.warning("recording the kernels to precompile failed; they compile at their first launch",
                       exc_info=True)
        return {}
    finally:
        knobs.runtime.jit_cache_hook = previous
    return recorded


def precompile(work: Callable[[], object], device: torch.device) -> int:
    """Compile, in threads, every kernel variant that `work` would compile; returns their number."""
    recorded = record_variants(work, device)
    # The current device is per thread and a new thread starts on device 0: each compile names this one.
    index = device.index if device.index is not None else torch.cuda.current_device()

    def compile_one(item: tuple[tuple[int, str], object]) -> tuple[float, float]:
        from triton.runtime.errors import OutOfResources  # there are variants: triton is installed

        (_, specialization), kernel = item
        torch.cuda.set_device(index)
        start = time.perf_counter()
        loaded = start
        try:
            compiled = kernel.preload(specialization)
            loaded = time.perf_counter()
            # Also its launcher (a C build, cached per signature) and the module's load onto the GPU, which
            # the first launch would otherwise do one kernel after another.
            if hasattr(compiled, "_init_handles"):
                compiled._init_handles()
        except OutOfResources:
            # A variant this GPU cannot hold (too much shared memory): its caller falls back at the launch.
            logger.debug("precompiling %s: out of resources on this GPU", kernel)
        except Exception:  # noqa: BLE001 - the real run compiles it again and raises there if it must
            logger.warning("precompiling %s failed; it compiles at its first launch", kernel, exc_info=True)
        return loaded - start, time.perf_counter() - loaded

    if recorded:
        start = time.perf_counter()
        with ThreadPoolExecutor(min(len(recorded), os.cpu_count() or 1), thread_name_prefix="precompile") as pool:
            times = list(pool.map(compile_one, recorded.items()))
        logger.info("precompiled %d kernel variants in %.1f s (summed over the threads: compiles or disk-cache "
                    "loads %.1f s, launchers and module loads %.1f s)", len(recorded), time.perf_counter() - start,
                    sum(t for t, _ in times), sum(t for _, t in times))
    return len(recorded)


class BackgroundCompile:
    """A compile process working on recorded variants; `wait()` before running the work they belong to."""

    def __init__(self, process: subprocess.Popen, jobs_file: str, num_variants: int, what: str) -> None:
        self.process, self.num_variants, self.what = process, num_variants, what
        self.start = time.perf_counter()
        # If start-up fails before wait(), the process must not outlive the engine.
        self._cleanup = weakref.finalize(self, _stop, process, jobs_file)

    def wait(self, timeout: float = 300.0) -> int:
        """Block until the process is done; returns how many variants it compiled (0 if it failed)."""
        report = {}
        try:
            self.process.wait(timeout)
            lines = self.process.stdout.read().splitlines()
            if self.process.returncode == 0 and lines:
                report = json.loads(lines[-1])
        except subprocess.TimeoutExpired:
            logger.warning("%s: the compile process took over %.0f s and was stopped", self.what, timeout)
        self._cleanup()
        logger.info("%s: %d of %d kernel variants (%d launchers) compiled in a background process, which took "
                    "%.1f s (imports %.1f s)", self.what, report.get("compiled", 0), self.num_variants,
                    report.get("launchers", 0), time.perf_counter() - self.start, report.get("import_s", 0.0))
        return report.get("compiled", 0)


def _stop(process: subprocess.Popen, jobs_file: str) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)  # its compile workers too: they share its process group
        process.wait()
    process.stdout.close()
    os.unlink(jobs_file)


def compile_in_background(work: Callable[[], object], device: torch.device, what: str) -> BackgroundCompile | None:
    """Start compiling, in another process, the kernel variants `work` would compile; None if there are none."""
    recorded = record_variants(work, device)
    if not recorded:
        return None
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    jobs = [{"module": kernel.fn.__module__, "qualname": kernel.fn.__qualname__, "specialization": specialization,
             "target": [target.backend, target.arch, target.warp_size]}
            for (_, specialization), kernel in recorded.items()]
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="tokenmill-compile-", delete=False) as f:
        json.dump(jobs, f)
    # The child imports the kernels' modules as this process does, from wherever tokenmill lives.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "tokenmill.kernels.compile_worker", f.name, str(time.time())],
                               stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    return BackgroundCompile(process, f.name, len(jobs), what)
