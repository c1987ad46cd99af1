"""The functions a researcher types in the REPL: ``thing.serve()``, ``thing.get('loss')``, ...

They all read the store of one default :class:`~thing.server.Server`, started
by :func:`serve`: values straight from the :class:`~thing.store.HistoryStore`,
reports built by ``reports.py`` and shown by ``display.py``, the live view
by ``live.py``, variables bound by ``ingest.py``; those are imported only
when asked for, so ``import thing`` stays light. What thing refuses on purpose
(an unknown name, no server yet, a damaged recording) ends in a short
traceback that names the fix.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shlex
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .captures import value_of
from .errors import ArgumentError, ArgumentTypeError, NotServing, ThingError
from .log import log
from .server import Server
from .store import Announcement, HistoryStore, Run

Function = TypeVar("Function", bound=Callable[..., Any])

_server: Server | None = None
_serving = threading.Lock()  # held by serve(): two threads calling it start one server
# The history loaded with thing.load() before any server ran: what the REPL functions read
# until thing.serve(), which then receives into it.
_loaded: HistoryStore | None = None


def _short_traceback(function: Function) -> Function:
    """What thing refuses on purpose (a mistyped name, no server, a directory a save may not
    use, a damaged recording: a :class:`ThingError`), and a wait that timed out, end in
    two traceback lines and the message, not the library's stack."""

    @functools.wraps(function)
    def reporting(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except (ThingError, TimeoutError) as exc:
            raise exc.with_traceback(None) from None

    return reporting  # type: ignore[return-value]


@_short_traceback
def serve(port: int | None = None, host: str | None = None) -> Server:
    """Start the default server in the background and return at once (calling it again is harmless).

    ``port`` defaults to ``THING_PORT`` or 2875 (0 picks a free port); ``host``
    to ``THING_HOST`` or 127.0.0.1 (``"0.0.0.0"`` accepts other machines).
    Served again after ``close()``, it keeps the session's history and what
    the REPL set for jobs (``thing.pause``, ``every``, ``first``).
    """
    global _server
    if port is not None and (type(port) is not int or not 0 <= port <= 65535):
        raise (ArgumentError if type(port) is int else ArgumentTypeError)(
            f"port is a port number from 0 (any free one) to 65535, not {port!r}")
    if host is not None and not isinstance(host, str):
        raise ArgumentTypeError(f"host is a host name or address (str), not {host!r}")
    _show_log_lines()
    with _serving:  # one server per session, whichever threads call at once
        if _server is not None and _server.running:
            if port not in (None, 0, _server.port) or host not in (None, _server.host):
                log.warning("The thing server is already running at %s:%d (one per session; "
                            "thing.Server(port=...).start() starts another).",
                            _server.host, _server.port)
            else:
                log.info("Server already running at port %d.", _server.port)
            return _server
        server = Server(port, host, store=_history())
        if _server is not None:  # the session's settings hold on, as its history does
            server.steering = _server.steering
        try:
            server.start()
        except OSError as exc:
            raise ThingError(_bind_failure(exc, server.host, server.port)) from None
        _server = server
        return server


def _bind_failure(exc: OSError, host: str, port: int, recording: str | None = None) -> str:
    """One sentence saying why the server could not listen, and what to try instead: in the
    REPL or ``thing serve``, or ``thing record`` into the directory ``recording``."""
    def instead(option: str, value: object) -> str:
        if recording is not None:
            return f"`thing record {shlex.quote(recording)} --{option} {value}`"
        return f"thing.serve({option}={value!r}) or `thing serve --{option} {value}`"

    if exc.errno in (errno.EADDRINUSE, errno.EACCES):
        why = ("is already in use (another thing server?)" if exc.errno == errno.EADDRINUSE
               else "needs administrator rights")
        free = _free_port_near(port if exc.errno == errno.EADDRINUSE else max(port, 1024), host)
        return (f"Port {port} {why}; try port {free}: {instead('port', free)}, and "
                f"THING_PORT={free} for the jobs.")
    if exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
        return (f"Cannot listen on {host!r}: it is not an address of this machine; try "
                f"{instead('host', '0.0.0.0')} to accept connections on every interface.")
    return f"Cannot listen on {host}:{port}: {exc.strerror or exc}."


def default_server() -> Server:
    """The server started by :func:`serve`; raises :class:`NotServing` before that."""
    if _server is None or not _server.running:
        raise NotServing("no server is running here: call thing.serve() first")
    return _server


def _history() -> HistoryStore | None:
    """The session's history while no server runs: what ``load`` brought back, else what a
    closed default server kept (``serve()`` again receives into it)."""
    if _loaded is not None:
        return _loaded
    return None if _server is None else _server.store


def _store() -> HistoryStore:
    if _server is None or not _server.running:
        history = _history()
        if history is not None:
            return history
    return default_server().store


@_short_traceback
def save(path: str | os.PathLike[str], names: str | Iterable[str] | None = None) -> int:
    """Write the kept history (every capture, or those of ``names``: one name or a list)
    to a new directory.

    Arrays go into safetensors files, the rest (names, containers, numbers,
    senders, call sites, times) into their metadata; ``thing.load`` reads it
    back. Needs the ``safetensors`` package (thing's ``save`` extra).
    Returns how many captures were written. A directory that holds anything
    already is refused, and a save that fails leaves nothing behind.
    """
    return _store().save(path, names)


@_short_traceback
def load(path: str | os.PathLike[str], *, skip_damaged: bool = False) -> int:
    """Bring back a recording (``thing.save``, ``thing record``) into this session's history.

    Captures keep their names, order, ranks, senders, call sites, times and
    ``consistent`` flags, bit for bit, as the framework they were sent from;
    they are placed in order of arrival among those already here. The files
    are memory-mapped: loading is quick, and an array takes memory only once
    looked at. Works without a server (``thing.serve()`` later receives into
    the same history). A damaged or foreign file is refused, nothing loaded;
    ``skip_damaged=True`` loads the other files and logs each one left out.
    A save that was cut short loads as far as it was written, with a warning.
    Returns how many captures were loaded: one that is here already (the
    same recording loaded twice) is not added again.
    """
    global _loaded
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"a recording is loaded from its directory's path, not {path!r}")
    _show_log_lines()  # get() warns of a capture that changed while it was sent
    if _server is not None and _server.running:
        return _server.store.load(path, skip_damaged=skip_damaged)
    store = _history()
    if store is None:
        store = HistoryStore()
    count = store.load(path, skip_damaged=skip_damaged)
    _loaded = store
    return count


