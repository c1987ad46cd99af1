"""Shared fixtures: real servers on ephemeral ports, real client processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import thing
import thing.channel
import thing.receiver
import thing.stream
import thing.wire
from thing._core import fallback

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["compiled", "python"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once with the compiled core and once with its pure-Python twin.

    In this process the byte movers are swapped in place; subprocesses started
    with :func:`run_script` get ``THING_PUREPYTHON`` accordingly.
    """
    if request.param == "python":
        for module in (thing.channel, thing.receiver, thing.stream, thing.wire):
            for name in ("send_buffers", "send_snapshots", "recv_buffers", "recv_some",
                         "split_small_frames", "split_stored_acks", "wake"):
                if hasattr(module, name):
                    monkeypatch.setattr(module, name, getattr(fallback, name))
        monkeypatch.setenv("THING_PUREPYTHON", "1")
    else:
        monkeypatch.delenv("THING_PUREPYTHON", raising=False)
    return request.param


@pytest.fixture
def server() -> Iterator[thing.Server]:
    """A server on a free loopback port, in this process."""
    with thing.Server(port=0) as running:
        yield running


def script_env(port: int | None = None, **extra: str) -> dict[str, str]:
    """The environment for a subprocess that imports this checkout's thing."""
    env = dict(os.environ)
    # Each script is a job of its own, as from a shell: not of the run pytest named.
    env.pop("THING_RUN_ID", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if port is not None:
        env["THING_PORT"] = str(port)
        env["THING_SERVER"] = "127.0.0.1"
    env.update(extra)
    return env


def run_script(
    code: str, port: int | None = None, timeout: float = 60, full: bool = False, **env: str
) -> Any:
    """Run ``code`` in a fresh interpreter; fail the test on a non-zero exit.

    Returns its stdout, or the whole ``CompletedProcess`` with ``full=True``.
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=script_env(port, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"script failed ({result.returncode}):\n{result.stderr}"
    return result if full else result.stdout


def start_script(
    code: str, port: int | None = None, stdin: bool = False, **env: str
) -> subprocess.Popen:
    """Start ``code`` in a fresh interpreter and return at once.

    ``stdin=True`` gives it a pipe on which the test can say "go on".
    """
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=script_env(port, **env),
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def poll(condition: Callable[[], Any], timeout: float = 15, what: str = "condition") -> Any:
    """Wait until ``condition()`` is truthy and return it; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def rss(pid: int) -> int:
    """A process's resident set size now, in bytes (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def open_fds() -> int:
    """File descriptors this process holds."""
    return len(os.listdir("/proc/self/fd"))


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def expect_line(process: subprocess.Popen, prefix: str) -> str:
    """The script's next line of output, which must start with ``prefix``."""
    assert process.stdout is not None
    line = process.stdout.readline()  # every script prints within seconds or dies
    if not line.startswith(prefix):
        process.kill()
        raise AssertionError(f"expected {prefix!r}, got {line!r}:\n{process.communicate()[1]}")
    return line


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    """Subprocesses a test starts; whatever is still running at the end is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.communicate()
