"""The ``thing`` command (also ``python -m thing``).

``thing serve [--host H] [--port P] [--record DIR]`` opens an interactive
session (IPython when it is installed, else Python's own REPL) with the server
already running and ``thing`` imported. ``thing record DIR`` receives with no
session, appending every capture to a recording; ``thing open DIR`` opens a
session on a recording, with no server. ``thing demo`` runs the end-to-end demo.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import config
from .display import counted, say

if TYPE_CHECKING:
    from .recorder import SegmentWritten

FIRST_COMMANDS = (
    ("thing.summary()", "what has arrived so far"),
    ("thing.get('loss')", "the newest capture of a name (index=1: one before)"),
    ("thing.ingest_all()", "every received name as a variable here"),
)


def main(argv: list[str] | None = None) -> int:
    """Run the ``thing`` command on ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    from .run_names import forget_this_job

    forget_this_job()  # jobs started from here (the demo's) are runs of their own
    parser = argparse.ArgumentParser(
        prog="thing",
        description="Catch tensors in one program and look at them in a live Python session.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{serve,record,open,demo}")
    serve = commands.add_parser(
        "serve", help="open a Python session that receives captures",
        description="Open an interactive Python session (IPython if installed) with the thing "
                    "server running in the background and thing imported.")
    serve.add_argument("--host", help="interface to listen on (default THING_HOST or 127.0.0.1; "
                                      "0.0.0.0 accepts other machines)")
    serve.add_argument("--port", type=_port,
                       help="port to listen on (default THING_PORT or 2875; 0: any free port)")
    serve.add_argument("--plain", action="store_true",
                       help="use Python's own REPL even if IPython is installed")
    serve.add_argument("--record", metavar="DIR",
                       help="also append every capture to the recording in DIR")
    record = commands.add_parser(
        "record", help="receive captures with no session, appending them to a recording",
        description="Run a server with no interactive session that appends every capture it "
                    "receives to the recording in DIR, one segment file at a time (printing a "
                    "line for each). Open it later with `thing open DIR` or thing.load(DIR).")
    record.add_argument("directory", metavar="DIR")
    record.add_argument("--host", help="interface to listen on (as for serve)")
    record.add_argument("--port", type=_port, help="port to listen on (as for serve)")
    for command in (serve, record):
        command.add_argument("--max-bytes", type=_size, metavar="SIZE",
                             help="keep the recording under SIZE on disk (e.g. 20G), deleting "
                                  "its oldest segments first; the newest is always kept, so "
                                  "give at least --segment-bytes (default: no limit)")
        command.add_argument("--segment-bytes", type=_size, default=64 << 20, metavar="SIZE",
                             help="start a new segment file after SIZE of captures (default 64M)")
        command.add_argument("--segment-seconds", type=_seconds, default=10.0, metavar="S",
                             help="write a segment at most S seconds after its first capture: "
                                  "a crash loses at most that (default 10)")
    open_ = commands.add_parser(
        "open", help="open a Python session on a recording (no server)",
        description="Load the recording in DIR and open an interactive session on it: "
                    "thing.get, get_all, summary and describe work as on a live server.")
    open_.add_argument("directory", metavar="DIR")
    open_.add_argument("--plain", action="store_true",
                       help="use Python's own REPL even if IPython is installed")
    open_.add_argument("--skip-damaged", action="store_true",
                       help="load the segments that are whole when some are damaged (each "
                            "one left out is said)")
    demo = commands.add_parser(
        "demo", help="train a small model in another process and show what it sent",
        description="Start a server, train a small model in a separate process that catches "
                    "its loss, a weight matrix and activations, then summarise what arrived.")
    demo.add_argument("--steps", type=_steps, default=100, help="training steps (default 100)")
    demo.add_argument("--numpy", action="store_true", help="use numpy even if torch is installed")
    demo.add_argument("--record", metavar="DIR",
                      help="also record what arrives into DIR (then: thing open DIR)")
    args = parser.parse_args(argv)
    if args.command == "serve" and args.record is None and _recorder_options(args) != (
            _recorder_options(parser.parse_args(["serve"]))):
        parser.error("--max-bytes, --segment-bytes and --segment-seconds need --record DIR")
    if args.command in ("serve", "open") and sys.stdin is None:
        # Started with its input closed (nohup ... <&-, a service): the session would end
        # in a traceback at its first prompt, after the server had started.
        parser.error(f"`thing {args.command}` opens an interactive session, and this process "
                     "has no input to read one from" + (
                         " (for a server with no session: thing record DIR)"
                         if args.command == "serve" else ""))
    try:
        return _run(args, parser)
    except BrokenPipeError:  # `thing ... | head`: the reader has gone, and so may we
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.command == "serve":
        recording = None if args.record is None else (args.record, _recorder_options(args))
        return serve_interactively(args.port, args.host, plain=args.plain, record=recording)
    if args.command == "record":
        return record_headless(args.directory, args.port, args.host, _recorder_options(args))
    if args.command == "open":
        return open_interactively(args.directory, plain=args.plain,
                                  skip_damaged=args.skip_damaged)
    if args.command == "demo":
        return run_demo(args.steps, use_torch=False if args.numpy else None, record=args.record)
    parser.print_help()
    return 2


