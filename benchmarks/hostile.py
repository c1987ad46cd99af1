"""A REPL's memory under hostile floods: the server's RSS growth against its store cap.

    python benchmarks/hostile.py              # about 40 s
    python benchmarks/hostile.py --cap 256    # the store cap in MiB (default 64)

A ``thing.Server`` with a byte-capped store runs in its own process, holding a
history of 20 captures; each flood below runs against it from this process
(raw sockets) or a client process, and the server's resident memory
(``/proc/<pid>/status``) is read before the flood and at its height. Printed
per flood: RSS growth, growth ÷ cap, the store's held bytes ÷ cap, and how
many of the history's captures are still kept.

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
import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_machine  # noqa: E402

from thing import wire  # noqa: E402

MiB = 1 << 20


class Repl:
    """The server process with a capped store, and what it holds."""

    def __init__(self, cap: int) -> None:
        code = textwrap.dedent(f"""
            import json, sys, thing
            store = thing.HistoryStore(max_bytes={cap})
            server = thing.Server(port=0, store=store)
            server.idle_timeout = 30
            server.start()
            print(server.port, flush=True)
            for line in sys.stdin:
                print(json.dumps({{"held": store.held_bytes, "kept": len(store.get_all("history"))
                                  if "history" in store.names() else 0}}), flush=True)
            """)
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True,
                                        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        self.port = int(self.process.stdout.readline())

    def stats(self) -> dict:
        self.process.stdin.write("?\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def rss(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as status:
            return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS"))

    def peer(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        sock.sendall(wire.encode_handshake({"hostname": "attacker", "pid": 1}))
        prefix = sock.recv(wire.HANDSHAKE.size, socket.MSG_WAITALL)
        sock.recv(wire.HANDSHAKE.unpack(prefix)[3], socket.MSG_WAITALL)
        return sock

    def client(self, code: str) -> str:
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "THING_TRANSPORT": "tcp",
                 "THING_SERVER": f"127.0.0.1:{self.port}"}, timeout=300)
        return result.stdout.strip() or result.stderr.strip()[-200:]

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def stalled_header_claims(repl: Repl) -> list[socket.socket]:
    peers = []
    for _ in range(64):
        peer = repl.peer()
        peer.sendall(wire.FRAME_PREFIX.pack(wire.FRAME_TAG, wire.KIND_CAPTURE, MiB, 0)
                     + b'{"seq": 0,')
        peers.append(peer)
    return peers


def tiny_node_headers(repl: Repl) -> list[socket.socket]:
    body = ",".join(["0"] * 300_000)
    header = ('{"seq":0,"name":"tiny","value":{"list":[' + body + ']},"leaves":[],"meta":{}}'
              ).encode()
    peers = []
    for _ in range(6):
        peer = repl.peer()
        peer.sendall(wire.encode_prefix(header, 0) + header)
        peers.append(peer)
    return peers


def escaped_names(repl: Repl) -> list[socket.socket]:
    repl.client("""
        import thing
        name = "\\x01" * 4000
        handles = [thing.catch(i, name=name + str(i), block=True) for i in range(20_000)]
        print(sum(h.wait(60) for h in handles))
        """)
    return []


def near_cap_claim(repl: Repl) -> list[socket.socket]:
    peer = repl.peer()
    payload = 60 * MiB
    header = json.dumps({"seq": 0, "name": "claim", "value": {"leaf": 0},
                         "leaves": [["numpy", "uint8", [payload], False]], "meta": {}}).encode()
    peer.sendall(wire.encode_prefix(header, payload) + header + bytes(1000))
    return [peer]


def idle_crowd(repl: Repl) -> list[socket.socket]:
    peers = [repl.peer() for _ in range(256)]
    outcome = repl.client("""
        import thing
        print("client stored" if thing.catch(1.0, name="legit").wait(15) else "client refused")
        """)
    print(f"    {outcome}")
    return peers


FLOODS = [
    ("64 stalled 1 MiB header claims", stalled_header_claims),
    ("6 headers of 300,000 tiny values", tiny_node_headers),
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
          f"{'history kept':>13}")
    for label, flood in FLOODS:
        repl = Repl(cap)
        try:
            repl.client("""
                import numpy as np, thing
                hs = [thing.catch(np.full(2 << 20, i, np.uint8), name="history", block=True)
                      for i in range(20)]
                print(all(h.wait(30) for h in hs))
                """)
            time.sleep(0.5)
            before = repl.rss()
            peers = flood(repl)
            time.sleep(1.5)  # let every connection thread get as far as it will
            grown, stats = repl.rss() - before, repl.stats()
            print(f"  {label:<44} {grown / MiB:>8.1f} MiB {grown / cap:>7.2f} "
                  f"{stats['held'] / cap:>11.2f} {stats['kept']:>10}/20")
            for peer in peers:
                peer.close()
        finally:
            repl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
