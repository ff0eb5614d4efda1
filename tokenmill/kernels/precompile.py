"""Compile the Triton kernels that a piece of start-up work needs, all at once in threads, before running it.

On a machine without Triton's disk cache each kernel otherwise compiles when first launched, one after
another: tens of seconds of start-up on a slow host. `precompile(work)` runs `work` once with Triton's
cache hook answering "skip": a launch that would compile records its kernel's specialisation and launches
nothing, everything else runs as usual. The recorded kernels then compile in threads (Triton's front end
holds the GIL; ptxas and the C compiler of each launcher run as subprocesses) and land in Triton's
caches; the caller runs `work` for real afterwards, and it compiles nothing. The recording run must not
read device results on the host: the skipped kernels' outputs are garbage. If a variant is missed, it
still compiles at its first launch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)


def precompile(work: Callable[[], object], device: torch.device) -> int:
    """Compile, in parallel, every kernel variant that `work` would compile; returns their number."""
    try:
        from triton import knobs  # triton >= 3.4
    except ImportError:
        return 0  # no triton (the torch paths run), or one without the hook: kernels compile as launched

    recorded: dict[tuple[int, str], object] = {}

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
        return 0
    finally:
        knobs.runtime.jit_cache_hook = previous
    # The current device is per thread and a new thread starts on device 0: each compile names this one.
    index = device.index if device.index is not None else torch.cuda.current_device()

    def compile_one(item: tuple[tuple[int, str], object]) -> None:
        (_, specialization), kernel = item
        torch.cuda.set_device(index)
        try:
            compiled = kernel.preload(specialization)
            # Also its launcher (a C build, cached per signature) and the module's load onto the GPU, which
            # the first launch would otherwise do one kernel after another.
            if hasattr(compiled, "_init_handles"):
                compiled._init_handles()
        except Exception:  # noqa: BLE001 - the real run compiles it again and raises there if it must
            logger.warning("precompiling %s failed; it compiles at its first launch", kernel, exc_info=True)

    if recorded:
        start = time.perf_counter()
        with ThreadPoolExecutor(min(len(recorded), os.cpu_count() or 1), thread_name_prefix="precompile") as pool:
            list(pool.map(compile_one, recorded.items()))
        logger.info("precompiled %d kernel variants in %.1f s", len(recorded), time.perf_counter() - start)
    return len(recorded)