def serve_interactively(port: int | None = None, host: str | None = None, *,
                        plain: bool = False,
                        record: tuple[str, dict[str, Any]] | None = None) -> int:
    """Start the default server, then an interactive session until the user leaves it.

    ``record=(directory, recorder options)`` also records every capture there.
    """
    import thing

    from .errors import ThingError

    try:
        server = thing.serve(port, host)
        if record is not None:
            directory, options = record
            server.record(directory, on_segment=_print_segment, **options)
    except (ThingError, OSError) as exc:
        print(f"thing: {exc}", file=sys.stderr)
        return 1
    where = f"thing is receiving at {server.host}:{server.port}"
    stopper = None
    if record is not None:
        where += f", recording into {record[0]}"
        stopper = _StopElsewhere(server)
    try:
        _interact(f"{where}; `thing` is imported. Try:", plain)
        return 0
    finally:
        server.close()
        if stopper is not None:
            stopper.finish()


def open_interactively(directory: str, *, plain: bool = False, skip_damaged: bool = False
                       ) -> int:
    """Load a recording, then an interactive session on it (no server) until the user leaves
    (``skip_damaged``: see ``thing.load``)."""
    import thing

    from .errors import ThingError
    from .recording import segments_of

    try:
        count = thing.load(directory, skip_damaged=skip_damaged)
        if not count and not segments_of(Path(directory)):  # a recorder's has its files
            raise ThingError(f"{directory or '(an empty path)'} holds no segments "
                             "(segment-NNNNNN.safetensors): nothing was recorded in it yet, "
                             "or it is not a recording")
    except (ThingError, OSError) as exc:
        print(f"thing: {exc}", file=sys.stderr)
        return 1
    _interact(f"thing opened {directory}: {count} captures, no server running\n"
              "(thing.serve() receives more into it); `thing` is imported. Try:", plain)
    return 0


def _interact(headline: str, plain: bool) -> None:
    import thing

    namespace: dict[str, Any] = {"thing": thing, "__name__": "__main__"}
    width = max(len(command) for command, _ in FIRST_COMMANDS)
    banner = "\n".join(
        [headline]
        + [f"    {command.ljust(width)}   # {what}" for command, what in FIRST_COMMANDS]
        + ["thing.help() lists everything."]
    )
    if not plain and _start_ipython(namespace, banner):
        return
    import code

    code.interact(banner=banner, local=namespace, exitmsg="")


