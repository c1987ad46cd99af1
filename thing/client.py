"""The sending side's public face: ``Client.catch`` on the caller's thread.

On the caller's thread ``catch`` traces or takes the name, applies ``every=``
and ``first=`` (a call they skip is answered by the compiled gate before any
Python runs, and a sent call of the common kind is queued there: see
``thing/_core/_gate.pyx``), notes each array's dtype
and shape, takes room in a bounded queue, and snapshots what must be
snapshotted (small leaves, and every leaf with ``copy=True``; see
:func:`thing.arrays.hold`): after taking room, so that a full queue costs no
copy, except for a capture of a few KiB. No I/O, no
exception. All network work happens in a :class:`~thing.channel.Channel` per
server, on its own threads. While no server listens, captures are dropped at
once and the channel keeps trying to connect, about once a second.

Every capture a process caught is delivered when it ends, within
``THING_FLUSH_TIMEOUT``: at interpreter exit, and in multiprocessing children
(which end with ``os._exit``, skipping ``atexit``) before that.
"""

from __future__ import annotations

import atexit
import operator
import os
import sys
import time
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from . import _core, config
from .errors import UnsupportedType
from .handles import CLOSED, REENTERED, SKIPPED, CaptureHandle, busy, interrupting, working
from .log import WARNING, LogOnce, log
from .names import CallSite, NameTracer

if TYPE_CHECKING:
    from .channel import Channel
    from .overrides import Overrides


# How long close() waits, at most, for its channels' threads to read their last answers
# and end (after any flush).
CLOSE_SECONDS = 2.0

__all__ = ["CaptureHandle", "Client"]


def _as_shown(name: str) -> str:
    r"""A name as the REPL shows it, and steers it (``"a\\tb"`` for ``"a\tb"``): so it is
    caught, counted and steered under that name here too. One that escaped is longer than a
    server takes stays as it is (the server escapes it; no steering names it anyway)."""
    from .wire import MAX_CONTROL_NAME, printable  # loaded with the first channel

    shown = printable(name)
    return shown if len(shown) <= MAX_CONTROL_NAME else name


def _step_of(step: Any) -> int:
    """``step=`` as the int the wire carries (numpy and torch integers too)."""
    step = operator.index(step)
    if not -(1 << 63) < step < 1 << 63:  # the wire's int64, its least value meaning "none"
        raise ValueError(f"step={step} does not fit in 64 bits")
    return step


class _ProcessRank:
    """This process's (rank, world size), read at every catch for an attribute lookup or two.

    torch.distributed's when a default process group exists, else ``RANK`` /
    ``WORLD_SIZE`` from the environment (torchrun's), else ``(None, None)``.
    Read again only when the default process group changes (created or
    destroyed) and in a forked child: at the call, not when the capture is
    sent, so captures made just before ``destroy_process_group()`` keep their rank.
    """

    _UNREAD = object()

    def __init__(self) -> None:
        self._group: Any = self._UNREAD
        self._value: tuple[int | None, int | None] = (None, None)
        # The module of torch's record of its default group (what ``GroupMember.WORLD``
        # reads through two properties): two attributes away, the group costs a catch about
        # 1 us right after a training step instead of 11. Found once torch.distributed is
        # loaded. The record itself is read each time: torch may replace it (a threaded
        # process group's, in torch's own tests).
        self._c10d: Any = None

    def read(self) -> tuple[int | None, int | None]:
        group = getattr(getattr(self._c10d, "_world", None), "_default_pg", self._UNREAD)
        if group is self._UNREAD:
            group = self._default_group()
        if group is not self._group:
            self._value = _distributed_rank(sys.modules.get("torch.distributed"), group)
            self._group = group
        return self._value

    def _default_group(self) -> Any:
        """The default process group through torch's public names (None without one);
        finds torch's record of it for the next calls, if this torch keeps one."""
        dist = sys.modules.get("torch.distributed")
        if dist is None:
            return None
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        if hasattr(getattr(c10d, "_world", None), "_default_pg"):
            self._c10d = c10d
        return getattr(getattr(dist, "GroupMember", None), "WORLD", None)

    def after_fork(self) -> None:
        self._group = self._UNREAD


