"""The ``thing`` command (also ``python -m thing``).

``thing serve [--host H] [--port P]`` opens an interactive session (IPython
when it is installed, else Python's own REPL) with the server already running
and ``thing`` imported. ``thing demo`` runs the end-to-end demo.
"""

from __future__ import annotations

import argparse
import sys
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
        from . import demo as demo_module

        return demo_module.run(args.steps, use_torch=False if args.numpy else None)
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
