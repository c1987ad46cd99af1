"""The functions a researcher types in the REPL: ``thing.serve()``, ``thing.get('loss')``, ...

They all act on one default :class:`~thing.server.Server` started by
:func:`serve`. Rendering (tables, the live view) lives in ``display.py`` and
is imported only when asked for, so ``import thing`` stays light.
"""

from __future__ import annotations

import errno
import keyword
import logging
import re
import socket
import sys
from typing import Any

from . import config
from .errors import NotServing, ThingError
from .server import Server

log = logging.getLogger("thing")

_server: Server | None = None


def serve(port: int | None = None, host: str | None = None) -> Server:
    """Start the default server in the background and return at once (calling it again is harmless).

    ``port`` defaults to ``THING_PORT`` or 2875 (0 picks a free port); ``host``
    to ``THING_HOST`` or 127.0.0.1 (``"0.0.0.0"`` accepts other machines).
    """
    global _server
    _show_log_lines()
    if _server is not None and _server.running:
        if port not in (None, 0, _server.port) or host not in (None, _server.host):
            log.warning("The thing server is already running at %s:%d (one per session; "
                        "thing.Server(port=...).start() starts another).",
                        _server.host, _server.port)
        else:
            log.info("Server already running at port %d.", _server.port)
        return _server
    server = Server(config.serve_port() if port is None else port, host or config.serve_host())
    try:
        server.start()
    except OSError as exc:
        raise ThingError(_bind_failure(exc, server.host, server.port)) from None
    _server = server
    return server


def _bind_failure(exc: OSError, host: str, port: int) -> str:
    """One sentence saying why the server could not listen, and what to try instead."""
    if exc.errno == errno.EADDRINUSE:
        return (f"Port {port} is already in use (another thing server?); "
                f"try thing.serve(port={_free_port_near(port, host)}).")
    if exc.errno == errno.EACCES:
        return (f"Port {port} needs administrator rights; "
                f"try thing.serve(port={_free_port_near(max(port, 1024), host)}).")
    if exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
        return (f"Cannot listen on {host!r}: it is not an address of this machine; "
                f"try thing.serve(host='0.0.0.0') to accept connections on every interface.")
    return f"Cannot listen on {host}:{port}: {exc.strerror or exc}."


def default_server() -> Server:
    """The server started by :func:`serve`; raises :class:`NotServing` before that."""
    if _server is None or not _server.running:
        raise NotServing("no server is running here: call thing.serve() first")
    return _server


def get(name_or_id: str | int, index: int = 0, rank: int | None = None) -> Any:
    """The newest capture of a name (``index=1``: the one before), or the capture with that id.

    Arrays come back as received, without a copy; containers as the same
    nested list/tuple/dict. ``rank=`` picks that distributed rank's captures.
    An unknown name raises ``KeyError`` listing the closest known names.
    """
    return default_server().get(name_or_id, index, rank)


def get_all(name: str, rank: int | None = None) -> list[Any]:
    """Every kept capture of ``name``, oldest to newest (``rank=``: only that rank's)."""
    return default_server().get_all(name, rank)


def wait(name: str, timeout: float | None = None) -> Any:
    """Wait for the next capture of ``name`` and return it (TimeoutError after ``timeout`` s)."""
    return default_server().wait(name, timeout)


def clear(name: str | None = None) -> int:
    """Forget one name's history, or everything; returns how many captures were dropped."""
    return default_server().clear(name)


def identifier_for(name: str) -> str:
    """The variable name :func:`ingest_all` binds ``name`` to.

    Every run of characters that cannot appear in an identifier becomes one
    ``_`` and leading/trailing ``_`` are stripped (``model.lm_head.weight`` ->
    ``model_lm_head_weight``, ``h[3]`` -> ``h_3``); a result that starts with
    a digit, is a keyword or is empty gets a leading ``_``.
    """
    ident = re.sub(r"\W+", "_", name).strip("_")
    if not ident or ident[0].isdigit() or keyword.iskeyword(ident):
        ident = "_" + ident
    return ident