@_short_traceback
def get(name_or_id: str | int, index: int = 0, rank: int | None = None, *,
        step: int | None = None, run: str | None = None) -> Any:
    """The newest capture of a name (``index=1``: the one before), or the capture with that id.

    ``step=s`` returns the capture of step ``s``: the step given to
    ``catch(step=)``, else the call number of the name (1 for its first
    call, throttled calls counted). Only the captures of one run (training
    job) count: ``run=`` (an id from :func:`runs`), by default the run that
    sent the newest capture of the name; ``run="all"``: every run. Arrays
    come back as received, without a
    copy; containers as the same nested list/tuple/dict. ``rank=`` picks
    that distributed rank's captures. A name's identifier also works (``"model_lm_head_weight"`` for
    ``"model.lm_head.weight"``) when no other name has it. An unknown name
    raises ``KeyError`` listing the closest known names.
    """
    return value_of(_store().get(name_or_id, index, rank, step, run))


@_short_traceback
def get_all(name: str, rank: int | None = None, *, run: str | None = None) -> list[Any]:
    """Every kept capture of ``name``, oldest to newest (``rank=``: only that rank's).

    Of one run: by default the run (training job) that sent the newest capture
    of the name, so a restarted job starts a new history; ``run="all"`` joins
    every run's, ``run=id`` picks one (see :func:`runs`).
    """
    return [value_of(capture) for capture in _store().get_all(name, rank, run)]


@_short_traceback
def stats(name: str, rank: int | None = None, run: str | None = None, *,
          spectral: bool = False) -> Any:
    """A row of statistics per kept capture of ``name``, oldest first.

    Columns: step, rank, arrived, shape, min, max, mean, std, norm (L2), nan,
    inf (over the finite values; magnitudes for complex), with ``run="all"``
    the run after the rank, and with ``spectral=True`` the top singular value
    of 2-D arrays (above 2**22 elements estimated by Lanczos, to about 1e-10 of
    it). Worked out once per capture, in the background as it arrives
    (``THING_STATS_SHARE``).
    ``rank=`` and ``run=`` select as in :func:`get_all`. A pandas DataFrame
    when pandas is installed, else a table that prints as one (``to_dict()``).
    """
    from .history_stats import stats_table

    return stats_table(_store(), name, rank, run, spectral)


