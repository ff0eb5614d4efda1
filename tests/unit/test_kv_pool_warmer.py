"""The CPU KV pool warmer maps the blocks ahead of the allocator's frontier, and only those."""

import ctypes
import mmap
import sys

import pytest
import torch

from tokenmill.worker.kv_pool_warmer import PAGE, KVPoolWarmer, block_axis

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_POPULATE_WRITE) and mincore: Linux")


def resident_pages(address: int, length: int) -> list[bool]:
    """mincore(2) over whole pages of [address, address + length)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = address - address % PAGE
    pages = -(-(address + length - start) // PAGE)
    vector = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, pages * PAGE, vector) == 0, ctypes.get_errno()
    return [bool(byte & 1) for byte in vector.raw]


def test_blocks_ahead_of_the_frontier_are_mapped_and_no_further():
    # [2 (K, V), blocks, block_size, heads, head_dim]: 64 KiB per block in each half, so blocks are whole pages.
    num_blocks, block_shape = 512, (16, 4, 256)
    # A fresh anonymous mapping (a malloc'd buffer may reuse memory an earlier test touched), page-aligned.
    memory = mmap.mmap(-1, 2 * num_blocks * 16 * 4 * 256 * 4)
    pool = torch.frombuffer(memory, dtype=torch.float32).view(2, num_blocks, *block_shape)
    block_bytes = pool.stride(1) * pool.element_size()
    bytes_per_block = 2 * block_bytes

    def mapped(half: int, first: int, last: int) -> bool:
        return all(resident_pages(pool[half, first].data_ptr(), (last - first) * block_bytes))

    def unmapped(half: int, first: int, last: int) -> bool:
        return not any(resident_pages(pool[half, first].data_ptr(), (last - first) * block_bytes))

    assert unmapped(0, 0, num_blocks) and unmapped(1, 0, num_blocks)
    warmer = KVPoolWarmer([(pool, 1)], num_blocks, window_bytes=128 * bytes_per_block)
    try:
        assert warmer.wait_idle() == 128
        assert mapped(0, 0, 128) and mapped(1, 0, 128)
        assert unmapped(0, 128, num_blocks) and unmapped(1, 128, num_blocks)
        warmer.note_blocks(299)  # the allocator handed out blocks up to 299: the window follows
        assert warmer.wait_idle() == 428
        assert mapped(0, 300, 428) and mapped(1, 300, 428)
        assert unmapped(0, 428, num_blocks) and unmapped(1, 428, num_blocks)
        warmer.note_blocks(num_blocks - 1)
        assert warmer.wait_idle() == num_blocks
    finally:
        warmer.stop()
    assert torch.count_nonzero(pool) == 0  # populating maps fresh (zero) pages and writes nothing


def test_the_block_axis_is_the_one_that_grows():
    assert block_axis((2, 1, 16, 4, 64), (2, 2, 16, 4, 64)) == 1
    assert block_axis((1, 16, 576), (2, 16, 576)) == 0