def ingest_all(overwrite: bool = False, namespace: dict[str, Any] | None = None) -> dict[str, str]:
    """Bind the newest capture of every name as a variable in the caller's namespace.

    The namespace is IPython's (a notebook's) user namespace when one is
    running, else the globals of the code that called. Names become
    identifiers by :func:`identifier_for` (``model.lm_head.weight`` ->
    ``model_lm_head_weight``). Existing variables are kept unless
    ``overwrite=True``. Prints what was bound and skipped; returns ``{variable: name}``.
    """
    return ingest_into(default_server(), overwrite, namespace)


def ingest_into(server: Server, overwrite: bool = False,
                namespace: dict[str, Any] | None = None) -> dict[str, str]:
    """:func:`ingest_all` for any server (``Server.ingest_all`` calls this)."""
    if namespace is None:
        namespace = _caller_namespace()
    bound: dict[str, str] = {}
    kept: list[str] = []
    clashes: list[str] = []
    for name in server.store.names():
        ident = identifier_for(name)
        if ident in bound:
            clashes.append(f"{name!r} (also {ident!r}, taken by {bound[ident]!r})")
            continue
        if ident in namespace and not overwrite:
            kept.append(ident if ident == name else f"{ident} ({name!r})")
            continue
        try:
            namespace[ident] = server.get(name)
        except KeyError:  # cleared or evicted meanwhile
            continue
        bound[ident] = name
    shown = [ident if ident == name else f"{ident} ({name!r})" for ident, name in bound.items()]
    print(f"bound {_count(len(bound), 'variable')}: {', '.join(shown) or '-'}")
    if kept:
        print(f"kept {_count(len(kept), 'existing variable')} "
              f"(ingest_all(overwrite=True) replaces them): {', '.join(kept)}")
    if clashes:
        print(f"skipped {_count(len(clashes), 'name')} whose variable was already bound: "
              f"{', '.join(clashes)}; use thing.get(name)")
    return bound


def summary(max_items: int | None = 5) -> None:
    """Print a table of what was received: per name its latest shape, dtype, count, sender.

    Shows the ``max_items`` most recently updated names, newest first (``None``:
    all), then counts of unnamed, evicted and refused captures and the memory held.
    """
    from .display import show_summary

    show_summary(default_server(), max_items)


def describe(name_or_id: str | int, index: int = 0, rank: int | None = None) -> None:
    """Print everything known about a capture, with min/max/mean/std/L2 norm/NaN/Inf for arrays.

    ``name_or_id``, ``index`` and ``rank`` select the capture as in :func:`get`.
    """
    from .display import show_description

    show_description(default_server().capture(name_or_id, index, rank), default_server())


def status() -> None:
    """Watch arrivals live, with a spinner; Ctrl+C returns to the prompt, the server keeps going."""
    from .display import show_status

    show_status(default_server())


def help() -> None:  # noqa: A001 - thing.help() is the documented entry point
    """List every public function of thing with its signature and first line."""
    from .display import show_help

    show_help()


def _caller_namespace() -> dict[str, Any]:
    """IPython's user namespace if a shell runs, else the first non-thing caller's globals."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        return shell.user_ns
    frame = sys._getframe(1)
    while frame.f_back is not None and _inside_thing(frame.f_globals.get("__name__")):
        frame = frame.f_back
    return frame.f_globals


def _inside_thing(module: Any) -> bool:
    return isinstance(module, str) and (module == "thing" or module.startswith("thing."))


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _show_log_lines() -> None:
    """Make the thing logger's INFO lines visible in a REPL that has not configured logging."""
    # thing's own NullHandler only silences "no handler" warnings; it shows nothing.
    if logging.getLogger().handlers or any(
            not isinstance(handler, logging.NullHandler) for handler in log.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s - %(name)s - %(levelname)-8s - %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


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
