"""The connection to one server: its send queue and the one thread that sends and reads.

A :class:`Channel` connects (through :func:`thing.dial.dial`: the path and the
handshake), sends each queued capture as one frame straight from its arrays'
memory, and resolves each capture's handle from the server's
acknowledgements. Whatever happens (a refusal, a lost connection, a bug, the
client closing), every handle it accepted is resolved exactly once.

One thread does both, waiting in ``poll`` for captures to send (a caller
wakes it through a socket pair) and for the server's messages. Between ticks
of small captures it does not listen for their acknowledgements: it reads
them at the next tick, so a training loop's capture costs one wake-up of this
process a tick, not two. It listens at once whenever someone waits for an
outcome, when it is idle (control messages, the server leaving), when the job
catches a name on demand (requests), and, once ``MAX_IN_FLIGHT`` frames await
answers, for them. A capture's room in the client's queue comes back once its
bytes are sent, so no catch waits for answers left for the tick.

The server answers every frame exactly once, in frame order, so the oldest
frame in flight is always the one an acknowledgement is for; the reader
checks that, and a server that breaks it is treated as a broken connection.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from . import auth, config, frames, shm, wire
from ._core import send_buffers, send_snapshots, wake
from .answers import Acknowledgement, Answers
from .arrays import leaf_bytes, torn
from .dial import TRANSPORT_NAMES, dial
from .errors import ProtocolError
from .frames import Finished, Headers, Pending, Undelivered, new_pending, untrack_pending
from .handles import CLOSED, NO_SERVER, QUEUE_FULL, CaptureHandle, busy, interrupting, working
from .log import ERROR, WARNING, LogOnce, log
from .names import CallSite
from .overrides import Overrides
from .send_queue import SendQueue
from .sockets import shutdown
from .value_trees import Payload, caught_type, take_apart, type_name

# Captures below wire.SMALL_BYTES are sent together, once a tick of TICK_SECONDS, at most
# BATCH at a time: delivery up to a tick later, for far fewer thread wake-ups (each costs
# tens of microseconds of CPU on a virtual machine, more than the capture itself). They
# were snapshotted at the call, so the wait cannot change what they hold.
TICK_SECONDS = 0.05
# An idle sender still wakes this often: a client collected by a finalizer that interrupted
# thing's own work (see finish) cannot wake it, and a client is always collected by the
# cyclic collector, wherever that runs (its gate holds its catch, which holds it).
IDLE_RECHECK_SECONDS = 10.0
BATCH = 64
# Captures up to this size are snapshotted before they take room in the queue (see
# Channel._enqueue).
HOLD_FIRST_BYTES = 4 << 10
# Small frames sent in one vectored write at most: bounds what one sendmsg holds.
COALESCE = 64
# Frames sent and not yet answered, at most. The sender reads answers only between sends:
# the server's unread answers (each write of them takes about a kilobyte of its socket's
# buffer, however small) must never fill that buffer while a long send of ours waits for
# the server to read, which it would not do while it waits to answer.
MAX_IN_FLIGHT = 128
# What the handle of a capture says that was let through at its call, and paused before it
# was queued (see _queue_up and _learn_settings).
PAUSED = "skipped: paused by the REPL"
# Why a capture whose memory was freed while it was read is not sent (see arrays.torn).
MEMORY_FREED = ("not sent: its memory was freed while it was sent (share_memory_(), as "
                "DataLoader and multiprocessing queues do to what they pass on); "
                "catch(..., copy=True) copies it at the call")
# How long hurry() waits for the lock before it leaves flags for the next tick instead.
HURRY_LOCK_SECONDS = 0.001

_CLOSED_IN_FLIGHT = ("unacknowledged: the client was closed before the server answered "
                     "(it may or may not have stored it)")

# Notices of unsent captures a connection sends at most (one per name and reason).
MAX_TOLD = 1000
# A connection lost again and again is logged at most once this often.
WARN_SECONDS = 60.0


class Channel:
    """The connection to one server: its queue, and the thread that sends and reads."""

    def __init__(self, address: tuple[str, int], queue: SendQueue, token: str | None,
                 overrides: Overrides, this_host: bool):
        self.address = address
        self.token = token
        self.overrides = overrides
        self._room = queue
        self._lock = queue.lock
        self._mutex = queue.mutex
        self._queue: deque[Pending] = deque()
        # The sender waits in poll (see _wait_for_captures): a write to _wake_fd wakes it,
        # made only while it sleeps (``_asleep``) and only under the lock, so never after
        # the descriptors are closed.
        self._wake_read, self._wake_fd = _wake_descriptors()
        self._asleep = False
        # A poll for a wake-up alone (not select(): a descriptor may be numbered past 1023).
        self._wake_only = select.poll()
        self._wake_only.register(self._wake_read, select.POLLIN)
        # Whether the sender waits for a capture with no tick to wake it (so a capture must),
        # whether what is queued must go at once, and whether acknowledgements must be read
        # as they come, not at the next tick: someone waits for an outcome.
        self._idle = False
        self._send_now = False
        self._acks_wanted = False
        self._queued_bytes = 0  # of the captures in _queue
        # Sent and awaiting the server's ack, in the order they were sent. An OrderedDict
        # finds its first key at once; a plain dict walks past every key popped before it
        # (a microsecond an acknowledgement, with a thousand frames in flight).
        self._inflight: OrderedDict[int, Pending] = OrderedDict()
        # Answered and counted, their handles not told yet (see _tell): still busy.
        self._resolving = 0
        self._next_seq = 0  # frames are numbered in the order they are sent
        # Room (bytes) of frames in flight sent in a memfd, by sequence number: see
        # _hold_room_until_answered.
        self._shared_room: dict[int, int] = {}
        # Why a frame in flight was cut short by us, not the server, by sequence number: its
        # refusal ("did not arrive whole") or its loss is told with this reason instead.
        self._cut_short: dict[int, str] = {}
        self._sock: socket.socket | None = None
        self._notices = False  # whether the server takes notices of unsent captures
        self._told: set[tuple[str | None, str]] = set()  # notices sent on this connection
        self._steered = False  # whether the server may steer us (and takes announcements)
        # Whether it ends what it tells a new connection of its settings with "replayed",
        # and whether that end has come (see _learn_settings).
        self._replays = False
        self._replayed = False
        self._steering: str | None = None  # the server's statements' instance (see dial.py)
        # On-demand names and what they look like, told again on every new connection.
        self._on_demand: dict[str | None, Pending] = {}
        self._headers = Headers()
        self._hurry = self.hurry  # every handle's, bound once (not one more object a catch)
        self.transport: str | None = None  # "tcp", "unix" or "shm" once connected
        self._closed = False
        self._finishing = False  # its client is gone: deliver what is queued, then end
        self._log_once = LogOnce()
        self._log_rarely = LogOnce(per=WARN_SECONDS)
        # Until the first attempt to connect has failed, captures wait for it. While down,
        # catch() answers with down_handle: why the last attempt failed.
        self.down = False
        self.down_handle = NO_SERVER
        self._this_host = this_host  # whether address names this machine
        self._thread = threading.Thread(
            target=self._run, name=f"thing-send-{address[0]}:{address[1]}", daemon=True
        )
        try:
            self._thread.start()
        except BaseException:  # no thread (a limit, the interpreter's end): nor descriptors
            self._close_wake()
            raise

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._inflight or self._resolving)

    def enqueue(self, name: str | None, obj: Any, site: CallSite | None,
                rank: tuple[int | None, int | None], block: bool, copy: bool | None,
                snapshot_bytes: int, call: int = 0, step: int | None = None,
                requested: bool = False) -> CaptureHandle:
        """Queue a capture of ``obj``: taken apart, given room and snapshotted where it must be
        (see :meth:`_enqueue`). Raises :class:`UnsupportedType` for what cannot travel."""
        caught_at = time.time()
        # Every field given, so the tuple is made directly (see frames.Pending).
        pending = new_pending(Pending, (name, take_apart(obj), site, caught_at, rank,
                                        CaptureHandle(name, None, self._hurry), None, call,
                                        step, requested))
        return self._enqueue(pending, block, copy, snapshot_bytes)

    def announce(self, name: str | None, site: CallSite | None,
                 rank: tuple[int | None, int | None], obj: Any) -> None:
        """Tell the server (no data) that ``name`` is caught on demand: its type, shape and
        dtype, so the REPL sees what it may ask for; told again on each new connection."""
        notice = Pending(name, Payload(None, [], 0), site, time.time(), rank,
                         CaptureHandle(name), {"on_demand": _looks(obj)})
        with self._mutex:
            if name not in self._on_demand and len(self._on_demand) >= MAX_TOLD:
                return
            self._on_demand[name] = notice
        self._enqueue(notice, False, False, 0)

    def _announce_again(self) -> None:
        """A new connection: tell its server the on-demand names told to the last one."""
        with self._mutex:
            notices = list(self._on_demand.values())
        for notice in notices:
            self._enqueue(notice._replace(handle=CaptureHandle(notice.name)), False, False, 0)

    def tell_unsent(self, name: str | None, site: CallSite | None,
                    rank: tuple[int | None, int | None], kind: str, reason: str) -> None:
        """Queue a notice (no data) that a capture of type ``kind`` (``value_trees.type_name``)
        could not be sent, and why.

        Once per name and reason on each connection (a server that restarted hears
        again), and only to a server that said it takes notices: an older one would
        store the notice as a capture of None (see :meth:`_send_batch`).
        """
        reason = reason[:wire.MAX_REASON]
        with self._mutex:
            told = self._told
            if (name, reason) in told or len(told) >= MAX_TOLD:
                return
        notice = Pending(name, Payload(None, [], 0), site, time.time(), rank,
                         CaptureHandle(name),
                         {"unsent": {"type": kind, "reason": reason}})
        if self._enqueue(notice, False, False, 0) is notice.handle:
            with self._mutex:
                told.add((name, reason))

    def _enqueue(self, pending: Pending, block: bool, copy: bool | None,
                 snapshot_bytes: int) -> CaptureHandle:
        nbytes = pending.payload.held
        # A capture of a few KiB is snapshotted before it takes room, and queued under the
        # same lock: its copy costs less than taking the lock a second time. A larger one
        # takes room first (a full queue must not cost it a copy) and copies outside the lock.
        held = nbytes <= HOLD_FIRST_BYTES
        if held:
            pending.payload.hold(copy, snapshot_bytes)
        with self._mutex:
            if self._closed:
                if pending.notice is None:
                    self._room.undelivered["closed"] += 1
                return CLOSED
            if self.down:  # failed since the caller looked: queued now, it would wait for
                # the next attempt and be told that one's reason, not its own
                if pending.notice is None:
                    self._room.undelivered["no server"] += 1
                return self.down_handle
            has_room = self._room.take(nbytes, block, pending.notice is None)
            if has_room and held:
                return self._queue_up(pending)
        if not has_room:
            if pending.notice is None:
                self._room.warn_full()
            return QUEUE_FULL
        try:
            pending.payload.hold(copy, snapshot_bytes)
        except BaseException:  # an Exception is counted as failed by catch()
            with self._mutex:
                self._room.give_back(nbytes)
            raise
        with self._mutex:
            return self._queue_up(pending)

    def _queue_up(self, pending: Pending) -> CaptureHandle:
        """Queue a capture that has its room, waking the sender if it must; CLOSED (its room
        given back) if the channel closed since the room was taken (the caller holds the
        lock)."""
        nbytes = pending.payload.held
        if self._closed:  # while the caller waited for room (block=True) or snapshotted
            self._room.give_back(nbytes)
            if pending.notice is None:
                self._room.undelivered["closed"] += 1
            return CLOSED
        if self.overrides.active and self._paused(pending):  # said since it was let through
            self._room.give_back(nbytes)
            pending.handle.resolve(None, PAUSED)
            return pending.handle
        queue = self._queue
        queue.append(pending)
        self._queued_bytes += nbytes
        if len(queue) > BATCH or len(pending.payload.leaves) > 1:
            # It waits behind others (a flood), or holds many objects: out of the collector's
            # walks before it ages into the generation every full collection walks.
            untrack_pending(pending)
        room = self._room
        # A small capture wakes nobody while the sender keeps its tick or is busy (waking
        # it costs the training loop more than the capture): it goes with the next batch,
        # unless what waits here is half of what the client may hold (a small
        # THING_QUEUE_ITEMS must not drop what a send would have made room for), or it is
        # the first a request brings, for which someone at the REPL waits (the rest of a
        # request for every call, request(name, 10**9), must not wake the sender at each).
        wake = self._idle
        awaited = pending.requested and self.overrides.first_answer(pending.name)
        if not self._send_now and (
                nbytes >= wire.SMALL_BYTES or len(queue) >= BATCH
                or 2 * len(queue) > room.max_items
                or 2 * self._queued_bytes > room.max_bytes or awaited):
            self._send_now = wake = True
        if wake:
            self._idle = False
            self._signal()
        return pending.handle

    def hurry(self) -> None:
        """Send what is queued now, without waiting for the tick, and read the answers as
        they come (someone waits for them).

        Waits a millisecond at most for the lock, which a thread catching or the sender
        settling answers holds for microseconds (then the sender sees the flags at its
        tick).
        """
        with working():  # a signal handler's catch must not wait for the lock held here
            if not self._mutex.acquire(timeout=HURRY_LOCK_SECONDS):
                self._send_now = self._acks_wanted = True
                return
            try:
                if self._queue:
                    self._send_now = True
                if self._queue or self._inflight:  # until every outcome awaited is known
                    self._acks_wanted = True
                    self._signal()
            finally:
                self._mutex.release()

    def _signal(self) -> None:
        """Wake the sender if it sleeps (the caller holds the lock)."""
        if self._asleep:
            self._asleep = False
            with contextlib.suppress(OSError):  # catch() never raises
                wake(self._wake_fd)

    def let_go_in_child(self) -> None:
        """In a forked child: close its copies of the parent's sockets (closing, not shutting
        down, which would end the parent's connection), so that the parent's connection
        ends when the parent does, not when the last of its children does. (The child's
        copies of the handles of captures it leaves to the parent end by themselves: see
        handles.SENT_BY_THE_PARENT.) Its copies of the parent's captures are left as they
        are: freeing them would write to their copy-on-write pages, and run their finalizers
        here (a CUDA capture's pinned memory records CUDA events, which a forked child
        cannot)."""
        self._closed, self._asleep = True, False
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._close_wake()

    def finish(self) -> None:
        """Deliver what is queued and read its answers, then end: the client is gone, so
        nothing more will be queued. From a finalizer that interrupted thing's own work on
        this thread, which may hold the lock, the sender finds out at its next wake-up
        (within IDLE_RECHECK_SECONDS; at the process's end, see client._deliver_and_close)."""
        self._finishing = True
        if interrupting():
            return
        with self._mutex:
            self._send_now = self._send_now or bool(self._queue)
            self._acks_wanted = True
            self._signal()

    def finished(self, timeout: float) -> bool:
        """After :meth:`finish`: wait up to ``timeout`` seconds for the sender to end."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop sending, and tell the queued captures the client closed; then :meth:`join`.
        A client stops all its channels before it waits for any."""
        with self._mutex:
            self._closed = True
            dropped = self._take_queue("closed")
            self._signal()
        for pending in dropped:
            pending.handle.resolve(None, "not sent: the client was closed first")
        sock = self._sock
        if sock is not None:  # a send under way ends; the answers that came are still read
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)

    def join(self, timeout: float) -> None:
        """After :meth:`stop`: wait up to ``timeout`` seconds for the sender to read the
        answers that came, then tell the captures still unanswered."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fail_inflight("closed", _CLOSED_IN_FLIGHT)

    # -- sender thread -------------------------------------------------------------

    def _run(self) -> None:
        busy.working = True  # a finalizer run here must not wait for the locks held here
        delay = 0.05
        try:
            while not self._closed and not (self._finishing and not self._queue):
                try:
                    sock, mac = self._connect()
                except Exception as exc:  # the sender thread must outlive any failure
                    if not isinstance(exc, (OSError, ProtocolError)):
                        self._log_once("connect", ERROR,
                                       "unexpected error connecting to %s:%d", *self.address,
                                       exc_info=True)
                    self._set_down(exc)
                    self.overrides.expire()
                    self._sleep(delay)
                    delay = min(delay * 2, config.reconnect_interval())
                    continue
                connected_at = time.monotonic()
                self._serve(sock, mac)
                if time.monotonic() - connected_at >= config.reconnect_interval():
                    delay = 0.05
                else:  # a server that breaks the protocol or hangs up at once: not in a loop
                    self._sleep(delay)
                    delay = min(delay * 2, config.reconnect_interval())
        finally:
            with self._mutex:  # no one signals a closed pair (see _signal)
                self._asleep = False
                self._close_wake()

    def _sleep(self, seconds: float) -> None:
        """Wait ``seconds`` before trying again, or until the channel closes (captures that
        wake the sender meanwhile wait for the next attempt)."""
        deadline = time.monotonic() + seconds
        while True:
            with self._mutex:
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    return
                self._asleep = True
            self._wake_only.poll(remaining * 1000)
            with self._mutex:
                self._asleep = False
            self._drain_wake()

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):  # nothing was written
            os.read(self._wake_read, 4096)

    def _close_wake(self) -> None:
        """Close the wake-up's descriptors, once: their numbers may be reused right after."""
        descriptors = {self._wake_read, self._wake_fd} - {-1}
        # Forgotten first: a fork while they are closed must not have the child close them.
        self._wake_read = self._wake_fd = -1
        for fd in descriptors:
            with contextlib.suppress(OSError):  # closed by other code (the thread must end)
                os.close(fd)

    def _serve(self, sock: socket.socket, mac: auth.SessionMac | None) -> None:
        """Send and read on one connection until it ends or the channel closes; then settle
        the in-flight."""
        with self._mutex:
            self._sock, self.down = sock, False
        self.overrides.connected(id(self), self._steering)
        self._announce_again()
        answers = Answers(sock, mac, self._settle, self._steer, self._ignored)
        try:
            if self._replays:
                self._learn_settings(answers)
            self._send_loop(sock, mac, answers)
        except ProtocolError as exc:  # the server broke its promise: reconnect
            self._log_rarely("broke", WARNING, "thing server at %s:%d: %s", *self.address, exc)
        except OSError as exc:
            if not self._closed:
                self._log_rarely("lost", WARNING, "lost the thing server at %s:%d: %s",
                                 *self.address, exc)
        except Exception:  # a bug must not end the thread: reconnect and keep serving
            self._log_once("send", ERROR, "unexpected error sending to %s:%d; "
                           "reconnecting", *self.address, exc_info=True)
        finally:
            if self._closed:  # what has come is read; what has not will not be waited for
                answers.read_until_end(0)
            else:
                # Stop sending but keep reading: the server answers what it received,
                # then hangs up, and those answers must not be lost with the socket.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                answers.read_until_end(config.connect_timeout())
            shutdown(sock)
            sock.close()
            with self._mutex:
                self._sock = None
            self.overrides.disconnected(id(self))
            if self._closed:
                self._fail_inflight("closed", _CLOSED_IN_FLIGHT)
            else:
                self._fail_inflight("lost", "unacknowledged: the connection to the server was "
                                    "lost before it answered (it may or may not have stored it)")

    def _steer(self, messages: list[wire.ControlMessage]) -> None:
        if any(message.operation == "replayed" for message in messages):
            self._replayed = True
        self.overrides.apply_all(messages)

    def _learn_settings(self, answers: Answers) -> None:
        """Before sending on a new connection, read what the server says is set (a
        ``forget``, its statements, ``replayed``), then hold back what was caught before
        that and is paused: a job started after ``thing.pause("x")`` sends no x, its
        first calls included.

        Only pauses are applied again: ``every=``/``first=`` numbered a call when it was
        made, and apply from the connection on. A server that says nothing within the
        connect timeout is sent to as it is.
        """
        self._replayed = False
        if not answers.read_until(lambda: self._replayed, config.connect_timeout()):
            log.debug("the thing server at %s:%d did not say what is set", *self.address)
            return
        # What is queued from now on is checked as it is queued (see _queue_up).
        with self._mutex:
            queue = self._queue
            kept: list[Pending] = []
            held: list[Pending] = []
            for pending in queue:
                (held if self._paused(pending) else kept).append(pending)
            if not held:
                return
            queue.clear()
            queue.extend(kept)
            nbytes = sum(pending.payload.held for pending in held)
            self._queued_bytes -= nbytes
            self._room.give_back(nbytes, len(held))
        for pending in held:
            pending.handle.resolve(None, PAUSED)

    def _paused(self, pending: Pending) -> bool:
        """Whether a capture let through at its call is paused now (a request outranks a
        pause, as at a call; a notice is no capture)."""
        return (pending.notice is None and not pending.requested
                and self.overrides.paused(pending.name))

    def _connect(self) -> tuple[socket.socket, auth.SessionMac | None]:
        """A new connection that passed the handshake (see thing/dial.py)."""
        dialled = dial(self.address, self.token, self._this_host, self.overrides.enabled)
        with self._mutex:
            self._notices, self._told = dialled.notices, set()
            self._steered, self._replays = dialled.steered, dialled.replays
            self._steering = dialled.steering
        if dialled.transport != self.transport:
            log.info("sending to the thing server at %s:%d over %s", *self.address,
                     TRANSPORT_NAMES[dialled.transport])
        self.transport = dialled.transport
        return dialled.sock, dialled.mac

    def _take_queue(self, reason: str) -> list[Pending]:
        """Empty the queue, giving back its room and counting it (the caller holds the lock)."""
        dropped = list(self._queue)
        self._queue.clear()
        self._queued_bytes = 0
        for pending in dropped:
            self._room.give_back(pending.payload.held)
        # A notice is not a capture: the capture it is about was counted as "failed".
        captures = sum(pending.notice is None for pending in dropped)
        if captures:
            self._room.undelivered[reason] += captures
        return dropped

    def _set_down(self, reason: Exception) -> None:
        # A peer answered (it refused us, or broke the protocol): a server is there, so say
        # why not it rather than that none listens.
        refused = isinstance(reason, ProtocolError)
        why = f"not sent: {reason}" if refused else NO_SERVER.error
        with self._mutex:
            first_failure = not self.down
            if why != self.down_handle.error:
                self.down_handle = CaptureHandle(None, why) if refused else NO_SERVER
            self.down = True
            dropped = self._take_queue("no server")
        for pending in dropped:
            pending.handle.resolve(None, why)
        if first_failure:
            if refused:  # one that takes the connection, then refuses, again and again
                self._log_rarely("refused", WARNING, "cannot use the thing server at %s:%d: %s",
                                 *self.address, reason)
            else:
                log.debug("no thing server at %s:%d (%s); will keep trying", *self.address, reason)

    def _send_loop(self, sock: socket.socket, mac: auth.SessionMac | None,
                   answers: Answers) -> None:
        listening = select.poll()  # for a wake-up or the server's messages
        listening.register(self._wake_read, select.POLLIN)
        listening.register(sock, select.POLLIN)
        next_tick = 0.0
        while True:
            self._wait_for_captures(answers, listening, next_tick)
            with self._mutex:
                if self._closed:
                    return
                queue = self._queue
                first = self._next_seq
                batch = [(seq, queue.popleft()) for seq in range(
                    first, first + min(len(queue), MAX_IN_FLIGHT - len(self._inflight)))]
                self._next_seq += len(batch)
                self._inflight.update(batch)
                if queue:
                    self._queued_bytes -= sum(pending.payload.held for _, pending in batch)
                else:
                    self._send_now, self._queued_bytes = False, 0
                # What the server did not see: it counted its own refusals.
                undelivered = tuple(sorted(item for item in self._room.undelivered.items()
                                           if item[0] != "refused"))
                next_tick = time.monotonic() + TICK_SECONDS  # a tick from this batch, not its end
            self._send_batch(sock, mac, batch, undelivered)

    def _wait_for_captures(self, answers: Answers, listening: select.poll,
                           next_tick: float) -> None:
        """Wait until the queue is to be sent and there is room in flight, or the channel
        closes, reading the server's messages as they come when they are wanted; raises
        what ends the connection.

        Small captures go once a tick, together: after a send, the sender keeps
        its clock for one more tick, and a capture arriving after that quiet
        tick wakes it and waits a tick for company. So a loop that catches more
        often than once a tick wakes the sender once a tick, never from its own
        thread; a slower one wakes it from its thread once per capture.
        A large capture, a full batch, a half-full queue, a caller
        waiting on a handle (:meth:`hurry`) or closing end the wait at once.
        Within a tick, acknowledgements are left for its end unless someone
        waits for them.
        """
        wake = self._wake_read
        idle = False
        events: list[tuple[int, int]] = []
        while True:
            if any(fd == wake for fd, _ in events):
                self._drain_wake()
            answers.read_arrived()
            with self._mutex:
                self._asleep = False
                if idle:
                    idle = self._idle = False
                    if self._queue:  # it came after a quiet tick: give it a tick for company
                        next_tick = time.monotonic() + TICK_SECONDS
                if self._closed:
                    return
                in_flight = len(self._inflight)
                if not in_flight and not self._queue:  # every outcome wanted is known
                    if self._finishing:  # and no more can come
                        self._closed = True
                        return
                    self._acks_wanted = False
                now = time.monotonic()
                due = self._send_now or (self._queue and now >= next_tick)
                if due and in_flight < MAX_IN_FLIGHT:
                    return
                ticking = not due and now < next_tick
                # Past the tick with nothing queued: sleep until a capture comes.
                idle = self._idle = not due and not ticking
                # A job that catches on demand listens at all times: a request's answer is
                # due within a step or two, not a tick.
                # So does one with frames in flight that hold room until answered.
                poller = (self._wake_only if ticking and in_flight and not self._acks_wanted
                          and not self._on_demand and not self._shared_room else listening)
                self._asleep = True
            events = poller.poll((next_tick - now if ticking else IDLE_RECHECK_SECONDS) * 1000)

    def _send_batch(self, sock: socket.socket, mac: auth.SessionMac | None,
                    batch: list[tuple[int, Pending]],
                    undelivered: Undelivered) -> None:
        """Send frames in order: small finished ones together, one vectored write for up to
        COALESCE of them (a run of snapshots written by the core: ``send_snapshots``);
        one that is large, goes by shared memory, or whose end is known only once it is
        sent, by itself.

        A frame's room in the client's queue is given back once its bytes are in the
        kernel (or it ended unsent), not at its acknowledgement: from then on the client
        holds nothing of it but its handle, and MAX_IN_FLIGHT bounds those. So room never
        waits for answers the sender reads only at its tick. Frames sent in a memfd are
        the exception (see _hold_room_until_answered).
        """
        together: list[Any] = []
        sent: list[Payload] = []
        held = 0  # the frames from batch[held] on still hold their room
        answered_for: set[int] = set()  # frames whose room comes back with their answer

        def give_back(through: int) -> None:
            nonlocal held
            if through > held:
                ended = [pending.payload.held for seq, pending in batch[held:through]
                         if seq not in answered_for]
                with self._mutex:
                    self._room.give_back(sum(ended), len(ended))
                held = through

        def flush(through: int) -> None:
            if together:
                send_buffers(sock, together)
            for payload in sent:  # the bytes are in the kernel: the arrays may be freed
                payload.leaves.clear()
            together.clear()
            sent.clear()
            give_back(through)

        alone = min(wire.SMALL_BYTES, config.shm_threshold() if self.transport == "shm"
                    else wire.SMALL_BYTES)
        whole = wire.encode_trailer(False)
        headers = self._headers

        def header_of(pending: Pending) -> bytes:
            return headers.encode(pending, undelivered)

        index = 0
        try:
            while index < len(batch):
                if mac is None and not together:
                    # A run of snapshots (a flood's every frame) goes in one call to the core.
                    sent_through = send_snapshots(sock, batch, index, index + COALESCE, alone,
                                                  header_of, whole)
                    if sent_through > index:
                        give_back(sent_through)
                        index = sent_through
                        continue
                seq, pending = batch[index]
                index += 1
                payload = pending.payload
                if pending.notice is not None and not (
                        self._steered if "on_demand" in pending.notice else self._notices):
                    self._finish(seq, None, "not sent: this server takes no notices", None)
                    continue
                if payload.nbytes >= alone or frames.read_in_place(payload):
                    flush(index - 1)
                    if self._send(sock, mac, seq, pending, undelivered):
                        answered_for.add(seq)
                    give_back(index)
                    continue
                frame = self._encode(seq, pending, undelivered)
                if frame is not None:
                    prefix, header, views = frame  # both movers skip empty views
                    # Not read in place (see above): it cannot have torn.
                    together += [prefix, header, *views, whole if mac is None
                                 else frames.trailer(mac, prefix, header, False)]
                    sent.append(payload)
                if len(sent) >= COALESCE:
                    flush(index)
            flush(len(batch))
        finally:  # the connection failed mid-batch: what was not sent is lost, memory and room
            for _, pending in batch[held:]:
                pending.payload.leaves.clear()
            give_back(len(batch))

    def _encode(self, seq: int, pending: Pending, undelivered: Undelivered
                ) -> tuple[bytes, bytes, list[Any]] | None:
        """A frame's prefix, header and payload views; None (the capture failed) if a leaf
        cannot be read."""
        payload = pending.payload
        try:
            views = [leaf_bytes(leaf) for leaf in payload.leaves]
            header = self._headers.encode(pending, undelivered)
        except Exception as exc:  # a leaf that cannot be read: fail this capture only
            reason = f"could not read the data: {exc}"
            self._finish(seq, None, f"not sent: {reason}", "failed")
            self._log_once(f"send:{pending.name}", WARNING,
                           "thing could not send %r: %s", pending.name, exc)
            # The REPL hears of it as of a capture that failed at the call.
            self.tell_unsent(pending.name, pending.site, pending.rank,
                             caught_type(payload.tree, [leaf.spec for leaf in payload.leaves]),
                             reason)
            return None
        prefix = wire.encode_prefix(header, payload.nbytes, seq, pending.caught_at,
                                    call=pending.call, step=pending.step)
        return prefix, header, views

    def _send(self, sock: socket.socket, mac: auth.SessionMac | None, seq: int, pending: Pending,
              undelivered: Undelivered) -> bool:
        """Send one frame by itself: a large one, or one read in place (its trailer says
        whether the data moved on while it was sent, which is known only once it was).
        True if its room is to come back with its answer (see _hold_room_until_answered)."""
        payload = pending.payload
        frame = self._encode(seq, pending, undelivered)
        if frame is None:
            return False
        prefix, header, views = frame
        if self.transport == "shm" and payload.nbytes >= config.shm_threshold():
            sent = self._send_shared(sock, mac, seq, pending, header, views)
        else:
            sent = False
        if not sent:
            buffers = [prefix, header, *views]  # both movers skip empty views
            del views
            try:
                if frames.read_in_place(payload):
                    # Whether a torch tensor moved on is known only once its bytes are in
                    # the kernel.
                    send_buffers(sock, buffers)
                    buffers = []
                trailer = frames.trailer(mac, prefix, header, any(map(torn, payload.leaves)))
                send_buffers(sock, [*buffers, trailer])
            except OSError as exc:
                if exc.errno == errno.EFAULT:  # the kernel found the memory gone: see torn()
                    with self._mutex:
                        self._cut_short[seq] = MEMORY_FREED
                raise
        # The bytes are in the kernel: drop our references so the arrays can be freed.
        payload.leaves.clear()
        return sent and self._hold_room_until_answered(seq, payload.held)

    def _hold_room_until_answered(self, seq: int, nbytes: int) -> bool:
        """A frame sent in a memfd: its pages live until the server takes the descriptor,
        so its room comes back with its answer (or its failure), not now. False if it
        ended already (the channel closed meanwhile): its room comes back with the batch."""
        with self._mutex:
            if seq not in self._inflight:
                return False
            self._shared_room[seq] = nbytes
            return True

    def _send_shared(self, sock: socket.socket, mac: auth.SessionMac | None, seq: int,
                     pending: Pending, header: bytes, views: list) -> bool:
        """Hand the payload over in a sealed memfd; False (and nothing sent) if that fails,
        True once it is handed over, or failed for good before anything was sent."""
        try:
            fd = shm.export(views)
        except OSError as exc:  # out of descriptors or memory: the stream still works
            if exc.errno == errno.EFAULT:  # freed while copied: see torn()
                self._finish(seq, None, MEMORY_FREED, "failed")
                return True
            self._log_once("shm", WARNING,
                           "shared memory unavailable (%s); sending inline", exc)
            return False
        try:
            payload = pending.payload
            prefix = wire.encode_prefix(header, payload.nbytes, seq, pending.caught_at,
                                        wire.KIND_SHARED_MEMORY, call=pending.call,
                                        step=pending.step)
            # Copied into the memfd by now: whether the data moved on during the copy.
            message = prefix + header + frames.trailer(mac, prefix, header,
                                                        any(map(torn, payload.leaves)))
            # Not a SIGPIPE if the server is gone (the core's sends say so too).
            sent = socket.send_fds(sock, [message], [fd], getattr(socket, "MSG_NOSIGNAL", 0))
            if sent < len(message):  # only a signal or a timeout splits a message this small
                send_buffers(sock, [memoryview(message)[sent:]])
        finally:
            os.close(fd)
        return True

    # -- the server's messages -----------------------------------------------------

    def _ignored(self, exc: wire.BadControl) -> None:
        self._log_once("control", WARNING,
                       "thing server at %s:%d: ignored a control message: %s (further "
                       "ones are ignored without a word)", *self.address, exc)

    def _settle(self, acks: list[Acknowledgement]) -> None:
        """Resolve the handles of acknowledged frames, in order; ProtocolError (after
        resolving those before it) for an ack that is not for the oldest frame in flight."""
        finished: list[Finished] = []
        broken = None
        with self._mutex:
            inflight, shared_room = self._inflight, self._shared_room
            for status, seq, capture_id, message in acks:
                oldest = next(iter(inflight), None)
                if seq == wire.SEQ_OLDEST_UNANSWERED and oldest is not None:
                    seq = oldest
                elif seq != oldest:
                    broken = ProtocolError(f"the server acknowledged frame {seq} while {oldest} "
                                           "was the oldest unanswered one")
                    break
                pending = inflight.pop(seq, None)
                if pending is None:
                    continue
                if shared_room and seq in shared_room:  # the server has taken the memfd
                    self._room.give_back(shared_room.pop(seq))
                if status == wire.ACK_STORED:
                    finished.append((pending, capture_id, None, None))
                elif seq in self._cut_short:
                    finished.append((pending, None, self._cut_short.pop(seq), "failed"))
                else:  # its text made readable below, not under the mutex catch() takes
                    finished.append((pending, None, message, "refused"))
            self._count(finished)
        self._tell([(pending, capture_id, _refusal(error) if reason == "refused" else error,
                     reason) for pending, capture_id, error, reason in finished])
        if broken is not None:
            raise broken

    def _finish(self, seq: int, capture_id: int | None, error: str | None,
                reason: str | None) -> None:
        """Resolve one frame in flight that ended without an ack (``reason``: how it counts)."""
        with self._mutex:
            pending = self._inflight.pop(seq, None)
            finished: list[Finished] = [] if pending is None else [
                (pending, capture_id, error, reason)]
            self._count(finished)
        self._tell(finished)

    def _fail_inflight(self, reason: str, error: str) -> None:
        with self._mutex:
            cut_short = self._cut_short
            finished: list[Finished] = [
                (pending, None, error, reason) if seq not in cut_short else
                (pending, None, cut_short[seq], "failed")
                for seq, pending in self._inflight.items()]
            self._inflight.clear()
            cut_short.clear()
            if self._shared_room:
                self._room.give_back(sum(self._shared_room.values()), len(self._shared_room))
                self._shared_room.clear()
            self._count(finished)
        self._tell(finished)

    def _count(self, finished: list[Finished]) -> None:
        """Count how each finished capture ended (the caller holds the lock): stored, or not
        delivered for its reason. Notices are not counted. :meth:`_tell` tells them."""
        room = self._room
        for pending, capture_id, _, reason in finished:
            if pending.notice is not None:
                continue
            if capture_id is not None:
                room.stored += 1
            elif reason is not None:
                room.undelivered[reason] += 1
        self._resolving += len(finished)

    def _tell(self, finished: list[Finished]) -> None:
        """Resolve the handles :meth:`_count` counted, outside the lock (it wakes their
        waiters); then wake ``Client.flush``, which returns once they are told, not merely
        counted: a handle read right after it knows its outcome."""
        if not finished:
            return
        try:
            _resolve(finished)
        finally:
            with self._mutex:
                self._resolving -= len(finished)
                self._lock.notify_all()


