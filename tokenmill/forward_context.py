"""The one global: what the attention layers of the current forward pass need.

Models keep the plain `forward(input_ids, positions)` signature; attention layers read the
step's backend and metadata from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.attention.backend import AttentionBackend


@dataclass(frozen=True)
class ForwardContext:
    backend: AttentionBackend
    attn_metadata: object


_CONTEXT: ForwardContext | None = None


@contextmanager
def forward_context(backend: AttentionBackend, attn_metadata: object) -> Iterator[None]:
    global _CONTEXT
    assert _CONTEXT is None, "forward contexts do not nest"
    _CONTEXT = ForwardContext(backend, attn_metadata)
    try:
        yield
    finally:
        _CONTEXT = None


def get_forward_context() -> ForwardContext:
    assert _CONTEXT is not None, "attention ran outside a forward_context"
    return _CONTEXT
