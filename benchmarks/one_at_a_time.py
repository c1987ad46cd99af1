"""Large captures one at a time, as a training loop sends them: thing against a raw Unix socket.

    python benchmarks/one_at_a_time.py              # 16 MiB and 256 MiB, 3 trials
    python benchmarks/one_at_a_time.py --quick      # fewer captures per trial

A job catches a weight, waits for nothing, and goes on; the next capture comes
a step later. So each capture here is timed alone, from the call to the
moment the receiver holds it (``catch(x, name=...).wait()`` for thing, the
receiver's one-byte answer for the raw socket), and the figure is the median
over every capture of every trial, with the best beside it.

- ``raw-unix``: ``sendall`` of an 8-byte length and the array's memory over a
  Unix socket with the same 4 MiB socket buffers thing's Unix sockets get;
  the receiver ``recv_into`` a fresh ``np.empty`` per message, which it keeps
  (as thing's server must hand out a new array per capture and keep history),
  then answers one byte.
- ``raw-unix-huge``: the same, the fresh memory mapped and advised
  ``MADV_HUGEPAGE`` as thing's server does (first touch of fresh pages is
  most of the cost on a VM): the baseline given the same advantage.
- ``thing`` / ``thing-py``: the same-host default (Unix socket) with the
  compiled core and with its pure-Python twin, a server in another process
  keeping its history as a user's does (every capture kept, a new name each
  time, no ``max_versions``); the last capture of each trial is checked
  bit-exact.
- ``thing-busy`` / ``thing-py-busy``: the same while another thread of the
  catching process runs a pure-Python loop, as a training job's main thread
  does between its calls: the sender thread must win the GIL back to move
  each chunk, unless the core moves it without the GIL.

Trials rotate through the methods; every receiver drops what it kept between
trials, so memory stays bounded.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import numpy as np  # noqa: E402
from _common import child_env, median  # noqa: E402

SOCKET_BUFFER = 4 << 20  # what thing.sockets gives its Unix sockets

RAW_RECEIVER = """
import mmap, socket, sys, numpy as np
path, buffer, huge = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "huge"


def fresh(size):
    if not huge:
        return np.empty(size, np.uint8)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, np.uint8)


listener = socket.socket(socket.AF_UNIX)
listener.bind(path)
listener.listen()
print("ready", flush=True)
while True:
    sock, _ = listener.accept()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
    kept = []
    while True:
        head = sock.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            break
        size = int.from_bytes(head, "little")
        array = fresh(size)
        view, got = memoryview(array), 0
        while got < size:
            got += sock.recv_into(view[got:])
        kept.append(array)
        sock.sendall(bytes([int(array[-1])]))
    sock.close()
"""

THING_RECEIVER = """
import sys, zlib, thing
server = thing.Server(port=0).start()
print(server.port, flush=True)
for line in sys.stdin:
    name = line.strip()
    print(zlib.crc32(server.get(name).tobytes()), len(server.store), flush=True)
    server.clear()
"""

# Times each capture it is told to make; "busy" keeps a pure-Python loop running meanwhile.
THING_SENDER = """
import json, sys, threading, time, zlib, numpy as np, thing
client = thing.Client("127.0.0.1", int(sys.argv[1]))
assert client.catch(np.zeros(4), name="warm").wait(10)
print("ready", flush=True)
trial = 0
for line in sys.stdin:
    size, count, busy = line.split()
    array = np.random.default_rng(int(size)).integers(0, 255, int(size), dtype=np.uint8)
    stop = threading.Event()

    def spin():
        spins = 0
        while not stop.is_set():
            spins += 1

    spinner = threading.Thread(target=spin)
    if busy == "1":
        spinner.start()
    trial += 1
    seconds = []
    for i in range(int(count)):
        array[-1] = i
        name = f"w{trial}_{i}"
        started = time.perf_counter()
        handle = client.catch(array, name=name)
        assert handle.wait(120), handle.error
        seconds.append(time.perf_counter() - started)
    stop.set()
    if busy == "1":
        spinner.join()
    print(json.dumps([seconds, name, zlib.crc32(array.tobytes())]), flush=True)
