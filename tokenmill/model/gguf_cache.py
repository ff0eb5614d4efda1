"""Parsed GGUF files remembered for the process, by the file's path, size and modification time.

Parsing a GGUF reads every metadata field, the whole vocabulary included: ~5 s for the config of SmolLM2-135M
(transformers parses the file for it) and ~2.5 s for the tensor reader, on a laptop-class core. A process that
builds several engines of one file (tests, notebooks, a benchmark comparing settings) parses it once.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

MAX_REMEMBERED = 4
"""Parsed files kept (a reader maps its file, it does not copy it)."""

_remembered: OrderedDict[tuple, object] = OrderedDict()
_lock = threading.Lock()


def remembered(kind: str, path: str, parse: Callable[[], T]) -> T:
    """`parse()`'s result for this file, parsed at most once while the file is unchanged (`kind` names what is
    parsed). The caller must not change it: copy what it will modify."""
    stat = os.stat(path)
    key = (kind, os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    with _lock:
        if key in _remembered:
            _remembered.move_to_end(key)
            return _remembered[key]
    value = parse()
    with _lock:
        _remembered[key] = value
        while len(_remembered) > MAX_REMEMBERED:
            _remembered.popitem(last=False)
    return value
