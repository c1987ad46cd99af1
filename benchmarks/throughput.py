"""Throughput of thing on each path against raw sockets, memcpy and pickle, process to process.

    python benchmarks/throughput.py                  # 1 MiB, 16 MiB, 256 MiB, every row
    python benchmarks/throughput.py --quick          # fewer bytes per trial, fewer trials
    python benchmarks/throughput.py --no-extra       # only the rows the targets are about
    python benchmarks/throughput.py --sizes 1M,16M,256M,1G --paths tcp,unix,shm,raw-tcp,raw-unix
    python benchmarks/throughput.py --sizes 4M,64M --trials 5 --no-rss

Every method moves float32 arrays from one process into a usable array in
another and is timed from its first send to the receiver's acknowledgement of
the last array (``--paths`` picks the methods by key):

- ``raw-tcp-fresh`` and ``raw-unix-fresh``: ``sendall(memoryview)`` /
  ``recv_into`` a new ``np.empty`` per message, which the receiver keeps until
  the next trial, over TCP loopback or a Unix socket in a private temporary
  directory: a receiver that hands out every array and keeps them, as thing's
  server does. The targets are measured against these.
- ``raw-tcp`` and ``raw-unix``: the same into one buffer preallocated once per
  size and reused warm for every message: the flattering floor, for context.
- ``memcpy`` and ``memcpy-fresh``: no second process, for scale: ``np.copyto``
  into a destination allocated and touched once per size, and into a new
  ``np.empty`` per array. Where the fresh destination comes from is numpy's and
  glibc's business: below 32 MiB freed heap memory is reused, above it every
  array is new pages from the kernel, and first touch of those (page faults,
  zeroing) is the dominant cost on some machines (VMs especially).
- ``pickle``: ``pickle.dumps(array, protocol=5, buffer_callback=...)`` over
  ``multiprocessing.connection`` on TCP loopback, the array's bytes out of
  band: ``send_bytes`` of the pickle and of the buffer, received with
  ``recv_bytes`` and ``recv_bytes_into`` a fresh ``bytearray`` that
  ``pickle.loads(..., buffers=...)`` builds the array on.
- ``tcp``, ``unix``, ``shm``: ``client.catch(array, name=..., block=True)`` N times,
  then ``handle.wait()`` on the last; a ``thing.Server(port=0)`` in the other
  process, keeping its history as a user's does, acknowledges each array once
  it is received and stored, so the receive into the server's array is inside
  the timing. Before each trial it drops what it kept and returns its spare
  receive memory, so every trial receives into memory it has not touched
  (cold, like the fresh raw receivers, which drop theirs too).
  ``THING_TRANSPORT`` forces the path: TCP loopback, the server's Unix socket,
  or shared memory (with ``THING_SHM_THRESHOLD=1``, so every array takes it).
- ``tcp-py`` (extra): thing over TCP with the pure-Python twin (``THING_PUREPYTHON=1``).

Each (method, size) repeats enough arrays to move ``--trial-bytes`` per trial
(at least two arrays, so that sending one while the other is received counts);
trials of all methods are interleaved (round robin, rotating order) so that
drifting load on a shared machine hits them alike. Where the methods' processes
would not fit in memory together at a size (1 GiB arrays, say), the size runs
in groups of methods, those the targets compare first. The table shows the best
trial (the least disturbed; the ratios use it), the median trial, and the CPU
time the method's processes used per GB. After each size every server checks
that the last array it holds is bit-exact what was sent, that none went
missing, and frees it.

Then, unless ``--no-rss``, each thing path's server memory: for every size a
fresh server and client, one tiny capture to warm both up, the server's peak
RSS reset (``/proc/<pid>/clear_refs``), one capture of that size, and the growth
of the server's peak RSS (``VmHWM``) divided by the payload: once the capture is
stored, and again after the server read a byte of every page of it (an array
backed by a shared-memory mapping costs the server memory only once it is read).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Client as MpClient
from multiprocessing.connection import Listener as MpListener
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import numpy as np  # noqa: E402
from _common import Child, child_env, matches_pattern, pattern, start_thing_server  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
RUN = struct.Struct("<QQ")  # array bytes, arrays in this run
TIMEOUT = 120.0
MEMORY_SHARE = 0.75  # of the memory available at the start of a size, for the methods' processes
TARGET_RSS = 1.05  # server's peak RSS growth per payload byte


@dataclass(frozen=True)
class MethodSpec:
    label: str
    server: str | None  # server role; "thing" for a thing server; None: no second process
    client: str  # client role
    env: dict[str, str] = field(default_factory=dict)  # of both processes
    extra: bool = False  # left out by --no-extra
    # Bytes its processes may hold at once per payload byte: the sender's array, the
    # receiver's stored array and what is in flight. Decides which methods run together.
    footprint: float = 2.0

    @property
    def keeps(self) -> bool:
        """Whether its receiver keeps every array of a trial (until the next), as thing does."""
        return self.server is not None and (self.server == "thing" or
                                            self.server.endswith("-fresh"))


THING = {"THING_PUREPYTHON": "0"}
METHODS = {  # in the order of the table
    "raw-tcp": MethodSpec("raw socket (TCP)", "raw-tcp", "raw"),
    "raw-tcp-fresh": MethodSpec("raw TCP, fresh buffer", "raw-tcp-fresh", "raw", footprint=3),
    "raw-unix": MethodSpec("raw socket (Unix)", "raw-unix", "raw"),
    "raw-unix-fresh": MethodSpec("raw Unix, fresh buffer", "raw-unix-fresh", "raw", footprint=3),
    "memcpy": MethodSpec("memcpy, warm destination", None, "memcpy"),
    "memcpy-fresh": MethodSpec("memcpy, fresh destination", None, "memcpy-fresh"),
    "pickle": MethodSpec("pickle p5 (mp.connection)", "pickle", "pickle", footprint=5),
    "tcp": MethodSpec("thing TCP, compiled", "thing", "thing",
                      {**THING, "THING_TRANSPORT": "tcp"}, footprint=3),
    "tcp-py": MethodSpec("thing TCP, pure Python", "thing", "thing",
                         {"THING_PUREPYTHON": "1", "THING_TRANSPORT": "tcp"}, extra=True,
                         footprint=3),
    "unix": MethodSpec("thing Unix socket", "thing", "thing",
                       {**THING, "THING_TRANSPORT": "unix"}, footprint=3),
    "shm": MethodSpec("thing shared memory", "thing", "thing",
                      {**THING, "THING_TRANSPORT": "shm", "THING_SHM_THRESHOLD": "1"},
                      footprint=4),
}
# When a size must run in groups, the methods the targets compare come first, to share one.
GROUPING_ORDER = ("raw-tcp-fresh", "tcp", "raw-unix-fresh", "unix", "raw-tcp", "raw-unix",
                  "shm", "memcpy", "memcpy-fresh", "pickle", "tcp-py")


@dataclass(frozen=True)
class Ratio:
    mine: str
    baseline: str
    target: float | None = None  # the least ratio the issues ask for; None: for context
    from_size: int = 0  # the target holds from this size up


RATIOS = (
    # Against receivers that, like thing's server, put every array in new memory and keep it.
    Ratio("tcp", "raw-tcp-fresh", 0.95, 16 * MiB),
    Ratio("unix", "raw-unix-fresh", 0.9, 16 * MiB),
    # Against the flattering baseline: one warm buffer reused for every message.
    Ratio("tcp", "raw-tcp"),
    Ratio("unix", "raw-unix"),
    Ratio("tcp", "pickle", 2.0),
    Ratio("tcp-py", "raw-tcp"),
    Ratio("shm", "raw-tcp", 3.0, 256 * MiB),
    Ratio("unix", "tcp", 1.0),  # the issue asks it of small arrays; shown at every size
    Ratio("shm", "tcp", 1.0),
    Ratio("shm", "memcpy-fresh"),
    Ratio("shm", "memcpy"),
)


# -- servers (child processes) ------------------------------------------------------

class Tally:
    """What a baseline server received: arrays per size and the last array of each size."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.last: dict[int, np.ndarray] = {}
        self.kept: list[np.ndarray] = []  # a fresh receiver's arrays, kept as thing keeps history
        self.error: str | None = None

    def answer_commands(self) -> None:
        """``verify <nbytes>`` and ``clear`` on stdin, a JSON answer each, until stdin closes."""
        for line in sys.stdin:
            words = line.split()
            if words[:1] == ["verify"]:
                answer = self.verify(int(words[1]))
            elif words[:1] == ["clear"]:
                self.last.clear()
                self.kept.clear()
                answer = {}
            elif words[:1] == ["forget"]:  # before a trial: drop what the last one kept
                self.kept.clear()
                answer = {}
            else:
                answer = {"error": f"unknown command {line.strip()!r}"}
            print(json.dumps(answer), flush=True)

    def verify(self, nbytes: int) -> dict:
        last = self.last.get(nbytes)
        answer = {"received": self.counts.get(nbytes, 0),
                  "ok": last is not None and matches_pattern(last, nbytes // 4)}
        if self.error:
            answer["error"] = self.error
        return answer

    def record(self, array: np.ndarray, count: int) -> None:
        self.last[array.nbytes] = array
        self.counts[array.nbytes] = self.counts.get(array.nbytes, 0) + count


@contextlib.contextmanager
def listening(family: str) -> Iterator[tuple[socket.socket, str]]:
    """A listening socket and its address: a port on TCP loopback, or a path in a private dir."""
    if family == "tcp":
        with socket.create_server(("127.0.0.1", 0)) as listener:
            yield listener, str(listener.getsockname()[1])
        return
    with tempfile.TemporaryDirectory(prefix="thing-bench-") as private:  # mode 0700
        path = str(Path(private, "raw.sock"))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen()
            yield listener, path


def serve_raw(family: str, fresh: bool) -> None:
    tally = Tally()

    def receive(listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
            if family == "tcp":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = bytearray(RUN.size)
            while _recv_exact(sock, memoryview(head)):
                nbytes, count = RUN.unpack(head)
                buffer = tally.last.get(nbytes)
                for _ in range(count):
                    if buffer is None or fresh:
                        buffer = np.empty(nbytes // 4, np.float32)
                    if not _recv_exact(sock, memoryview(buffer).cast("B")):
                        raise ConnectionError("client closed mid-run")
                    if fresh:
                        tally.kept.append(buffer)
                tally.record(buffer, count)
                sock.sendall(b"k")
        except Exception as exc:  # reported by verify
            tally.error = repr(exc)

    with listening(family) as (listener, address):
        print(f"ADDRESS {address}", flush=True)
        threading.Thread(target=receive, args=(listener,), daemon=True).start()
        tally.answer_commands()


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False on a clean EOF before the first byte."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError("short read")
        got += n
    return True


def serve_pickle() -> None:
    tally = Tally()
    listener = MpListener(("127.0.0.1", 0))
    print(f"ADDRESS {listener.address[1]}", flush=True)

    def receive() -> None:
        try:
            conn = listener.accept()
            while True:
                try:
                    nbytes, count = RUN.unpack(conn.recv_bytes())
                except EOFError:
                    return
                for _ in range(count):
                    # Protocol 5 out of band: the array's bytes come apart from the pickle,
                    # received into a fresh buffer that the unpickled array then uses.
                    header = conn.recv_bytes()
                    data = bytearray(nbytes)
                    conn.recv_bytes_into(data)
                    array = pickle.loads(header, buffers=[data])
                    if not isinstance(array, np.ndarray) or array.nbytes != nbytes:
                        raise ValueError(f"received {type(array)} of {array.nbytes} bytes")
                tally.record(array, count)
                conn.send_bytes(b"k")
        except Exception as exc:  # reported by verify
            tally.error = repr(exc)

    threading.Thread(target=receive, daemon=True).start()
    tally.answer_commands()


# -- clients (child processes) ------------------------------------------------------

class Sender:
    """A client's way of moving ``count`` copies of an array; ``run`` answers with the time."""

    def run(self, array: np.ndarray, count: int) -> dict:
        raise NotImplementedError

    def clear(self) -> None:
        """Free what the last size needed."""


def client_loop(sender: Sender) -> None:
    """``run <nbytes> <count>`` -> ``{"seconds": s, ...}``, ``clear`` -> ``{}``, until EOF.

    Holds the array of one size at a time, so that a run over many sizes needs
    memory for the largest only.
    """
    array: np.ndarray | None = None
    for line in sys.stdin:
        words = line.split()
        if words[0] == "clear":
            array = None
            sender.clear()
            answer = {}
        else:
            nbytes, count = int(words[1]), int(words[2])
            if array is None or array.nbytes != nbytes:
                array = None  # free the last size before making the next
                array = pattern(nbytes // 4)
            answer = sender.run(array, count)
        print(json.dumps(answer), flush=True)


def connect(address: str) -> socket.socket:
    """A blocking socket to a port on TCP loopback, or to a Unix socket's path."""
    if address.isdigit():
        sock = socket.create_connection(("127.0.0.1", int(address)), timeout=TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT)
    sock.connect(address)
    return sock


class RawSender(Sender):
    def __init__(self, address: str):
        self.sock = connect(address)
        self.ack = bytearray(1)

    def run(self, array: np.ndarray, count: int) -> dict:
        view = memoryview(array).cast("B")
        start = time.perf_counter()
        self.sock.sendall(RUN.pack(array.nbytes, count))
        for _ in range(count):
            self.sock.sendall(view)
        if not _recv_exact(self.sock, memoryview(self.ack)):
            raise ConnectionError("server closed")
        return {"seconds": time.perf_counter() - start}


class PickleSender(Sender):
    def __init__(self, address: str):
        self.conn = MpClient(("127.0.0.1", int(address)))

    def run(self, array: np.ndarray, count: int) -> dict:
        start = time.perf_counter()
        self.conn.send_bytes(RUN.pack(array.nbytes, count))
        for _ in range(count):
            buffers: list[pickle.PickleBuffer] = []
            self.conn.send_bytes(pickle.dumps(array, protocol=5, buffer_callback=buffers.append))
            (data,) = buffers
            self.conn.send_bytes(data.raw())
        if not self.conn.poll(TIMEOUT) or self.conn.recv_bytes() != b"k":
            raise ConnectionError("no acknowledgement")
        return {"seconds": time.perf_counter() - start}


class MemcpySender(Sender):
    def __init__(self, fresh: bool):
        self.fresh = fresh
        self.target: np.ndarray | None = None

    def run(self, array: np.ndarray, count: int) -> dict:
        if not self.fresh and (self.target is None or self.target.nbytes != array.nbytes):
            self.target = None
            self.target = array.copy()  # allocated and touched before the clock starts
        start = time.perf_counter()
        for _ in range(count):
            np.copyto(np.empty_like(array) if self.fresh else self.target, array)
        return {"seconds": time.perf_counter() - start}

    def clear(self) -> None:
        self.target = None


class ThingSender(Sender):
    def __init__(self, address: str):
        import thing

        self.thing = thing
        self.client = thing.Client("127.0.0.1", int(address))
        if not self.client.catch(np.zeros(4, np.float32), name="warmup").wait(TIMEOUT):
            raise SystemExit("thing client: the warm-up capture was not stored")

    def run(self, array: np.ndarray, count: int) -> dict:
        name = f"x{array.nbytes}"
        start = time.perf_counter()
        handles = [self.client.catch(array, name=name, block=True) for _ in range(count)]
        stored = handles[-1].wait(TIMEOUT)
        seconds = time.perf_counter() - start
        lost = sum(not handle.wait(TIMEOUT) for handle in handles)
        return {"seconds": seconds, "lost": lost + (not stored), "backend": self.thing.BACKEND,
                "transport": self.client.transport()}


CLIENTS = {
    "raw": RawSender,
    "pickle": PickleSender,
    "thing": ThingSender,
    "memcpy": lambda _: MemcpySender(fresh=False),
    "memcpy-fresh": lambda _: MemcpySender(fresh=True),
}
SERVERS = {
    "raw-tcp": lambda: serve_raw("tcp", fresh=False),
    "raw-tcp-fresh": lambda: serve_raw("tcp", fresh=True),
    "raw-unix": lambda: serve_raw("unix", fresh=False),
    "raw-unix-fresh": lambda: serve_raw("unix", fresh=True),
    "pickle": serve_pickle,
}


# -- the parent ---------------------------------------------------------------------

class Method:
    """One method's client process and, but for memcpy, its server process."""

    def __init__(self, key: str):
        self.key = key
        self.spec = METHODS[key]
        here = str(Path(__file__).resolve())
        env = child_env(**self.spec.env)
        self.server: Child | None = None
        address = []
        if self.spec.server == "thing":
            self.server, port = start_thing_server(history=True, **self.spec.env)
            address = ["--address", str(port)]
        elif self.spec.server:
            self.server = Child([here, "--role", "server-" + self.spec.server], env)
            address = ["--address", self.server.readline().split(maxsplit=1)[1]]
        self.client = Child([here, "--role", "client-" + self.spec.client, *address], env)
        self.sent: dict[int, int] = {}
        self.rates: dict[int, list[float]] = {}  # MB/s of each timed trial
        self.cpu: dict[int, list[float]] = {}  # CPU seconds (its processes) per GB moved
        self.lost = 0
        self.backend: str | None = None
        self.transport: str | None = None

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def is_thing(self) -> bool:
        return self.spec.server == "thing"

    def run(self, nbytes: int, count: int, timed: bool = True) -> None:
        if self.spec.keeps:
            # What the last trial kept goes, memory and all: every trial receives into
            # memory it has not used before, as a server keeping its history does.
            self.server.ask("forget")
        before = self.cpu_seconds()
        answer = self.client.ask(f"run {nbytes} {count}")
        used = self.cpu_seconds()
        self.sent[nbytes] = self.sent.get(nbytes, 0) + count
        self.lost += answer.get("lost", 0)
        self.backend = answer.get("backend", self.backend)
        self.transport = answer.get("transport", self.transport)
        if timed:
            self.rates.setdefault(nbytes, []).append(nbytes * count / answer["seconds"] / 1e6)
            self.cpu.setdefault(nbytes, []).append((used - before) / (nbytes * count / 1e9))

    def cpu_seconds(self) -> float:
        children = [self.client] + ([self.server] if self.server else [])
        return sum(_common.cpu_seconds(child.proc.pid) for child in children)

    def rate(self, nbytes: int, best: bool = True) -> float:
        """MB/s of the best (or the median) trial."""
        rates = self.rates[nbytes]
        return max(rates) if best else _common.median(rates)

    def finish(self, nbytes: int) -> list[str]:
        """Check the arrays of this size arrived (problems found; none when all is well), then
        free them on both sides."""
        problems = self._check(nbytes)
        if self.server:
            self.server.ask("clear")
        self.client.ask("clear")
        return problems

    def _check(self, nbytes: int) -> list[str]:
        if self.server is None:
            return []
        problems = [f"{self.lost} captures not acknowledged"] if self.lost else []
        if self.is_thing:
            received = self.server.ask("count")["received"]
            if received != sum(self.sent.values()) + 1:  # + the client's warm-up capture
                problems.append(f"server received {received}, sent {sum(self.sent.values()) + 1}")
            answer = self.server.ask(f"verify x{nbytes} {nbytes // 4}")
            if not answer["ok"]:
                problems.append(f"{human(nbytes)}: {answer}")
            return problems
        answer = self.server.ask(f"verify {nbytes}")
        if "error" in answer:
            problems.append(answer.pop("error"))
        if answer["received"] != self.sent.get(nbytes) or not answer["ok"]:
            problems.append(f"{human(nbytes)}: sent {self.sent.get(nbytes)}, "
                            f"server says {answer}")
        return problems

    def close(self) -> None:
        self.client.close()
        if self.server:
            self.server.close()


def arrays_per_trial(nbytes: int, trial_bytes: int) -> int:
    return max(2, trial_bytes // nbytes)


def plan_groups(keys: list[str], nbytes: int, trial_bytes: int) -> list[list[str]]:
    """The methods in groups whose processes fit in memory together at this size."""
    budget = MEMORY_SHARE * _common.memory_available()
    groups: list[list[str]] = [[]]
    used = 0.0
    for key in sorted(keys, key=GROUPING_ORDER.index):
        spec = METHODS[key]
        need = spec.footprint * nbytes + (max(trial_bytes, 2 * nbytes) if spec.keeps else 0)
        if groups[-1] and used + need > budget:
            groups.append([])
            used = 0.0
        groups[-1].append(key)
        used += need
    return groups


def measure_throughput(methods: list[Method], sizes: list[int], trials: int,
                       trial_bytes: int) -> tuple[dict[int, list[list[str]]], dict[str, list[str]]]:
    """Run every method's trials at every size; return the groups run and the problems found."""
    by_key = {method.key: method for method in methods}
    groups_by_size: dict[int, list[list[str]]] = {}
    problems: dict[str, list[str]] = {key: [] for key in by_key}
    for nbytes in sizes:
        count = arrays_per_trial(nbytes, trial_bytes)
        groups_by_size[nbytes] = plan_groups(list(by_key), nbytes, trial_bytes)
        for group in groups_by_size[nbytes]:
            members = [by_key[key] for key in group]
            for method in members:  # warm-up: connections, allocators, receive buffers
                method.run(nbytes, min(count, 4), timed=False)
            for trial in range(trials):
                shift = trial % len(members)
                for method in members[shift:] + members[:shift]:
                    method.run(nbytes, count)
            for method in members:
                problems[method.key] += method.finish(nbytes)
    return groups_by_size, problems


@dataclass(frozen=True)
class PeakRss:
    """A thing server's peak RSS growth for one capture, per payload byte."""

    stored: float  # once the capture is stored and acknowledged
    read: float  # after the server read a byte of every page of it
    reset: bool  # False: the peak could not be reset first, so these are upper bounds
    ok: bool  # the capture arrived bit-exact
    transport: str | None


def measure_server_rss(key: str, nbytes: int) -> PeakRss:
    """One capture of ``nbytes`` into a fresh thing server (see the module docstring)."""
    method = Method(key)
    try:
        method.run(4, 1, timed=False)  # the path set up and used once, on both sides
        method.server.ask("touch x4")  # and the server's code for reading a capture
        pid = method.server.proc.pid
        reset = _common.reset_peak_rss(pid)
        before = _common.memory_status(pid)["VmRSS"]  # the peak too, after a reset
        method.run(nbytes, 1, timed=False)
        stored = _common.memory_status(pid)["VmHWM"]
        method.server.ask(f"touch x{nbytes}")
        read = _common.memory_status(pid)["VmHWM"]
        ok = method.server.ask(f"verify x{nbytes} {nbytes // 4}")["ok"] and not method.lost
    finally:
        method.close()
    return PeakRss((stored - before) / nbytes, (read - before) / nbytes, reset, ok,
                   method.transport)


# -- the report ---------------------------------------------------------------------

def print_throughput(methods: list[Method], sizes: list[int], trial_bytes: int) -> None:
    width = max(len(method.label) for method in methods)
    print(f"{'size':>8}  {'method':<{width}}  {'best MB/s':>10}  {'median MB/s':>11}  "
          f"{'CPU s/GB':>8}  {'arrays/trial':>12}")
    for nbytes in sizes:
        for index, method in enumerate(methods):
            size_text = human(nbytes) if index == 0 else ""
            print(f"{size_text:>8}  {method.label:<{width}}  {method.rate(nbytes):>10.0f}"
                  f"  {method.rate(nbytes, best=False):>11.0f}"
                  f"  {_common.median(method.cpu[nbytes]):>8.2f}"
                  f"  {arrays_per_trial(nbytes, trial_bytes):>12}")
    print("(CPU s/GB: user+system CPU seconds of the method's processes per 10^9 bytes, median\n"
          " trial; less sensitive than MB/s to other load on a shared machine.)")


def print_groups(groups_by_size: dict[int, list[list[str]]]) -> None:
    for nbytes, groups in groups_by_size.items():
        if len(groups) > 1:
            print(f"({human(nbytes)} ran in {len(groups)} groups to fit in memory: "
                  f"{'; '.join(', '.join(group) for group in groups)}; trials interleave "
                  "within a group only.)")


def print_ratios(by_key: dict[str, Method], sizes: list[int]) -> None:
    ratios = [ratio for ratio in RATIOS if ratio.mine in by_key and ratio.baseline in by_key]
    if not ratios:
        return
    names = [f"{METHODS[ratio.mine].label} / {METHODS[ratio.baseline].label}" for ratio in ratios]
    width = max(map(len, names))
    print("Ratios of best trials (ok or MISS where a target applies at that size):")
    print(f"  {'':<{width}}" + "".join(f"{human(nbytes):>8}     " for nbytes in sizes) + "  target")
    for name, ratio in zip(names, ratios):
        cells = ""
        for nbytes in sizes:
            value = by_key[ratio.mine].rate(nbytes) / by_key[ratio.baseline].rate(nbytes)
            mark = ""
            if ratio.target is not None and nbytes >= ratio.from_size:
                mark = "ok" if value >= ratio.target else "MISS"
            cells += f"{value:8.2f} {mark:<4}"
        target = ""
        if ratio.target is not None:
            target = f">= {ratio.target:g}" + (f" from {human(ratio.from_size)}"
                                              if ratio.from_size else "")
        print(f"  {name:<{width}}{cells}  {target}")


def print_rss(results: dict[tuple[str, int], PeakRss]) -> bool:
    """Print the server memory table; True if a capture went wrong."""
    width = max(len(METHODS[key].label) for key, _ in results)
    print(f"Server peak RSS growth for one capture, / payload bytes (a fresh server per path and "
          f"size); target <= {TARGET_RSS:g} once read:")
    print(f"{'size':>8}  {'path':<{width}}  {'stored':>7}  {'read':>7}")
    failed = False
    for (key, nbytes), rss in sorted(results.items(), key=lambda item: item[0][1]):
        notes = ["ok" if rss.read <= TARGET_RSS else "MISS"]
        if not rss.reset:
            notes.append("(peak not reset first: upper bounds)")
        wanted = METHODS[key].env["THING_TRANSPORT"]
        if rss.transport != wanted:
            notes.append(f"(ran over {rss.transport})")
        if not rss.ok:
            failed = True
            notes.append("CAPTURE LOST OR NOT BIT-EXACT")
        print(f"{human(nbytes):>8}  {METHODS[key].label:<{width}}  {rss.stored:>7.3f}"
              f"  {rss.read:>7.3f}  {' '.join(notes)}")
    return failed


def print_checks(methods: list[Method], problems: dict[str, list[str]]) -> bool:
    """Print what went wrong or was unexpected; True if an array went missing or arrived wrong."""
    failed = False
    for method in methods:
        if problems[method.key]:
            failed = True
            print(f"VERIFY FAILED for {method.label}: {'; '.join(problems[method.key])}")
        if not method.is_thing:
            continue
        wanted_backend = "python" if method.spec.env["THING_PUREPYTHON"] == "1" else "compiled"
        wanted_transport = method.spec.env["THING_TRANSPORT"]
        if method.backend != wanted_backend:
            failed = True
            print(f"WARNING: {method.label!r} ran on the {method.backend} core")
        if method.transport != wanted_transport:
            print(f"NOTE: {method.label!r} ran over {method.transport}, not {wanted_transport}")
    if not failed:
        print("Verified: every server received every array, and the last of each size bit-exact.")
    return failed


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    nbytes = int(float(number) * scale)
    if nbytes <= 0 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return nbytes


def parse_paths(text: str) -> list[str]:
    chosen = {key.strip() for key in text.split(",") if key.strip()}
    unknown = chosen - METHODS.keys()
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(sorted(unknown))}; "
                                         f"choose from {', '.join(METHODS)}")
    return [key for key in METHODS if key in chosen]


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1M,16M,256M",
                        help="comma-separated sizes, K/M/G suffixes (default 1M,16M,256M)")
    parser.add_argument("--paths", type=parse_paths,
                        help=f"comma-separated methods to run, of {', '.join(METHODS)} "
                             "(default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="256 MiB per trial and 2 trials instead of 1 GiB and 3 (a smoke run)")
    parser.add_argument("--trials", type=int, help="timed trials per method and size")
    parser.add_argument("--trial-bytes", type=parse_size, help="bytes moved per trial (default 1G)")
    parser.add_argument("--no-extra", action="store_true",
                        help="without --paths: leave out the extra rows (raw-tcp-fresh, tcp-py)")
    parser.add_argument("--no-rss", dest="rss", action="store_false",
                        help="skip measuring the thing servers' peak RSS per capture")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.role:
        kind, _, name = args.role.partition("-")
        if kind == "server":
            SERVERS[name]()
        else:
            client_loop(CLIENTS[name](args.address))
        return 0

    sizes = [parse_size(size) for size in args.sizes.split(",")]
    trials = args.trials or (2 if args.quick else 3)
    trial_bytes = args.trial_bytes or (256 * MiB if args.quick else GiB)
    keys = args.paths or [key for key, spec in METHODS.items()
                          if not (spec.extra and args.no_extra)]

    _common.print_machine("thing throughput benchmark: client process -> server process, "
                          "on one machine")
    print(f"{trials} timed trials per method and size, each moving about {human(trial_bytes)} "
          "(at least 2 arrays; after one untimed warm-up run); trials interleaved across methods.")
    print("MB/s = 10^6 bytes per second, from the first send to the acknowledgement of the last "
          "array.\n")

    started = time.perf_counter()
    methods = [Method(key) for key in keys]
    try:
        groups_by_size, problems = measure_throughput(methods, sizes, trials, trial_bytes)
    finally:
        for method in methods:
            method.close()
    print_throughput(methods, sizes, trial_bytes)
    print_groups(groups_by_size)
    print()
    print_ratios({method.key: method for method in methods}, sizes)
    print()
    failed = print_checks(methods, problems)
    thing_keys = [method.key for method in methods if method.is_thing]
    if args.rss and thing_keys:
        print()
        results = {(key, nbytes): measure_server_rss(key, nbytes)
                   for key in thing_keys for nbytes in sizes}
        failed |= print_rss(results)
    print(f"Total time {time.perf_counter() - started:.0f} s.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
