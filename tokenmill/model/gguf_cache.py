"""Parsed GGUF files remembered for the process, by the file's path, size and modification time; their
transformers configs kept on disk as well.

transformers builds a GGUF's config from all of its metadata, the whole vocabulary included: ~3.5 s for
SmolLM2-135M on a laptop-class core. A process that builds several engines of one file (tests, notebooks, a
benchmark comparing settings) parses it once; and every later process (the server's API process and engine core,
each `tokenmill generate`) reads the config back from the tokenmill cache folder in a millisecond.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from transformers import PretrainedConfig

from tokenmill.model.gguf_file import GGUFHeader, read_header

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_REMEMBERED = 4
"""Parsed files kept (a reader maps its file, it does not copy it)."""

MAX_STORED_CONFIGS = 256
"""Configs kept in the cache folder (~2 KB each); the least recently stored go first."""

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


def gguf_header(path: str) -> GGUFHeader:
    """The file's metadata and tensors (model.gguf_file), read once per process: read only, its tensors are the
    file's."""
    return remembered("header", path, lambda: read_header(path))


def config_kept_on_disk(path: str, parse: Callable[[], PretrainedConfig]) -> PretrainedConfig:
    """`parse()`'s config of this GGUF file, from the cache folder when an earlier process stored it for the same
    file (path, size, modification time) and transformers version; stored there after parsing otherwise. A
    folder that cannot be written, or an entry that cannot be read, only costs the parse."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tokenmill.default_model import cache_dir

    stat = os.stat(path)
    identity = "\0".join([os.path.abspath(path), str(stat.st_size), str(stat.st_mtime_ns), transformers.__version__])
    stored = os.path.join(cache_dir(), "gguf_configs", hashlib.sha256(identity.encode()).hexdigest()[:16] + ".json")
    try:
        with open(stored) as f:
            values = json.load(f)
        return CONFIG_MAPPING[values["model_type"]].from_dict(values)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError) as e:  # a damaged entry (a disk full once): rewritten below
        logger.warning("cannot read the stored config of %s (%s): parsing the file again", path, e)
    config = parse()
    try:
        os.makedirs(os.path.dirname(stored), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(stored), suffix=".part", delete=False) as f:
            json.dump(config.to_dict(), f)
        os.replace(f.name, stored)  # atomic: processes storing at once each install a whole file
        _forget_oldest(os.path.dirname(stored))
    except OSError as e:
        logger.debug("cannot store the config of %s in the cache folder: %s", path, e)
    return config


def _forget_oldest(folder: str) -> None:
    entries = [entry for entry in os.scandir(folder) if entry.name.endswith(".json")]
    if len(entries) > MAX_STORED_CONFIGS:
        entries.sort(key=lambda entry: entry.stat().st_mtime_ns)
        for entry in entries[:len(entries) - MAX_STORED_CONFIGS]:
            try:
                os.remove(entry.path)
            except FileNotFoundError:  # another process removed it first
                pass