client.close()
"""


class RawUnix:
    def __init__(self, huge: bool) -> None:
        self.path = os.path.join(tempfile.mkdtemp(), "raw.sock")
        self.child = subprocess.Popen(
            [sys.executable, "-c", RAW_RECEIVER, self.path, str(SOCKET_BUFFER),
             "huge" if huge else "plain"],
            stdout=subprocess.PIPE, text=True, env=child_env())
        assert self.child.stdout.readline().strip() == "ready"

    def trial(self, array: np.ndarray, count: int) -> list[float]:
        seconds = []
        with socket.socket(socket.AF_UNIX) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            sock.connect(self.path)
            head = array.nbytes.to_bytes(8, "little")
            for i in range(count):
                array[-1] = i
                started = time.perf_counter()
                sock.sendall(head)
                sock.sendall(memoryview(array).cast("B"))
                if sock.recv(1) != bytes([i % 256]):
                    raise RuntimeError("the raw receiver got something else")
                seconds.append(time.perf_counter() - started)
        return seconds

    def close(self) -> None:
        self.child.kill()
        self.child.wait()


class Thing:
    def __init__(self, busy: bool, **env: str) -> None:
        self.busy = busy
        self.server = subprocess.Popen([sys.executable, "-c", THING_RECEIVER],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       env=child_env())
        port = self.server.stdout.readline().strip()
        self.sender = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(THING_SENDER), port],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(**env))
        assert self.sender.stdout.readline().strip() == "ready"

    def trial(self, array: np.ndarray, count: int) -> list[float]:
        import json

        self.sender.stdin.write(f"{array.nbytes} {count} {int(self.busy)}\n")
        self.sender.stdin.flush()
        seconds, name, crc = json.loads(self.sender.stdout.readline())
        self.server.stdin.write(name + "\n")
        self.server.stdin.flush()
        kept_crc, kept = self.server.stdout.readline().split()
        if int(kept_crc) != crc or int(kept) < count:
            raise RuntimeError(f"thing's server kept {kept} of {count}, or not bit-exact")
        return seconds

    def close(self) -> None:
        for child in (self.sender, self.server):
            child.stdin.close()
            child.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer captures, 2 trials")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    trials = 2 if args.quick else args.trials
    sizes = {16 << 20: 8 if args.quick else 24, 256 << 20: 2 if args.quick else 4}
    _common.print_machine("large captures, one at a time")
    methods = {"raw-unix": RawUnix(huge=False), "raw-unix-huge": RawUnix(huge=True),
               "thing": Thing(False), "thing-py": Thing(False, THING_PUREPYTHON="1"),
               "thing-busy": Thing(True), "thing-py-busy": Thing(True, THING_PUREPYTHON="1")}
    print(f"\neach capture timed alone, {trials} trials; MB/s = array bytes / seconds per "
          "capture; x raw: median against each raw baseline\n")
    print(f"{'size':>8} {'method':<15}{'median MB/s':>12}{'best MB/s':>11}"
          f"{'median ms':>11}{'x raw':>8}{'x huge':>8}")
    try:
        for size, count in sizes.items():
            array = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
            times: dict[str, list[float]] = {key: [] for key in methods}
            keys = list(methods)
            for trial in range(trials):
                for key in keys[trial % len(keys):] + keys[:trial % len(keys)]:
                    times[key] += methods[key].trial(array, count)
            plain, huge = (median(times[key]) for key in ("raw-unix", "raw-unix-huge"))
            for key, seconds in times.items():
                typical, best = median(seconds), min(seconds)
                print(f"{size >> 20:>6}Mi {key:<15}{size / typical / 1e6:>12,.0f}"
                      f"{size / best / 1e6:>11,.0f}{typical * 1e3:>11.1f}"
                      f"{plain / typical:>8.2f}{huge / typical:>8.2f}")
            idle = median(times["thing-py"]) / median(times["thing"])
            busy = median(times["thing-py-busy"]) / median(times["thing-busy"])
            print(f"{'':>9}compiled core / twin: {idle:.2f}x idle, {busy:.2f}x with a busy "
                  "Python thread")
    finally:
        for method in methods.values():
            method.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
