"""What frames being received hold against a server's limits until they are stored or
dropped: room in the store for their arrays, and the header budget for their headers.

Every claim a frame makes is given back whichever way it ends (stored, refused,
cut off): a :class:`FrameCharge` is held for the whole of one frame.
"""

from __future__ import annotations

import threading

from .errors import LimitExceeded
from .store import HistoryStore


class HeaderBudget:
    """Bytes the headers of all frames being received may hold, parsed, at once.

    A header's cost is counted before it is parsed (``wire.header_cost``); a
    frame whose header does not fit is refused and read past. Real headers
    take kilobytes: the budget only ever binds for a flood of them.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        with self._lock:
            if self._used + nbytes > self.max_bytes:
                raise LimitExceeded(
                    f"headers being received already hold {self._used} of {self.max_bytes} "
                    f"bytes; this one would take {nbytes} more"
                )
            self._used += nbytes

    def take_spare(self, nbytes: int) -> bool:
        """Take ``nbytes`` only from the budget's unused half (for what is kept, not what
        is under way); False, taking nothing, if they do not fit there."""
        with self._lock:
            if self._used + nbytes > self.max_bytes // 2:
                return False
            self._used += nbytes
            return True

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes


class FrameCharge:
    """What one frame holds until it is stored or dropped: store claims, bytes, its header."""

    def __init__(self, store: HistoryStore, header_budget: HeaderBudget):
        self.store = store
        self.header_budget = header_budget
        self.reserved = 0
        self.filled = 0
        self.header = 0

    def __enter__(self) -> FrameCharge:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.reserved or self.filled:
            self.store.release(self.reserved, self.filled)
        self.release_header()

    def hold_header(self, nbytes: int) -> None:
        """Hold ``nbytes`` of the header budget for this frame's header, in all: first its
        bytes as they come, then what parsing them makes."""
        if nbytes > self.header:
            self.header_budget.take(nbytes - self.header)
            self.header = nbytes

    def release_header(self) -> None:
        """Give the header's share of the budget back (a refused frame's, before its discard)."""
        if self.header:
            self.header_budget.give_back(self.header)
            self.header = 0

    def reserve(self, nbytes: int) -> None:
        self.store.reserve(nbytes)
        self.reserved += nbytes

    def fill(self, nbytes: int) -> None:
        self.store.fill(nbytes)
        self.filled += nbytes

    def stored(self, nbytes: int) -> None:
        """``nbytes`` now belong to a stored capture: the store keeps them, not this frame."""
        self.reserved -= nbytes
        self.filled -= nbytes
