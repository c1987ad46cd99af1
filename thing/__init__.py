"""thing: catch tensors in one program and quietly send them to another live Python session.

In the training job::

    thing.catch(loss, every=10)

In a REPL or notebook::

    thing.serve()
    thing.get("loss")

``thing.help()`` lists every function.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import TYPE_CHECKING, Any

from . import _core, run_names
from ._core import BACKEND
from .client import CaptureHandle, Client
from .errors import (
    ArgumentError,
    ArgumentTypeError,
    BadRecording,
    HandshakeError,
    LimitExceeded,
    NotServing,
    ProtocolError,
    ThingError,
    UnknownName,
    UnsupportedType,
    VersionOutOfRange,
)
from .handles import REENTERED, SKIPPED, busy, working
from .log import log

if TYPE_CHECKING:
    from .captures import Capture
    from .repl import (
        available,
        clear,
        describe,
        every,
        first,
        get,
        get_all,
        hist,
        ingest_all,
        load,
        pause,
        plot,
        request,
        reset,
        resume,
        runs,
        save,
        serve,
        stats,
        status,
        summary,
        wait,
    )
    from .repl import help as help
    from .server import Server
    from .store import HistoryStore

# The receiving side loads on first use: a training job that only catches never imports
# the server, the store or the REPL (nor what they import), so `import thing` stays cheap.
_ON_FIRST_USE = {
    **dict.fromkeys(("serve", "get", "get_all", "wait", "clear", "ingest_all", "summary",
                     "describe", "status", "help", "save", "load", "runs", "stats", "plot",
                     "hist", "request", "every", "first", "pause", "resume", "reset",
                     "available"), "repl"),
    "Server": "server",
    "Capture": "captures",
    "HistoryStore": "store",
}


def __getattr__(name: str) -> Any:
    module = _ON_FIRST_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'thing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_ON_FIRST_USE})


__version__ = "0.1.0"

# Name this job's run now: processes it spawns or forks before its first catch join it.
run_names.name_this_job()

__all__ = [
    "BACKEND",
    "ArgumentError",
    "ArgumentTypeError",
    "BadRecording",
    "Capture",
    "CaptureHandle",
    "Client",
    "HandshakeError",
    "HistoryStore",
    "LimitExceeded",
    "NotServing",
    "ProtocolError",
    "Server",
    "ThingError",
    "UnknownName",
    "UnsupportedType",
    "VersionOutOfRange",
    "available",
    "catch",
    "clear",
    "describe",
    "every",
    "first",
    "get",
    "get_all",
    "hist",
    "ingest_all",
    "load",
    "pause",
    "plot",
    "request",
    "reset",
    "resume",
    "runs",
    "save",
    "serve",
    "stats",
    "status",
    "summary",
    "wait",
]

_default_client: Client | None = None
_default_client_lock = threading.Lock()


def catch(
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
) -> CaptureHandle:
    """Send ``obj`` to the thing server without disturbing the caller.

    ``obj``: a numpy/torch/jax array (torch sparse too), a number, a string,
    bytes, or nested lists, tuples, dicts and sets of them. ``name`` defaults
    to the argument's source text.
    ``server="host:port"`` overrides ``THING_SERVER``/``THING_PORT`` (default
    ``localhost:2875``). ``every=n`` sends every n-th call of a name;
    ``first=n`` only its first n. What arrives is the value at this call:
    arrays up to ``THING_SNAPSHOT_BYTES`` (64 KiB) are copied now, larger ones
    are read in place by the sender thread (a torch tensor changed in place
    before that ends arrives marked ``consistent=False``, unless changed through
    ``.data`` or a numpy view, which torch does not count); ``copy=True``
    copies every array now, ``copy=False`` none. ``block=True`` waits for
    room instead of dropping when the queue is full. ``step=global_step`` is
    the step the REPL shows and plots (default: the call number of the name,
    1 for its first call). ``on_demand=True`` sends nothing until the REPL
    asks with ``thing.request(name, count)``. The REPL may change what is
    sent (``thing.every``, ``first``, ``pause``, ``resume``, ``reset``);
    ``THING_CONTROL=0`` refuses that. Returns a handle whose ``wait()`` is True once the
    server stored it; ``error`` says why not.
    """
    client = _default_client
    if client is None:
        if getattr(busy, "working", False):  # a signal handler interrupted its making
            return REENTERED
        try:
            client = _make_default_client()
        except Exception as exc:  # a typo in THING_SERVER must not stop a training job
            return _cannot_send(exc)
    return Client.catch(  # the class's: this call already went through the gate below
        client,
        obj,
        name,
        server,
        every,
        first,
        copy=copy,
        block=block,
        step=step,
        on_demand=on_demand,
        _depth=2,
    )


# The default client's every=/first= counts exist before it does, so that the calls they
# skip are answered by the compiled gate before any Python runs (thing/_core/_gate.pyx); the
# sent calls of the common kind it queues itself, for whichever client is the default.
_default_throttles = _core.Throttles()
catch = _core.gated(catch, _default_throttles, SKIPPED, globals())


_said_cannot_send = False


def _cannot_send(exc: Exception) -> CaptureHandle:
    """What ``catch`` returns while the default client cannot be made (``THING_SERVER`` that
    is no address): the reason, in the handle and once in the log. Tried again at each call,
    so a job that fixes its environment starts sending."""
    global _said_cannot_send
    reason = f"not sent: {exc}"
    if not _said_cannot_send:
        _said_cannot_send = True
        log.warning("thing.catch cannot send anything: %s", exc)
    return CaptureHandle(None, reason)


def _make_default_client() -> Client:
    global _default_client, _maker
    with working(), _default_client_lock:
        if _default_client is None:
            _maker = threading.get_ident()
            try:  # THING_SERVER / THING_PORT, as any Client()
                _default_client = Client(_throttles=_default_throttles)
            finally:
                _maker = None
        return _default_client


# A fork while another thread makes the default client (which imports the sending side)
# would leave the child this lock, and the imports' own locks, held by a thread it does not
# have: its first catch would wait forever. So a fork waits until the client is made (a
# few milliseconds, once). A fork from the thread making it (a signal handler), or one
# that waited longer than any making takes, leaves the child a lock of its own.
_FORK_WAITS_FOR_THE_CLIENT = 10.0
_maker: int | None = None  # the thread making the default client, while it does
_forking = threading.local()  # whether this thread's fork holds the lock


def _before_fork() -> None:
    _forking.holds = (_maker != threading.get_ident() and _default_client_lock.acquire(
        timeout=_FORK_WAITS_FOR_THE_CLIENT))


def _after_fork_in_parent() -> None:
    if _forking.holds:
        _default_client_lock.release()


def _after_fork_in_child() -> None:
    global _default_client_lock, _maker
    if _forking.holds:
        _default_client_lock.release()
    else:
        _default_client_lock, _maker = threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
