"""The REPL's pause at a full garbage collection, with a long history kept.

    python benchmarks/collector.py            # 200,000 captures
    python benchmarks/collector.py --quick    # 50,000

Every full collection walks every object the collector tracks, holding the GIL:
the REPL (and the server's threads in it) stands still meanwhile, and Python
starts one by itself whenever the objects made since the last one reach a
quarter of those it holds. A REPL that keeps hours of captures holds many.

For the compiled core and for its pure-Python twin, in turn, a server process
receives N small captures (4 float32 each, ``catch(..., block=True)`` from a
client process, as a training loop sends them), keeps them all, works out the
statistics ``thing.stats`` keeps on each, and times ``gc.collect()`` (median of
five). The baseline is the same process before anything arrived: numpy and
thing imported, the server listening. Also shown: the objects the collector
tracks, before and after.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import child_env  # noqa: E402

SERVER = """
import gc, json, statistics, sys, time
import thing
from thing.history_stats import capture_stats

def pause():
    times = []
    for _ in range(5):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000, len(gc.get_objects())

server = thing.Server(port=0).start()
empty = pause()
print(server.port, flush=True)
sys.stdin.readline()  # the client is done
kept = server.store.get_all("loss")
for capture in kept:
    capture_stats(capture)
full = pause()
print(json.dumps({"backend": thing.BACKEND, "kept": len(kept), "empty": empty, "full": full}))
server.close()
"""

CLIENT = """
import sys, numpy as np, thing
client = thing.Client("127.0.0.1", int(sys.argv[1]))
value = np.arange(4, dtype=np.float32)
for step in range(int(sys.argv[2])):
    handle = client.catch(value, name="loss", step=step, block=True)
assert handle.wait(120), handle.error
client.close()
"""


def measure(count: int, **env: str) -> dict:
    import json

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env(**env))
    try:
        port = server.stdout.readline().strip()
        subprocess.run([sys.executable, "-c", CLIENT, port, str(count)], check=True,
                       timeout=600, env=child_env(**env))
        server.stdin.write("done\n")
        server.stdin.flush()
        result = json.loads(server.stdout.readline())
    finally:
        server.stdin.close()
        server.wait(60)
    if result["kept"] != count:
        raise RuntimeError(f"the server kept {result['kept']} of {count} captures")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50,000 captures")
    args = parser.parse_args()
    count = 50_000 if args.quick else 200_000
    _common.print_machine("a full garbage collection in the REPL, with a long history kept")
    print(f"{count:,} captures kept, statistics worked out; gc.collect() median of 5\n")
    print(f"{'core':<10} {'empty ms':>9} {'full ms':>9} {'x empty':>8} "
          f"{'objects empty':>14} {'objects full':>13}")
    results = {"compiled": measure(count), "twin": measure(count, THING_PUREPYTHON="1")}
    for label, result in results.items():
        (empty_ms, empty_objects), (full_ms, full_objects) = result["empty"], result["full"]
        print(f"{label:<10} {empty_ms:>9.1f} {full_ms:>9.1f} {full_ms / empty_ms:>8.1f} "
              f"{empty_objects:>14,} {full_objects:>13,}")
    compiled, twin = results["compiled"]["full"][0], results["twin"]["full"][0]
    print(f"\nthe twin's pause / the compiled core's: {twin / compiled:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
