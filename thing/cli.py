"""The ``thing`` command (also ``python -m thing``).

``thing serve [--host H] [--port P]`` opens an interactive session (IPython
when it is installed, else Python's own REPL) with the server already running
and ``thing`` imported. ``thing demo`` runs the end-to-end demo.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

FIRST_COMMANDS = (
    ("thing.summary()", "what has arrived so far"),
    ("thing.get('loss')", "the newest capture of a name (index=1: the one before)"),
    ("thing.ingest_all()", "every received name as a variable here"),
)


def main(argv: list[str] | None = None) -> int:
    """Run the ``thing`` command on ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = argparse.ArgumentParser(
        prog="thing",
        description="Catch tensors in one program and look at them in a live Python session.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{serve,demo}")
    serve = commands.add_parser(
        "serve", help="open a Python session that receives captures",
        description="Open an interactive Python session (IPython if installed) with the thing "
                    "server running in the background and thing imported.")
    serve.add_argument("--host", help="interface to listen on (default THING_HOST or 127.0.0.1; "
                                      "0.0.0.0 accepts other machines)")
    serve.add_argument("--port", type=int,
                       help="port to listen on (default THING_PORT or 2875; 0: any free port)")
    serve.add_argument("--plain", action="store_true",
                       help="use Python's own REPL even if IPython is installed")
    demo = commands.add_parser(
        "demo", help="train a small model in another process and show what it sent",
        description="Start a server, train a small model in a separate process that catches "
                    "its loss, a weight matrix and activations, then summarise what arrived.")
    demo.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    demo.add_argument("--numpy", action="store_true", help="use numpy even if torch is installed")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve_interactively(args.port, args.host, plain=args.plain)
    if args.command == "demo":
        return run_demo(args.steps, use_torch=False if args.numpy else None)
    parser.print_help()
    return 2


def serve_interactively(port: int | None = None, host: str | None = None, *,
                        plain: bool = False) -> int:
    """Start the default server, then an interactive session until the user leaves it."""
    import thing

    from .errors import ThingError

    try:
        server = thing.serve(port, host)
    except ThingError as exc:
        print(f"thing: {exc}", file=sys.stderr)
        return 1
    namespace: dict[str, Any] = {"thing": thing, "__name__": "__main__"}
    width = max(len(command) for command, _ in FIRST_COMMANDS)
    banner = "\n".join(
        [f"thing is receiving at {server.host}:{server.port}; `thing` is imported. Try:"]
        + [f"    {command.ljust(width)}   # {what}" for command, what in FIRST_COMMANDS]
        + ["thing.help() lists everything."]
    )
    try:
        if not plain and _start_ipython(namespace, banner):
            return 0
        import code

        code.interact(banner=banner, local=namespace, exitmsg="")
        return 0
    finally:
        server.close()


def _start_ipython(namespace: dict[str, Any], banner: str) -> bool:
    """Run an IPython shell on ``namespace``; False when IPython is not installed."""
    try:
        from IPython import start_ipython
    except ImportError:
        return False
    print(banner, flush=True)
    start_ipython(argv=["--no-banner"], user_ns=namespace)
    return True


def run_demo(steps: int = 100, use_torch: bool | None = None, timeout: float = 120.0) -> int:
    """``thing demo``: serve here, train in another process (``thing/demo.py``), show what came."""
    from . import repl

    if use_torch is None:
        use_torch = importlib.util.find_spec("torch") is not None
    was_serving = repl._server is not None and repl._server.running
    server = repl.serve(port=0)  # a free port, unless a server already runs here
    try:
        print(f"thing demo: training a small {'torch' if use_torch else 'numpy'} model for "
              f"{steps} steps in another process, sending to port {server.port}...", flush=True)
        host = "127.0.0.1" if server.host in ("", "0.0.0.0", "::") else server.host
        status = _train_elsewhere(host, server.port, steps, use_torch, timeout)
        if status != 0:
            return status
        print("\n>>> thing.summary()", flush=True)
        repl.summary()
        for name in ("model.hidden.weight", "activations"):
            print(f"\n>>> thing.describe({name!r})", flush=True)
            repl.describe(name)
        print("\nNext: run `thing serve` here, call thing.catch(...) in your own training "
              "script, then try thing.get('loss'), thing.ingest_all() and thing.help().")
        return 0
    finally:
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
    process = subprocess.Popen(command, env=env, cwd=package_parent)
    try:
        status = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        print(f"thing demo: the training process did not finish within {timeout:.0f} s",
              file=sys.stderr)
        return 1
    if status != 0:
        print(f"thing demo: the training process failed (exit status {status})", file=sys.stderr)
    return status
