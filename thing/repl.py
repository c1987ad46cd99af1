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
import sys
from typing import Any

from . import config
from .errors import NotServing, ThingError
from .server import Server

log = logging.getLogger("thing")

_server: Server | None = None


def serve(port: int | None = None, host: str | None = None) -> Server:
    """Start the default server in the background and return at once (calling it again is harmless).

    ``port`` defaults to ``THING_PORT`` or 2875; ``host`` to ``THING_HOST`` or 127.0.0.1.
    """
    global _server
    _show_log_lines()
    if _server is not None and _server.running:
        log.info("Server already running at port %d.", _server.port)
        return _server
    server = Server(config.serve_port() if port is None else port, host or config.serve_host())
    try:
        server.start()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise ThingError(
            f"Port {server.port} is already in use (another thing server?); "
            f"try thing.serve(port={_free_port_near(server.port, server.host)})."
        ) from None
    _server = server
    return server


def default_server() -> Server:
    """The server started by :func:`serve`; raises :class:`NotServing` before that."""
    if _server is None or not _server.running:
        raise NotServing("no server is running here: call thing.serve() first")
    return _server


def get(name_or_id: str | int, index: int = 0, rank: int | None = None) -> Any:
    """The newest capture of a name (``index=1``: the one before), or the capture with an integer id."""
    return default_server().get(name_or_id, index, rank)


def get_all(name: str, rank: int | None = None) -> list[Any]:
    """Every kept capture of ``name``, oldest to newest (``rank=``: only that rank's)."""
    return default_server().get_all(name, rank)


def wait(name: str, timeout: float | None = None) -> Any:
    """Block until a new capture of ``name`` arrives and return it (TimeoutError after ``timeout`` s)."""
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

    Names become identifiers by :func:`identifier_for`. Existing variables are
    kept unless ``overwrite=True``. Returns ``{variable: name}`` of what was bound.
    """
    server = default_server()
    if namespace is None:
        namespace = _caller_namespace()
    bound: dict[str, str] = {}
    skipped: list[str] = []
    for name in server.store.names():
        ident = identifier_for(name)
        if ident in bound or (ident in namespace and not overwrite):
            skipped.append(f"{ident} ({name})")
            continue
        try:
            namespace[ident] = server.get(name)
        except KeyError:  # cleared or evicted meanwhile
            continue
        bound[ident] = name
    print(f"bound {len(bound)}: {', '.join(bound) or '-'}")
    if skipped:
        print(f"kept existing variables (overwrite=True replaces them): {', '.join(skipped)}")
    return bound


def summary(max_items: int = 5) -> None:
    """Print a table of what was received: per name its latest shape, dtype, count, sender."""
    from .display import show_summary

    show_summary(default_server(), max_items)


def describe(name_or_id: str | int, index: int = 0, rank: int | None = None) -> None:
    """Print everything known about a capture, with statistics for arrays."""
    from .display import show_description

    show_description(default_server().capture(name_or_id, index, rank), default_server())


def status() -> None:
    """A live view of arrivals with a spinner; Ctrl+C returns to the prompt (the server keeps running)."""
    from .display import show_status

    show_status(default_server())


def help() -> None:  # noqa: A001 - thing.help() is the documented entry point
    """List every public function of thing with its signature and first line."""
    from .display import show_help

    show_help()


def _caller_namespace() -> dict[str, Any]:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        return shell.user_ns
    frame = sys._getframe(2)
    return frame.f_globals


def _show_log_lines() -> None:
    """Make the thing logger's INFO lines visible in a REPL that has not configured logging."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)-8s - %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def _free_port_near(port: int, host: str) -> int:
    import socket

    for candidate in range(port + 1, min(port + 50, 65535)):
        with socket.socket() as probe:
            try:
                probe.bind((host, candidate))
            except OSError:
                continue
            return candidate
    return 0
