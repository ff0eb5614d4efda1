"""GPU kernel tests: on a CUDA device, or on the CPU under TRITON_INTERPRET=1 (slow, for debugging)."""

from __future__ import annotations

import os

import pytest
import torch


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
