"""Triton kernels: one file per kernel, each with its @triton.jit, a Python wrapper and a pure-torch `*_ref`.

The modules import triton at the top, so import them only where `triton_available()` says yes:
the engine itself must import and run on a CPU machine without triton.
"""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x) -> bool:
    """Whether tensor `x` should go through a Triton kernel (it lives on a CUDA device and triton imports)."""
    return x.is_cuda and triton_available()
