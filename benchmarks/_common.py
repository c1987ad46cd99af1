"""Helpers shared by the benchmark scripts: the machine, child processes, a thing server.

Run as a script (``python benchmarks/_common.py thing-server``) it is the
server process the benchmarks send to: it prints ``PORT <n>`` on stdout, keeps
only the newest capture of each name, and answers these commands on stdin, one
JSON line each:

- ``count``: captures received so far;
- ``verify <name> <count>``: whether the newest capture of ``name`` is bit-exact
  ``pattern(count)``;
- ``touch <name>``: read one byte of every page of that capture, as a user of
  the array would (a mapped array costs memory only once it is read);
- ``clear``: forget every capture and spare receive buffer;
- ``request <name> <count>``: ``server.request(name, count)``, then the seconds
  from that call to the arrival of the first capture it brought.

It exits when stdin closes.
"""

from __future__ import annotations

import datetime
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # measure this checkout, not some other installed thing
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

PATTERN_BLOCK = 1 << 20  # elements


def pattern(count: int) -> np.ndarray:
    """The float32 array of ``count`` elements every benchmark sends (deterministic, not zeros).

    A block of 2**20 normal floats repeats, each repeat with its index XOR-ed into the
    low mantissa bits: a block delivered to the wrong place is caught, and a GiB is
    made in a fraction of a second rather than the seconds a random GiB takes.
    """
    array = np.empty(count, np.float32)
    bits = array.view(np.uint32)
    for start, expected in _pattern_blocks(count):
        bits[start:start + len(expected)] = expected
    return array


def matches_pattern(value: Any, count: int) -> bool:
    """True when ``value`` holds exactly the bytes of ``pattern(count)``.

    Compares bit patterns (NaN-safe), a block at a time, so checking a GiB needs no
    second GiB.
    """
    array = np.asarray(value)
    if array.dtype != np.float32 or array.shape != (count,):
        return False
    bits = array.view(np.uint32)
    return all(np.array_equal(bits[start:start + len(expected)], expected)
               for start, expected in _pattern_blocks(count))


def _pattern_blocks(count: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first element, bits as uint32) of each block of ``pattern(count)``."""
    block = np.random.default_rng(count).standard_normal(
        min(count, PATTERN_BLOCK), dtype=np.float32).view(np.uint32)
    for index, start in enumerate(range(0, count, PATTERN_BLOCK)):
        yield start, block[:min(PATTERN_BLOCK, count - start)] ^ np.uint32(index)


def machine() -> dict[str, str]:
    """What the figures were measured on."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count() or 0
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        memory_text = f"{memory:.0f} GiB"
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        memory_text = "?"
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        load = "?"
    import thing

    info = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu,
        "cores": f"{usable} usable ({os.cpu_count()} online)",
        "memory": memory_text,
        "load average": load,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "thing": f"{thing.__version__} ({thing.BACKEND} core)",
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = f"{torch.__version__} ({torch.get_num_threads()} intra-op threads)"
    return info


def print_machine(title: str) -> None:
    print(title)
    for key, value in machine().items():
        print(f"  {key:<13} {value}")
    print()


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a benchmark child: this checkout first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


