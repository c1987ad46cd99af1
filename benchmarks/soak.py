"""Soak: many senders flood a byte-capped server for minutes; its RSS is sampled against the cap.

    python benchmarks/soak.py                        # 3 minutes, 64 MiB cap, 4 x 2 senders
    python benchmarks/soak.py --minutes 20 --cap 256M
    python benchmarks/soak.py --minutes 1 --transport auto   # same-host path (shared memory)

A ``thing.Server`` with ``HistoryStore(max_bytes=cap)`` runs in a child
process. ``--processes`` sender processes with ``--threads`` threads each call
``client.catch(array, block=True)`` in a loop with arrays of random sizes
between ``--min-size`` and ``--max-size`` (float32, 20 names per thread, so
the store keeps evicting). Every ``--every`` seconds a line shows the server's
RSS (``VmRSS``), its growth over the baseline taken after the server started,
the store's held bytes and counts; with ``--transport auto`` large arrays
arrive in shared memory that the server maps but does not touch, so the bytes
of those mappings are shown too (they are memory the server holds, not in
RSS). The run fails (exit status 1) if the growth ever exceeds the cap plus
the warm receive buffers the server may keep (an eighth of the cap) plus
``--margin``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import child_env, print_machine  # noqa: E402

MiB = 1 << 20

SERVER = """
import os, sys, thing
from thing.store import HistoryStore
server = thing.Server(port=0, store=HistoryStore(max_bytes=int(os.environ["CAP"]))).start()
print(server.port, os.getpid(), flush=True)
for line in sys.stdin:
    store = server.store
    print(store.held_bytes, store.received, store.evicted, store.rejected,
          server.buffers.spare_bytes, flush=True)
server.close()
"""

SENDER = """
import os, sys, threading, time
import numpy as np, thing
duration, threads = float(os.environ["DURATION"]), int(os.environ["THREADS"])
low, high = int(os.environ["MIN_SIZE"]) // 4, int(os.environ["MAX_SIZE"]) // 4
client = thing.Client("127.0.0.1", int(os.environ["THING_PORT"]))
sent = [0] * threads
worst = [0.0] * threads
def flood(thread):
    rng = np.random.default_rng([os.getpid(), thread])
    started = time.monotonic()
    i = 0
    while time.monotonic() - started < duration:
        array = np.full(int(rng.integers(low, high + 1)), i, np.float32)
        before = time.perf_counter()
        client.catch(array, name=f"p{os.getpid()}-t{thread}-{i % 20}", block=True)
        worst[thread] = max(worst[thread], time.perf_counter() - before)
        sent[thread] += array.nbytes
        i += 1
workers = [threading.Thread(target=flood, args=(t,)) for t in range(threads)]
for worker in workers:
    worker.start()
for worker in workers:
    worker.join()
client.flush(60)
print(client.sent, client.dropped, sum(sent), max(worst), flush=True)
"""


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


def shared_mapped(pid: int) -> int:
    """Bytes of memfd mappings (shared-memory captures) in ``pid``'s address space."""
    total = 0
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                if "/memfd:" in line:
                    start, end = (int(x, 16) for x in line.split()[0].split("-"))
                    total += end - start
    except OSError:
        pass
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--cap", type=parse_size, default=64 * MiB)
    parser.add_argument("--margin", type=parse_size, default=64 * MiB)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-size", type=parse_size, default=64 << 10)
    parser.add_argument("--max-size", type=parse_size, default=8 * MiB)
    parser.add_argument("--transport", default="tcp", choices=["tcp", "unix", "shm", "auto"])
    parser.add_argument("--every", type=float, default=5.0, help="seconds between report lines")
    args = parser.parse_args()

    print_machine("thing soak: many senders, a byte-capped store, the server's RSS")
    env = {"THING_TRANSPORT": args.transport}
    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SERVER)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=child_env(CAP=str(args.cap), **env))
    assert server.stdin is not None and server.stdout is not None
    port, pid = map(int, server.stdout.readline().split())
    baseline = rss(pid)
    limit = args.cap + args.cap // 8 + args.margin
    duration = args.minutes * 60
    print(f"cap {args.cap / MiB:.0f} MiB, limit on growth {limit / MiB:.0f} MiB "
          f"(cap + cap/8 warm buffers + {args.margin / MiB:.0f} MiB margin); "
          f"{args.processes} processes x {args.threads} threads, arrays of "
          f"{args.min_size / MiB:.2f}-{args.max_size / MiB:.2f} MiB over {args.transport}; "
          f"server baseline RSS {baseline / MiB:.1f} MiB\n")

    def ask() -> list[int]:
        server.stdin.write("stats\n")
        server.stdin.flush()
        return [int(x) for x in server.stdout.readline().split()]

    senders = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(SENDER)], text=True,
                                stdout=subprocess.PIPE,
                                env=child_env(THING_PORT=str(port), DURATION=str(duration),
                                              THREADS=str(args.threads),
                                              MIN_SIZE=str(args.min_size),
                                              MAX_SIZE=str(args.max_size), **env))
               for _ in range(args.processes)]
    header = (f"{'time':>7} {'RSS MiB':>8} {'growth':>7} {'peak':>7} {'of limit':>8} "
              f"{'held MiB':>8} {'spare':>6} {'shm MiB':>7} {'received':>9} {'evicted':>8}")
    print(header)
    started = time.monotonic()
    peak = baseline
    next_report = started
    failed = False
    while any(sender.poll() is None for sender in senders):
        now_rss = rss(pid)
        peak = max(peak, now_rss)
        failed = failed or peak - baseline > limit
        if time.monotonic() >= next_report:
            held, received, evicted, _, spare = ask()
            print(f"{time.monotonic() - started:6.0f}s {now_rss / MiB:8.1f} "
                  f"{(now_rss - baseline) / MiB:7.1f} {(peak - baseline) / MiB:7.1f} "
                  f"{(peak - baseline) / limit:8.0%} {held / MiB:8.1f} {spare / MiB:6.1f} "
                  f"{shared_mapped(pid) / MiB:7.1f} {received:9d} {evicted:8d}", flush=True)
            next_report += args.every
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    sent = dropped = sent_bytes = 0
    worst = 0.0
    for sender in senders:
        out, _ = sender.communicate(timeout=120)
        count, lost, nbytes, slowest = out.split()
        sent, dropped, sent_bytes = sent + int(count), dropped + int(lost), sent_bytes + int(nbytes)
        worst = max(worst, float(slowest))
    held, received, evicted, rejected, spare = ask()
    server.stdin.close()
    server.wait(timeout=60)
    print(f"\n{elapsed:.0f} s: {received} captures ({sent_bytes / 2**30:.1f} GiB, "
          f"{sent_bytes / elapsed / MiB:.0f} MiB/s) received, {evicted} evicted, {rejected} "
          f"refused, {dropped} dropped by senders; slowest catch(block=True) {worst * 1000:.0f} ms")
    print(f"server RSS: baseline {baseline / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB, growth "
          f"{(peak - baseline) / MiB:.1f} MiB = cap x {(peak - baseline) / args.cap:.2f} "
          f"(limit {limit / MiB:.0f} MiB): {'EXCEEDED' if failed else 'ok'}")
    if received != sent:
        print(f"MISMATCH: senders had {sent} acknowledged, the server counted {received}")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
