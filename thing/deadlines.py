"""When what a server's connections are reading must have arrived.

A peer that trickles a frame a byte at a time, or stops halfway through a
handshake, must not hold a connection slot (and the memory claimed for its
frame) for good: each connection starts a deadline only when a read must wait,
and the server's watcher thread cuts off the readers that miss theirs.
"""

from __future__ import annotations

import socket
import threading
import time


class Deadlines:
    """When each connection's handshake or current frame must be complete.

    ``SO_RCVTIMEO`` alone restarts on every byte, so a peer trickling one byte
    at a time would never time out; a watcher thread shuts the reading side of
    late sockets (:meth:`expired`), which wakes their reader while leaving the
    writing side open for the acknowledgements still owed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: dict[socket.socket, float] = {}
        # Set while deadlines may be running: the watcher sleeps on it when none is, so
        # a server whose frames all take the fast path (which sets none) is never woken.
        self._armed = threading.Event()

    def start(self, sock: socket.socket, seconds: float) -> None:
        with self._lock:
            self._due[sock] = time.monotonic() + seconds
        if not self._armed.is_set():
            self._armed.set()

    def stop(self, sock: socket.socket) -> None:
        with self._lock:
            self._due.pop(sock, None)

    def wait_until_armed(self, closing: threading.Event) -> None:
        """Return once a deadline runs (at once if one does) or ``closing`` is set (and
        :meth:`wake` called after it)."""
        with self._lock:
            if self._due or closing.is_set():
                return
            self._armed.clear()
        self._armed.wait()

    def wake(self) -> None:
        """End a :meth:`wait_until_armed`, under the lock: one that looked at ``closing``
        before it was set has cleared the event by now, not after this."""
        with self._lock:
            self._armed.set()

    def expired(self) -> list[socket.socket]:
        """Forget and return the sockets whose deadline has passed."""
        now = time.monotonic()
        with self._lock:
            late = [sock for sock, due in self._due.items() if now > due]
            for sock in late:
                del self._due[sock]
        return late


class ReadDeadline:
    """The deadline of what one connection is reading, started only when a read must wait
    (a frame already in the read-ahead buffer costs the shared :class:`Deadlines` nothing)."""

    def __init__(self, deadlines: Deadlines, sock: socket.socket, seconds: float):
        self._deadlines = deadlines
        self._sock = sock
        self._seconds = seconds
        self._running = False

    def set(self, seconds: float) -> None:
        """What is read from now on must arrive within ``seconds`` (of when it started)."""
        self._seconds = seconds
        if self._running:
            self._deadlines.start(self._sock, seconds)

    def start(self) -> None:
        if not self._running:
            self._deadlines.start(self._sock, self._seconds)
            self._running = True

    def stop(self) -> None:
        if self._running:
            self._deadlines.stop(self._sock)
            self._running = False
