"""The sending side: ``catch`` on the caller's thread, all network I/O on a sender thread.

On the caller's thread ``catch`` traces or takes the name, applies ``every=``
and ``first=``, notes each array's dtype and shape together with a reference
to it, and appends that to a bounded queue: no I/O, no copy of array data, no
exception. A sender thread per server sends each capture as one frame straight
from the arrays' own memory, and a reader thread resolves handles as the
server acknowledges them. While no server listens, captures are dropped at
once and the sender keeps trying to connect, about once a second.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any, NamedTuple

from . import auth, config, shm, wire
from ._core import recv_buffers, send_buffers
from .arrays import leaf_bytes, torn
from .errors import HandshakeError, ProtocolError
from .names import CallSite, NameTracer
from .sockets import (
    connect,
    connect_unix,
    is_this_host,
    parse_address,
    set_timeouts,
    unix_socket_path,
)

log = logging.getLogger("thing")

_allocate_lock = threading.Lock


class CaptureHandle:
    """What ``catch`` returns. ``wait()`` tells whether the server stored the capture.

    ``id`` is the server's id for it once acknowledged; ``error`` says why not.
    """

    __slots__ = ("name", "id", "error", "_pending")

    def __init__(self, name: str | None, error: str | None = None):
        self.name = name
        self.id: int | None = None
        self.error = error
        self._pending = None
        if error is None:
            self._pending = _allocate_lock()
            self._pending.acquire()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the server's acknowledgement; True once the capture is stored and visible."""
        pending = self._pending
        if pending is not None:
            if not pending.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
                return False
            pending.release()
        return self.id is not None

    @property
    def done(self) -> bool:
        """True once the capture was stored, refused, dropped or skipped."""
        return self._pending is None or not self._pending.locked()

    def _resolve(self, capture_id: int | None, error: str | None = None) -> None:
        if self._pending is not None and self._pending.locked():
            self.id, self.error = capture_id, error
            self._pending.release()

    def __repr__(self) -> str:
        state = (
            "pending"
            if not self.done
            else (f"stored as {self.id}" if self.id is not None else f"not sent: {self.error}")
        )
        return f"<CaptureHandle {self.name!r} {state}>"


# Handles for calls that never reach the queue; shared so a skipped call allocates nothing.
SKIPPED = CaptureHandle(None, "skipped by every=/first=")
NO_SERVER = CaptureHandle(None, "no server is listening")
QUEUE_FULL = CaptureHandle(None, "dropped: the send queue is full")
FAILED = CaptureHandle(None, "catch failed; see the 'thing' log")


class _Pending(NamedTuple):
    name: str | None
    payload: wire.Payload
    site: CallSite | None
    caught_at: float
    handle: CaptureHandle


class _Throttle:
    """Per-name ``every=`` / ``first=`` bookkeeping."""

    __slots__ = ("calls", "sent")

    def __init__(self) -> None:
        self.calls = 0
        self.sent = 0

    def admit(self, every: int, first: int | None) -> bool:
        call = self.calls
        self.calls = call + 1
        if call % every or (first is not None and self.sent >= first):
            return False
        self.sent += 1
        return True


