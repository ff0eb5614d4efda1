"""Compile every Triton kernel that the kernel tests launch for the H100/H200 (sm_90), on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) runs the kernels' Python on the CPU, and it accepts code that the GPU
compiler rejects (a constexpr assigned twice, a variable whose type differs between branches). So this runs
the given tests under the interpreter, recording each launch (kernel, argument types, constexprs, the values
Triton would specialise on), then compiles each distinct launch for sm_90 in a second process, without the
interpreter: front end, LLVM and ptxas, all on the CPU, from an empty cache, and prints the slowest compiles
(what a cold start-up pays per variant, less the C launcher Triton also builds for each new signature).
Needs triton next to the CPU torch. The whole of tests/kernels takes about 8 minutes on 2 cores.

    TRITON_INTERPRET=1 is set by the script itself:
    python tools/compile_sm90.py                                   # tests/kernels
    python tools/compile_sm90.py tests/kernels/test_sampling_kernels.py -k top_p
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int64": "i64",
          "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float8_e4m3fn": "fp8e4nv"}
SM90_MAX_SHARED = 232448  # bytes of shared memory one program may have on an H100/H200 (227 KiB): past it, the
# launch (not the compile) raises OutOfResources, so the compiled kernel's figure is checked here


def describe(value):
    """A launch argument as JSON: a tensor's dtype and 16-byte alignment, or the plain value."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": DTYPES[str(value.dtype).removeprefix("torch.")], "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    return {"value": repr(value)}  # a tl.dtype or the like: kept for the constexpr's identity only


class LaunchRecorder:
    """pytest plugin: records every interpreted kernel launch (the GridExecutor call) to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        from triton.runtime.interpreter import GridExecutor

        self.out = open(path, "w")
        launch = GridExecutor.__call__
        recorder = self

        def recording_call(executor, *args, **kwargs):
            params = list(inspect.signature(executor.fn).parameters)
            bound = dict(zip(params, args))
            bound.update({k: v for k, v in kwargs.items() if k in params})
            recorder.out.write(json.dumps({
                "module": executor.fn.__module__, "name": executor.fn.__name__,
                "args": {name: describe(value) for name, value in bound.items()},
                "num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages", 3),
            }) + "\n")
            return launch(executor, *args, **kwargs)

        GridExecutor.__call__ = recording_call

    def pytest_sessionfinish(self) -> None:
        self.out.close()


def compile_spec(launch: dict) -> tuple:
    """(kernel, signature, constexprs, attrs, options): what Triton's compile of this launch depends on (the
    options: num_warps and num_stages, which sets the shared memory of a pipelined loop)."""
    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        arg = launch["args"].get(param.name, {"value": param.default if param.has_default else None})
        value = arg.get("value")
        if "tensor" in arg:
            signature[param.name] = "*" + arg["tensor"]
            if arg["aligned"] and not param.do_not_specialize_on_alignment:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif param.is_constexpr or value is None:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if not param.do_not_specialize:
                if value == 1:  # Triton makes an int equal to 1 a constant
                    signature[param.name], constexprs[param.name] = "constexpr", 1
                elif value % 16 == 0:
                    attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    return kernel, signature, constexprs, attrs, {"num_warps": launch["num_warps"],
                                                  "num_stages": launch.get("num_stages", 3)}


def compile_sm90(kernel, signature: dict, constexprs: dict, attrs: dict, options: dict) -> str | None:
    """None when the kernel compiles for sm_90 within its shared memory, else the error and its causes.
    Register spills (ptxas's log) are printed, not failed: they cost speed, not correctness."""
    import contextlib
    import io
    import re

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        log = io.StringIO()
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log.getvalue())]
        if any(spills):
            print(f"  note: {kernel.fn.__name__} {constexprs} {options} spills {max(spills)} bytes")
        if compiled.metadata.shared > SM90_MAX_SHARED:
            return f"OutOfResources: shared memory {compiled.metadata.shared} > {SM90_MAX_SHARED} bytes"
    except Exception as exc:  # report every failing kernel, not only the first
        causes, error = [], exc
        while error is not None:
            causes.append(f"{type(error).__name__}: {error}")
            error = error.__cause__
        return "\n".join(causes)
    return None


def main() -> int:
    if sys.argv[1:2] == ["--record"]:  # the interpreted test run (a child process)
        import pytest

        return pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[3:]], plugins=[LaunchRecorder(sys.argv[2])])
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the second phase compiles for the GPU")
    tests = sys.argv[1:] or ["tests/kernels"]
    with tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "launches.jsonl")
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
        status = subprocess.run([sys.executable, __file__, "--record", record, *tests], cwd=ROOT, env=env).returncode
        launches = Path(record).read_text().splitlines() if os.path.exists(record) else []
    sys.path.insert(0, str(ROOT))  # the kernels' modules
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # cold: every compile is done and timed here
    specs = {}
    for line in launches:
        spec = compile_spec(json.loads(line))
        specs.setdefault(repr((spec[0].fn.__qualname__, *spec[1:])), spec)
    failures, seconds = 0, []
    for kernel, signature, constexprs, attrs, options in specs.values():
        start = time.perf_counter()
        error = compile_sm90(kernel, signature, constexprs, attrs, options)
        label = f"{kernel.fn.__name__} {({k: v for k, v in constexprs.items() if v is not None})} {options}"
        seconds.append((time.perf_counter() - start, label))
        if error:
            failures += 1
            print(f"FAIL {label} {signature}\n  {error[-2000:]}")
    print("slowest compiles (each variant is paid once per machine at start-up, before Triton's disk cache has it):")
    for elapsed, label in sorted(seconds, reverse=True)[:10]:
        print(f"  {elapsed:6.1f} s  {label}")
    print(f"{len(launches)} launches, {len(specs)} distinct compiles for sm_90, {failures} failed "
          f"(the interpreted tests exited {status})")
    return 1 if failures or status else 0


if __name__ == "__main__":
    sys.exit(main())
