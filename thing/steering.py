"""The REPL steering running jobs: ``thing.request``, ``every``, ``first``, ``pause``, ``resume``,
``reset``.

A :class:`Steering` turns each call into a control message (``wire.CONTROL``:
an operation from a fixed set, a name, a rank, a number) and sends it to every
connected client that takes control. It keeps the statements in force (not
the requests, which are for the calls of now) in the same
:class:`~thing.settings_table.SettingsTable` a client keeps, and replays them,
oldest first, to each client that connects later, after a ``forget`` and
before a ``replayed`` (to a client that asked for it: it holds what it caught
before it connected until then): a restarted job decides as one connected all
along, and holds nothing it no longer should. A job that was connected before
(the same host, pid and run) is told after the ``replayed`` what was said
since it was last told anything: said anew, a ``first`` it held counts anew,
where one it was told before keeps its count. The client applies them
(``overrides.py``); nothing in the job runs code from the REPL.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional

from . import wire
from .display import counted
from .errors import ArgumentError, ArgumentTypeError, whole_number
from .log import log
from .settings_table import MAX_RANKED_STATEMENTS, MAX_STEERED_NAMES, SettingsTable, Statement
from .sockets import shutdown

if TYPE_CHECKING:
    from .receiver import Connection

# Jobs (host, pid, run) whose last telling is remembered; beyond, the oldest is forgotten
# (it is then told everything as replayed, as a job never seen).
MAX_JOBS_TOLD = 4096


class Steering:
    """The statements of one server, and the connections they go to."""

    def __init__(self) -> None:
        # Held while sending: a client connecting meanwhile is told all before, or after.
        self._lock = threading.Lock()
        self._table = SettingsTable()
        self._connections: set[Connection] = set()
        # Told to every client: one that reconnects to the same statements keeps what a
        # first= let through, one that meets a restarted REPL's starts afresh.
        self.instance = secrets.token_hex(8)
        # Job -> how many statements the table had made when it was last told (see attach).
        self._told: OrderedDict[tuple[str, int, Optional[str]], int] = OrderedDict()
        # Connected jobs that refuse steering (control=False, THING_CONTROL=0): told nothing.
        self._refusing: set[Connection] = set()
        self._refusing_said = 0  # how many the REPL was last warned of (not at every call)

    def attach(self, connection: Connection) -> None:
        """Start steering a client that has just connected: what is in force, after a
        ``forget`` of what it may hold from before; to a job told before, what was said
        since then after the ``replayed``, as said anew."""
        with self._lock:
            if not connection.takes_control:
                self._refusing.add(connection)
                return
            self._connections.add(connection)
            told = self._told.get(_job(connection))
            statements = self._table.statements()  # oldest first: what it heard, then not
            heard = sum(told is None or s.order < told for s in statements)
            said = [wire.encode_control(s.operation, s.name, s.rank, s.value)
                    for s in statements]
            messages = [wire.encode_control("forget", None, None), *said[:heard]]
            if connection.awaits_replay:
                messages.append(wire.encode_control("replayed", None, None))
            messages += said[heard:]
            for message in messages:
                if not self._send(connection, message):
                    return
            self._remember(connection)

    def detach(self, connection: Connection) -> None:
        """Forget a connection that ended."""
        with self._lock:
            self._connections.discard(connection)
            self._refusing.discard(connection)

    def apply(self, operation: str, name: Optional[str], rank: Optional[int],
              value: int = 0) -> int:
        """Record a statement (or send a request, or a reset) to every client; returns how
        many connected clients it was sent to."""
        if name is not None and not isinstance(name, str):
            raise ArgumentTypeError(f"a name is a str (or None: every name), not {name!r}")
        if name is None and operation in ("request", "first"):
            raise ArgumentError(f"{operation}() is for the calls of one name: give its name")
        if rank is not None:
            rank = whole_number(rank, "rank (or None: every rank)", wire.RANKS.start,
                                wire.RANKS.stop - 1)
        message = wire.encode_control(operation, name, rank, value)
        # What a client would refuse is refused here, with its reason.
        wire.decode_control(message[:wire.CONTROL.size], message[wire.CONTROL.size:])
        with self._lock:
            if operation != "request" and not self._table.apply(operation, name, rank, value):
                raise ArgumentError(f"the REPL steers at most {MAX_STEERED_NAMES} names, and sets "
                                 f"at most {MAX_RANKED_STATEMENTS} things for single ranks: "
                                 "thing.reset() some first")
            sent = 0
            for connection in list(self._connections):
                if self._send(connection, message):
                    self._remember(connection)
                    sent += 1
            refusing = len(self._refusing)
            warn, self._refusing_said = refusing != self._refusing_said, refusing
        if warn and refusing:
            log.warning("%s (control=False or THING_CONTROL=0 there): not told",
                        refusing_steering(refusing))
        return sent

    @property
    def refusing(self) -> int:
        """How many connected jobs refuse steering."""
        with self._lock:
            return len(self._refusing)

    def statements(self) -> list[Statement]:
        """What is set now, oldest first."""
        with self._lock:
            return self._table.statements()

    @property
    def clients(self) -> int:
        """Connected clients that take control."""
        with self._lock:
            return len(self._connections)

    def _remember(self, connection: Connection) -> None:
        """Note that ``connection``'s job was told every statement made so far."""
        job = _job(connection)
        self._told[job] = self._table.said
        self._told.move_to_end(job)
        while len(self._told) > MAX_JOBS_TOLD:
            self._told.popitem(last=False)

    def _send(self, connection: Connection, message: bytes) -> bool:
        """Send to one client; one that missed a message is disconnected, so that it
        reconnects and is told everything again rather than go on steered wrong."""
        try:
            if connection.send_control(message):
                return True
            log.warning("thing: %s reads nothing of what it is sent: disconnected it",
                        connection.address)
        except OSError as exc:  # going away: its own thread ends it
            log.debug("control message to %s not sent: %s", connection.address, exc)
        self._connections.discard(connection)
        shutdown(connection.sock)
        return False


def refusing_steering(count: int) -> str:
    """``count`` connected jobs refuse steering, in words."""
    return f"{counted(count, 'connected job')} refuse{'s' if count == 1 else ''} steering"


def _job(connection: Connection) -> tuple[str, int, Optional[str]]:
    """Which job a connection is from, as its hello says (a reconnection says the same)."""
    sender = connection.sender
    return sender.hostname, sender.pid, sender.run
