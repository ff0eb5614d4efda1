"""Per-device tile tables: kernels/configs/<kind>_<device>.json, as a benchmark's `--out` writes them (the best tiles
of a sweep on that GPU, by shape key). A kernel's wrapper looks its shape up here and falls back to its own
defaults where the table, or the key, is missing (another GPU, an untuned shape, Triton's interpreter)."""

from __future__ import annotations

import functools
import json

import torch

from tokenmill.kernels.fused_moe import CONFIG_DIR, config_path


@functools.cache
def _table(kind: str, device_index: int) -> dict[str, tuple[int, ...]]:
    path = config_path(torch.cuda.get_device_name(device_index), CONFIG_DIR, kind=kind)
    if not path.exists():
        return {}
    return {key: tuple(map(int, tiles)) for key, tiles in json.loads(path.read_text())["configs"].items()}


def swept_tiles(kind: str, device: torch.device, key: str) -> tuple[int, ...] | None:
    """The tiles the device's `kind` table holds for `key`, or None."""
    if device.type != "cuda":
        return None
    return _table(kind, device.index if device.index is not None else torch.cuda.current_device()).get(key)


def forget_tables() -> None:
    """Read the tables again at the next lookup (a sweep has just written one)."""
    _table.cache_clear()