def record_headless(directory: str, port: int | None = None, host: str | None = None,
                    options: dict[str, Any] | None = None) -> int:
    """``thing record DIR``: receive and record until Ctrl+C or SIGTERM, then write what
    is waiting and stop."""
    import shutil

    from .errors import ThingError
    from .repl import _bind_failure, _show_log_lines
    from .server import Server
    from .store import HistoryStore

    _show_log_lines()
    # Only what is being written is needed in memory: the newest capture of each name stays
    # (as in any server) so that a capture is never refused for want of room.
    server = Server(port, host, store=HistoryStore(max_versions=1))
    # The directory first: one that cannot be recorded into is said before any server starts.
    made = not os.path.lexists(directory)
    try:
        recorder = server.record(directory, on_segment=_print_segment, **(options or {}))
    except (ThingError, OSError) as exc:
        print(f"thing: {exc}", file=sys.stderr)
        return 1
    try:
        server.start()
    except OSError as exc:
        server.close()  # lets the directory go
        if made:  # nothing was recorded in it: not left behind
            shutil.rmtree(directory, ignore_errors=True)
        print(f"thing: {_bind_failure(exc, server.host, server.port, directory)}", file=sys.stderr)
        return 1
    stop = threading.Event()
    # Ctrl+C too sets the event rather than raising KeyboardInterrupt: one that came again
    # as the first was handled aborted the close that writes the open segment.
    _on_stop_signals(lambda _: stop.set(), ctrl_c=True)
    say(f"thing is recording what arrives at {server.host}:{server.port} into {directory}; "
        "Ctrl+C stops.")
    try:
        while not stop.wait(1.0):
            pass
    finally:
        _close_undisturbed(server)  # writes the open segment
    dropped = ", ".join(f"{count} {reason}" for reason, count in recorder.dropped.items())
    say(f"thing recorded {counted(recorder.written, 'capture')} in "
        f"{counted(recorder.segments, 'segment')}"
        + (f"; not recorded: {dropped}" if dropped else "") + ".")
    return 0


def _on_stop_signals(stop: Callable[[int], object], ctrl_c: bool = False) -> None:
    """Call ``stop(signum)`` on SIGTERM, on SIGHUP (the ssh session it ran in closed), and
    with ``ctrl_c`` on SIGINT."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGHUP, *([signal.SIGINT] if ctrl_c else [])):
        signal.signal(signum, lambda number, _: stop(number))


def _close_undisturbed(server: Any) -> None:
    """Close ``server``, writing its recording's open segment, with Ctrl+C and the stop
    signals ignored from here on (the process ends after it): a second Ctrl+C in the middle
    of it aborted the process ("FATAL: exception not rethrown"), the segment unwritten."""
    _ignore_stop_signals()
    server.close()


class _StopElsewhere:
    """In an interactive session: on SIGTERM or SIGHUP, close ``server`` (writing its
    recording's open segment) on a thread of its own, then end the process.

    Not in the signal's handler: it interrupts the session's own code wherever it is, and
    that may be inside the server (a ``close()`` the user typed holds the lock a close
    takes: the handler waited for it for good, the stop signals ignored), its store, or
    the making of a thread. So the thread is started now, and the handler only wakes it.
    """

    def __init__(self, server: Any):
        self._asked = threading.Event()
        self._signal = 0
        self._thread = threading.Thread(target=self._close_and_exit, args=(server,),
                                        name="thing-stop", daemon=True)
        self._thread.start()
        _on_stop_signals(self._ask)

    def _ask(self, signum: int) -> None:
        _ignore_stop_signals()
        self._signal = signum
        self._asked.set()

    def _close_and_exit(self, server: Any) -> None:
        self._asked.wait()
        try:
            server.close()
        finally:
            os._exit(128 + self._signal)

    def finish(self) -> None:
        """At the session's end: after a stop signal, wait for its close, which ends the
        process with the signal's code."""
        if self._asked.is_set():
            self._thread.join()


def _ignore_stop_signals() -> None:
    import signal

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


def _print_segment(written: SegmentWritten) -> None:
    say(f"{written.path.name}: {counted(written.captures, 'capture')}, "
        f"{_megabytes(written.nbytes)} "
        f"(recording: {counted(written.kept_segments, 'segment')}, "
        f"{_megabytes(written.kept_bytes)})")


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def _recorder_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_bytes": args.max_bytes, "segment_bytes": args.segment_bytes,
            "segment_seconds": args.segment_seconds}


def _port(text: str) -> int:
    """A port number, 0 (any free port) to 65535."""
    return _number(text, int, lambda port: 0 <= port <= 65535, "a port",
                   "0 to 65535; 0: any free one")


def _seconds(text: str) -> float:
    """A number of seconds a segment may stay open (see ``Recorder``)."""
    from .recorder import MAX_SEGMENT_SECONDS

    return _number(text, float, lambda seconds: 0 < seconds <= MAX_SEGMENT_SECONDS,
                   "a number of seconds", f"more than 0, at most {MAX_SEGMENT_SECONDS:g}")


def _steps(text: str) -> int:
    """A number of training steps, at least 1."""
    return _number(text, int, lambda steps: steps >= 1, "a number of steps", "at least 1")


