"""Decode rows' attention metadata from positions known only on the device, in one launch: each row's context
length and the KV slot its token is written to (AttentionBackend.place_decodes, Triton backend).

Replaces about nine small torch launches a call (a gather through the block table, divisions, two selects and
their copies); the EAGLE chain's CUDA graph makes one call per drafting pass and a step launched ahead one more.
A row at a negative position is padding: no context (length 0) and no slot (-1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys


# The tables' widths change as contexts grow: not specialized on, so no variant compiles mid-run.
@triton.jit(do_not_specialize=["table_stride", "source_stride", "source_width"])
def _place_decodes_kernel(positions_ptr, table_ptr, table_stride, source_ptr, source_stride, source_width,
                          seq_lens_ptr, slots_ptr, block_size, COPY_TABLE: tl.constexpr, BLOCK_W: tl.constexpr):
    row = tl.program_id(0)
    lookup_ptr, lookup_stride = table_ptr, table_stride
    if COPY_TABLE:  # the row's new block table first; its block is read from the source (no store-load race)
        for start in range(0, source_width, BLOCK_W):
            columns = start + tl.arange(0, BLOCK_W)
            inside = columns < source_width
            blocks = tl.load(source_ptr + row * source_stride + columns, mask=inside)
            tl.store(table_ptr + row * table_stride + columns, blocks, mask=inside)
        lookup_ptr, lookup_stride = source_ptr, source_stride
    position = tl.load(positions_ptr + row)
    at = tl.maximum(position, 0)
    block = tl.load(lookup_ptr + row * lookup_stride + at // block_size)
    padding = position < 0
    tl.store(seq_lens_ptr + row, tl.where(padding, 0, position + 1).to(seq_lens_ptr.dtype.element_ty))
    slot = block.to(tl.int64) * block_size + at % block_size
    tl.store(slots_ptr + row, tl.where(padding, -1, slot).to(slots_ptr.dtype.element_ty))


def place_decode_rows(positions: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      slot_mapping: torch.Tensor, block_size: int, source_table: torch.Tensor | None = None) -> None:
    """For each of the len(positions) rows: seq_lens = position + 1 and slot_mapping = its KV slot through
    `block_table` (0 and -1 for a negative position); `source_table` [rows, width], if given, is first copied
    into the rows' first `width` columns of `block_table`."""
    num = len(positions)
    if num == 0:
        return
    copy = source_table is not None
    source = source_table if copy else block_table
    assert block_table.stride(1) == source.stride(1) == seq_lens.stride(0) == slot_mapping.stride(0) == 1
    positions = positions.contiguous()
    _place_decodes_kernel[(num,)](
        positions, block_table, block_table.stride(0), source, source.stride(0), source.shape[1] if copy else 0,
        seq_lens, slot_mapping, block_size, COPY_TABLE=copy, BLOCK_W=128, num_warps=1,
    )


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