class Client:
    """Sends captures to a thing server; ``catch`` never blocks, raises or prints.

    ``max_queue_bytes`` / ``max_queue_items`` bound what waits to be sent
    (defaults ``THING_QUEUE_BYTES`` = 1 GiB, ``THING_QUEUE_ITEMS`` = 1024).
    ``token`` (default ``THING_TOKEN``, else the local server's token file)
    answers a server that requires one.
    """

    def __init__(
        self,
        server_addr: str = "localhost",
        server_port: int = config.DEFAULT_PORT,
        *,
        max_queue_bytes: int | None = None,
        max_queue_items: int | None = None,
        token: str | None = None,
    ):
        self.address = parse_address(server_addr, server_port)
        self.token = token
        self.max_queue_bytes = max_queue_bytes or config.queue_max_bytes()
        self.max_queue_items = max_queue_items or config.queue_max_items()
        self._lock = threading.Condition(threading.Lock())
        self._channels: dict[Any, _Channel] = {}
        self._throttles: dict[str | None, _Throttle] = {}
        self._names = NameTracer()
        self._queued_bytes = 0
        self._queued_items = 0
        self._warned: set[str] = set()
        self._last_drop_log = 0.0
        self.dropped = 0
        self.sent = 0
        self._closed = False
        _live_clients.add(self)

    def catch(
        self,
        obj: Any,
        name: str | None = None,
        server: str | None = None,
        every: int = 1,
        first: int | None = None,
        *,
        copy: bool = False,
        block: bool = False,
        _frame: Any = None,
    ) -> CaptureHandle:
        """Queue ``obj`` (an array, a number, a string, or nested list/tuple/dict of them).

        ``name`` defaults to the source text of the argument. ``every=n`` sends
        the 1st, (1+n)th, ... call of a name; ``first=n`` only its first n sent
        captures. ``copy=True`` snapshots the data now instead of reading it
        on the sender thread. ``block=True`` waits for room in a full queue
        instead of dropping. Never raises: failures log one warning and return
        a handle whose ``wait()`` is False.
        """
        try:
            site = None
            if name is None:
                name, site = self._names.name_for(_frame or sys._getframe(1))
            if every != 1 or first is not None:
                throttle = self._throttles.get(name) or self._throttles.setdefault(
                    name, _Throttle()
                )
                if not throttle.admit(max(int(every), 1), first):
                    return SKIPPED
            channel = self._channels.get(server) or self._open_channel(server)
            if channel.down:
                return NO_SERVER
            pending = _Pending(
                name, wire.take_apart(obj, copy), site, time.time(), CaptureHandle(name)
            )
            return channel.enqueue(pending, block)
        except Exception as exc:  # catch() must never raise into a training loop
            self._warn_once(f"{type(exc).__name__}:{name}", "thing.catch(%s) failed: %s", name, exc)
            return FAILED

    def _open_channel(self, server: str | None) -> _Channel:
        address = self.address if server is None else parse_address(server, self.address[1])
        with self._lock:
            if self._closed:
                raise RuntimeError("this client is closed")
            channel = next((c for c in self._channels.values() if c.address == address), None)
            if channel is None:
                channel = _Channel(self, address)
            self._channels[server] = channel
            return channel

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued capture was sent and acknowledged; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while any(channel.busy for channel in self._channels.values()):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True

    def close(self, timeout: float | None = 0) -> None:
        """Flush for up to ``timeout`` seconds, then disconnect and drop whatever is left."""
        if timeout:
            self.flush(timeout)
        with self._lock:
            self._closed = True
            channels = set(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close()

    def connected(self, server: str | None = None) -> bool:
        """True while the client holds a connection to the (default) server."""
        channel = self._channels.get(server)
        return channel is not None and channel.connected

    def transport(self, server: str | None = None) -> str | None:
        """The path to the (default) server: "tcp", "unix" or "shm"; None before connecting."""
        channel = self._channels.get(server)
        return None if channel is None else channel.transport

    # -- bookkeeping shared by the channels ----------------------------------------

    def _admit(self, nbytes: int, block: bool) -> bool:
        """Take queue room for one capture (caller holds ``_lock``)."""
        while self._queued_items >= self.max_queue_items or (
            self._queued_items and self._queued_bytes + nbytes > self.max_queue_bytes
        ):
            if not block:
                self.dropped += 1
                now = time.monotonic()
                if now - self._last_drop_log > 5:
                    self._last_drop_log = now
                    log.warning(
                        "send queue full (%d captures, %d bytes): %d captures dropped so far",
                        self._queued_items,
                        self._queued_bytes,
                        self.dropped,
                    )
                return False
            self._lock.wait(1.0)
        self._queued_items += 1
        self._queued_bytes += nbytes
        return True

    def _release(self, nbytes: int) -> None:
        """Give back queue room (caller holds ``_lock``)."""
        self._queued_items -= 1
        self._queued_bytes -= nbytes
        self._lock.notify_all()

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned and len(self._warned) < 1000:
            self._warned.add(key)
            log.warning(message, *args)

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's sockets and threads, start afresh."""
        self._lock = threading.Condition(threading.Lock())
        self._channels = {}
        self._queued_bytes = self._queued_items = 0


class _Channel:
    """The connection to one server: its queue, sender thread and acknowledgement reader."""

    def __init__(self, client: Client, address: tuple[str, int]):
        self.client = client
        self.address = address
        self._lock = client._lock
        self._queue: deque[_Pending] = deque()
        self._inflight: dict[int, _Pending] = {}  # sent, awaiting the server's ack
        self._seq = itertools.count()
        self._sock: socket.socket | None = None
        self._lost = False  # the reader saw the connection end; the sender must reconnect
        self.transport: str | None = None  # "tcp", "unix" or "shm" once connected
        self._unix_refused = False  # the Unix socket turned us away: go by TCP
        self._closed = False
        # Until the first attempt to connect has failed, captures wait for it.
        self.down = False
        self._thread = threading.Thread(
            target=self._run, name=f"thing-send-{address[0]}:{address[1]}", daemon=True
        )
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._inflight)

    def enqueue(self, pending: _Pending, block: bool) -> CaptureHandle:
        nbytes = pending.payload.nbytes
        with self._lock:
            if not self.client._admit(nbytes, block):
                return QUEUE_FULL
            self._queue.append(pending)
            # A small capture joining others needs no wake-up: the sender is already
            # gathering them (see _gather), and waking it costs the training loop more.
            if len(self._queue) == 1 or nbytes >= _SMALL_BYTES or len(self._queue) >= _BATCH:
                self._lock.notify_all()
        return pending.handle

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._sock is not None:
            _shutdown(self._sock)

    # -- sender thread -------------------------------------------------------------

    def _run(self) -> None:
        delay = 0.05
        while not self._closed:
            try:
                sock = self._connect()
            except Exception as exc:  # the sender thread must outlive any failure to connect
                if not isinstance(exc, (OSError, ProtocolError)):
                    log.exception("unexpected error connecting to %s:%d", *self.address)
                self._set_down(exc)
                time.sleep(delay)
                delay = min(delay * 2, config.reconnect_interval())
                continue
            delay = 0.05
            with self._lock:
                self._sock, self.down, self._lost = sock, False, False
            reader = threading.Thread(
                target=self._read_acks,
                args=(sock,),
                daemon=True,
                name=f"thing-acks-{self.address[0]}:{self.address[1]}",
            )
            reader.start()
            try:
                self._send_loop(sock)
            except (OSError, ProtocolError) as exc:
                log.warning("lost the thing server at %s:%d: %s", *self.address, exc)
            finally:
                _shutdown(sock)
                reader.join()
                sock.close()
                self._fail_inflight("the connection to the server was lost")
                with self._lock:
                    self._sock = None

    def _open(self, same_host: bool) -> tuple[socket.socket, str]:
        """Connect by the fastest path available: shared memory, Unix socket, else TCP."""
        host, port = self.address
        wanted = config.transport()
        if same_host and wanted != "tcp" and is_this_host(host):
            path = unix_socket_path(port)
            try:
                if path is not None and path.exists():
                    sock = connect_unix(path, config.connect_timeout())
                    return sock, "shm" if wanted == "shm" and shm.AVAILABLE else "unix"
            except OSError as exc:
                log.debug("Unix socket %s unusable (%s); trying TCP", path, exc)
        return connect(host, port, config.connect_timeout()), "tcp"

    def _connect(self) -> socket.socket:
        sock, transport = self._open(same_host=not self._unix_refused)
        try:
            self._handshake(sock)
        except (OSError, ProtocolError) as exc:
            sock.close()
            if transport == "tcp":
                raise
            # The Unix socket is there but would not have us (another user's server
            # behind a shared path, say): TCP may still, and from now on is tried first.
            log.info("the Unix socket refused us (%s); using TCP", exc)
            self._unix_refused = True
            sock, transport = self._open(same_host=False)
            try:
                self._handshake(sock)
            except BaseException:
                sock.close()
                raise
        except BaseException:
            sock.close()
            raise
        if transport != self.transport:
            host, port = self.address
            log.info(
                "sending to the thing server at %s:%d over %s",
                host,
                port,
                _TRANSPORT_NAMES[transport],
            )
        self.transport = transport
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        host, port = self.address
        send_buffers(sock, [wire.encode_handshake(_identity())])
        status, info = wire.recv_handshake(sock)
        token = None
        if status == wire.HANDSHAKE_CHALLENGE:
            # Without a token, answer anyway, so the server can say why it refuses us.
            token = auth.client_token(port, self.client.token)
            nonce = str(info.get("nonce", ""))
            answer = {"proof": auth.proof(token, nonce) if token else ""}
            send_buffers(sock, [wire.encode_handshake(answer)])
            status, info = wire.recv_handshake(sock)
        if status != wire.HANDSHAKE_OK:
            if token is None and "token" in str(info.get("error", "")):
                raise HandshakeError(
                    f"the server at {host}:{port} requires a token: set THING_TOKEN "
                    "to the value the server printed"
                )
            raise HandshakeError(f"server refused the connection: {info.get('error', '?')}")
        set_timeouts(sock, config.send_timeout(), None)

    def _set_down(self, reason: Exception) -> None:
        with self._lock:
            first_failure = not self.down
            self.down = True
            dropped = list(self._queue)
            self._queue.clear()
            for pending in dropped:
                self.client._release(pending.payload.nbytes)
        why = str(reason) if isinstance(reason, HandshakeError) else "no server is listening"
        for pending in dropped:
            pending.handle._resolve(None, why)
        if first_failure:
            if isinstance(reason, HandshakeError):
                log.warning("cannot use the thing server at %s:%d: %s", *self.address, reason)
            else:
                log.debug("no thing server at %s:%d (%s); will keep trying", *self.address, reason)

    def _send_loop(self, sock: socket.socket) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed and not self._lost:
                    self._lock.wait()
                if self._closed:
                    return
                if self._lost:
                    raise ConnectionResetError("the server closed the connection")
                self._gather()
                batch = []
                while self._queue:
                    pending = self._queue.popleft()
                    seq = next(self._seq)
                    self._inflight[seq] = pending
                    batch.append((seq, pending))
            for seq, pending in batch:
                self._send(sock, seq, pending)

    def _gather(self) -> None:
        """Let small captures wait a moment for company (the caller holds the lock).

        A loop that catches a scalar every step then costs the sender one
        wake-up per batch instead of one per capture; a large capture, a long
        queue or closing ends the wait at once.
        """
        deadline = time.monotonic() + _GATHER_SECONDS
        while (
            not self._closed
            and not self._lost
            and len(self._queue) < _BATCH
            and all(pending.payload.nbytes < _SMALL_BYTES for pending in self._queue)
        ):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._lock.wait(remaining)

    def _send(self, sock: socket.socket, seq: int, pending: _Pending) -> None:
        payload = pending.payload
        try:
            views = [leaf_bytes(leaf) for leaf in payload.leaves]
            header = wire.encode_header(seq, pending.name, payload, _meta(pending))
        except Exception as exc:  # a leaf that cannot be read: fail this capture only
            self._finish(seq, None, f"could not read the data: {exc}")
            self.client._warn_once(
                f"send:{pending.name}", "thing could not send %r: %s", pending.name, exc
            )
            return
        if self.transport == "shm" and payload.nbytes >= config.shm_threshold():
            sent = self._send_shared(sock, header, payload, views)
        else:
            sent = False
        if not sent:
            prefix = wire.encode_prefix(header, payload.nbytes)
            buffers = [prefix, header, *(view for view in views if view.nbytes)]
            del views
            if any(leaf.version is not None for leaf in payload.leaves):
                # Whether a torch tensor tore is known only once its bytes are in the kernel.
                send_buffers(sock, buffers)
                buffers = []
            trailer = wire.encode_trailer(any(torn(leaf) for leaf in payload.leaves))
            send_buffers(sock, [*buffers, trailer])
        # The bytes are in the kernel: drop our references so the arrays can be freed.
        payload.leaves.clear()

    def _send_shared(
        self, sock: socket.socket, header: bytes, payload: wire.Payload, views: list
    ) -> bool:
        """Hand the payload over in a sealed memfd; False (and nothing sent) if that fails."""
        try:
            fd = shm.export(views)
        except OSError as exc:  # out of descriptors or memory: the stream still works
            self.client._warn_once("shm", "shared memory unavailable (%s); sending inline", exc)
            return False
        try:
            prefix = wire.encode_prefix(header, payload.nbytes, wire.KIND_SHARED_MEMORY)
            trailer = wire.encode_trailer(any(torn(leaf) for leaf in payload.leaves))
            message = prefix + header + trailer
            sent = socket.send_fds(sock, [message], [fd])
            if sent < len(message):  # only a signal or a timeout splits a message this small
                send_buffers(sock, [memoryview(message)[sent:]])
        finally:
            os.close(fd)
        return True

    def _read_acks(self, sock: socket.socket) -> None:
        prefix = bytearray(wire.ACK.size)
        try:
            while True:
                recv_buffers(sock, [prefix])
                status, length, seq, capture_id = wire.decode_ack(bytes(prefix))
                message = bytearray(length)
                if length:
                    recv_buffers(sock, [message])
                if seq == wire.SEQ_CURRENT_FRAME:  # acks come in order: it is the oldest
                    with self._lock:
                        seq = min(self._inflight, default=seq)
                if status == wire.ACK_STORED:
                    self._finish(seq, capture_id, None)
                else:
                    self._finish(seq, None, message.decode("utf-8", "replace"))
        except (OSError, ProtocolError):
            _shutdown(sock)  # wakes the sender thread if it is blocked in a send
            with self._lock:  # or if it is waiting for the next capture
                self._lost = True
                self._lock.notify_all()

    def _finish(self, seq: int, capture_id: int | None, error: str | None) -> None:
        with self._lock:
            pending = self._inflight.pop(seq, None)
            if pending is None:
                return
            self.client._release(pending.payload.nbytes)
            if capture_id is not None:
                self.client.sent += 1
        pending.handle._resolve(capture_id, error)
        if error is not None and capture_id is None:
            log.debug("capture %r not stored: %s", pending.name, error)

    def _fail_inflight(self, reason: str) -> None:
        with self._lock:
            seqs = list(self._inflight)
        for seq in seqs:
            self._finish(seq, None, reason)


