"""GPU kernel tests: on a CUDA device, or on the CPU under TRITON_INTERPRET=1 (slow; CI runs the tests marked
`interpret` that way, one small case per kernel and variant)."""

from __future__ import annotations

import os

import pytest
import torch


def _fix_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a scalar (a 1-element array) into a Python int with int(array), which
    NumPy 2.4 refuses for arrays of ndim > 0 (a kernel's `range(start, end)` over loaded values then fails with
    "only 0-dimensional arrays can be converted to Python scalars"). The upstream fix (triton-lang/triton#9172),
    patched in until the pinned triton has it: it changes nothing where the interpreter is already fixed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "numpy_2_4_fix", False):
        return

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.numpy_2_4_fix = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_for_numpy_2_4()


@pytest.fixture
def device() -> str:
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    pytest.skip("needs a CUDA device (or TRITON_INTERPRET=1)")
