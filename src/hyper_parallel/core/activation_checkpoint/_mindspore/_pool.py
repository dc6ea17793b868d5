"""Host buffers for swapped MindSpore tensors: a pool of numpy blocks in size classes.

The MindSpore counterpart of the C++ ``HostBufferPool`` (docs/design.md, "Backends"):
that one allocates through c10 allocators and recycles on c10 events, which MindSpore
tensors cannot use. Blocks are 1-D ``uint8`` arrays whose sizes are powers of two (at
least 4 KiB), so a steady training loop reuses the blocks of its first step and
allocates no new host memory afterwards (SPEC 4.8). A block goes back to the free list
only after the copy that last touched it completed: synchronous copies (CPU) release at
once; asynchronous ones (Ascend, ``_copy.py``) hand over their ``mindspore.runtime.Event``
and the block is promoted when ``event.query()`` says it completed.

Thread-safety: every method takes the pool's lock.
"""

from __future__ import annotations

import threading

import numpy as np

_MIN_BLOCK = 4096


def size_class(nbytes: int) -> int:
    """The block size, in bytes, that holds ``nbytes`` (a power of two, >= 4 KiB)."""
    return max(_MIN_BLOCK, 1 << max(0, int(nbytes) - 1).bit_length())


class HostPool:
    """Numpy host blocks, reused by size class.

    Counters (bytes): ``in_use`` (handed out), ``cached`` (free or pending, kept for
    reuse), ``allocated_total`` (ever allocated: flat after warm-up in a steady loop).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._pending: list[tuple[np.ndarray, object]] = []  # (block, event)
        self.in_use = 0
        self.cached = 0
        self.allocated_total = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        """A block of at least ``nbytes`` bytes (contents undefined)."""
        size = size_class(nbytes)
        with self._lock:
            self._promote_locked()
            free = self._free.get(size)
            if free:
                block = free.pop()
                self.cached -= size
            else:
                block = np.empty(size, dtype=np.uint8)
                self.allocated_total += size
            self.in_use += size
        return block

    def release(self, block: np.ndarray, event=None) -> None:
        """Returns ``block``; with ``event`` (an object with ``query()``) it is reusable
        only once the event completed."""
        size = block.nbytes
        with self._lock:
            self.in_use -= size
            self.cached += size
            if event is None:
                self._free.setdefault(size, []).append(block)
            else:
                self._pending.append((block, event))

    def _promote_locked(self) -> None:
        still = []
        for block, event in self._pending:
            if event.query():
                self._free.setdefault(block.nbytes, []).append(block)
            else:
                still.append((block, event))
        self._pending = still

    def clear(self) -> None:
        """Drops the cached blocks (blocks in use stay valid)."""
        with self._lock:
            self._free.clear()
            self._pending.clear()
            self.cached = 0