# Captures below _SMALL_BYTES wait up to _GATHER_SECONDS to be sent with others, at most
# _BATCH at a time: delivery a few milliseconds later, for far fewer thread wake-ups.
_SMALL_BYTES = 64 << 10
_GATHER_SECONDS = 0.01
_BATCH = 64

_TRANSPORT_NAMES = {
    "tcp": "TCP",
    "unix": "a Unix socket",
    "shm": "a Unix socket, with shared memory for large arrays",
}


def _meta(pending: _Pending) -> dict[str, Any]:
    meta: dict[str, Any] = {"caught_at": pending.caught_at}
    if pending.site is not None:
        site = pending.site
        meta["site"] = f"{site.file}:{site.line} ({site.function})"
    rank, world_size = _distributed_rank()
    if rank is not None:
        meta["rank"], meta["world_size"] = rank, world_size
    return meta


def _distributed_rank() -> tuple[int | None, int | None]:
    """Rank and world size: torch.distributed's when initialised, else RANK / WORLD_SIZE."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        rank = int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None, None
    try:
        return rank, int(os.environ.get("WORLD_SIZE", ""))
    except ValueError:
        return rank, None


def _identity() -> dict[str, Any]:
    from . import __version__

    return {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "thing": __version__,
        "python": sys.version.split()[0],
    }


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


_live_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def _flush_at_exit() -> None:
    timeout = config.flush_timeout()
    deadline = time.monotonic() + timeout
    for client in list(_live_clients):
        client.flush(max(deadline - time.monotonic(), 0))


def _after_fork_in_child() -> None:
    for client in list(_live_clients):
        client._after_fork()


atexit.register(_flush_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
