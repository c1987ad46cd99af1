"""Project-wide rules: import weight, lint, no pickle or eval in the library."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT, run_script


def test_import_thing_imports_no_heavy_modules() -> None:
    out = run_script(
        """
        import sys, thing
        heavy = ("torch", "jax", "rich", "IPython", "ml_dtypes")
        print(" ".join(m for m in heavy if m in sys.modules))
        print("logging" in sys.modules)  # 3 ms, half of `import thing`: made on first use
        """
    )
    assert out.splitlines() == ["", "False"]


def test_a_training_job_loads_only_the_sending_side(server) -> None:
    out = run_script(
        """
        import sys, thing
        imported = sorted(m for m in sys.modules if m.startswith("thing"))
        assert thing.catch(1.5, name="x").wait(10)
        sent = sorted(m for m in sys.modules if m.startswith("thing"))
        print(" ".join(imported)); print(" ".join(sent))
        print(" ".join(m for m in ("difflib", "rich", "IPython") if m in sys.modules))
        """,
        server.port,
    )
    imported, sent, heavy = (out.splitlines() + [""])[:3]
    assert heavy == ""  # the store's name matching, the live view, IPython
    # `import thing`: the client and what its catch() needs before it opens a connection.
    assert imported.split() == ["thing", "thing._core", "thing._core._gate",
                                "thing._core._throttles", "thing._core._transport",
                                "thing.client", "thing.config", "thing.errors", "thing.handles",
                                "thing.log", "thing.names", "thing.run_names"]
    # Catching loads the sending side, never the server, the store or the REPL's.
    receiving = {"thing.server", "thing.store", "thing.captures", "thing.receiver", "thing.repl",
                 "thing.reports", "thing.display", "thing.live", "thing.ingest",
                 "thing.array_stats", "thing.buffers", "thing.plot_series", "thing.plot_drawing"}
    assert not receiving & set(sent.split()), sent
    assert "thing.channel" in sent.split()


def test_the_repl_side_loads_none_of_the_sending_side() -> None:
    """The server, the store and the recording reader never load a client's sender: what both
    sides agree on (the small-frame size, the reasons of what was not delivered) is wire's."""
    out = run_script("""
        import sys, thing.server, thing.segments, thing.recording
        print(" ".join(sorted(m for m in ("thing.channel", "thing.send_queue", "thing.dial",
                                          "thing.answers", "thing.frames", "thing.overrides")
                              if m in sys.modules)))
    """)
    assert out.strip() == ""


def test_the_sender_thread_imports_nothing(server) -> None:
    """A thread importing a module holds that module half made: a child forked meanwhile (a
    DataLoader worker) finds it so for good. The sender's first log message imported
    logging: a child forked within milliseconds of the job's first connection had its own
    logging broken, and a sender that died on it, its handles never resolved. Whatever the
    sender needs is imported by the thread that opens its channel: here it connects, sends,
    logs a capture the server refuses, loses its server and dials one that is not there."""
    out = run_script(
        """
        import sys, threading
        imported = []
        def note(event, args):
            if event == "import" and threading.current_thread().name.startswith("thing-"):
                imported.append(args[0])
        sys.addaudithook(note)
        import numpy as np, thing
        assert thing.catch(np.arange(3), name="sent").wait(10)
        header_over_the_servers_cap = {str(i): i for i in range(200_000)}
        assert not thing.catch(header_over_the_servers_cap, name="refused").wait(10)
        assert not thing.catch(1, name="elsewhere", server="127.0.0.1:9").wait(10)
        print(imported)
        """,
        server.port, THING_MAX_HEADER_BYTES="16M",  # the job's own: it sends what the server
    )                                                 # refuses
    assert out.strip() == "[]"


def test_no_module_hides_a_function_of_the_same_name() -> None:
    # Importing thing.X sets the attribute X of the package: a module named like a public
    # function (thing/stats.py once did) would replace thing.stats() once anything imported it.
    out = run_script("""
        import pkgutil, importlib, thing
        for module in pkgutil.iter_modules(thing.__path__):
            if module.name != "__main__":  # the command line itself
                importlib.import_module("thing." + module.name)
        print(sorted(name for name in thing.__all__ if type(getattr(thing, name)).__name__
                     == "module"))
    """)
    assert out.strip() == "[]"


def test_the_receiving_side_loads_on_first_use() -> None:
    out = run_script(
        """
        import sys, thing
        from thing import *
        print(serve is thing.serve, thing.Server.__name__, "thing.repl" in sys.modules)
        print(sorted(set(thing.__all__) - set(dir(thing))))
        """
    )
    assert out.splitlines() == ["True Server True", "[]"]


def test_library_never_unpickles_or_evaluates() -> None:
    pattern = re.compile(r"\bimport pickle\b|\bfrom pickle\b|\bpickle\.loads?\(|\beval\(|\bexec\(")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in (ROOT / "thing").rglob("*.py*")
        if path.suffix in (".py", ".pyx", ".pxd")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_ruff_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "thing", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
