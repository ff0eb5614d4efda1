"""The decode rows' placement kernel (kernels/decode_placement.py) against the torch ops it replaced in the Triton
backend's place_decodes: context lengths and KV slots through the block table, padding rows (negative positions)
with no context and no slot, and a new block table copied in first."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]


def reference(positions, block_table, block_size):
    at = positions.clamp(min=0)
    blocks = block_table[: len(positions)].gather(1, (at // block_size).unsqueeze(1)).squeeze(1)
    slots = blocks * block_size + at % block_size
    return torch.where(positions < 0, 0, positions + 1), torch.where(positions < 0, -1, slots)


@pytest.mark.parametrize("copy_table", [False, True])
def test_lengths_and_slots_are_the_torch_ops(device, copy_table):
    from tokenmill.kernels.decode_placement import place_decode_rows

    generator = torch.Generator().manual_seed(int(copy_table))
    rows, width, block_size = 7, 150, 16  # wider than the kernel's 128-column tile
    old_table = torch.randint(0, 1000, (rows + 2, width + 3), generator=generator, dtype=torch.int32)
    new_table = torch.randint(0, 1000, (rows, width), generator=generator, dtype=torch.int32)
    positions = torch.randint(0, width * block_size, (rows,), generator=generator)
    positions[2], positions[5] = -1, -7  # padding
    positions[4] = width * block_size - 1  # the table's last slot
    table = new_table if copy_table else old_table
    expected_table = old_table.clone()
    if copy_table:
        expected_table[:rows, :width] = new_table
    expected_lens, expected_slots = reference(positions, expected_table, block_size)

    block_table = old_table.to(device)
    seq_lens = torch.full((rows + 2,), 99, dtype=torch.int32, device=device)
    slot_mapping = torch.full((rows + 2,), 99, dtype=torch.int32, device=device)
    place_decode_rows(positions.to(device), block_table, seq_lens, slot_mapping, block_size,
                      source_table=table.to(device) if copy_table else None)
    assert torch.equal(block_table.cpu(), expected_table)
    assert torch.equal(seq_lens[:rows].cpu(), expected_lens.to(torch.int32))
    assert torch.equal(slot_mapping[:rows].cpu(), expected_slots.to(torch.int32))
    assert (seq_lens[rows:] == 99).all() and (slot_mapping[rows:] == 99).all()  # rows past them untouched
