"""The shared-memory hand-off: large arrays cross in an anonymous, sealed memfd.

On the same host, above a size threshold, the sender copies the arrays once
into a ``memfd_create`` file, seals it against any later change of size or
content, and passes the descriptor over the Unix socket (``SCM_RIGHTS``). The
receiver checks the descriptor against the already-validated header, maps it
copy-on-write, and hands the user arrays backed by that mapping: the whole
trip is one memcpy. Anonymous memfds vanish when the last descriptor and
mapping are gone, so nothing is left behind in ``/dev/shm`` when either side
dies.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._core import PrivateMapping, copy_into
from .arrays import CARRIER_DTYPES, LeafSpec
from .errors import ProtocolError

# Each array starts on a cache line, so every leaf is aligned for its dtype.
ALIGNMENT = 64
_SEALS = (
    getattr(fcntl, "F_SEAL_SHRINK", 0)
    | getattr(fcntl, "F_SEAL_GROW", 0)
    | getattr(fcntl, "F_SEAL_WRITE", 0)
)

AVAILABLE = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of arrays of ``sizes`` bytes laid back to back on aligned boundaries; the total."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGNMENT) * ALIGNMENT
    return offsets, max(end, 1)


def export(views: Sequence[Any]) -> int:
    """Copy flat byte ``views`` into a new sealed memfd; return its descriptor (caller closes)."""
    offsets, total = layout([memoryview(view).nbytes for view in views])
    fd = os.memfd_create("thing", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, total)
        populate = getattr(mmap, "MAP_POPULATE", 0)  # one fault-in pass, not one per page
        with mmap.mmap(fd, total, flags=mmap.MAP_SHARED | populate) as mapping:
            target = memoryview(mapping)
            for view, offset in zip(views, offsets):
                copy_into(target[offset:], view)
            target.release()
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def adopt(fd: int, specs: Sequence[LeafSpec]) -> tuple[list[np.ndarray], np.ndarray]:
    """Map a received memfd as the arrays ``specs`` describe, after checking it; closes ``fd``.

    Returns the arrays and the one base array they all view: the mapping lasts
    as long as that does.

    The descriptor must be a regular file of exactly the size the header
    implies, sealed against shrinking, growing and writing, so the sender can
    neither change the arrays nor make them fault later.
    """
    try:
        info = os.fstat(fd)
        offsets, total = layout([spec.nbytes for spec in specs])
        if not stat.S_ISREG(info.st_mode) or info.st_size != total:
            raise ProtocolError(
                f"shared memory of {info.st_size} bytes does not match the header's {total}"
            )
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & _SEALS != _SEALS:
            raise ProtocolError("shared memory is not sealed against changes")
        mapping = PrivateMapping(fd, total)
    finally:
        os.close(fd)
    base = np.frombuffer(mapping, np.uint8)
    arrays = [
        base[offset : offset + spec.nbytes].view(CARRIER_DTYPES[spec.dtype]).reshape(spec.shape)
        for spec, offset in zip(specs, offsets)
    ]
    return arrays, base
