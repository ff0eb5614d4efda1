"""A process that compiles recorded Triton kernel variants into Triton's disk cache, without a GPU.

Started by `precompile.compile_in_background` with a JSON file of jobs and the time it was started at;
prints one JSON line: how many variants and launchers it compiled, and the seconds its start (the
imports) and the compiles took. Each job names a kernel (module and qualified name), the specialisation
Triton recorded for it in the parent, and the GPU target. The compile (front end, LLVM, ptxas) and the C
launcher of each new signature land in the disk cache, where the parent's own launch (or `preload`) then
finds them. It runs in its own process because Triton's front end holds the GIL: threads of the engine's
process could not overlap it with the engine's own work. Nothing here touches CUDA, so forking compile
workers is safe.

    python -m tokenmill.kernels.compile_worker jobs.json START_TIME
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import sys
import time

logger = logging.getLogger(__name__)


def compile_job(job: dict) -> tuple[bool, bool]:
    """Compile one variant, then build its launcher, as JITFunction.preload would: whether each was done."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    try:
        kernel = importlib.import_module(job["module"])
        for name in job["qualname"].split("."):
            kernel = getattr(kernel, name)  # a kernel defined inside a function cannot be found: left to the parent
        data = json.loads(job["specialization"])
        constexprs = {
            tuple(key): tl.dtype(value) if tl.dtype.is_dtype(value)
            else tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value
            for key, value in zip(data["constant_keys"], data["constant_vals"])
        }
        attrs = {tuple(key): value for key, value in zip(data["attrs_keys"], data["attrs_vals"])}
        # Deserialised as JITFunction.preload does, so that the engine's process computes the same cache key.
        signature = {key: convert_to_tuple_if_list(value) for key, value in data["signature"].items()}
        target = GPUTarget(*job["target"])
        options = make_backend(target).parse_options(
            {key: tuple(value) if isinstance(value, list) else value for key, value in data["options"].items()})
        source = ASTSource
        if kernel.is_gluon():  # a Gluon kernel (kernels.int4_mma_gemv) is compiled from its own source type
            from triton.experimental.gluon._runtime import GluonASTSource as source
        compiled = triton.compile(source(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    except Exception:  # noqa: BLE001 - the parent compiles what this process could not
        logger.warning("%s.%s is left to the engine's process", job["module"], job["qualname"], exc_info=True)
        return False, False
    if target.backend != "cuda":
        return True, False
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(compiled.src, compiled.metadata)  # a C build, cached by its source
    except Exception:  # noqa: BLE001 - the parent builds it at the first launch
        logger.debug("the launcher of %s is left to the engine's process", job["qualname"], exc_info=True)
        return True, False
    return True, True


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="compile worker: %(levelname)s %(message)s")
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for module in {job["module"] for job in jobs}:
        importlib.import_module(module)  # once here, before forking, not once per worker
    imported = time.time()
    num_workers = min(len(jobs), os.cpu_count() or 1)
    if num_workers > 1:
        with multiprocessing.get_context("fork").Pool(num_workers) as pool:
            done = pool.map(compile_job, jobs, chunksize=1)
    else:
        done = [compile_job(job) for job in jobs]
    print(json.dumps({"compiled": sum(c for c, _ in done), "launchers": sum(b for _, b in done),
                      "import_s": round(imported - float(sys.argv[2]), 1),
                      "compile_s": round(time.time() - imported, 1)}))


if __name__ == "__main__":
    main()
