"""The receiving side: listening sockets, one thread per connected client, the store.

Each connection is handled on its own thread (reading it is
``receiver.py``'s job), so one slow or stalled client never holds up the
others. What arrives goes into a :class:`~thing.store.HistoryStore`, which is
what the REPL functions read; the server's query methods are the same
functions, for programs that hold a :class:`Server` of their own.
"""

from __future__ import annotations

import atexit
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import auth, config, receiver, shm, wire
from .buffers import ReceiveBuffers
from .captures import Capture, Sender, value_of
from .deadlines import Deadlines
from .errors import HandshakeError, ProtocolError, whole_number
from .frame_charges import HeaderBudget
from .history_stats import StatsWorker
from .log import INFO, WARNING, LogOnce, log
from .settings_table import Statement
from .sockets import (
    NO_OWNER,
    listen,
    listen_unix,
    peer_uid,
    remove_unix_socket,
    shutdown,
    tcp_peer_uid,
    trusted_owner,
    tune_stream,
    unix_socket_path,
)
from .steering import Steering
from .store import Announcement, HistoryStore, Run

if TYPE_CHECKING:
    from .recorder import Recorder


# How long close() waits, in all, for connections to send the answers they owe and end;
# then any still sending (to a peer that reads nothing) is cut off.
CLOSE_SECONDS = 5.0
# When every slot is taken, a connection that sent nothing for this long makes room.
IDLE_SECONDS = 5.0


@dataclass(frozen=True)
class ServerInfo:
    """A snapshot of a running server, for what the REPL shows about it."""

    host: str
    port: int
    clients: int  # connected now
    dropped_transfers: int  # frames begun but not stored
    refused: int  # connections turned away at the cap
    steering: tuple[Statement, ...] = ()  # what the REPL set for running clients
    running: bool = True  # False once closed
    refusing: int = 0  # connected clients that refuse steering


