"""Small captures per second: thing against raw sockets, one at a time, in one run.

    python benchmarks/small_captures.py             # about a minute
    python benchmarks/small_captures.py --quick     # fewer captures and trials

A training loop sends small captures (a loss, a few scalars) one call at a
time. Every method here sends N captures of 4 float32 from this process to a
receiver in another process, one send call per capture, and the clock runs
from the first send to the receiver's acknowledgement of the last. Every
receiver keeps every message, in order, and the last one is checked bit-exact.

- ``raw-unix`` / ``raw-tcp``: ``sendall`` of a message as long as thing's whole
  frame for the same capture (prefix, header, payload, trailer), received with
  ``recv_into`` a fresh ``bytearray`` per message, kept in a list; one
  acknowledgement at the end. Default socket buffers on both.
- ``thing`` (the Unix socket thing takes on one host, compiled core),
  ``thing-py`` (the same with the pure-Python twin, ``THING_PUREPYTHON=1``) and
  ``thing-tcp``: ``client.catch(x, name="s", block=True)`` N times, then
  ``wait()`` on the last; the server keeps its history as a user's does
  (every capture kept, no ``max_versions``). ``thing-torch``: ``thing`` from a
  client process that imported torch first, as a training process has: its
  objects are what every garbage collection the captures trigger walks.
- ``fan-in``: 32 client processes × 2,000 captures each (``block=True``) into
  one thing server, started together once all are connected; aggregate rate
  from that start to the last one's last acknowledgement, every capture counted.
- ``server alone``: the server's side by itself: 50,000 (``--server-frames``) ready-made frames of
  the same capture (numbered, as a client numbers them) written by a raw
  socket as fast as it takes them, the acknowledgements read by another
  thread; frames/s and the server process's CPU per frame, for a server on
  the compiled core and one on the twin.
- ``paced``: a training loop's pace instead of a flood: one capture every
  1/50 s and every 1/5,000 s, on a schedule, and the CPU it costs outside the
  caller's thread: the client process's other threads (its process CPU less
  the calling thread's) and the whole server process (``/proc/PID/stat``),
  per capture. Idle wake-ups between captures count; the Python import and
  the handshake happen before the clock starts, and do not. Beside each,
  its floor: a raw Unix socket at the same pace, each message (as long as
  thing's frame) received into a fresh ``bytearray`` by a receiver woken for
  it and answered with an acknowledgement's bytes; the sender's CPU in its
  send calls and the receiver's. Then the server's CPU while 100 connected
  clients send nothing.

Trials of the one-client methods are interleaved (round robin) so drifting
load hits them alike; the table shows the median and best trial, and each
method's median as a multiple of raw-unix's median.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from _common import child_env, cpu_seconds, median  # noqa: E402

VALUE = np.arange(4, dtype=np.float32)

RAW_RECEIVER = """
import socket, sys
family, address, size, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
answer = bytes(int(sys.argv[5]))  # if not empty, sent back for each message, as thing acks it
if family == "unix":
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
else:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
listener.listen()
print(listener.getsockname()[1] if family == "tcp" else address, flush=True)
while True:
    sock, _ = listener.accept()
    kept = []
    for _ in range(count):
        message = bytearray(size)
        view, got = memoryview(message), 0
        while got < size:
            n = sock.recv_into(view[got:])
            if not n:
                raise SystemExit("cut short")
            got += n
        kept.append(message)
        if answer:
            sock.sendall(answer)
    expected = (bytes(range(256)) * (size // 256 + 1))[:size]
    sock.sendall(b"\\x01" if len(kept) == count and kept[-1] == expected else b"\\x00")
    sock.close()
"""

THING_RECEIVER = """
import sys, thing
server = thing.Server(port=0).start()
print(server.port, flush=True)
for line in sys.stdin:
    name, count = line.split()
    history = server.store.get_all(name)
    last = history[-1].value.tobytes() if history else b""
    print(len(history), last.hex(), flush=True)
    server.clear(name)
"""

FAN_IN_CLIENT = """
import sys, time, numpy as np, thing
client = thing.Client("127.0.0.1", int(sys.argv[1]))
value = np.arange(4, dtype=np.float32)
assert client.catch(value, name="warm").wait(120)  # imported and connected
print("ready", flush=True)
sys.stdin.readline()  # go
cpu = time.process_time()
for _ in range(int(sys.argv[2])):
    handle = client.catch(value, name="fan", block=True)
assert handle.wait(120), handle.error
# The last acknowledgement (one clock for all processes), and this process's CPU for all.
print(time.monotonic(), time.process_time() - cpu, flush=True)
client.close()
"""


def frame_size() -> int:
    """Bytes thing sends for one capture of VALUE: prefix, header, payload and trailer."""
    from thing import value_trees, wire

    payload = value_trees.take_apart(VALUE)
    meta = {"site": "train.py:42 (step)", "rank": 0, "world_size": 2}
    header = wire.encode_header("s", payload, meta)
    return wire.FRAME_PREFIX.size + len(header) + VALUE.nbytes + wire.FRAME_TRAILER.size


class RawMethod:
    def __init__(self, family: str, size: int, count: int, answer: int = 0):
        self.family, self.size, self.count = family, size, count
        self.address = (os.path.join(tempfile.mkdtemp(), "raw.sock") if family == "unix"
                        else "")
        self.child = subprocess.Popen(
            [sys.executable, "-c", RAW_RECEIVER, family, self.address, str(size), str(count),
             str(answer)], stdout=subprocess.PIPE, text=True)
        where = self.child.stdout.readline().strip()
        self.target = where if family == "unix" else ("127.0.0.1", int(where))
        self.message = (bytes(range(256)) * (size // 256 + 1))[:size]

    def trial(self) -> float:
        family = socket.AF_UNIX if self.family == "unix" else socket.AF_INET
        with socket.socket(family) as sock:
            sock.connect(self.target)
            if family == socket.AF_INET:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            message = self.message
            started = time.perf_counter()
            for _ in range(self.count):
                sock.sendall(message)
            ok = sock.recv(1)
            elapsed = time.perf_counter() - started
        if ok != b"\x01":
            raise RuntimeError(f"{self.family} receiver did not get every message")
        return self.count / elapsed

    def close(self) -> None:
        self.child.kill()
        self.child.wait()


class ThingMethod:
    def __init__(self, count: int, with_torch: bool = False, **env: str):
        import thing

        self.count = count
        self.env = env
        self.child = subprocess.Popen([sys.executable, "-c", THING_RECEIVER],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env=child_env(**env))
        port = int(self.child.stdout.readline())
        # The client in this process takes the path THING_TRANSPORT says; the twin is
        # chosen at import, and torch cannot be unimported, so those clients run in a
        # child of their own.
        self.client_child = None
        if env.get("THING_PUREPYTHON") or with_torch:
            self.client_child = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(CHILD_CLIENT), str(port), str(count),
                 "torch" if with_torch else "-"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(**env))
            assert self.client_child.stdout.readline().strip() == "ready"
        else:
            os.environ["THING_TRANSPORT"] = env.get("THING_TRANSPORT", "auto")
            self.client = thing.Client("127.0.0.1", port)
            assert self.client.catch(VALUE, name="warm").wait(10)
            del os.environ["THING_TRANSPORT"]

    def trial(self) -> float:
        if self.client_child is not None:
            self.client_child.stdin.write("go\n")
            self.client_child.stdin.flush()
            rate = float(self.client_child.stdout.readline())
        else:
            started = time.perf_counter()
            for _ in range(self.count):
                handle = self.client.catch(VALUE, name="s", block=True)
            if not handle.wait(120):
                raise RuntimeError(handle.error)
            rate = self.count / (time.perf_counter() - started)
        self.child.stdin.write(f"s {self.count}\n")
        self.child.stdin.flush()
        kept, last = self.child.stdout.readline().split()
        if int(kept) != self.count or bytes.fromhex(last) != VALUE.tobytes():
            raise RuntimeError(f"thing server kept {kept} of {self.count}, or not bit-exact")
        return rate

    def close(self) -> None:
        if self.client_child is not None:
            self.client_child.stdin.close()
            self.client_child.wait()
        else:
            self.client.close()
        self.child.stdin.close()
        self.child.wait()


CHILD_CLIENT = """
import sys, time, numpy as np
if sys.argv[3] == "torch":
    import torch  # a training process's heap: what a garbage collection it triggers walks
import thing
client = thing.Client("127.0.0.1", int(sys.argv[1]))
value = np.arange(4, dtype=np.float32)
assert client.catch(value, name="warm").wait(10)
print("ready", flush=True)
for _ in sys.stdin:
    started = time.perf_counter()
    for _ in range(int(sys.argv[2])):
        handle = client.catch(value, name="s", block=True)
    assert handle.wait(120), handle.error
    print(int(sys.argv[2]) / (time.perf_counter() - started), flush=True)
client.close()
"""


def fan_in(clients: int, each: int) -> tuple[float, int, float, float]:
    """Aggregate captures/s of ``clients`` processes into one server, how many arrived, and
    the CPU per capture of the clients (all threads) and of the server, in µs.

    The clock runs from "go", once every client has imported thing and had a
    capture acknowledged, to the last acknowledgement of the last client
    (``time.monotonic`` is one clock for every process on the machine).
    """
    server = subprocess.Popen([sys.executable, "-c", THING_RECEIVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env())
    port = server.stdout.readline().strip()
    children = [subprocess.Popen([sys.executable, "-c", FAN_IN_CLIENT, port, str(each)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 env=child_env(), text=True)
                for _ in range(clients)]
    for child in children:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("a fan-in client did not connect")
    served = cpu_seconds(server.pid)
    started = time.monotonic()
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    finished, client_cpu = [], 0.0
    for child in children:
        when, cpu = map(float, child.stdout.readline().split())
        finished.append(when)
        client_cpu += cpu
    served = cpu_seconds(server.pid) - served  # a little of it after the last ack, if any
    for child in children:
        if child.wait(300) != 0:
            raise RuntimeError("a fan-in client failed")
    elapsed = max(finished) - started
    server.stdin.write(f"fan {clients * each}\n")
    server.stdin.flush()
    kept = int(server.stdout.readline().split()[0])
    server.stdin.close()
    server.wait()
    total = clients * each
    return kept / elapsed, kept, client_cpu / total * 1e6, served / total * 1e6


def server_alone(count: int, **env: str) -> tuple[float, float]:
    """(frames/s, server CPU µs per frame) for ``count`` ready-made frames from a raw socket,
    the server's environment given ``env`` (``THING_PUREPYTHON="1"``: the twin)."""
    import threading

    from thing import value_trees, wire
    from thing.arrays import leaf_bytes

    server = subprocess.Popen([sys.executable, "-c", THING_RECEIVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env(**env))
    port = int(server.stdout.readline())
    payload = value_trees.take_apart(VALUE)
    header = wire.encode_header("s", payload, {"site": "train.py:42 (step)", "rank": 0,
                                               "world_size": 2})
    data, trailer = bytes(leaf_bytes(payload.leaves[0])), wire.encode_trailer(False)
    frames = b"".join(wire.encode_prefix(header, payload.nbytes, seq, time.time(), call=seq + 1)
                      + header + data + trailer for seq in range(count))
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(wire.encode_handshake({"hostname": "bench", "pid": os.getpid()}))
            assert wire.recv_handshake(sock)[0] == wire.HANDSHAKE_OK
            answered = bytearray()

            def read_acks() -> None:
                while len(answered) < count * wire.ACK.size:
                    chunk = sock.recv(1 << 20)
                    if not chunk:
                        return
                    answered.extend(chunk)

            reader = threading.Thread(target=read_acks)
            served, started = cpu_seconds(server.pid), time.perf_counter()
            reader.start()
            sock.sendall(frames)
            reader.join(120)
            elapsed = time.perf_counter() - started
            served = cpu_seconds(server.pid) - served
        stored = sum(wire.decode_ack(answered[at:at + wire.ACK.size])[0] == wire.ACK_STORED
                     for at in range(0, len(answered), wire.ACK.size))
        if stored != count:
            raise RuntimeError(f"the server stored {stored} of {count} frames")
    finally:
        server.stdin.close()
        server.wait()
    return count / elapsed, served / count * 1e6


def paced(rate: float, count: int) -> tuple[float, float]:
    """Background CPU per capture at ``rate`` captures/s: (client's other threads, server), µs."""
    import thing

    server = subprocess.Popen([sys.executable, "-c", THING_RECEIVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env())
    client = thing.Client("127.0.0.1", int(server.stdout.readline()))
    try:
        assert client.catch(VALUE, name="warm").wait(10)
        process, caller, served = time.process_time(), time.thread_time(), cpu_seconds(server.pid)
        due = time.perf_counter()
        for _ in range(count):
            handle = client.catch(VALUE, name="p")
            due += 1 / rate
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
        if not handle.wait(60):
            raise RuntimeError(handle.error)
        caller = time.thread_time() - caller
        background = time.process_time() - process - caller
        served = cpu_seconds(server.pid) - served
    finally:
        client.close()
        server.stdin.close()
        server.wait()
    return background / count * 1e6, served / count * 1e6


def paced_raw(rate: float, count: int) -> tuple[float, float]:
    """The floor under :func:`paced`: a raw Unix socket at ``rate`` messages/s, each as long as
    thing's frame, received into a fresh ``bytearray`` that is kept and answered with an
    acknowledgement's worth of bytes, as thing's server answers. Returns (the sender's CPU in
    its send and answer-reading calls, the receiver process's CPU), µs per message: what any
    sender that wakes a receiver once a message costs on this machine."""
    from thing import wire

    raw = RawMethod("unix", frame_size(), count, answer=wire.ACK.size)
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(raw.target)
            answers, owed = 0, count * wire.ACK.size
            sending, served = 0.0, cpu_seconds(raw.child.pid)
            due = time.perf_counter()
            for _ in range(count):
                started = time.thread_time()
                sock.sendall(raw.message)
                try:
                    answers += len(sock.recv(owed - answers, socket.MSG_DONTWAIT))
                except BlockingIOError:
                    pass
                sending += time.thread_time() - started
                due += 1 / rate
                pause = due - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
            sock.settimeout(60)
            while answers < owed:
                answers += len(sock.recv(owed - answers))
            served = cpu_seconds(raw.child.pid) - served
            if sock.recv(1) != b"\x01":
                raise RuntimeError("the raw receiver did not get every message")
    finally:
        raw.close()
    return sending / count * 1e6, served / count * 1e6


def idle_connections(count: int, seconds: float) -> float:
    """A server's CPU, in ms a second, while ``count`` connected clients send nothing (a
    paused job's ranks): what its threads' wake-ups cost, when nothing is received."""
    from thing import wire

    server = subprocess.Popen([sys.executable, "-c", THING_RECEIVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env())
    port = int(server.stdout.readline())
    peers = []
    try:
        for pid in range(count):
            peer = socket.create_connection(("127.0.0.1", port))  # blocking, as thing reads
            peer.sendall(wire.encode_handshake({"hostname": "idle", "pid": pid}))
            assert wire.recv_handshake(peer)[0] == wire.HANDSHAKE_OK
            peers.append(peer)
        time.sleep(1.0)  # past the handshakes' deadlines being set and stopped
        spent = cpu_seconds(server.pid)
        time.sleep(seconds)
        spent = cpu_seconds(server.pid) - spent
    finally:
        for peer in peers:
            peer.close()
        server.stdin.close()
        server.wait()
    return spent / seconds * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5,000 captures, 2 trials")
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--paced", action="store_true",
                        help="only the paced rows (to compare checkouts run one after another)")
    parser.add_argument("--fan-in", action="store_true", help="only the fan-in row (as --paced)")
    parser.add_argument("--server", action="store_true",
                        help="only the server-alone rows (as --paced)")
    parser.add_argument("--server-frames", type=int, default=50_000,
                        help="frames per server-alone trial, all kept (a longer history)")
    args = parser.parse_args()
    count, trials = (5_000, 2) if args.quick else (args.count, args.trials)
    clients, each = (8, 500) if args.quick else (32, 2_000)
    _common.print_machine("small captures, one at a time")
    if args.paced:
        print_paced(args.quick)
        return 0
    if args.fan_in:
        return print_fan_in(clients, each)
    if args.server:
        print_server_alone(trials, args.server_frames)
        return 0
    size = frame_size()
    print(f"\n{count} captures of 4 float32 per trial, {trials} trials; thing's frame for one "
          f"is {size} bytes, the raw messages as long.\n")
    methods = {
        "raw-unix": RawMethod("unix", size, count),
        "raw-tcp": RawMethod("tcp", size, count),
        "thing": ThingMethod(count),
        "thing-py": ThingMethod(count, THING_PUREPYTHON="1"),
        "thing-tcp": ThingMethod(count, THING_TRANSPORT="tcp"),
    }
    if importlib.util.find_spec("torch") is not None:
        methods["thing-torch"] = ThingMethod(count, with_torch=True)
    rates: dict[str, list[float]] = {key: [] for key in methods}
    try:
        for trial in range(trials):
            for key in list(methods)[trial % len(methods):] + list(methods)[:trial % len(methods)]:
                rates[key].append(methods[key].trial())
    finally:
        for method in methods.values():
            method.close()
    base = median(rates["raw-unix"])
    print(f"{'method':<11}{'median /s':>12}{'best /s':>12}{'x raw-unix':>12}")
    for key, values in rates.items():
        print(f"{key:<11}{median(values):>12,.0f}{max(values):>12,.0f}"
              f"{median(values) / base:>12.3f}")
    twin = median(rates["thing-py"])
    print(f"\ncompiled core / pure-Python twin, small captures: "
          f"{median(rates['thing']) / twin:.2f}x")
    all_stored = print_fan_in(clients, each) == 0
    print_server_alone(trials, args.server_frames)
    print_paced(args.quick)
    return 0 if all_stored else 1


def print_server_alone(trials: int, frames: int) -> None:
    """The server alone, compiled core and twin, trials interleaved; medians and their ratio."""
    runs: dict[str, list[tuple[float, float]]] = {"compiled core": [], "pure-Python twin": []}
    for _ in range(trials):
        runs["compiled core"].append(server_alone(frames))
        runs["pure-Python twin"].append(server_alone(frames, THING_PUREPYTHON="1"))
    rates = {}
    for core, alone in runs.items():
        rates[core] = median([rate for rate, _ in alone])
        print(f"server alone, {core}: {rates[core]:,.0f} frames/s, "
              f"{median([cpu for _, cpu in alone]):.1f} µs of server CPU per frame "
              f"(median of {trials})")
    print(f"compiled core / pure-Python twin, server alone: "
          f"{rates['compiled core'] / rates['pure-Python twin']:.2f}x")


def print_fan_in(clients: int, each: int) -> int:
    """Print the fan-in row; 0 if every capture was stored."""
    rate, kept, client_cpu, server_cpu = fan_in(clients, each)
    print(f"fan-in: {clients} processes x {each} captures: {rate:,.0f} captures/s aggregate, "
          f"{kept} of {clients * each} stored; CPU per capture: clients {client_cpu:.1f} µs, "
          f"server {server_cpu:.1f} µs")
    return 0 if kept == clients * each else 1


def print_paced(quick: bool) -> None:
    print("\npaced, CPU per capture (µs): thing's outside the caller's thread (the client's "
          "other threads,\nthe server); raw-unix's in its send calls and its receiver, woken "
          "once a message")
    print(f"{'rate /s':>9}{'captures':>10}{'method':>10}{'client':>9}{'server':>9}"
          f"{'together':>10}{'x raw':>8}")
    for pace, captures in ((50, 500 if quick else 3_000),
                           (5_000, 2_000 if quick else 20_000)):
        rows = {"raw-unix": paced_raw(pace, captures), "thing": paced(pace, captures)}
        raw = sum(rows["raw-unix"])
        for method, (client_us, server_us) in rows.items():
            print(f"{pace:>9,}{captures:>10,}{method:>10}{client_us:>9.1f}{server_us:>9.1f}"
                  f"{client_us + server_us:>10.1f}{(client_us + server_us) / raw:>8.2f}")
    print(f"server CPU with 100 connected clients that send nothing: "
          f"{idle_connections(100, 5.0 if quick else 10.0):.2f} ms a second")


if __name__ == "__main__":
    sys.exit(main())