class Child:
    """A Python child process spoken to line by line over its stdin and stdout."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env=env or child_env())

    def readline(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"benchmark child {self.proc.args[1:]} exited with {code}")
        return line.strip()

    def ask(self, command: str) -> Any:
        """Send one command line; return the JSON answer line."""
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.readline())

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def start_thing_server(history: bool = False, **env: str) -> tuple[Child, int]:
    """Start ``thing.Server(port=0)`` in a child process; return it and its port.

    With ``history`` its store keeps every capture, as a user's does; without, one
    version per name, so that a long run holds at most one array of each size.
    """
    child = Child([__file__, "thing-server", *(["--history"] if history else [])],
                  child_env(**env))
    line = child.readline()
    if not line.startswith("PORT "):
        raise RuntimeError(f"thing server child said {line!r}")
    return child, int(line.split()[1])


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used so far, all its threads (Linux).

    ``/proc/PID/stat`` counts in clock ticks (10 ms): 500 captures at 100 µs each
    would read as 5 ticks, give or take one. So each live thread's time is read to
    the nanosecond from its ``schedstat``, and only the threads that already ended
    are counted in ticks (what the process's ticks hold beyond its live threads').
    """
    ticks = os.sysconf("SC_CLK_TCK")
    try:
        whole = _ticks(f"/proc/{pid}/stat")
        live_ticks = live_ns = 0
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                live_ticks += _ticks(f"{task.path}/stat")
                with open(f"{task.path}/schedstat") as schedstat:
                    live_ns += int(schedstat.read().split()[0])
            except (OSError, ValueError):
                pass  # the thread ended while we looked: counted in ticks
    except OSError:
        return float("nan")
    return live_ns / 1e9 + max(whole - live_ticks, 0) / ticks


def _ticks(path: str) -> int:
    """User plus system clock ticks in a ``/proc`` ``stat`` file."""
    with open(path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def median(values: list[float]) -> float:
    return statistics.median(values)


def memory_status(pid: int) -> dict[str, int]:
    """A process's resident set now (``VmRSS``) and at its peak (``VmHWM``), in bytes (Linux)."""
    status = {}
    with open(f"/proc/{pid}/status") as lines:
        for line in lines:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                status[key] = int(value.split()[0]) * 1024  # reported in kB
    return status


def reset_peak_rss(pid: int) -> bool:
    """Set a process's peak RSS back to its current RSS; True if that worked.

    Writing 5 to ``/proc/<pid>/clear_refs`` does it (Linux 4.0 and later, for a
    process we may ptrace).
    """
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        status = memory_status(pid)
    except OSError:
        return False
    return status["VmHWM"] - status["VmRSS"] < 1 << 20  # a page or two may come and go


def memory_available() -> int:
    """Bytes the kernel could give out now without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _serve_thing(history: bool) -> None:
    import thing

    store = thing.HistoryStore(max_versions=None if history else 1)
    server = thing.Server(port=0, store=store).start()
    print(f"PORT {server.port}", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words:
            try:
                answer = _answer(server, words)
            except Exception as exc:  # report, do not crash the benchmark
                answer = {"command": words, "ok": False, "error": repr(exc)}
            print(json.dumps(answer), flush=True)
    server.close()


def _answer(server: Any, words: list[str]) -> dict[str, Any]:
    """The thing server child's answer to one command (see the module docstring)."""
    import thing

    if words[0] == "count":
        return {"received": server.received, "backend": thing.BACKEND}
    if words[0] == "verify":
        value = server.get(words[1])
        return {"name": words[1], "ok": matches_pattern(value, int(words[2])),
                "type": type(value).__name__}
    if words[0] == "touch":
        pages = np.asarray(server.get(words[1])).reshape(-1).view(np.uint8)[::mmap.PAGESIZE]
        return {"name": words[1], "pages": len(pages), "sum": int(pages.sum())}
    if words[0] == "clear":
        return {"dropped": server.clear()}
    if words[0] == "forget":  # clear, and return the spare receive memory: the next is cold
        dropped = server.clear()
        server.buffers.clear()
        return {"dropped": dropped}
    if words[0] == "request":
        name, after = words[1], server.store.received - 1
        asked = time.time()
        server.request(name, int(words[2]))
        server.store.wait(name, timeout=10, after=after)
        arrived = min(capture.received_at for capture in server.store.get_all(name, run="all")
                      if capture.id > after)
        return {"delay": arrived - asked}
    return {"error": f"unknown command {words[0]!r}"}


if __name__ == "__main__":
    if sys.argv[1:2] == ["thing-server"]:
        _serve_thing(history=sys.argv[2:] == ["--history"])
    else:
        sys.exit("usage: _common.py thing-server")
