"""Faulting the CPU KV pool's pages in before the engine writes them.

The pool is `torch.empty`: a page is mapped at its first write, inside the step that writes a token's K/V,
and on a virtual machine a fault on memory the guest has not used yet costs ~10 us (BENCHMARKS.md, issue 23:
a batch-64 float32 run 21% slower than with the pool pre-touched). vLLM-CPU zero-fills its pool at start-up
instead (~2.7 s per GiB there). Here a thread maps the blocks just ahead of those the allocator has handed
out (it hands never-used blocks out in index order) with madvise(MADV_POPULATE_WRITE), which fills the page
tables without touching the contents, so it is safe beside the engine's own writes. The thread runs at
SCHED_IDLE: it takes only a core the engine leaves idle (start-up, between requests, a step's serial host
work), never preempts the engine's threads, and keeps at most `window_bytes` mapped beyond the frontier.
Mapping costs the same in the thread as in a fault (measured), so it pays only where a core idles: +8% on the
batch-64 float32 workload with idle time between bursts, nothing back to back (BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import weakref

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14+
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
DEFAULT_WINDOW_BYTES = 1 << 30
# Blocks per madvise round: small enough that the frontier is followed closely.
CHUNK_BLOCKS = 64


def _madvise():
    if not sys.platform.startswith("linux"):  # the advice number is Linux's
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


class _PoolLayout:
    """Where block b of one pool tensor lies: `outer` runs of `block_bytes` per block, `outer_stride` apart."""

    def __init__(self, pool: torch.Tensor, block_axis: int) -> None:
        assert pool.is_contiguous()
        self.pool = weakref.ref(pool)
        self.base = pool.data_ptr()
        self.outer = 1
        for size in pool.shape[:block_axis]:
            self.outer *= size
        self.block_bytes = pool.stride(block_axis) * pool.element_size()
        self.outer_stride = pool.shape[block_axis] * self.block_bytes

    def ranges(self, start: int, end: int):
        for i in range(self.outer):
            first = self.base + i * self.outer_stride + start * self.block_bytes
            last = first + (end - start) * self.block_bytes
            first -= first % PAGE  # populating is content-neutral: the neighbour's partial page may join
            yield first, last - first


class KVPoolWarmer:
    def __init__(self, pools: list[tuple[torch.Tensor, int]], num_blocks: int,
                 window_bytes: int = DEFAULT_WINDOW_BYTES) -> None:
        """`pools`: each pool tensor (on the CPU) and the axis its blocks are indexed along."""
        self._madvise = _madvise()
        self._layouts = [_PoolLayout(pool, axis) for pool, axis in pools]
        bytes_per_block = sum(layout.outer * layout.block_bytes for layout in self._layouts)
        self._window = max(CHUNK_BLOCKS, window_bytes // max(1, bytes_per_block))
        self._num_blocks = num_blocks
        self._frontier = 0  # one past the highest block id handed out so far
        self._populated = 0
        self._stopped = False
        self._wake = threading.Condition()
        self._thread = None
        if self._madvise is not None and self._layouts:
            self._thread = threading.Thread(target=self._run, name="tokenmill-kv-warmer", daemon=True)
            self._thread.start()

    def _goal(self) -> int:
        return min(self._num_blocks, self._frontier + self._window)

    def note_blocks(self, highest_block_id: int) -> None:
        """The allocator handed out blocks up to `highest_block_id`: move the mapped window along."""
        if highest_block_id < self._frontier:
            return
        with self._wake:
            self._frontier = highest_block_id + 1
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def wait_idle(self) -> int:
        """Block until the window is mapped (tests); returns the blocks mapped."""
        with self._wake:
            self._wake.wait_for(lambda: self._stopped or self._populated >= self._goal())
            return self._populated

    def _run(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        except (AttributeError, OSError):
            pass
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopped or self._populated < self._goal())
                if self._stopped:
                    return
                # Blocks behind the frontier are the engine's to write now: it maps them itself.
                start = max(self._populated, min(self._frontier, self._num_blocks))
                end = min(start + CHUNK_BLOCKS, self._goal())
            if start < end and not self._populate(start, end):
                return
            with self._wake:
                self._populated = max(start, end)
                self._wake.notify_all()

    def _populate(self, start: int, end: int) -> bool:
        for layout in self._layouts:
            if layout.pool() is None:  # the pool was released: nothing left to map
                return False
            for address, length in layout.ranges(start, end):
                if self._madvise(address, length, MADV_POPULATE_WRITE) != 0:
                    # An older kernel (EINVAL): faults stay where they were.
                    logger.debug("KV pool warmer stops: madvise errno %d", ctypes.get_errno())
                    with self._wake:
                        self._stopped = True
                        self._wake.notify_all()
                    return False
        return True


def block_axis(shape_of_one: tuple[int, ...], shape_of_two: tuple[int, ...]) -> int:
    """The axis a pool's blocks are indexed along: the one that grows with the block count."""
    return next(i for i, (a, b) in enumerate(zip(shape_of_one, shape_of_two)) if a != b)


def highest_new_block(scheduler_output) -> int:
    """The highest block id a step's scheduler output hands to a request (-1 if none)."""
    highest = -1
    for request in scheduler_output.new_requests:
        if request.block_ids:
            highest = max(highest, max(request.block_ids))
    for request in scheduler_output.cached_requests:
        if request.new_block_ids:
            highest = max(highest, max(request.new_block_ids))
    return highest
