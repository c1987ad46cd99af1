"""What ``catch`` returns: a handle that learns, exactly once, what became of one capture.

A capture ends in exactly one of three ways, and its handle says which:
stored (``id`` is the server's id for it), refused by the server (``error``
is the server's reason for *this* capture), or not sent (``error`` says why:
no server, a full queue, a closed client, a lost connection, ...).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_allocate_lock = threading.Lock


class CaptureHandle:
    """What ``catch`` returns. ``wait()`` tells whether the server stored the capture.

    ``id`` is the server's id for it once acknowledged; ``error`` says why not.
    """

    __slots__ = ("name", "id", "error", "_pending", "_hurry")

    def __init__(self, name: str | None, error: str | None = None,
                 hurry: Callable[[], None] | None = None):
        self.name = name
        self.id: int | None = None
        self.error = error
        # Asks the sender to send now: small captures otherwise wait for company.
        self._hurry = hurry
        self._pending = None
        if error is None:
            self._pending = _allocate_lock()
            self._pending.acquire()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the outcome; True once the capture is stored and visible in the REPL.

        False when it was refused or not sent (``error`` says why), or when
        ``timeout`` seconds passed first (then ``done`` is still False). A
        small capture still queued is sent at once rather than with the
        sender's next tick (``wait(0)`` only looks).
        """
        pending = self._pending
        if pending is not None:
            # A look (timeout 0) asks for nothing: polling must not undo the batching.
            if self._hurry is not None and (timeout is None or timeout > 0) and pending.locked():
                self._hurry()
            if not pending.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
                return False
            pending.release()
        return self.id is not None

    @property
    def done(self) -> bool:
        """True once the capture was stored, refused or not sent."""
        return self._pending is None or not self._pending.locked()

    def resolve(self, capture_id: int | None, error: str | None = None) -> None:
        """Record the outcome; only the first call counts."""
        if self._pending is not None and self._pending.locked():
            self.id, self.error = capture_id, error
            self._pending.release()

    def __repr__(self) -> str:
        state = (
            "pending"
            if not self.done
            else (f"stored as {self.id}" if self.id is not None else str(self.error))
        )
        return f"<CaptureHandle {self.name!r} {state}>"


# Handles for calls that never reach a queue; shared so such a call allocates nothing.
SKIPPED = CaptureHandle(None, "skipped by every=/first=")
NO_SERVER = CaptureHandle(None, "not sent: no server is listening")
QUEUE_FULL = CaptureHandle(None, "not sent: the send queue is full")
CLOSED = CaptureHandle(None, "not sent: the client is closed")
