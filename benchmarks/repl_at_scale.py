"""The REPL's calls against a long history: how long each holds up the captures arriving.

    python benchmarks/repl_at_scale.py            # 400,000 captures kept
    python benchmarks/repl_at_scale.py --quick    # 100,000

A REPL that has kept hours of a job's captures answers get(), summary(), a
status() frame, runs() and load() while its connection threads go on storing
what arrives. Whatever a call does under the store's lock, no capture is stored
meanwhile: a long hold backs the senders up until their queues fill and they
drop captures.

The history is built in the process (the store's own calls, as a connection
thread makes them; a socket would take minutes to bring as many): a scalar
"loss" from 4 ranks (three in four captures) and 50 weights' names, one run.
While each call runs, a thread stores a capture every 0.2 ms as a connection
does (``add_arrived``), and the longest any one of its stores took is the
figure; the baseline is the same thread's longest over as long with no call
running. Each call is timed 5 times: median and worst.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from thing import live, reports  # noqa: E402
from thing.captures import Capture, Sender  # noqa: E402
from thing.store import RECORD_BYTES, HistoryStore  # noqa: E402


def build(count: int) -> HistoryStore:
    store = HistoryStore(max_bytes=1 << 40)
    senders = [Sender("unix", "host", 100 + rank, rank, 4, "run-a") for rank in range(4)]
    start = time.time() - count * 1e-3
    batch = []
    for i in range(count):
        name = "loss" if i % 4 else f"layer{i // 4 % 50}.weight"
        batch.append(Capture(0, name, float(i), (), 0, senders[i % 4],
                             received_at=start + i * 1e-3, call=i // 4 + 1))
        if len(batch) == 64:
            store.add_arrived(batch, [RECORD_BYTES] * len(batch))
            batch = []
    store.add_arrived(batch, [RECORD_BYTES] * len(batch))
    return store


def longest_store(store: HistoryStore, call, seconds: float | None = None) -> tuple[float, float]:
    """(the call's own seconds, the longest one capture took to store meanwhile)."""
    done = threading.Event()
    worst = [0.0]
    sender = Sender("unix", "host", 999, 0, 1, "run-b")

    def receive() -> None:
        while not done.is_set():
            capture = Capture(0, "arriving", 1.0, (), 0, sender)
            started = time.perf_counter()
            store.add_arrived([capture], [RECORD_BYTES])
            worst[0] = max(worst[0], time.perf_counter() - started)
            time.sleep(0.0002)

    thread = threading.Thread(target=receive)
    thread.start()
    time.sleep(0.01)
    started = time.perf_counter()
    try:
        if call is None:
            time.sleep(seconds)
        else:
            call()
    finally:
        took = time.perf_counter() - started
        done.set()
        thread.join()
    return took, worst[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100,000 captures, not 400,000")
    parser.add_argument("--captures", type=int)
    args = parser.parse_args()
    count = args.captures or (100_000 if args.quick else 400_000)
    _common.print_machine(f"REPL calls with {count:,} captures kept")
    store = build(count)
    folder = tempfile.mkdtemp()
    one = HistoryStore()
    one.add("loss", 0.5, (), 0, Sender("unix", "other", 7, None, None, "run-c"),
            received_at=time.time() - 3600)
    one.save(os.path.join(folder, "one"))
    calls = {
        "get('loss')": lambda: store.get("loss"),
        "get('loss', 1000)": lambda: store.get("loss", 1000),
        "get('loss', rank=3, step=10)": lambda: store.get("loss", rank=3, step=10),
        "summary()": lambda: reports.summary(store, None),
        "a status() frame": lambda: live.view(store, _info(), 10, 80),
        "runs()": store.runs,
        "load() of 1 capture": lambda: store.load(os.path.join(folder, "one")),
    }
    print(f"{'call':30} {'call ms (median / worst)':>26} {'longest store ms':>18} "
          f"{'baseline ms':>12} {'ratio':>7}")
    for label, call in calls.items():
        took, held = zip(*(longest_store(store, call) for _ in range(5)))
        base = max(longest_store(store, None, max(max(took), 0.01))[1] for _ in range(3))
        print(f"{label:30} {statistics.median(took) * 1e3:>12.2f} / {max(took) * 1e3:>10.2f} "
              f"{max(held) * 1e3:>18.2f} {base * 1e3:>12.2f} {max(held) / base:>7.1f}")


def _info():
    from thing.server import ServerInfo
    return ServerInfo("127.0.0.1", 2875, clients=4, dropped_transfers=0, refused=0)


if __name__ == "__main__":
    main()