@_short_traceback
def plot(names: str | list[str], stat: str | list[str] = "auto", rank: int | str | None = None,
         run: str | None = None, *, live: bool = False,
         file: str | os.PathLike[str] | None = None) -> Any:
    """Plot how a name (or each of a list of names) moved over the steps.

    A name of single numbers (a loss) is drawn as its value; an array as its
    L2 norm, and its mean within a band of ± one std and one from min to max.
    ``stat=`` picks instead: one or a list of "value", "norm", "spread",
    "mean", "std", "min", "max", "nan", "inf", "spectral". Several ranks
    are a line each, more than eight their median with their least and greatest;
    ``rank="all"`` draws a line per rank however many, ``run="all"`` one per
    run (else as in :func:`get_all`). In Jupyter an inline image (matplotlib), in a terminal
    a Unicode plot (uniplot), from thing's ``plot`` extra. ``file="x.png"``
    writes it instead. ``live=True`` redraws it as captures arrive: in
    Jupyter at most twice a second, returning a view whose ``stop()`` ends
    it; in a terminal until Ctrl+C.
    """
    from . import plot_drawing

    return plot_drawing.plot(_store(), names, stat, rank, run, live=live, file=file)


@_short_traceback
def hist(name_or_id: str | int, index: int = 0, rank: int | None = None, *,
         step: int | None = None, run: str | None = None, bins: int = 50,
         file: str | os.PathLike[str] | None = None) -> None:
    """Plot the distribution of one capture's values in equal bins (``bins``, 50) from min to max.

    The capture is chosen as in :func:`get` (the newest by default; ``index``,
    ``rank``, ``step``, ``run``). NaN and Inf are counted apart; complex
    values by magnitude. Drawn as :func:`plot` draws; ``file=`` writes it.
    """
    from . import plot_drawing

    plot_drawing.hist(_store(), name_or_id, index, rank, step=step, run=run, bins=bins,
                      file=file)


@_short_traceback
def runs() -> list[Run]:
    """The runs that sent the kept captures, oldest first: id, start, end, captures, ranks,
    names.

    A run is a training job: a script names its run at ``import thing`` and
    the processes it forks or spawns join it (``THING_RUN=name`` names it
    yourself; torchrun's ranks share their launch's). A notebook or REPL
    that catches names a run of its own, shared only with what it forks.
    """
    return _store().runs()


# -- steering: what running jobs send -----------------------------------------------------


@_short_traceback
def request(name: str, count: int = 1, rank: int | None = None) -> int:
    """Make the next ``count`` calls of ``name`` in the running jobs send, whatever their
    throttles say (``rank=``: only that rank's).

    For a name caught with ``catch(x, on_demand=True)``, which sends nothing
    until asked (:func:`available` lists those), and for any other name. A
    capture sent so is marked "sent because of a request" in :func:`describe`.
    Returns how many connected jobs were told.
    """
    return default_server().request(name, count, rank)


@_short_traceback
def every(name: str | None, n: int, rank: int | None = None) -> int:
    """From now, the running jobs send every ``n``-th call of ``name`` (None: of every name).

    It overrides the job's own ``every=`` until :func:`reset`; a job that
    connects later (a restart) gets it too. ``rank=``: only that rank. Nothing
    runs in the job: it changes a number its ``catch`` reads. A job that loses
    this REPL keeps the setting for ``THING_CONTROL_TTL`` s (10 min), then
    returns to its own. Returns how many connected jobs were told.
    """
    return default_server().every(name, n, rank)


@_short_traceback
def first(name: str, n: int, rank: int | None = None) -> int:
    """The running jobs send the next ``n`` captures of ``name``, then none, until :func:`reset`.

    Overrides the job's own ``first=`` (and keeps its ``every=``); see :func:`every`.
    """
    return default_server().first(name, n, rank)


@_short_traceback
def pause(name: str | None = None, rank: int | None = None) -> int:
    """The running jobs send nothing of ``name`` (None: of any name) until :func:`resume`.

    Calls are still counted, so steps stay right. See :func:`every`.
    """
    return default_server().pause(name, rank)


@_short_traceback
def resume(name: str | None = None, rank: int | None = None) -> int:
    """Undo :func:`pause`: for ``name`` (sent even while every name is paused), or for all."""
    return default_server().resume(name, rank)


@_short_traceback
def reset(name: str | None = None, rank: int | None = None) -> int:
    """Undo what :func:`every`, :func:`first` and :func:`pause` set for ``name`` (None: for
    every name): the jobs' own ``every=``/``first=`` again."""
    return default_server().reset(name, rank)


