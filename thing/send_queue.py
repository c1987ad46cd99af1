"""What a client may hold unsent, across all its channels, and what it failed to deliver."""

from __future__ import annotations

import threading
from collections import Counter

from .log import WARNING, LogOnce


class SendQueue:
    """The room a client's captures take until they are sent, shared by its channels.

    ``lock`` is the one condition every channel of the client uses, on ``mutex``:
    holding the mutex is holding the condition, and costs less to take.
    ``undelivered`` counts captures that were not delivered, by reason; all
    but the server's own refusals travel with every frame so the REPL sees them too.
    """

    def __init__(self, max_bytes: int, max_items: int):
        self.mutex = threading.Lock()
        self.lock = threading.Condition(self.mutex)
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.items = 0
        self.bytes = 0
        self.undelivered: Counter[str] = Counter()
        self.stored = 0  # captures the server acknowledged as stored
        self._warn_rarely = LogOnce(per=5.0)

    def take(self, nbytes: int, block: bool, capture: bool = True) -> bool:
        """Take room for one frame (the caller holds ``lock``); False if full and not blocking.

        A notice (``capture=False``: no data, about a capture counted already, or an
        on-demand name told of) that finds no room is not counted as a capture lost.
        """
        while self.items >= self.max_items or (self.items and self.bytes + nbytes > self.max_bytes):
            if not block:
                if capture:
                    self.undelivered["queue full"] += 1
                return False
            self.lock.wait(1.0)
        self.items += 1
        self.bytes += nbytes
        return True

    def warn_full(self) -> None:
        """Log that captures are dropped, at most once every 5 s; called without ``lock``
        (the application's log handlers, a slow one too, must not hold up every catch)."""
        self._warn_rarely("full", WARNING,
                          "send queue full (%d captures, %d bytes): %d captures dropped so far",
                          self.items, self.bytes, self.undelivered["queue full"])

    def give_back(self, nbytes: int, items: int = 1) -> None:
        """Give back the room of ``items`` captures of ``nbytes`` in all (the caller holds
        ``lock``)."""
        self.items -= items
        self.bytes -= nbytes
        self.lock.notify_all()