# The sender thread logs: logging is imported here, by the thread that opens the first
# channel, not by the sender's first message (see log.ready).
log.ready()


def _wake_descriptors() -> tuple[int, int]:
    """The descriptors a sender waits on and a catch writes to wake it: one eventfd, the
    kernel's lightest wake-up, or a non-blocking pipe where there is none (Python 3.9,
    macOS)."""
    if hasattr(os, "eventfd"):
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return fd, fd
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    return read, write


def _refusal(message: Any) -> str:
    """A server's reason for refusing a frame, as its handle tells it: its first
    wire.MAX_REFUSAL_TEXT bytes (thing's own reasons are shorter), escaped for a terminal."""
    text = bytes(message[: wire.MAX_REFUSAL_TEXT]).decode("utf-8", "replace")
    return f"refused by the server: {wire.printable(text)}"


def _resolve(finished: list[Finished]) -> None:
    """Tell each finished capture's handle its outcome (outside the lock: it wakes waiters)."""
    for pending, capture_id, error, _ in finished:
        pending.handle.resolve(capture_id, error)
        if error is not None:
            log.debug("capture %r not stored: %s", pending.name, error)


def _looks(obj: Any) -> dict[str, Any]:
    """What a capture of ``obj`` would be, without touching its data: its type, and its
    shape and dtype when it has them."""
    looks: dict[str, Any] = {"type": type_name(obj)}
    try:
        shape = getattr(obj, "shape", None)
        if shape is not None:
            looks["shape"] = [int(size) for size in shape]
        dtype = getattr(obj, "dtype", None)
        if dtype is not None:
            looks["dtype"] = str(dtype).rpartition(".")[2][:40]
    except (TypeError, ValueError):  # a shape that is not one: the type says enough
        looks.pop("shape", None)
    return looks