class Server:
    """Receives captures from any number of clients into a :class:`HistoryStore`.

    ``port`` defaults to ``THING_PORT`` or 2875 (``0`` picks a free port; see
    :attr:`port` after :meth:`start`), ``host`` to ``THING_HOST`` or 127.0.0.1. With a
    ``token`` (or ``THING_TOKEN``) clients must prove they know it; listening
    beyond loopback without one generates a token (see ``thing/auth.py``).
    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(
        self,
        port: int | None = None,
        host: str | None = None,
        *,
        store: HistoryStore | None = None,
        limits: wire.Limits | None = None,
        token: str | None = None,
    ):
        self.host = config.serve_host() if host is None else host
        self.port = config.serve_port() if port is None else port
        # None until start(): then the token clients must prove (see auth.py), if any.
        self.token: str | None = None
        self._configured_token = token
        self._generated_token = False
        self.store = store if store is not None else HistoryStore()
        # Warm memory for the next captures: an eighth of the store's cap, 1 GiB at most.
        self.buffers = ReceiveBuffers(min(self.store.max_bytes // 8, 1 << 30))
        self.limits = limits if limits is not None else wire.Limits()
        self.idle_timeout = config.idle_timeout()
        self.max_connections = config.max_connections()
        self._listener: socket.socket | None = None
        self._unix_listener: socket.socket | None = None
        self.unix_path: Path | None = None  # the same-host Unix socket, while running
        self._unix_inode = 0  # the socket file we bound there: the only one we remove
        self._started_in = os.getpid()  # the process whose files they are
        self._connections: dict[socket.socket, receiver.Connection] = {}
        self.min_rate = config.min_frame_rate()
        self._deadlines = Deadlines()
        # What the headers of frames under way may hold at once, parsed: an eighth of the
        # store's cap, at least 16 MiB (a real header takes kilobytes).
        self._header_budget = HeaderBudget(max(self.store.max_bytes // 8, 16 << 20))
        self._counts = receiver.ReceiveCounts()
        self._mappings = shm.Mappings(config.max_mappings())
        self._lock = threading.Lock()
        # Held by start() and close(): two threads closing (or one starting while another
        # closes) would each tear down what the other is setting up.
        self._lifecycle = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._warnings = LogOnce(per=60)
        self.refused = 0  # connections turned away at the cap
        self._recorders: list[Recorder] = []
        self._stats_worker: StatsWorker | None = None  # while running
        self.steering = Steering()

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> Server:
        """Bind, listen and start accepting in a background thread; return ``self``."""
        with self._lifecycle:
            return self._start()

    def _start(self) -> Server:
        if self._listener is not None:
            return self
        self.token = auth.configured_token(self._configured_token)  # THING_TOKEN="": an error
        self._listener = listen(self.host, self.port)
        self.port = self._listener.getsockname()[1]
        if self.token is None and not auth.is_loopback(self.host):
            self.token, self._generated_token = secrets.token_urlsafe(32), True
            try:
                path = auth.write_token_file(self.port, self.token)
                where = f"Clients of this user here read it from {path}"
            except (auth.TokenFileError, OSError) as exc:
                where = f"No token file was written ({exc}), so clients here need it set too"
            log.warning(
                "Listening on %s, beyond this machine, so clients need a token. %s; "
                "elsewhere run:  export THING_TOKEN=%s", self.host, where, self.token,
            )
        self._started_in = os.getpid()
        _running.add(self)
        self._closing.clear()
        self.buffers.open()
        self._stats_worker = StatsWorker(self.store, config.stats_share()).start()
        self._spawn(self._accept_loop, "thing-accept", self._listener)
        self._spawn(self._enforce_deadlines, "thing-deadlines")
        self._listen_on_this_host()
        log.info("Server started at port %d.", self.port)
        return self

    def _listen_on_this_host(self) -> None:
        """Also listen on a Unix socket, the fast path for clients on this machine."""
        path = unix_socket_path(self.port, self.host)
        try:
            if path is None:
                raise OSError("no private directory of this user's for it")
            self._unix_listener, self._unix_inode = listen_unix(path)
        except OSError as exc:
            # Clients on this machine without a token use only that socket (see channel.py).
            log.warning("No Unix socket for this server (%s): clients on this machine need "
                        "a token, or THING_TRANSPORT=tcp, to reach it.", exc)
            return
        self.unix_path = path
        self._spawn(self._accept_loop, "thing-accept-unix", self._unix_listener)

    def close(self) -> None:
        """Stop accepting, disconnect every client and wait for their threads; finish
        recording (see :meth:`record`).

        Interrupted (Ctrl+C while a peer that reads nothing holds it for seconds), it
        still lets go of its port, sockets and memory, and is not running any more: only
        the graceful part (each connection sending the acks it owes) is cut short.
        """
        with self._lifecycle:
            listener, self._listener = self._listener, None  # not running from here on
            if listener is None:  # closed, or a close interrupted: finish what it left
                self._close_workers()
                return
            self._closing.set()
            self._deadlines.wake()
            shutdown(listener)
            if self._unix_listener is not None:
                shutdown(self._unix_listener)
            with self._lock:
                threads = list(self._threads)
            try:
                self._disconnect(threads)
            finally:
                with self._lock:
                    for sock in self._connections:  # what the wait did not end, cut off
                        shutdown(sock)
                listener.close()
                self.buffers.close()
                if self._unix_listener is not None:
                    self._unix_listener.close()
                    self._unix_listener = None
                self._remove_files()
                self._threads.clear()
                self._close_workers()

    def _remove_files(self) -> None:
        """Remove this server's Unix socket file (if still the one it bound) and the token
        file it wrote; not from a forked child, whose parent still serves through them."""
        if self._started_in != os.getpid():
            return
        if self.unix_path is not None:
            remove_unix_socket(self.unix_path, self._unix_inode)
            self.unix_path = None
        if self._generated_token and self.token is not None:
            auth.remove_token_file(self.port, self.token)
            self._generated_token = False

    def _disconnect(self, threads: list[threading.Thread]) -> None:
        """Let every connection send the acks it owes and end, for up to CLOSE_SECONDS."""
        with self._lock:
            for sock in self._connections:
                # Reading stops; each connection still sends the acks it owes, then closes.
                _shutdown_reading(sock)
        deadline = time.monotonic() + CLOSE_SECONDS
        for thread in threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        with self._lock:
            # A peer that reads none of what it is sent keeps its thread in a send: cut off.
            for sock in self._connections:
                shutdown(sock)
        deadline = time.monotonic() + 1.0
        for thread in threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))

    def _close_workers(self) -> None:
        """Stop the statistics worker, then the recorders (after the last capture is stored:
        a recording's last flush, where Ctrl+C may land, comes last)."""
        if self._stats_worker is not None:
            self._stats_worker.close()
            self._stats_worker = None
        while self._recorders:
            self._recorders[0].close()  # interrupted, the next close() closes it again
            del self._recorders[0]

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`close`."""
        return self._listener is not None

    @property
    def received(self) -> int:
        """Frames stored since :meth:`start`."""
        return self._counts.received

    @property
    def dropped_transfers(self) -> int:
        """Frames begun but not stored: cut off, malformed, too slow or refused."""
        return self._counts.dropped_transfers

    def clients(self) -> list[Sender]:
        """The clients connected right now."""
        with self._lock:
            return [connection.sender for connection in self._connections.values()]

    def info(self) -> ServerInfo:
        """A snapshot of where this server listens and how its connections fare."""
        with self._lock:
            clients = len(self._connections)
        return ServerInfo(self.host, self.port, clients, self.dropped_transfers, self.refused,
                          tuple(self.steering.statements()), self.running,
                          self.steering.refusing)

    def __repr__(self) -> str:
        if not self.running:
            return f"<thing.Server {self.host}:{self.port}, not running>"
        paths = "TCP" + (", Unix socket" if self.unix_path is not None else "")
        token = ", token" if self.token is not None else ""
        return (f"<thing.Server at {self.host}:{self.port} ({paths}{token}): "
                f"{self.store.received} received, {len(self.store)} kept>")

    # -- queries: the REPL functions, for this server's store ------------------------

    def get(self, name_or_id: str | int, index: int = 0, rank: int | None = None, *,
            step: int | None = None, run: str | None = None) -> Any:
        """The newest value of a name (``index=1`` the one before, ``step=`` that step's) or
        the value with an id (see ``thing.get``)."""
        return value_of(self.store.get(name_or_id, index, rank, step, run))

    def get_all(self, name: str, rank: int | None = None, *, run: str | None = None
                ) -> list[Any]:
        """Every kept value of ``name`` from one run, oldest to newest (see ``thing.get_all``)."""
        return [value_of(capture) for capture in self.store.get_all(name, rank, run)]

    def runs(self) -> list[Run]:
        """The runs (training jobs) that sent the kept captures (see ``thing.runs``)."""
        return self.store.runs()

    def stats(self, name: str, rank: int | None = None, run: str | None = None, *,
              spectral: bool = False) -> Any:
        """A row of statistics per capture of ``name`` (see ``thing.stats``)."""
        from .history_stats import stats_table

        return stats_table(self.store, name, rank, run, spectral)

    def plot(self, names: str | list[str], stat: str | list[str] = "auto",
             rank: int | str | None = None, run: str | None = None, *, live: bool = False,
             file: str | os.PathLike[str] | None = None) -> Any:
        """Plot how names moved over the steps (see ``thing.plot``)."""
        from . import plot_drawing

        return plot_drawing.plot(self.store, names, stat, rank, run, live=live, file=file)

    def hist(self, name_or_id: str | int, index: int = 0, rank: int | None = None, *,
             step: int | None = None, run: str | None = None, bins: int = 50,
             file: str | os.PathLike[str] | None = None) -> None:
        """Plot the distribution of one capture's values (see ``thing.hist``)."""
        from . import plot_drawing

        plot_drawing.hist(self.store, name_or_id, index, rank, step=step, run=run, bins=bins,
                          file=file)

    # -- steering: what running clients send ---------------------------------------

    def request(self, name: str, count: int = 1, rank: int | None = None) -> int:
        """Make the next ``count`` calls of ``name`` send (see ``thing.request``); returns how
        many connected clients were told."""
        return self._steer("request", name, rank, _control_value(count, "count"))

    def every(self, name: str | None, n: int, rank: int | None = None) -> int:
        """Send every ``n``-th call of ``name`` (None: every name) (see ``thing.every``)."""
        return self._steer("every", name, rank, _control_value(n, "n"))

    def first(self, name: str, n: int, rank: int | None = None) -> int:
        """Send the next ``n`` captures of ``name``, then none (see ``thing.first``)."""
        return self._steer("first", name, rank, _control_value(n, "n", least=0))

    def pause(self, name: str | None = None, rank: int | None = None) -> int:
        """Send nothing of ``name`` (None: of any name) until resumed (see ``thing.pause``)."""
        return self._steer("pause", name, rank)

    def resume(self, name: str | None = None, rank: int | None = None) -> int:
        """Undo ``pause`` for ``name`` (None: for everything) (see ``thing.resume``)."""
        return self._steer("resume", name, rank)

    def reset(self, name: str | None = None, rank: int | None = None) -> int:
        """Back to the job's own every=/first= for ``name`` (None: every name) (see
        ``thing.reset``)."""
        return self._steer("reset", name, rank)

    def _steer(self, operation: str, name: str | None, rank: int | None,
               value: int = 0) -> int:
        """Tell running clients (see :meth:`Steering.apply`), a name's identifier standing for
        the name, as everywhere else in the REPL."""
        return self.steering.apply(operation, self.store.name_to_steer(name), rank, value)

    def available(self) -> list[Announcement]:
        """The names clients catch on demand (see ``thing.available``)."""
        return self.store.available()

    def capture(self, name_or_id: str | int, index: int = 0, rank: int | None = None) -> Capture:
        """The :class:`Capture` record (value plus everything known about it)."""
        return self.store.get(name_or_id, index, rank)

    def wait(self, name: str, timeout: float | None = None) -> Any:
        """Block until a new capture of ``name`` arrives; return its value."""
        return value_of(self.store.wait(name, timeout))

    def clear(self, name: str | None = None) -> int:
        """Forget one name's history, or everything; return how many captures were dropped."""
        dropped = self.store.clear(name)
        if name is None:
            self.buffers.clear()
        return dropped

    def save(self, path: str | os.PathLike[str], names: str | Iterable[str] | None = None) -> int:
        """Write the kept history (or that of ``names``) to a new directory (see ``thing.save``)."""
        return self.store.save(path, names)

    def load(self, path: str | os.PathLike[str], *, skip_damaged: bool = False) -> int:
        """Add the captures of a recording to this server's history (see ``thing.load``)."""
        return self.store.load(path, skip_damaged=skip_damaged)

    def record(self, path: str | os.PathLike[str], **options: Any) -> Recorder:
        """Also append every capture from now on to the recording at ``path``; returns the
        started :class:`~thing.recorder.Recorder` (its ``options``: ``max_bytes``, ...).
        Closing the server closes it."""
        from .recorder import Recorder

        recorder = Recorder(self.store, path, **options).start()
        self._recorders.append(recorder)
        return recorder

    def summary(self, max_items: int | None = 5) -> None:
        """Show a table of what this server received (see ``thing.summary``)."""
        from . import display, reports

        display.show(reports.summary(self.store, self.info(), max_items))

    def describe(self, name_or_id: str | int, index: int = 0, rank: int | None = None, *,
                 step: int | None = None, run: str | None = None) -> None:
        """Show everything known about a capture, with statistics for arrays (see
        ``thing.describe``)."""
        from . import display, reports

        display.show(reports.describe(self.store, name_or_id, index, rank, step, run))

    def status(self, watch: bool = True) -> None:
        """Watch arrivals live (see ``thing.status``)."""
        from . import live

        live.watch(self.store, self.info, watch)

    def ingest_all(
        self, overwrite: bool = False, namespace: dict[str, Any] | None = None
    ) -> Any:
        """Bind the newest capture of every name as a variable (see ``thing.ingest_all``)."""
        from . import ingest

        return ingest.ingest_all(self.store, overwrite, namespace)

    def help(self) -> None:
        """List every public function of thing with its signature."""
        from . import display, reports

        display.show(reports.help_report())

    # -- connections -------------------------------------------------------------

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:  # two accept loops (TCP and Unix) spawn concurrently
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._closing.is_set():
            try:
                sock, address = listener.accept()
            except OSError as exc:
                if self._closing.is_set():
                    return
                # Out of descriptors or buffers: the pending connection stays pending, so
                # retrying at once would spin. Pause, and say so once a minute at most.
                self._warn_about("accept", f"accept failed ({exc}); still listening")
                self._closing.wait(0.1)
                continue
            try:
                self._admit(sock, _format_address(address))
            except Exception:  # the accept loop must outlive anything, MemoryError included
                log.exception("could not serve a new connection; still listening")
                sock.close()

    def _admit(self, sock: socket.socket, name: str) -> None:
        """Take a new connection into a slot, making room if unproven or idle peers hold them.

        Counted from accept, not from the handshake: peers that connect and say
        nothing must not pile up threads. While slots are free everyone comes in, so
        the ranks of a large job may all dial at the same moment. When every slot is
        taken, the peer in its handshake the longest goes first, then the connection
        idle the longest, if it has sent nothing for IDLE_SECONDS (its client
        reconnects by itself): a silent crowd is no barrier to a new client. A
        newcomer is refused rather than cut off a client that sends, whose captures
        in flight would be lost (and which would cut off another on its way back).
        """
        connection = receiver.Connection(sock, name, self._settings())
        quiet_since = time.monotonic() - IDLE_SECONDS
        with self._lock:
            connections = list(self._connections.values())
            unproven = [c for c in connections if not c.handshaken]
            idle = [c for c in connections
                    if c.handshaken and not c.busy and c.since <= quiet_since]
            make_room = None
            if len(connections) >= self.max_connections:
                if unproven or idle:
                    make_room = min(unproven or idle, key=lambda c: c.since)
                    # Out of the count at once: until its thread ends, the next newcomer
                    # would choose it again and come in over the cap.
                    del self._connections[make_room.sock]
                else:
                    self.refused += 1
                    self._warn_about(name, f"refused {name}: already serving "
                                     f"{self.max_connections} clients, none idle for "
                                     f"{IDLE_SECONDS:g} s (THING_MAX_CONNECTIONS)",
                                     about="refused")
                    sock.close()
                    return
            self._connections[sock] = connection
        if make_room is not None:
            why = "idle the longest" if make_room.handshaken else "still in its handshake"
            self._warn_about(name, f"closed the connection of {make_room.address}, {why}, to "
                             f"make room for {name}", INFO, about="room")
            _shutdown_reading(make_room.sock)
        self._spawn(self._serve_connection, f"thing-conn-{name}", connection)

    def _enforce_deadlines(self) -> None:
        while not self._closing.is_set():
            self._deadlines.wait_until_armed(self._closing)
            if self._closing.wait(min(1.0, self.idle_timeout / 4)):
                return
            for sock in self._deadlines.expired():
                connection = self._connections.get(sock)
                self._warn_about(
                    "?" if connection is None else connection.address,
                    "cut off a peer too slow to finish its handshake or frame",
                )
                _shutdown_reading(sock)

    def _serve_connection(self, connection: receiver.Connection) -> None:
        sock, address = connection.sock, connection.address
        try:
            refusal = None
            if connection.local:
                uid = peer_uid(sock)
                if not trusted_owner(uid):
                    raise HandshakeError(f"refused a Unix-socket peer of another user (uid {uid})")
            elif self.token is None:  # listening on loopback: every peer is on this machine
                uid = tcp_peer_uid(sock)
                if uid == NO_OWNER:
                    raise HandshakeError("refused a TCP peer that closed at once, or hides")
                if not trusted_owner(uid):
                    # Told why once its hello is read (it would think no server listens).
                    refusal = (f"refused a TCP peer of another user on this machine (uid {uid});"
                               " THING_TOKEN set alike on both sides lets another user's job "
                               "send")
            tune_stream(sock)
            sender = connection.handshake(refusal)
            log.debug("client connected: %s (pid %d on %s)", address, sender.pid, sender.hostname)
            self.steering.attach(connection)
            connection.serve()
        except HandshakeError as exc:
            self._warn_about(address, f"dropped {address}: {exc}")
        except ProtocolError as exc:
            self._warn_about(address, f"dropped {address}: {exc}")
        except (ConnectionError, TimeoutError) as exc:
            log.debug("client %s went away: %s", address, exc)
        except OSError as exc:
            if not self._closing.is_set():
                self._warn_about(address, f"connection to {address} failed: {exc}")
        except Exception:  # never let one client's bug take the server thread's siblings down
            log.exception("unexpected error serving %s; connection closed", address)
        finally:
            # Before the socket closes: no control message may go to a reused descriptor.
            self.steering.detach(connection)
            self.store.forget_available(connection.sender)  # nobody left to ask
            with self._lock:
                self._connections.pop(sock, None)
            self._deadlines.stop(sock)
            sock.close()

    def _settings(self) -> receiver.ReceiveSettings:
        return receiver.ReceiveSettings(
            store=self.store, buffers=self.buffers, limits=self.limits, token=self.token,
            idle_timeout=self.idle_timeout, min_rate=self.min_rate, deadlines=self._deadlines,
            header_budget=self._header_budget, mappings=self._mappings,
            counts=self._counts, closing=self._closing, warn=self._warn_about,
            steering=self.steering.instance,
        )

    def _warn_about(self, address: str, message: str, level: int = WARNING,
                    about: str = "") -> None:
        """Log a peer's misbehaviour (or what befell it, ``about`` which); a peer retrying
        every second is logged once a minute."""
        self._warnings((address.rpartition(":")[0] or address, about), level, message)


# Its connection threads log: logging is imported here, by the thread that imports the
# server, not by a connection thread's first message (see log.ready).
log.ready()

# Servers started in this process. At exit their files go, as close() removes them: a REPL
# left without close() left a socket file for each port it had served.
_running: weakref.WeakSet[Server] = weakref.WeakSet()


@atexit.register
def _remove_files_at_exit() -> None:
    for server in list(_running):
        server._remove_files()


def _control_value(number: int, what: str, least: int = 1) -> int:
    """``number`` as the int a control message carries (see errors.whole_number)."""
    return whole_number(number, what, least, wire.MAX_CONTROL_VALUE)


def _shutdown_reading(sock: socket.socket) -> None:
    """Wake the connection's reader; its writing side stays open for the acks it owes."""
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass


def _format_address(address: Any) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address) or "local"


