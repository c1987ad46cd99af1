"""The server's messages on one connection, read as they arrive and never waited for halfway.

The server answers every frame exactly once, in frame order, and sends control
messages (the REPL steering this client) among the answers. The sender thread
reads them between its sends: :meth:`Answers.read_arrived` takes every message
that has arrived whole, with one ``recv`` for many, and leaves a message cut
off by the network for the next call, so reading never holds up sending.
:func:`read_server_message` is the one reader of those bytes.
"""

from __future__ import annotations

import errno
import select
import socket
import time
from collections.abc import Callable

from . import auth, wire
from .errors import ProtocolError
from .log import log
from .stream import NotArrived, StreamReader

# Acknowledgements settled together at most (one lock, one wake-up of a blocked catch).
SETTLE_BATCH = 256
# Room for the longest message whole: a refusal's text and its signature.
BUFFER_BYTES = 128 << 10
# Control messages a connection takes in a second at most. A REPL's replay of every
# setting it holds is a few thousand; a server sending more floods the job's sender
# thread, whose Python would hold the GIL from the training loop: it is hung up on.
MAX_CONTROL_PER_SECOND = 10_000
# Seconds of the sender thread's CPU control messages may take in a second: a replay of
# the largest table a job keeps (7,000 statements) takes 53 ms on the slowest machine
# measured, and a REPL pausing 200 ranks one by one with that table in force 0.29 s.
# Statements for every name cost more to apply than others, so a server may flood with
# fewer than MAX_CONTROL_PER_SECOND; this bounds what it takes from training.
MAX_CONTROL_SECONDS = 0.5

Acknowledgement = tuple[int, int, int, bytes]  # (status, seq, capture id, message)


