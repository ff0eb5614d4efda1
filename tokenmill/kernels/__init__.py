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


def fix_cache_keys(namespace: dict) -> None:
    """Compute the Triton cache key of every Triton function a kernel module defines, in definition order.
    Every kernel module calls this on its globals() at its end.

    Triton's key for a kernel includes the global constants read by the helpers it calls only if those
    helpers were hashed before it. So a kernel's key depends on which kernels the process happened to hash
    first. A compile process (precompile.compile_in_background) stored variants under keys that the engine
    then did not compute, and a restart could miss the disk cache. Hashed at import, in one fixed order,
    every process computes the same keys. The interpreter (TRITON_INTERPRET=1) has no keys.
    """
    for value in list(namespace.values()):
        if getattr(value, "__module__", None) == namespace["__name__"] and hasattr(type(value), "cache_key"):
            value.cache_key  # noqa: B018 - computed and kept by Triton
