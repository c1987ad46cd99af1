"""A REPL's memory under hostile floods: the server's RSS growth against its store cap.

    python benchmarks/hostile.py              # about 40 s
    python benchmarks/hostile.py --cap 256    # the store cap in MiB (default 64)

A ``thing.Server`` with a byte-capped store runs in its own process, holding a
history of 20 captures; each flood below runs against it from this process
(raw sockets) or a client process, and the server's resident memory
(``/proc/<pid>/status``) is read before the flood and at its height. Printed
per flood: RSS growth, growth ÷ cap, the store's held bytes ÷ cap, and how
many captures the store keeps (the 20 of the history, before the flood).

- stalled header claims: 64 connections each claiming the largest header
  allowed (1 MiB), sending 10 bytes of it, then nothing;
- tiny-node headers: 6 connections each sending a header of 300,000 tiny
  values (just under what is parsed) and withholding the rest of the frame;
- escaped names: 20,000 captures under 4,000-character names that grow four
  times when escaped for the terminal;
- a near-cap claim, trickled: one frame claiming 60 MiB of payload, 1 KB of
  it sent;
- idle crowd: 256 connections that finish the handshake and say nothing, then
  a real client (stored or not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# _common puts this checkout first on sys.path (thing, and the tests this reuses).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_machine  # noqa: E402

from tests.conftest import run_script  # noqa: E402
from tests.test_memory_bounds import (  # noqa: E402
    Repl,
    escaped_names,
    fill_history,
    near_cap_claim,
    nearly_whole_headers,
    stalled_header_claims,
    tiny_value_headers,
)

MiB = 1 << 20


def idle_crowd(repl: Repl) -> list:
    """256 connections that finish the handshake and say nothing, then a real client, which
    is refused while they are idle for less than 5 s and retries, as a job does."""
    peers = [repl.peer() for _ in range(256)]
    out = run_script("""
        import time, thing
        started = time.monotonic()
        while time.monotonic() - started < 20:
            if thing.catch(1.0, name="legit").wait(5):
                print(f"stored after {time.monotonic() - started:.1f} s")
                break
            time.sleep(0.5)
        else:
            print("NOT stored in 20 s")
    """, repl.port, THING_TRANSPORT="tcp", THING_RECONNECT_INTERVAL="0.5", timeout=60)
    print(f"    a client after the idle crowd: {out.strip()}")
    return peers


FLOODS = [
    ("64 stalled 1 MiB header claims", stalled_header_claims),
    ("64 1 MiB headers withheld at their end", nearly_whole_headers),
    ("6 headers of 300,000 tiny values", tiny_value_headers),
    ("20,000 captures with 16 KiB escaped names", escaped_names),
    ("a 60 MiB claim, 1 KB sent", near_cap_claim),
    ("256 idle peers, then a client", idle_crowd),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap", type=int, default=64, help="store cap in MiB (default 64)")
    args = parser.parse_args()
    cap = args.cap * MiB
    print_machine("thing hostile-peer benchmark: server RSS against its store cap")
    print(f"store cap {args.cap} MiB; a history of 20 captures of 2 MiB before each flood\n")
    print(f"  {'flood':<44} {'RSS growth':>11} {'÷ cap':>7} {'held ÷ cap':>11} "
          f"{'captures kept':>14}")
    for label, flood in FLOODS:
        repl = Repl(cap)
        try:
            fill_history(repl)
            time.sleep(0.5)
            before = repl.rss()
            peers = flood(repl)
            time.sleep(1.5)  # let every connection thread get as far as it will
            grown, stats = repl.rss() - before, repl.stats()
            print(f"  {label:<44} {grown / MiB:>8.1f} MiB {grown / cap:>7.2f} "
                  f"{stats['held'] / cap:>11.2f} {stats['kept']:>14}")
            for peer in peers:
                peer.close()
        finally:
            repl.process.kill()
            repl.process.communicate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