class Answers:
    """Reads one connection's acknowledgements and control messages, as they arrive.

    ``settle`` is given the acknowledgements read together, in order; ``steer``
    the control messages read together, in order; ``ignored`` each control
    message outside the fixed set (read whole and skipped: the stream stays in
    step).
    """

    def __init__(self, sock: socket.socket, mac: auth.SessionMac | None,
                 settle: Callable[[list[Acknowledgement]], None],
                 steer: Callable[[list[wire.ControlMessage]], None],
                 ignored: Callable[[wire.BadControl], None]):
        self.sock = sock
        self._mac = mac
        self._settle = settle
        self._steer = steer
        self._ignored = ignored
        self._stream = StreamReader(sock, capacity=BUFFER_BYTES, waits=False)
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)
        self.ended = False  # the server closed the connection, and all it sent was read
        self._control_window = 0.0  # monotonic second the count below is for
        self._control_count = 0
        self._control_seconds = 0.0  # spent steering in that second

    def read_arrived(self) -> None:
        """Read every message that has arrived whole, waiting for none.

        Raises ConnectionResetError once the server has closed the connection
        (after reading all it sent before), ProtocolError for a message that
        breaks the protocol (after settling those before it).
        """
        stream = self._stream
        acks: list[Acknowledgement] = []
        steering: list[wire.ControlMessage] = []
        try:
            while True:
                while len(acks) < SETTLE_BATCH:
                    if self._mac is None and stream.buffered >= wire.ACK.size:
                        # A burst of "stored" acknowledgements: split in one call.
                        stored = wire.decode_stored_acks(stream.peek(stream.buffered),
                                                         SETTLE_BATCH - len(acks))
                        if stored:
                            stream.take(len(stored) * wire.ACK.size)
                            acks += stored
                            continue
                    message = self._next_message()
                    if message is None:
                        break
                    if isinstance(message, wire.ControlMessage):
                        steering.append(message)
                    else:
                        acks.append(message)
                if len(acks) >= SETTLE_BATCH:
                    settled, acks = acks, []
                    self._settle(settled)
                    continue
                if not self._readable.poll(0):
                    return
                if stream.receive_arrived() == 0:
                    self.ended = True
                    raise ConnectionResetError(errno.ECONNRESET,
                                               "the server closed the connection")
        finally:  # those read whole count, even if the next is bad
            if acks:
                self._settle(acks)
            if steering:
                self._apply(steering)

    def _apply(self, steering: list[wire.ControlMessage]) -> None:
        """Steer by the control messages read together; ProtocolError once steering took
        more than MAX_CONTROL_SECONDS of this second (after applying them: the job hangs
        up on a server whose messages cost more than a REPL's can)."""
        # This thread's own time: not the time it waited for the GIL a training loop held.
        started = time.thread_time()
        self._steer(steering)
        self._control_seconds += time.thread_time() - started
        if self._control_seconds > MAX_CONTROL_SECONDS:
            raise ProtocolError(f"control messages took more than {MAX_CONTROL_SECONDS:g} s "
                                "of a second to apply: a flood, not a REPL steering")

    def read_until(self, done: Callable[[], bool], seconds: float) -> bool:
        """Read what arrives until ``done()`` is true (checked after each read) or ``seconds``
        pass; returns ``done()``. Raises as :meth:`read_arrived`."""
        deadline = time.monotonic() + seconds
        while True:
            self.read_arrived()
            if done():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._readable.poll(remaining * 1000):
                return done()

    def read_until_end(self, seconds: float) -> None:
        """Read what arrives for up to ``seconds``, until the server hangs up (after
        ``shutdown(SHUT_WR)``, it answers what it received first). Never raises: it runs
        while a connection is taken down, which must finish whatever happened."""
        deadline = time.monotonic() + seconds
        try:
            while not self.ended:
                self.read_arrived()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._readable.poll(remaining * 1000):
                    return
        except (OSError, ProtocolError):
            return
        except Exception:  # a bug settling or steering: the connection still ends cleanly
            log.exception("unexpected error reading the server's last answers")

    def _next_message(self) -> Acknowledgement | wire.ControlMessage | None:
        """The next message if it arrived whole, else None (and nothing is consumed);
        control messages outside the fixed set are skipped."""
        stream = self._stream
        while True:
            start = stream.position
            try:
                message = read_server_message(stream, self._mac)
            except NotArrived:
                stream.rewind(start)
                return None
            except wire.BadControl as exc:
                self._count_control()
                self._ignored(exc)
                continue
            if isinstance(message, wire.ControlMessage):
                self._count_control()
            return message

    def _count_control(self) -> None:
        """Count a control message; ProtocolError past MAX_CONTROL_PER_SECOND."""
        now = time.monotonic()
        if now - self._control_window >= 1.0:
            self._control_window, self._control_count, self._control_seconds = now, 0, 0.0
        self._control_count += 1
        if self._control_count > MAX_CONTROL_PER_SECOND:
            raise ProtocolError(f"more than {MAX_CONTROL_PER_SECOND} control messages a "
                                "second: a flood, not a REPL steering")


def read_server_message(stream: StreamReader, mac: auth.SessionMac | None
                        ) -> Acknowledgement | wire.ControlMessage:
    """The server's next message, its signature checked: an acknowledgement ``(status, seq,
    capture_id, message)`` or a control message. Raises BadControl for a control message
    outside the fixed set (read whole: the stream stays in step), ProtocolError for
    anything that breaks the stream or its signatures."""
    prefix = stream.read(wire.ACK.size)
    if prefix[:2] == wire.CONTROL_TAG:
        length = wire.CONTROL.unpack(prefix)[2]
        if length > wire.MAX_CONTROL_NAME:
            raise ProtocolError(f"a control message with a name of {length} bytes")
        raw_name = stream.read(length) if length else b""
        if mac is not None and not mac.check(stream.read(auth.MAC_BYTES), prefix, raw_name):
            raise ProtocolError("a control message's signature does not match: it did not "
                                "come from the server that proved the token")
        return wire.decode_control(prefix, raw_name)
    status, length, seq, capture_id = wire.decode_ack(prefix)
    message = stream.read(length) if length else b""
    if mac is not None and not mac.check(stream.read(auth.MAC_BYTES), prefix, message):
        raise ProtocolError("an acknowledgement's signature does not match: it did not come "
                            "from the server that proved the token")
    return status, seq, capture_id, message

