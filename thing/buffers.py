"""Receive buffers: memory for the arrays the server receives into, recycled while warm.

Touching fresh memory costs the kernel a page fault and a page of zeroes per
4 KiB; on many machines that, not the copy, is what limits a receive. A
training job tends to send the same shapes again and again, and the store
evicts old versions as new ones arrive, so the memory of an evicted array is
the ideal home for the next one of its size. Large arrays are therefore
backed by anonymous mappings that go back to a small, byte-capped free list
when the last array or tensor viewing them is gone, instead of back to the OS.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import defaultdict, deque

import numpy as np

from .arrays import CARRIER_DTYPES, LeafSpec

# Below this, malloc's own free lists already keep memory warm.
POOLED_FROM = 1 << 20


def fresh_memory(nbytes: int) -> mmap.mmap:
    """``nbytes`` of new, private, anonymous memory, huge pages advised where there are any.

    Private, not ``mmap``'s default of shared: shared anonymous memory is shmem,
    which takes no transparent huge pages on most machines and faults page by
    page. Measured here (first touch by memcpy): private 5.8–9.9 GB/s, shared
    1.4–1.5 GB/s, at 16 MiB and 256 MiB alike.
    """
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


class ReceiveBuffers:
    """Hands out arrays to receive into; keeps up to ``max_bytes`` of freed ones for reuse."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: defaultdict[int, list[mmap.mmap]] = defaultdict(list)
        self._free_bytes = 0
        self._keeping = True  # False once closed: memory returned then goes to the system
        self._lock = threading.Lock()
        # Where dying arrays drop their memory (see _give_back).
        self._returned: deque[mmap.mmap] = deque()

    def array(self, spec: LeafSpec) -> np.ndarray:
        """An uninitialised array of ``spec``'s carrier dtype and shape."""
        dtype = CARRIER_DTYPES[spec.dtype]
        nbytes = spec.nbytes
        if nbytes < POOLED_FROM or self.max_bytes <= 0:
            return np.empty(spec.shape, dtype)
        with self._lock:
            self._file_returned()
            spare = self._free.get(nbytes)
            memory = spare.pop() if spare else None
            if memory is not None:
                self._free_bytes -= nbytes
        self._file_now()  # what died while the lock was held here
        if memory is None:
            memory = fresh_memory(nbytes)
        flat = np.frombuffer(memory, dtype, nbytes // dtype.itemsize)
        # Every view (a reshape, a slice, a torch tensor) keeps ``flat`` alive: the memory
        # comes back only when the last of them is gone.
        weakref.finalize(flat, self._give_back, memory)
        return flat.reshape(spec.shape)

    def _give_back(self, memory: mmap.mmap) -> None:
        """File the memory of an array that died: kept for reuse, or unmapped beyond the cap,
        at once, not at the next large receive (evicted or cleared captures would hold their
        memory until then, which could be never). A finalizer may run in the middle of any
        allocation, on any thread, even one inside this class holding the lock: so it never
        waits for the lock, and memory returned while the lock is held waits in
        ``_returned`` for the next caller."""
        self._returned.append(memory)
        self._file_now()

    def _file_now(self) -> None:
        """File what was returned, unless another caller holds the lock (it files after)."""
        if self._returned and self._lock.acquire(blocking=False):
            try:
                self._file_returned()
            finally:
                self._lock.release()

    def _file_returned(self) -> None:
        """Move returned memory to the free lists, up to the cap (the caller holds the lock)."""
        while True:
            try:
                memory = self._returned.popleft()
            except IndexError:
                return
            # A mapping left out unmaps once its last reference, this one, goes.
            if self._keeping and self._free_bytes + len(memory) <= self.max_bytes:
                self._free[len(memory)].append(memory)
                self._free_bytes += len(memory)

    def clear(self) -> None:
        """Return every spare buffer to the operating system."""
        with self._lock:
            self._returned.clear()
            self._free.clear()
            self._free_bytes = 0

    def close(self) -> None:
        """Return every spare buffer, and the memory of arrays that die from now on, to the
        operating system (the server stopped receiving: nothing would reuse it)."""
        with self._lock:
            self._keeping = False
        self.clear()

    def open(self) -> None:
        """Keep freed memory for reuse again (the server receives again)."""
        with self._lock:
            self._keeping = True

    @property
    def spare_bytes(self) -> int:
        """Bytes held for reuse, beyond those of stored captures."""
        with self._lock:
            self._file_returned()
            spare = self._free_bytes
        self._file_now()  # what died while the lock was held here
        return spare
