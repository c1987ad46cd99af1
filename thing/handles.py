"""What ``catch`` returns: a handle that learns, exactly once, what became of one capture.

A capture ends in exactly one of three ways, and its handle says which:
stored (``id`` is the server's id for it), refused by the server (``error``
is the server's reason for *this* capture), or not sent (``error`` says why:
no server, a full queue, a closed client, a lost connection, ...).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

# The waiter of each handle someone waits on, made by its first wait() and released (and
# dropped from here) by resolve(): every handle a channel hands out is resolved. Handles
# have no lock of their own: a capture costs the training thread no lock, and the garbage
# collector one object fewer to track. setdefault and pop are each one step under the GIL,
# so no lock is held that a signal handler's wait() could find taken.
_waiters: dict[CaptureHandle, threading.Lock] = {}
_allocate_lock = threading.Lock

# Counts the forks this process descends from. A handle pending in the process that made
# it is the parent's to resolve: in a forked child, its copy ends at the first look, for
# only the parent sends that capture (and the child's sender, gone, could have been in the
# middle of resolving it).
_generation = 0
SENT_BY_THE_PARENT = ("not sent by this process: caught before it was forked, so the parent "
                      "sends it (wait on the parent's handle)")


def _forked() -> None:
    global _generation
    _generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class CaptureHandle:
    """What ``catch`` returns. ``wait()`` tells whether the server stored the capture.

    ``id`` is the server's id for it once acknowledged; ``error`` says why not.
    """

    __slots__ = ("name", "_id", "_error", "_done", "_hurry", "_born")

    def __init__(self, name: str | None, error: str | None = None,
                 hurry: Callable[[], None] | None = None):
        self.name = name
        self._id: int | None = None
        self._error = error
        self._done = error is not None
        # Asks the sender to send now: small captures otherwise wait for company.
        self._hurry = hurry
        self._born = _generation  # see SENT_BY_THE_PARENT

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the outcome; True once the capture is stored and visible in the REPL.

        False when it was refused or not sent (``error`` says why), or when
        ``timeout`` seconds passed first (then ``done`` is still False). A
        small capture still queued is sent at once rather than with the
        sender's next tick (``wait(0)`` only looks). From a signal handler or
        a finalizer that interrupted thing's own work on this thread it only
        looks too: the sender may need what that work holds.
        """
        if self.done or (timeout is not None and timeout <= 0) or interrupting():
            return self._id is not None
        waiter = _allocate_lock()
        waiter.acquire()
        waiter = _waiters.setdefault(self, waiter)  # the one every waiter of this handle shares
        if self._done:  # resolved before the waiter was there to be released
            _waiters.pop(self, None)
            return self._id is not None
        # Only a real wait asks: polling with wait(0) must not undo the batching.
        hurry = self._hurry  # read once: resolve() lets go of it
        if hurry is not None:
            hurry()
        if not waiter.acquire(timeout=-1 if timeout is None else timeout):
            return False
        waiter.release()  # for the next waiter of the same handle
        return self._id is not None

    @property
    def id(self) -> int | None:
        """The server's id for the capture once stored; None until then, or if it was not."""
        return self._id if self.done else None

    @property
    def error(self) -> str | None:
        """Why the capture was not stored (refused, or not sent); None while it may be."""
        return self._error if self.done else None

    @property
    def done(self) -> bool:
        """True once the capture was stored, refused or not sent."""
        if not self._done and self._born != _generation:
            self.resolve(None, SENT_BY_THE_PARENT)
        return self._done

    def resolve(self, capture_id: int | None, error: str | None = None) -> None:
        """Record the outcome; only the first call counts."""
        if self._done:
            return
        self._id, self._error = capture_id, error
        self._done = True  # after the outcome: whoever sees it done sees the outcome
        self._hurry = None  # a kept handle must not keep its channel (and its sender) alive
        waiter = _waiters.pop(self, None)
        if waiter is not None:
            waiter.release()

    def __repr__(self) -> str:
        state = (
            "pending"
            if not self.done
            else (f"stored as {self.id}" if self.id is not None else str(self.error))
        )
        return f"<CaptureHandle {self.name!r} {state}>"


# Handles for calls that never reach a queue; shared so such a call allocates nothing.
SKIPPED = CaptureHandle(None, "skipped: not due (every=, first=, on_demand=True or the "
                                "REPL's steering)")
REENTERED = CaptureHandle(None, "not sent: caught from a signal handler or a finalizer that "
                                "ran in the middle of thing's own work on this thread")
NO_SERVER = CaptureHandle(None, "not sent: no server is listening")
QUEUE_FULL = CaptureHandle(None, "not sent: the send queue is full")
CLOSED = CaptureHandle(None, "not sent: the client is closed")


# Whether this thread is in the middle of thing's own work (a catch, a flush or close, the
# making of the default client, or the sender's locked steps, all its life): a catch() made
# then, from a signal handler or from a finalizer the garbage collector runs at any
# allocation, gets REENTERED instead of waiting for a lock its own thread holds, which
# would hang the job for good.
busy = threading.local()


def interrupting() -> bool:
    """True when this thread is in the middle of thing's own work (see :data:`busy`): a
    call now comes from a signal handler or a finalizer that interrupted it, and must not
    wait for anything that work may hold. (``catch`` inlines this test: it is on the
    throttled path.)"""
    return getattr(busy, "working", False)


class _Working:
    """Marks this thread as in thing's own work for a with-block (see :data:`busy`); a
    class, not a generator, so an interrupt cannot leave the mark behind it."""

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = getattr(busy, "working", False)
        busy.working = True

    def __exit__(self, *exc_info: object) -> None:
        busy.working = self._was


def working() -> _Working:
    """``with working():`` marks this thread as in thing's own work (see :data:`busy`)."""
    return _Working()
