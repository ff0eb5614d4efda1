"""precompile: the recording run launches nothing that needs a compile; the variants then compile in threads."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_precompile_records_without_launching_then_compiles_every_variant(device):
    if device != "cuda":
        pytest.skip("the interpreter has no compile hook")
    import triton
    import triton.language as tl

    from tokenmill.kernels.precompile import precompile

    @triton.jit
    def add_kernel(x_ptr, out_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * SCALE, mask=offsets < n)

    x = torch.arange(100, dtype=torch.float32, device=device)
    outs = {scale: torch.full_like(x, -1.0) for scale in (2, 3)}

    def work():
        for scale, out in outs.items():
            add_kernel[(1,)](x, out, 100, SCALE=scale, BLOCK=128)
            add_kernel[(1,)](x, out, 100, SCALE=scale, BLOCK=128)  # the same variant twice: recorded once

    assert precompile(work, torch.device(device)) == 2
    assert all(bool((out == -1).all()) for out in outs.values())  # nothing ran
    assert len(add_kernel.device_caches[torch.cuda.current_device()][0]) == 2  # both compiled
    assert precompile(work, torch.device(device)) == 0  # nothing left to compile: the work ran for real
    for scale, out in outs.items():
        torch.testing.assert_close(out, x * scale)


BACKGROUND_RUN = """
import os, pathlib, torch
from tokenmill.kernels.activation import silu_and_mul, silu_and_mul_ref
from tokenmill.kernels.precompile import compile_in_background, precompile
x = torch.randn(3, 2 * 700, device="cuda")
work = lambda: silu_and_mul(x)
background = compile_in_background(work, torch.device("cuda"), "test")
assert background.wait() == 1
cubins = lambda: sorted(pathlib.Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin"))
compiled = cubins()
assert len(compiled) == 1, compiled
assert precompile(work, torch.device("cuda")) == 1  # loaded from the disk cache: the same cache key
assert cubins() == compiled
torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x))
"""


def test_compile_in_background_fills_the_disk_cache_this_process_then_loads(device, tmp_path):
    """A fresh process with an empty Triton cache: the compile process compiles the variant into the disk
    cache, this process then finds it there (no second compile) and the kernel runs correctly."""
    if device != "cuda":
        pytest.skip("the interpreter has no compile hook")
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", BACKGROUND_RUN], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


HASH_IN_ORDER = """
import hashlib, sys
import tokenmill.kernels.penalties as p, tokenmill.kernels.sampling as s, tokenmill.kernels.sampling_floor as f
kernels = {n: getattr(m, n) for m in (s, f, p) for n in dir(m) if n.endswith("_kernel")}
for name in sorted(kernels, reverse=sys.argv[1] == "reversed"):
    kernels[name].cache_key
print({n: hashlib.sha256(k.cache_key.encode()).hexdigest() for n, k in kernels.items()})
"""


def test_kernel_cache_keys_do_not_depend_on_the_order_kernels_are_hashed(tmp_path):
    """Triton merges a helper's global constants into a caller's key only if the helper was hashed first; the
    kernel modules hash everything at import, so two processes that touch the kernels in opposite orders (a
    compile process and the engine) compute the same keys."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    keys = [subprocess.run([sys.executable, "-c", HASH_IN_ORDER, order], env=env, cwd=root, capture_output=True,
                           text=True, check=True).stdout for order in ("sorted", "reversed")]
    assert keys[0] == keys[1]
