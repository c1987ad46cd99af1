"""The receiving side: a listening socket, one thread per connected client, the store.

Each connection is handled on its own thread, so one slow or stalled client
never holds up the others. A frame is received straight into freshly
allocated arrays and stored only once it arrived whole; anything malformed
closes that connection and nothing of it is kept.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

from . import auth, config, shm, wire
from ._core import recv_buffers, send_buffers
from .arrays import finish
from .buffers import ReceiveBuffers
from .errors import HandshakeError, LimitExceeded, ProtocolError
from .sockets import (
    listen,
    listen_unix,
    peer_uid,
    set_timeouts,
    tune_stream,
    unix_socket_path,
)
from .store import Capture, HistoryStore, Sender

log = logging.getLogger("thing")


class Server:
    """Receives captures from any number of clients into a :class:`HistoryStore`.

    ``port=0`` picks a free port (see :attr:`port` after :meth:`start`). With a
    ``token`` (or ``THING_TOKEN``) clients must prove they know it; listening
    beyond loopback without one generates a token (see ``thing/auth.py``).
    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(
        self,
        port: int = config.DEFAULT_PORT,
        host: str = "127.0.0.1",
        *,
        store: HistoryStore | None = None,
        limits: wire.Limits | None = None,
        token: str | None = None,
    ):
        self.host = host
        self.port = port
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
        self._connections: dict[socket.socket, Sender] = {}
        # Handshakes and frame headers must arrive whole by a deadline: SO_RCVTIMEO alone
        # restarts on every byte, so a peer trickling one byte at a time would never time out.
        self._deadlines: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._warned_at: dict[str, float] = {}
        self.received = 0
        self.refused = 0  # connections turned away at the cap
        self.dropped_transfers = 0  # frames begun but never stored

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> Server:
        """Bind, listen and start accepting in a background thread; return ``self``."""
        if self._listener is not None:
            return self
        self._listener = listen(self.host, self.port)
        self.port = self._listener.getsockname()[1]
        self.token = self._configured_token or os.environ.get("THING_TOKEN") or None
        if self.token is None and not auth.is_loopback(self.host):
            self.token, self._generated_token = secrets.token_urlsafe(32), True
            path = auth.write_token_file(self.port, self.token)
            log.warning(
                "Listening on %s, beyond this machine, so clients need a token. Clients of "
                "this user here read it from %s; elsewhere run:  export THING_TOKEN=%s",
                self.host,
                path,
                self.token,
            )
        self._closing.clear()
        self._spawn(self._accept_loop, "thing-accept", self._listener)
        self._spawn(self._enforce_deadlines, "thing-deadlines")
        self._listen_on_this_host()
        log.info("Server started at port %d.", self.port)
        return self

    def _listen_on_this_host(self) -> None:
        """Also listen on a Unix socket, the fast path for clients on this machine."""
        path = unix_socket_path(self.port)
        if path is None:
            log.debug("no private directory for a Unix socket; TCP only")
            return
        try:
            self._unix_listener = listen_unix(path)
        except OSError as exc:
            log.debug("cannot listen on %s (%s); TCP only", path, exc)
            return
        self.unix_path = path
        self._spawn(self._accept_loop, "thing-accept-unix", self._unix_listener)

    def close(self) -> None:
        """Stop accepting, disconnect every client and wait for their threads."""
        if self._listener is None:
            return
        self._closing.set()
        _shutdown(self._listener)
        if self._unix_listener is not None:
            _shutdown(self._unix_listener)
        with self._lock:
            for sock in self._connections:
                _shutdown(sock)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)
        self._listener.close()
        self._listener = None
        self.buffers.clear()
        if self._unix_listener is not None:
            self._unix_listener.close()
            self._unix_listener = None
            with contextlib.suppress(OSError):
                self.unix_path.unlink()
            self.unix_path = None
        if self._generated_token and self.token is not None:
            auth.remove_token_file(self.port, self.token)
            self._generated_token = False
        self._threads.clear()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`close`."""
        return self._listener is not None

    def clients(self) -> list[Sender]:
        """The clients connected right now."""
        with self._lock:
            return list(self._connections.values())

    # -- queries (the REPL functions call these) -----------------------------------

    def get(self, name_or_id: str | int, index: int = 0, rank: int | None = None) -> Any:
        """The newest value of a name (``index=1`` the one before, ...) or the value with an id."""
        return self.store.get(name_or_id, index, rank).value

    def get_all(self, name: str, rank: int | None = None) -> list[Any]:
        """Every kept value of ``name``, oldest to newest."""
        return [capture.value for capture in self.store.get_all(name, rank)]

    def capture(self, name_or_id: str | int, index: int = 0, rank: int | None = None) -> Capture:
        """The :class:`Capture` record (value plus everything known about it)."""
        return self.store.get(name_or_id, index, rank)

    def wait(self, name: str, timeout: float | None = None) -> Any:
        """Block until a new capture of ``name`` arrives; return its value."""
        return self.store.wait(name, timeout).value

    def clear(self, name: str | None = None) -> int:
        """Forget one name's history, or everything; return how many captures were dropped."""
        dropped = self.store.clear(name)
        if name is None:
            self.buffers.clear()
        return dropped

    def summary(self, max_items: int | None = 5) -> None:
        """Print a table of what this server received (see ``thing.summary``)."""
        from .display import show_summary

        show_summary(self, max_items)

    def describe(self, name_or_id: str | int, index: int = 0, rank: int | None = None) -> None:
        """Print everything known about a capture, with statistics for arrays."""
        from .display import show_description

        show_description(self.capture(name_or_id, index, rank), self)

    def status(self) -> None:
        """Watch arrivals live; Ctrl+C returns and the server keeps running."""
        from .display import show_status

        show_status(self)

    def ingest_all(
        self, overwrite: bool = False, namespace: dict[str, Any] | None = None
    ) -> dict[str, str]:
        """Bind the newest capture of every name as a variable in the caller's namespace."""
        from .repl import ingest_into

        return ingest_into(self, overwrite, namespace)

    def help(self) -> None:
        """List every public function of thing with its signature."""
        from .display import show_help

        show_help()

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
            name = _format_address(address)
            with self._lock:
                # Counted from accept, not from the handshake: peers that connect and
                # say nothing must not be able to pile up threads.
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections[sock] = Sender(name)
            if full:
                self.refused += 1
                log.warning(
                    "refused %s: already serving %d clients (THING_MAX_CONNECTIONS)",
                    name,
                    self.max_connections,
                )
                sock.close()
                continue
            self._spawn(self._serve_connection, f"thing-conn-{name}", sock, name)

    def _enforce_deadlines(self) -> None:
        while not self._closing.wait(min(1.0, self.idle_timeout / 4)):
            now = time.monotonic()
            with self._lock:
                late = [sock for sock, deadline in self._deadlines.items() if now > deadline]
                for sock in late:
                    del self._deadlines[sock]
            for sock in late:
                self._warn_about(
                    self._connections.get(sock, Sender("?")).address,
                    "dropped a peer too slow to finish its handshake or header",
                )
                _shutdown(sock)

    def _start_deadline(self, sock: socket.socket) -> None:
        with self._lock:
            self._deadlines[sock] = time.monotonic() + self.idle_timeout

    def _stop_deadline(self, sock: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(sock, None)

    def _serve_connection(self, sock: socket.socket, address: str) -> None:
        sender = Sender(address)
        local = sock.family == socket.AF_UNIX
        try:
            if local:
                uid = peer_uid(sock)
                if uid not in (None, 0, os.getuid()):
                    raise HandshakeError(f"refused a Unix-socket peer of another user (uid {uid})")
            tune_stream(sock)
            set_timeouts(sock, self.idle_timeout, self.idle_timeout)
            self._start_deadline(sock)
            sender = self._handshake(sock, address)
            self._stop_deadline(sock)
            with self._lock:
                self._connections[sock] = sender
            log.debug("client connected: %s (pid %d on %s)", address, sender.pid, sender.hostname)
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            acks: list[bytes] = []
            while self._wait_readable(poller):
                ack = self._receive_frame(sock, sender, local)
                if ack is None:
                    break
                acks.append(ack)
                # Frames that arrived together are answered together: one send, and
                # one wake-up of the client's reader, per batch.
                if len(acks) >= 64 or not poller.poll(0):
                    send_buffers(sock, acks)
                    acks.clear()
        except HandshakeError as exc:
            self._warn_about(address, f"dropped {address}: {exc}")
        except ProtocolError as exc:
            self._warn_about(address, f"dropped {address}: {exc}")
            _reject_and_close(sock, str(exc))
        except (ConnectionError, TimeoutError) as exc:
            log.debug("client %s went away: %s", address, exc)
        except OSError as exc:
            if not self._closing.is_set():
                log.warning("connection to %s failed: %s", address, exc)
        except Exception:  # never let one client's bug take the server thread's siblings down
            log.exception("unexpected error serving %s; connection closed", address)
        finally:
            with self._lock:
                self._connections.pop(sock, None)
                self._deadlines.pop(sock, None)
            sock.close()

    def _warn_about(self, address: str, message: str) -> None:
        """Log a peer's misbehaviour; a peer retrying every second is logged once a minute."""
        host = address.rpartition(":")[0] or address
        now = time.monotonic()
        if now - self._warned_at.get(host, -60.0) >= 60:
            if len(self._warned_at) > 1000:
                self._warned_at.clear()
            self._warned_at[host] = now
            log.warning(message)
        else:
            log.debug(message)

    def _handshake(self, sock: socket.socket, address: str) -> Sender:
        prefix = _recv_exact(sock, wire.HANDSHAKE.size)
        try:
            _, length = wire.decode_handshake_prefix(prefix)
        except HandshakeError as exc:
            if prefix[:4] == wire.MAGIC:  # a thing peer of another version: tell it why
                # Read its hello first: closing with unread bytes would reset the
                # connection and lose the refusal on the way.
                _discard(sock, min(wire.HANDSHAKE.unpack(prefix)[3], wire.MAX_HANDSHAKE_JSON))
                _refuse(sock, str(exc))
            raise
        info = wire.decode_handshake_info(_recv_exact(sock, length))
        if self.token is not None:
            nonce = auth.new_nonce()
            send_buffers(sock, [wire.encode_handshake({"nonce": nonce}, wire.HANDSHAKE_CHALLENGE)])
            _, answer = wire.recv_handshake(sock)
            if not auth.verify(self.token, nonce, answer.get("proof")):
                _refuse(sock, "wrong or missing token (set THING_TOKEN to the server's token)")
                raise HandshakeError("refused: wrong or missing token")
        send_buffers(sock, [wire.encode_handshake({"server": "thing", "pid": os.getpid()})])
        return Sender(
            address=address,
            hostname=_printable(str(info.get("hostname", "?"))[:255]),
            pid=_int_or(info.get("pid"), 0),
        )

    def _wait_readable(self, poller: select.poll) -> bool:
        """Wait, as long as it takes, for the next frame to begin; False once closing."""
        while not self._closing.is_set():
            if poller.poll(1000):
                return True
        return False

    def _receive_frame(self, sock: socket.socket, sender: Sender, local: bool) -> bytes | None:
        """Receive, validate and store one frame; return its acknowledgement.

        None when the peer closed between frames.
        """
        self._start_deadline(sock)
        try:
            prefix, fds = _recv_prefix(sock, local)
        except ConnectionResetError:
            return None  # a clean close between frames
        try:
            return self._receive_rest(sock, sender, prefix, fds)
        except BaseException:
            with self._lock:
                self.dropped_transfers += 1  # cut mid-frame, invalid, or stalled: nothing kept
            raise
        finally:
            for fd in fds:  # descriptors we did not adopt, e.g. sent by a misbehaving peer
                os.close(fd)

    def _receive_rest(
        self, sock: socket.socket, sender: Sender, prefix: bytes, fds: list[int]
    ) -> bytes:
        kind, header_len, payload_len = wire.decode_prefix(prefix, self.limits)
        shared = kind == wire.KIND_SHARED_MEMORY
        if len(fds) != shared:
            raise ProtocolError(f"a frame of kind {kind} came with {len(fds)} descriptors")
        header = wire.decode_header(_recv_exact(sock, header_len), payload_len, self.limits)
        # The payload may take long on a slow link; SO_RCVTIMEO still drops a stalled one.
        self._stop_deadline(sock)
        try:
            self.store.reserve(payload_len)
        except LimitExceeded as exc:
            _discard(sock, (0 if shared else payload_len) + wire.FRAME_TRAILER.size)
            log.warning("rejected %r from %s: %s", header.name, sender.address, exc)
            return wire.encode_ack(header.seq, -1, str(exc))
        stored = False
        try:
            trailer = bytearray(wire.FRAME_TRAILER.size)
            if shared:
                arrays = shm.adopt(fds.pop(), header.leaves)
                recv_buffers(sock, [trailer])
            else:
                arrays = [self.buffers.array(spec) for spec in header.leaves]
                recv_buffers(sock, [array for array in arrays if array.nbytes] + [trailer])
            modified = wire.decode_trailer(bytes(trailer))
            value = wire.build_value(
                header.tree, [finish(s, a) for s, a in zip(header.leaves, arrays)]
            )
            capture = self.store.add(
                None if header.name is None else _printable(header.name),
                value,
                header.leaves,
                payload_len,
                _sender_of(header.meta, sender),
                caught_at=_float_or(header.meta.get("caught_at")),
                call_site=_str_or(header.meta.get("site")),
                modified_during_send=modified,
            )
            stored = True
        except LimitExceeded as exc:  # the whole frame was read: the stream is still in step
            log.warning("rejected %r from %s: %s", header.name, sender.address, exc)
            return wire.encode_ack(header.seq, -1, str(exc))
        finally:
            if not stored:
                self.store.release(payload_len)
        self.received += 1
        return wire.encode_ack(header.seq, capture.id)


def _recv_prefix(sock: socket.socket, local: bool) -> tuple[bytes, list[int]]:
    """A frame prefix, and on a Unix socket the descriptors that came with it."""
    if not local:
        return _recv_exact(sock, wire.FRAME_PREFIX.size), []
    prefix, fds = b"", []
    flags = socket.MSG_WAITALL | getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    while len(prefix) < wire.FRAME_PREFIX.size:
        data, received, message_flags, _ = socket.recv_fds(
            sock, wire.FRAME_PREFIX.size - len(prefix), 4, flags
        )
        fds += received
        if message_flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise ProtocolError("a peer sent more descriptors than a frame carries")
        if not data:
            for fd in fds:
                os.close(fd)
            raise ConnectionResetError(errno.ECONNRESET, "peer closed the connection")
        prefix += data
    return prefix, fds


def _sender_of(meta: dict[str, Any], connection: Sender) -> Sender:
    rank, world_size = meta.get("rank"), meta.get("world_size")
    if rank is None and world_size is None:
        return connection
    return Sender(
        connection.address,
        connection.hostname,
        connection.pid,
        _int_or(rank, None),
        _int_or(world_size, None),
    )


def _reject_and_close(sock: socket.socket, reason: str) -> None:
    """Tell the peer why its frame was refused, then let it see the end of the stream.

    Closing with its unread bytes still queued would reset the connection and
    lose the answer, so read (and drop) what it still sends, briefly.
    """
    try:
        set_timeouts(sock, 1.0, 0.2)
        send_buffers(sock, [wire.encode_ack(wire.SEQ_CURRENT_FRAME, -1, reason[:1000])])
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 1.0
        scratch = bytearray(1 << 16)
        while time.monotonic() < deadline and sock.recv_into(scratch):
            pass
    except OSError:
        pass


def _refuse(sock: socket.socket, reason: str) -> None:
    send_buffers(sock, [wire.encode_handshake({"error": reason}, wire.HANDSHAKE_REFUSED)])


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    recv_buffers(sock, [buffer])
    return bytes(buffer)


def _discard(sock: socket.socket, size: int) -> None:
    scratch = bytearray(min(size, 1 << 20))
    while size:
        chunk = memoryview(scratch)[: min(size, len(scratch))]
        recv_buffers(sock, [chunk])
        size -= len(chunk)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _format_address(address: Any) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address) or "local"


def _int_or(value: Any, default: Any) -> Any:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _float_or(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _str_or(value: Any) -> str | None:
    return _printable(value[:1024]) if isinstance(value, str) else None


def _printable(text: str) -> str:
    """``text`` with every character a terminal would act on shown escaped.

    Names, hostnames and call sites are chosen by peers and end up in the
    researcher's terminal: no escape sequences, no unpaired surrogates.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