@_short_traceback
def available() -> list[Announcement]:
    """The names running jobs catch on demand (``catch(x, on_demand=True)``), most recently
    announced first: name, type, shape, dtype, call site, sender. :func:`request` sends
    some; :func:`summary` shows them too."""
    return _store().available()


@_short_traceback
def wait(name: str, timeout: float | None = None) -> Any:
    """Wait for the next capture of ``name`` and return it (TimeoutError after ``timeout`` s).

    Needs a running server (NotServing otherwise: with none, or only a loaded recording,
    nothing could arrive)."""
    return value_of(default_server().store.wait(name, timeout))


@_short_traceback
def clear(name: str | None = None) -> int:
    """Forget one name's history, or everything; returns how many captures were dropped."""
    if _server is not None and _server.running:
        return _server.clear(name)
    return _store().clear(name)  # a loaded recording's, with no server


@_short_traceback
def ingest_all(overwrite: bool = False, namespace: dict[str, Any] | None = None) -> Any:
    """Bind the newest capture of every name as a variable in the REPL.

    The namespace is IPython's (a notebook's) user namespace when one is
    running, else the globals of the code that called. Names become
    identifiers (``model.lm_head.weight`` -> ``model_lm_head_weight``).
    Builtins, modules and IPython's own variables are never
    replaced; other existing variables only with ``overwrite=True``.
    Returns ``{variable: name}``, which shows what was bound and skipped.
    """
    from .ingest import ingest_all as ingest

    if namespace is not None and not isinstance(namespace, dict):
        raise ArgumentTypeError(f"namespace is a dict of variables (or None), not {namespace!r}")
    return ingest(_store(), overwrite, namespace)


@_short_traceback
def summary(max_items: int | None = 5) -> None:
    """Show a table of what was received: per name its latest shape, dtype, count, sender.

    Shows the ``max_items`` most recently updated names, newest first (``None``:
    all), a row per run and rank when several send a name (at most ``max_items``
    of them: the newest run's lowest ranks), what senders could not send and
    why, then counts of unnamed, evicted and refused captures.
    Fits the terminal (long names are shortened in the middle); HTML in Jupyter.
    """
    from . import display, reports

    store = _store()
    info = _server.info() if _server is not None and _server.running else None
    display.show(reports.summary(store, info, max_items))


@_short_traceback
def describe(name_or_id: str | int, index: int = 0, rank: int | None = None, *,
             step: int | None = None, run: str | None = None) -> None:
    """Show everything known about a capture, with min/max/mean/std/L2 norm/NaN/Inf for arrays.

    ``name_or_id``, ``index``, ``rank``, ``step`` and ``run`` select the capture as in
    :func:`get`; for a name its sender could not send, or this server refused, the reason.
    """
    from . import display, reports

    display.show(reports.describe(_store(), name_or_id, index, rank, step, run))


@_short_traceback
def status(watch: bool = True) -> None:
    """Watch arrivals live; the server keeps receiving whatever happens to the view.

    In a terminal the view is redrawn until Ctrl+C. In Jupyter it is a display
    that updates itself while the kernel stays free; ``status(False)`` (or
    calling ``status()`` again) stops it.
    """
    from . import live

    if not watch:  # also once the server is closed: the view must stop whatever happened
        live.stop_watching()
        return
    server = default_server()
    live.watch(server.store, server.info)


def help() -> None:  # noqa: A001 - thing.help() is the documented entry point
    """List every public function of thing with its signature and first sentence."""
    from . import display, reports

    display.show(reports.help_report())


def _show_log_lines() -> None:
    """Make the thing logger's INFO lines visible in a REPL that has not configured logging."""
    # thing's own NullHandler only silences "no handler" warnings; it shows nothing.
    if logging.getLogger().handlers or any(
            not isinstance(handler, logging.NullHandler) for handler in log.handlers):
        return
    handler = _CurrentStderr()
    handler.setFormatter(
        logging.Formatter("%(asctime)s - %(name)s - %(levelname)-8s - %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


class _CurrentStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a line is logged, not as it was when the
    handler was made: while ``status()`` shows its live view, rich's stand-in prints
    the line above the view (written past it, the line was drawn over)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def _free_port_near(port: int, host: str) -> int:
    """A port after ``port`` that is free on ``host`` right now (0, "any free port", if none is)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for candidate in range(port + 1, min(port + 50, 65536)):
        with socket.socket(family) as probe:
            try:
                probe.bind((host, candidate))
            except OSError:
                continue
            return candidate
    return 0
