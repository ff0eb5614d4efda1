"""Compile the Triton kernels that a piece of start-up work needs, all at once, before running it.

On a machine without Triton's disk cache each kernel otherwise compiles when first launched, one after
another: tens of seconds of start-up on a slow host. `precompile(work)` runs `work` once with Triton's
cache hook answering "skip": a launch that would compile records its kernel's specialisation and launches
nothing, everything else runs as usual. The recording run must not read device results on the host: the
skipped kernels' outputs are garbage. The recorded kernels then compile together:

- in compile processes, when `start_compile_processes()` forked them before CUDA was initialised (a child
  of a process with a CUDA context must not use CUDA; compiling for an explicit target does not). Triton's
  front end and MLIR passes hold the GIL, so threads alone overlap only LLVM, ptxas and the C compiler.
  The children write Triton's disk cache;
- then in threads of this process, each kernel through Triton's own `preload` (from the disk cache when a
  child compiled it, else compiled here), with its launcher (a C build) and its module load.

The caller runs `work` for real afterwards, and it compiles nothing. Whatever fails here only costs time:
a variant that was missed or failed to precompile compiles, or raises, at its first launch as before.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

_processes = None  # the fork-context multiprocessing pool, while start-up lasts


def start_compile_processes() -> None:
    """Fork the compile processes. A no-op once CUDA is initialised in this process (then threads only)."""
    global _processes
    if _processes is None and not torch.cuda.is_initialized() and (os.cpu_count() or 1) > 1:
        _processes = multiprocessing.get_context("fork").Pool(os.cpu_count())  # forks them all now


def stop_compile_processes() -> None:
    global _processes
    if _processes is not None:
        _processes.terminate()
        _processes = None


def precompile(work: Callable[[], object], device: torch.device) -> int:
    """Compile every kernel variant that `work` would compile; returns their number."""
    from triton import knobs

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
    if not recorded:
        return 0
    start, in_children = time.perf_counter(), 0
    if _processes is not None:
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
        jobs = [(kernel.fn.__module__, kernel.fn.__qualname__, specialization, target)
                for (_, specialization), kernel in recorded.items()]
        in_children = sum(_processes.starmap(_compile_in_child, jobs))
    # The current device is per thread and a new thread starts on device 0: each thread names this one.
    index = device.index if device.index is not None else torch.cuda.current_device()

    def load(item: tuple[tuple[int, str], object]) -> None:
        (_, specialization), kernel = item
        torch.cuda.set_device(index)
        try:
            compiled = kernel.preload(specialization)
            if hasattr(compiled, "_init_handles"):
                compiled._init_handles()  # the launcher and the module load, else done at the first launch
        except Exception:  # noqa: BLE001 - the real run compiles it again and raises there if it must
            logger.warning("precompiling %s failed; it compiles at its first launch", kernel, exc_info=True)

    with ThreadPoolExecutor(min(len(recorded), os.cpu_count() or 1), thread_name_prefix="precompile") as pool:
        list(pool.map(load, recorded.items()))
    logger.info("precompiled %d kernel variants (%d in compile processes) in %.1f s", len(recorded), in_children,
                time.perf_counter() - start)
    return len(recorded)


def _compile_in_child(module: str, qualname: str, specialization: str, target) -> bool:
    """Compile one recorded variant into Triton's disk cache, as JITFunction.preload would, without CUDA."""
    import json

    import triton
    import triton.language as tl
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    try:
        kernel = importlib.import_module(module)
        for name in qualname.split("."):
            kernel = getattr(kernel, name)  # a kernel defined in a function cannot be found: left to the parent
        data = json.loads(specialization)
        constexprs = {
            tuple(key): tl.dtype(value) if tl.dtype.is_dtype(value)
            else tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value
            for key, value in zip(data["constant_keys"], data["constant_vals"])
        }
        attrs = {tuple(key): value for key, value in zip(data["attrs_keys"], data["attrs_vals"])}
        signature = {key: _tuples(value) for key, value in data["signature"].items()}
        options = make_backend(target).parse_options(
            {key: tuple(value) if isinstance(value, list) else value for key, value in data["options"].items()})
        triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    except Exception:  # noqa: BLE001 - the parent compiles what a child could not
        logger.debug("compile process: %s.%s left to the parent", module, qualname, exc_info=True)
        return False
    return True


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
