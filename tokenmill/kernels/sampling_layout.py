"""How the sampler's kernels split a [rows, vocab] pass into tiles and per-row splits (host side only)."""

from __future__ import annotations

import triton

TILE = 1024
"""Tokens per tile of the draw passes, the candidate floor and the penalty pass."""
DRAW_SPLITS = 32
"""Splits per row of a draw: fixed, so that a row's sums do not depend on the batch. At batch 256 over
151,936 tokens: 30 splits of 5 tiles, 7,680 programs."""
TARGET_PROGRAMS = 4096
"""Programs wanted in the passes whose result does not depend on the layout (argmax, floors)."""


def split_layout(num_rows: int, vocab_size: int, tile: int, tiles_per_split: int | None = None) -> tuple[int, int, int]:
    """(num_tiles, tiles_per_split, num_splits) of a pass over [num_rows, vocab_size] by `tile`-token tiles
    whose result does not depend on the layout (an argmax, a floor): enough programs to fill the GPU."""
    num_tiles = triton.cdiv(vocab_size, tile)
    if tiles_per_split is None:
        tiles_per_split = max(1, num_rows * num_tiles // TARGET_PROGRAMS)
    return num_tiles, tiles_per_split, triton.cdiv(num_tiles, tiles_per_split)


def draw_layout(vocab_size: int, tile: int, tiles_per_split: int | None = None) -> tuple[int, int, int]:
    """(num_tiles, tiles_per_split, num_splits) of a draw: DRAW_SPLITS splits whatever the batch."""
    num_tiles = triton.cdiv(vocab_size, tile)
    if tiles_per_split is None:
        tiles_per_split = triton.cdiv(num_tiles, DRAW_SPLITS)
    return num_tiles, tiles_per_split, triton.cdiv(num_tiles, tiles_per_split)
