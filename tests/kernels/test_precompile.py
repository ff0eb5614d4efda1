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
