"""A socket read in large chunks: many small frames per receive call, large ones in place.

The receiver asks for exact byte counts; one ``recv`` takes whatever the peer
has sent so far (up to the buffer's size), so a burst of small frames costs
one system call instead of four per frame, and their bytes are split here.
Bytes that belong in an array large enough to be worth it go from the socket
straight into that array's memory, after the few already buffered.

On a Unix socket whose peer may pass descriptors, every receive has room for
them. The kernel hands a message's descriptors over with its first bytes, so
they arrive no later than the prefix of the frame they belong to, and frames
take them in the order they came.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

from ._core import MAX_DESCRIPTORS, recv_buffers, recv_some
from .errors import ProtocolError

# Bytes one connection reads ahead at most: hundreds of small frames.
BUFFER_BYTES = 64 << 10


class NotArrived(Exception):
    """A read of a reader that does not wait found its bytes not here yet."""


class StreamReader:
    """Exact reads from a blocking socket, through a read-ahead buffer.

    A reader made with ``waits=False`` never receives in :meth:`read`: it raises
    :class:`NotArrived` instead, and :meth:`rewind` takes it back to where a
    message began, for a caller that reads only what :meth:`receive_arrived` took in.
    """

    def __init__(self, sock: Any, before_wait: Callable[[], None] | None = None,
                 capacity: int = BUFFER_BYTES, waits: bool = True):
        self.sock = sock
        self._waits = waits
        self._buffer = bytearray(capacity)
        self._view = memoryview(self._buffer)
        self._start = 0  # the first unread byte
        self._end = 0  # one past the last received byte
        self._descriptors: list[int] | None = None  # see take_descriptors
        # Called before every receive that may wait, e.g. to start a deadline.
        self._before_wait = before_wait or (lambda: None)

    @property
    def buffered(self) -> int:
        """Bytes received and not yet read."""
        return self._end - self._start

    def peek(self, size: int) -> memoryview | None:
        """The next ``size`` bytes if they are already here (not consumed), else None."""
        if self._end - self._start < size:
            return None
        return self._view[self._start:self._start + size]

    def read(self, size: int) -> bytes:
        """Exactly ``size`` bytes (at most the buffer's size), waiting as long as it takes."""
        if size > len(self._buffer):
            raise ValueError(f"a read of {size} bytes is larger than the buffer")
        if self._end - self._start < size:
            if not self._waits:
                raise NotArrived
            self._fill(size)
        start = self._start
        self._start = start + size
        return bytes(self._view[start:start + size])

    @property
    def position(self) -> int:
        """Where the next read starts, for :meth:`rewind`."""
        return self._start

    def rewind(self, position: int) -> None:
        """Go back to ``position``, taken since the last receive: the bytes are still here."""
        self._start = position

    def take(self, size: int) -> memoryview | None:
        """The next ``size`` bytes, consumed, if they are already here (else None, nothing
        consumed): a view of the buffer, valid until the next read."""
        start = self._start
        if self._end - start < size:
            return None
        self._start = start + size
        return self._view[start:start + size]

    def read_into(self, views: list[Any]) -> None:
        """Fill each writable flat byte buffer in order: what is buffered first, then the
        rest straight from the socket (or through the buffer, when it all fits there)."""
        total = sum(len(view) for view in views)
        if total - self.buffered > 0 and total <= len(self._buffer) // 4:
            self._fill(total)
        rest = []
        for buffer in views:
            view = memoryview(buffer)  # its slices share its memory (a bytearray's do not)
            size = len(view)
            take = min(size, self._end - self._start)
            if take:
                view[:take] = self._view[self._start:self._start + take]
                self._start += take
            if take < size:
                rest.append(view[take:])
        if rest:
            self._before_wait()
            recv_buffers(self.sock, rest)

    def skip(self, size: int, feed: Callable[[memoryview], Any] | None = None) -> None:
        """Read and drop ``size`` bytes, handing each piece to ``feed`` (if given) first."""
        while size:
            if self._start == self._end:
                self._fill(1)
            take = min(size, self._end - self._start)
            if feed is not None:
                feed(self._view[self._start:self._start + take])
            self._start += take
            size -= take

    def take_descriptors(self) -> None:
        """From now on, receive descriptors passed with the bytes (kept for the frames)."""
        if self._descriptors is None:
            self._descriptors = []

    @property
    def descriptors_waiting(self) -> int:
        """Descriptors received and not yet taken by a frame."""
        return len(self._descriptors or ())

    def take_descriptor(self) -> int | None:
        """The oldest descriptor received and not yet taken, or None."""
        if not self._descriptors:
            return None
        return self._descriptors.pop(0)

    def close(self) -> None:
        """Close the descriptors no frame took (a misbehaving peer's)."""
        while self._descriptors:
            os.close(self._descriptors.pop())

    def receive_arrived(self) -> int:
        """Receive what has arrived, after what is buffered, without the wait hook: for a
        socket known to be readable. The byte count, 0 at the end of the stream."""
        self._make_room(self.buffered + 1)
        return self._receive()

    def _fill(self, size: int) -> None:
        """Receive until ``size`` bytes are buffered; ConnectionResetError at the stream's end."""
        self._make_room(size)
        while self._end - self._start < size:
            self._before_wait()
            if self._receive() == 0:
                raise ConnectionResetError(
                    errno.ECONNRESET, f"peer closed the connection {self._end - self._start} "
                    f"bytes into {size} it owed")

    def _make_room(self, size: int) -> None:
        """Make room for ``size`` unread bytes in one piece."""
        if self._start == self._end:  # nothing unread: receive from the start again
            self._start = self._end = 0
        elif self._start + size > len(self._buffer):  # unread bytes to the front
            held = self._end - self._start
            self._buffer[:held] = self._view[self._start:self._end]
            self._start, self._end = 0, held

    def _receive(self) -> int:
        """One receive (waiting for a byte) into the free end of the buffer; its count."""
        try:
            moved = recv_some(self.sock, self._buffer, self._end, self._descriptors)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:  # the kernel closed those that did not fit
                raise ProtocolError("a peer sent more descriptors than a frame carries") \
                    from None
            raise
        self._end += moved
        if self._descriptors is not None and len(self._descriptors) > MAX_DESCRIPTORS:
            # An honest peer's descriptors are taken by its next frames: these are not.
            raise ProtocolError("a peer sent more descriptors than its frames carry")
        return moved