def _number(text: str, parse: Callable[[str], Any], fits: Callable[[Any], bool], what: str,
            rule: str) -> Any:
    """``text`` parsed, if what it says ``fits`` (NaN fits no range); else a one-line error
    naming ``what`` it must be and the ``rule``."""
    try:
        number = parse(text)
    except ValueError:
        number = None
    if number is None or not fits(number):
        raise argparse.ArgumentTypeError(f"not {what}: {text!r} ({rule})")
    return number


def _size(text: str) -> int:
    """``20G``, ``512M``, ``4096`` (bytes; powers of 1024) as a number of bytes."""
    size = config.parse_size(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 20G or 512M)")
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive: {text!r}")
    return size


def _start_ipython(namespace: dict[str, Any], banner: str) -> bool:
    """Run an IPython shell on ``namespace``; False when IPython is not installed."""
    try:
        from IPython import start_ipython
    except ImportError:
        return False
    print(banner, flush=True)
    start_ipython(argv=["--no-banner"], user_ns=namespace)
    return True


def run_demo(steps: int = 100, use_torch: bool | None = None, timeout: float = 120.0,
             record: str | None = None) -> int:
    """``thing demo``: serve here, train in another process (``thing/demo.py``), show what came.

    ``record``: a directory to record what arrives into, as ``thing serve --record`` does.
    """
    from . import repl

    if use_torch is None:
        use_torch = importlib.util.find_spec("torch") is not None
    from .errors import ThingError

    # SIGTERM (or SIGHUP) ends the demo as Ctrl+C does: the finally blocks below end its
    # training process and close its server.
    _on_stop_signals(lambda signum: sys.exit(128 + signum))
    was_serving = repl._server is not None and repl._server.running
    server = repl.serve(port=0)  # a free port, unless a server already runs here
    try:
        recorder = None if record is None else server.record(record)
    except (ThingError, OSError) as exc:
        if not was_serving:
            server.close()
        print(f"thing: {exc}", file=sys.stderr)
        return 1
    try:
        say(f"thing demo: training a small {'torch' if use_torch else 'numpy'} model for "
            f"{counted(steps, 'step')} in another process, sending to port {server.port}...")
        host = "127.0.0.1" if server.host in ("", "0.0.0.0", "::") else server.host
        status = _train_elsewhere(host, server.port, steps, use_torch, timeout)
        if status != 0:
            return status
        print("\n>>> thing.summary()", flush=True)
        repl.summary()
        for name in ("model.hidden.weight", "activations"):
            print(f"\n>>> thing.describe({name!r})", flush=True)
            repl.describe(name)
        print("\n>>> thing.plot('loss')", flush=True)
        repl.plot("loss")
        if recorder is not None:
            recorder.close()  # the last segment written, every capture is on disk
            say(f"\nRecorded {recorder.written} captures into {record}: "
                f"`thing open {record}` looks at them again.")
        say("\nNext: run `thing serve` here, call thing.catch(...) in your own training "
            "script, then try thing.get('loss'), thing.ingest_all() and thing.help().")
        return 0
    finally:
        if recorder is not None:
            recorder.close()
        if not was_serving:
            server.close()


def _train_elsewhere(host: str, port: int, steps: int, use_torch: bool, timeout: float) -> int:
    """Run the training half in a fresh interpreter and wait for it (at most ``timeout`` s)."""
    env = dict(os.environ, THING_SERVER=host, THING_PORT=str(port))
    command = [sys.executable, "-m", "thing.demo", "--steps", str(steps)]
    if not use_torch:
        command.append("--numpy")
    # "-m" puts the working directory first on sys.path: run where this very thing
    # package lives, so a source checkout in the current directory cannot shadow it.
    package_parent = Path(__file__).resolve().parent.parent
    process = None
    try:
        process = subprocess.Popen(command, env=env, cwd=package_parent)
        status = process.wait(timeout)
    except subprocess.TimeoutExpired:
        print(f"thing demo: the training process did not finish within {timeout:.0f} s",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the training process had its own Ctrl+C
        print("thing demo: interrupted", file=sys.stderr)
        return 130
    finally:
        if process is not None and process.poll() is None:  # not left training, no server
            process.kill()
            process.wait()
    if status != 0:
        print(f"thing demo: the training process failed (exit status {status})", file=sys.stderr)
    return status
