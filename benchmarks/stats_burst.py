"""Does working out statistics in the background slow receiving? A burst, with and without.

A client process sends ``--count`` captures of 4 MiB (float32) back to back
(``block=True``, every handle waited for) to a server process that keeps its
history, as a user's does. The server works out each capture's statistics in
the background (``THING_STATS_SHARE=0.25``, the default) or not at all (``0``,
the baseline); the figure is the time from the first send to the last
acknowledgement, median of ``--trials``, the two settings alternating. Target:
at most 10 % slower with the worker.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from _common import REPO, child_env, median, print_machine, start_thing_server

SENDER = """
import sys, numpy as np, thing
port, count = int(sys.argv[1]), int(sys.argv[2])
client = thing.Client(f"127.0.0.1:{port}")
value = np.random.default_rng(0).standard_normal(1 << 20, dtype=np.float32)
assert client.catch(value, name="warm").wait(30)
print("ready", flush=True)
while sys.stdin.readline():
    handles = [client.catch(value, name=f"x{i}", block=True) for i in range(count)]
    assert all(handle.wait(120) for handle in handles)
    print("sent", flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    print_machine("stats_burst: receiving a burst with statistics worked out in the background")
    seconds: dict[str, list[float]] = {"0": [], "0.25": []}
    for trial in range(args.trials):
        for share in seconds:
            server, port = start_thing_server(history=True, THING_STATS_SHARE=share)
            sender = subprocess.Popen([sys.executable, "-c", SENDER, str(port), str(args.count)],
                                      env=child_env(), cwd=REPO, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            assert sender.stdout is not None and sender.stdin is not None
            assert sender.stdout.readline().strip() == "ready"
            start = time.perf_counter()
            sender.stdin.write("go\n")
            sender.stdin.flush()
            assert sender.stdout.readline().strip() == "sent"
            seconds[share].append(time.perf_counter() - start)
            sender.stdin.close()
            sender.wait(60)
            server.close()
            print(f"  trial {trial + 1}, THING_STATS_SHARE={share}: "
                  f"{seconds[share][-1]:.2f} s", flush=True)
    nbytes = args.count * (4 << 20)
    base = median(seconds["0"])
    for share, label in (("0", "no background statistics (baseline)"),
                         ("0.25", "statistics in the background, 25 % of a core")):
        took = median(seconds[share])
        print(f"  {label:<48} {took:6.2f} s  {nbytes / took / 1e6:7.0f} MB/s  "
              f"{took / base:5.2f}x the baseline's time"
              + ("  (target <= 1.10x)" if share != "0" else ""))


if __name__ == "__main__":
    main()