def _distributed_rank(dist: Any, group: Any) -> tuple[int | None, int | None]:
    if group is not None:
        try:
            return dist.get_rank(), dist.get_world_size()
        except Exception:  # a group being torn down; the environment still knows
            pass
    try:
        rank = int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None, None
    try:
        return rank, int(os.environ.get("WORLD_SIZE", ""))
    except ValueError:
        return rank, None


class Client:
    """Sends captures to a thing server; ``catch`` never blocks, raises or prints.

    ``server_addr`` (``"host"`` or ``"host:port"``) and ``server_port`` default
    to ``THING_SERVER`` and ``THING_PORT``, as for ``thing.catch``, else
    ``localhost:2875``.

    ``max_queue_bytes`` / ``max_queue_items`` bound what waits to be sent
    (defaults ``THING_QUEUE_BYTES`` = 1 GiB, ``THING_QUEUE_ITEMS`` = 1024).
    ``snapshot_bytes`` (``THING_SNAPSHOT_BYTES``, 64 KiB) is the largest array
    copied at the call by default. ``token`` (default ``THING_TOKEN``, else
    the local server's token file) answers a server that requires one.
    ``control=False`` (default: ``THING_CONTROL``, on) ignores the REPL's
    steering (``thing.every``, ``thing.request``, ...).
    """

    def __init__(
        self,
        server_addr: str | None = None,
        server_port: int | None = None,
        *,
        max_queue_bytes: int | None = None,
        max_queue_items: int | None = None,
        snapshot_bytes: int | None = None,
        token: str | None = None,
        control: bool | None = None,
        _throttles: _core.Throttles | None = None,  # thing.catch's, made before its client
    ):
        from .overrides import Overrides
        from .sockets import parse_address

        host, port = config.server_address()
        self.address = parse_address(server_addr or host, port if server_port is None
                                     else server_port)
        self.token = token
        self.max_queue_bytes = max_queue_bytes or config.queue_max_bytes()
        self.max_queue_items = max_queue_items or config.queue_max_items()
        self.snapshot_bytes = config.snapshot_bytes() if snapshot_bytes is None else snapshot_bytes
        self._max_names = config.max_names()
        # Kept by a forked child, as its names are: every= counts on from the parent's.
        self._throttles = _core.Throttles() if _throttles is None else _throttles
        self._throttles.max_names = self._max_names
        self._names = NameTracer(max_sites=self._max_names,
                                 on_forget=self._throttles.forget_sites)
        self._warn_once = LogOnce()
        self._rank = rank = _ProcessRank()
        # What the REPL set (thing.every, thing.request, ...), kept across forks like the
        # throttles it overrides. Its channels hold it: nothing in it may hold the client,
        # or a client dropped without close() would never be collected (see _finish_channels).
        self._overrides = Overrides(config.control() if control is None else control,
                                    config.control_ttl(), lambda: rank.read()[0],
                                    self._throttles)
        # The calls every=/first= skip are answered by the compiled core, before any Python
        # runs, and the sent calls of the common kind queued there; the gate calls this
        # class's catch for every other call (see _CATCH).
        if type(self).catch is _CATCH:
            self.catch = _core.gated(_CATCH.__get__(self), self._throttles, SKIPPED, self)
        self._start_afresh()
        self._closed = False
        _live_clients.add(self)

    def _start_afresh(self) -> None:
        """The state that belongs to one process: a forked child starts with its own."""
        # The sending machinery (sockets, the wire format, authentication) loads with the
        # first client, not with `import thing`, and on this thread, before any thread of
        # thing's runs: a child forked later never inherits an import half done.
        from . import channel  # noqa: F401 (loaded now, on this thread: see above)
        from .send_queue import SendQueue

        self._queue = SendQueue(self.max_queue_bytes, self.max_queue_items)
        self._lock = self._queue.lock
        self._announced: set[str | None] = set()  # on-demand names told of, by this process
        self._throttles.announced = self._announced  # the gate answers their calls
        # server= string -> channel, oldest first; several strings may share a channel.
        self._channels: OrderedDict[str | None, Channel] = OrderedDict()
        # Dropped without close(), a client's channels deliver what it queued, then end.
        # (The process's end closes the clients still here; these, it waits for.)
        if getattr(self, "_dropped", None) is not None:  # a forked child: the parent's
            self._dropped.detach()
        self._dropped = weakref.finalize(self, _finish_channels, self._channels)
        self._dropped.atexit = False

    def catch(
        self,
        obj: Any,
        name: str | None = None,
        server: str | None = None,
        every: int = 1,
        first: int | None = None,
        *,
        copy: bool | None = None,
        block: bool = False,
        step: int | None = None,
        on_demand: bool = False,
        _depth: int = 1,  # frames up to the code that called catch (thing.catch: 2)
    ) -> CaptureHandle:
        """Queue ``obj``: an array (numpy, torch incl. sparse, jax), a number, a string, bytes,
        or nested lists, tuples, dicts and sets of them.

        ``name`` defaults to the source text of the argument. ``every=n`` sends
        the 1st, (1+n)th, ... call of a name; ``first=n`` only its first n sent
        captures (one let through that then found no server, or no room,
        counts). What arrives is the value at this call: arrays up to
        ``snapshot_bytes`` are copied now; larger ones are read in place by the
        sender thread, and a torch tensor changed in place before that ends is
        marked ``consistent=False`` in the REPL (not a change through ``.data``
        or a numpy view, which torch does not count). ``copy=True`` copies every
        array now; ``copy=False`` copies none. ``block=True`` waits for room
        in a full queue instead of dropping. Every call of a name is numbered
        (from 1, throttled calls counted); ``step=`` (an int, e.g. the global
        step) is the step the REPL shows and plots instead of that number.
        ``on_demand=True`` sends nothing (at the cost of a throttled call)
        until the REPL asks with ``thing.request(name, count)``; the REPL
        sees the name, its shape and dtype in ``thing.available()``. The REPL
        may also change ``every``/``first`` or pause sending (``thing.every``,
        ...; ``control=False`` or ``THING_CONTROL=0`` refuses). Never raises:
        the handle's ``wait()`` is False and its ``error`` says why when not
        stored.
        """
        if getattr(busy, "working", False):
            return REENTERED
        site = frame = None
        try:
            busy.working = True  # in the try: an interrupt here must not leave it set
            if name is None:
                frame = sys._getframe(_depth)
                name, site = self._names.name_for(frame)
            elif type(name) is str and not name.isprintable():
                name = _as_shown(name)
            throttle = self._throttles.of(name)
            # A traced name: the gate answers the next calls from here. If that is news, the
            # tracer must still give the name (another thread's tracing may have made it
            # forget since), or the gate would answer under a name the tracer no longer gives.
            if (frame is not None and self._throttles.remember(frame, throttle)
                    and not self._names.still_names(frame, name)):
                self._throttles.forget_sites(frame.f_code)
            overrides = self._overrides if server is None else self._overrides_of(server)
            if overrides.active:  # the REPL set something: see overrides.py
                call, requested = overrides.admit(name, throttle, int(every), first, on_demand)
            elif on_demand:  # nobody asked for it: counted, not sent
                throttle.count()
                call, requested = 0, False
            else:
                call, requested = throttle.admit(int(every), first), False
            if on_demand and name not in self._announced:  # the REPL hears of it once
                self._announce(server, name, site, obj, _depth + 1)
            if not call:
                return SKIPPED
            if step is not None:
                step = _step_of(step)
            if site is None:  # given a name: where it was caught still helps describe()
                site = self._names.site_for(sys._getframe(_depth))
            channel = self._channels.get(server) or self._open_channel(server)
            if channel is None:
                with self._lock:
                    self._queue.undelivered["closed"] += 1
                return CLOSED
            if channel.down:
                with self._lock:
                    self._queue.undelivered["no server"] += 1
                return channel.down_handle
            return channel.enqueue(name, obj, site, self._rank.read(), block, copy,
                                   self.snapshot_bytes, call, step, requested)
        except Exception as exc:  # catch() must never raise into a training loop
            return self._failed(exc, server, name, site, obj)
        finally:
            busy.working = False

    def _failed(self, exc: Exception, server: str | None, name: str | None,
                site: CallSite | None, obj: Any) -> CaptureHandle:
        """Count, log (once) and tell the server of a catch that failed with ``exc``; the
        handle that says why. (Also the compiled gate's: see thing/_core/_gate.pyx.)"""
        with self._lock:
            self._queue.undelivered["failed"] += 1
        try:
            reason = (str(exc) if isinstance(exc, UnsupportedType)
                      else f"{type(exc).__name__}: {exc}")
            self._warn_once(f"{type(exc).__name__}:{name}", WARNING,
                            "thing.catch(%s) failed: %s", name, reason)
            self._tell_server(server, name, site, obj, reason)
            return CaptureHandle(name, f"not sent: {reason}")
        except Exception:  # an exception, or a name, that cannot even be put in words
            return CaptureHandle(None, f"not sent: {type(exc).__name__}")

    def _announce(self, server: str | None, name: str | None, site: CallSite | None, obj: Any,
                  depth: int) -> None:
        """Tell the server an on-demand name exists (at its first call here; no data);
        ``depth`` frames up is the code that caught it."""
        if len(self._announced) >= self._max_names:
            return
        self._announced.add(name)
        channel = self._channels.get(server) or self._open_channel(server)
        if channel is None or not channel.overrides.enabled:
            # A job that refuses steering, or a server that does not steer it, lists nothing
            # that could never be asked for.
            return
        if site is None:
            site = self._names.site_for(sys._getframe(depth))
        channel.announce(name, site, self._rank.read(), obj)

    def _overrides_of(self, server: str) -> Overrides:
        """What decides the calls sent to ``server``: the REPL's steering if it is the default
        server, else nothing (another server's connection refuses steering)."""
        channel = self._channels.get(server) or self._open_channel(server)
        return self._overrides if channel is None else channel.overrides

    def _tell_server(self, server: str | None, name: str | None, site: CallSite | None,
                     obj: Any, reason: str) -> None:
        """Tell the server (no data) that a capture could not be sent, so that the REPL can
        say what went missing and why; see :meth:`Channel.tell_unsent`."""
        try:
            from .value_trees import type_name  # loaded with the first channel; not at teardown

            channel = self._channels.get(server)
            if channel is not None:
                channel.tell_unsent(name, site, self._rank.read(), type_name(obj), reason)
        except Exception as exc:  # still catch(): never raises
            log.debug("could not tell the server about %r: %s", name, exc)

    def _open_channel(self, server: str | None) -> Channel | None:
        """The channel for ``server=``, opened if need be; None once the client is closed."""
        if self._closed:  # before the imports: at interpreter teardown they fail
            return None
        from .channel import Channel
        from .overrides import Overrides
        from .sockets import is_this_host, parse_address

        address = self.address if server is None else parse_address(server, self.address[1])
        # Asked here, on the thread that opens the channel, not on its sender thread (see
        # sockets.own_names: a fork while the sender is inside the resolver), and not under
        # the lock every catch takes: the resolver may take seconds to answer.
        this_host = is_this_host(address[0])
        with self._lock:
            if self._closed:
                return None
            channel = next((c for c in self._channels.values() if c.address == address), None)
            if channel is None:
                _deliver_at_process_end()
                # Only the default server steers: two REPLs would undo each other's settings.
                channel = Channel(address, self._queue, self.token,
                                  self._overrides if address == self.address
                                  else Overrides(False, 0.0, lambda: None), this_host)
            self._channels[server] = channel
            evicted = []
            while len(self._channels) > config.max_servers():
                _, oldest = self._channels.popitem(last=False)
                if oldest not in self._channels.values():
                    evicted.append(oldest)
        for oldest in evicted:  # too many servers: the least recently opened one goes
            oldest.stop()
            oldest.join(0.0)
        return channel

    @property
    def undelivered(self) -> dict[str, int]:
        """Captures caught but not delivered, by reason; the REPL's summary() shows them too
        (``"refused"``, by the server, it counts itself)."""
        if interrupting():  # the lock may be held by the work interrupted: a copy unlocked
            return dict(self._queue.undelivered)
        with working(), self._lock:
            return dict(self._queue.undelivered)

    @property
    def sent(self) -> int:
        """Captures the server acknowledged as stored."""
        return self._queue.stored

    @property
    def dropped(self) -> int:
        """Captures dropped because the send queue was full."""
        return self.undelivered.get("queue full", 0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued capture was sent and acknowledged; False on timeout.

        It waits until nothing is queued or unanswered: what other threads catch
        meanwhile counts too (give a timeout where they never stop).

        From a signal handler or a finalizer that interrupted thing's own work on this
        thread (a catch), it returns False at once: that work may hold what the sender
        needs. The process's end delivers what is queued (``THING_FLUSH_TIMEOUT``).
        """
        if interrupting():
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        with working():
            for channel in list(self._channels.values()):
                channel.hurry()
            with self._lock:
                while any(channel.busy for channel in self._channels.values()):
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._lock.wait(remaining)
        return True

    def close(self, timeout: float | None = 0) -> None:
        """Flush for up to ``timeout`` seconds, then disconnect.

        Every capture still queued or unacknowledged then has its handle
        resolved as not delivered (``error`` says the client was closed). From a
        signal handler or a finalizer that interrupted thing's own work on this
        thread it does nothing: closing is left to the process's end.
        """
        if interrupting():
            return
        if timeout:
            self.flush(timeout)
        with working():
            with self._lock:
                self._closed = True
                channels = set(self._channels.values())
                self._channels.clear()
            # All stop first, then all are waited for together: a job that sent to several
            # servers that stopped answering exits in CLOSE_SECONDS, not in that many each.
            for channel in channels:
                channel.stop()
            deadline = time.monotonic() + CLOSE_SECONDS
            for channel in channels:
                channel.join(max(deadline - time.monotonic(), 0.0))

    def connected(self, server: str | None = None) -> bool:
        """True while the client holds a connection to the (default) server."""
        channel = self._channels.get(server)
        return channel is not None and channel.connected

    def transport(self, server: str | None = None) -> str | None:
        """The path to the (default) server: "tcp", "unix" or "shm"; None before connecting."""
        channel = self._channels.get(server)
        return None if channel is None else channel.transport


_live_clients: weakref.WeakSet[Client] = weakref.WeakSet()


# Client.catch as defined here: the gate stands in front of it only, not of a subclass's own
# catch or one patched onto the class before the client was made (which may treat the
# arguments otherwise). A client made before a patch keeps its gate: patch its own catch.
_CATCH = Client.catch


# The channels of clients dropped without close(), while they deliver what was queued.
_finishing: weakref.WeakSet[Channel] = weakref.WeakSet()


def _finish_channels(channels: dict[str | None, Channel]) -> None:
    """A client was collected without close(): its channels send what it queued and end
    (nothing more can be queued); a one-line ``Client(...).catch(x)`` is delivered."""
    for channel in set(channels.values()):
        _finishing.add(channel)
        channel.finish()


def _deliver_and_close() -> None:
    """At the end of a process: deliver what is queued, then stop every thread cleanly.

    Threads left running into interpreter shutdown can be caught inside a native
    library (torch's) while its static objects are destroyed, which aborts the process.
    """
    deadline = time.monotonic() + config.flush_timeout()
    for client in list(_live_clients):
        client.close(max(deadline - time.monotonic(), 0.001))
    late = [channel for channel in list(_finishing)
            if not channel.finished(max(deadline - time.monotonic(), 0.001))]
    for channel in late:
        channel.stop()
    for channel in late:
        channel.join(CLOSE_SECONDS / len(late))


_finalizer_pid = 0


def _deliver_at_process_end() -> None:
    """Flush when a multiprocessing child ends, which happens through ``os._exit``.

    multiprocessing runs its own finalizers first (``multiprocessing.util._exit_function``),
    both for fork/forkserver children and for spawned ones. A forked child starts with
    none (multiprocessing clears the parent's once the child runs), so this is called
    when a process opens its first channel, which in a child is after that.
    """
    global _finalizer_pid
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is None or _finalizer_pid == os.getpid():
        return
    _finalizer_pid = os.getpid()
    mp_util.Finalize(None, _deliver_and_close, exitpriority=100)


def _after_fork_in_child() -> None:
    # The parent's queue, sockets and threads are not ours: start afresh. The parent's
    # captures stay the parent's to deliver; its names stay the same names here.
    shm = sys.modules.get("thing.shm")  # loaded by a channel, never imported here
    if shm is not None:
        shm.close_inherited_exports()
    for channel in list(_finishing):  # a dropped client's, delivering: the parent's too
        channel.let_go_in_child()
    _finishing.clear()
    for client in list(_live_clients):
        for channel in set(client._channels.values()):
            channel.let_go_in_child()
        client._start_afresh()
        client._names.after_fork()
        client._rank.after_fork()
        client._overrides.after_fork()


atexit.register(_deliver_and_close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
