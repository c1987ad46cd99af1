"""The REPL's memory is bounded by the store's cap, whatever a peer sends.

A server runs in its own process with a 64 MiB cap; the attacks come from
raw sockets in this one; the server's resident memory is read from outside
(``/proc/<pid>/status``) before and during each attack.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest

from thing import wire

from .conftest import poll, rss, run_script, start_script

CAP = 64 << 20
# What a server holds beyond its cap for its own use: threads, buffers, Python's own.
SLACK = 48 << 20

SERVER = """
import json, sys, thing
store = thing.HistoryStore(max_bytes=CAP)
server = thing.Server(port=0, store=store)
server.idle_timeout = 30
server.start()
print(server.port, flush=True)
for line in sys.stdin:
    print(json.dumps({"held": store.held_bytes, "kept": len(store), "evicted": store.evicted,
                      "received": store.received}), flush=True)
"""


class Repl:
    """The server process with a capped store, and what it holds.

    ``benchmarks/hostile.py`` runs the same server under the same attacks.
    """

    def __init__(self, cap: int = CAP) -> None:
        self.process = start_script(SERVER.replace("CAP", str(cap)), stdin=True)
        self.port = int(self.process.stdout.readline())

    def stats(self) -> dict:
        self.process.stdin.write("?\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def rss(self) -> int:
        return rss(self.process.pid)

    def peer(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        sock.sendall(wire.encode_handshake({"hostname": "attacker", "pid": 1}))
        prefix = sock.recv(wire.HANDSHAKE.size, socket.MSG_WAITALL)
        sock.recv(wire.HANDSHAKE.unpack(prefix)[3], socket.MSG_WAITALL)
        return sock


@pytest.fixture
def repl(processes: list) -> Repl:
    server = Repl()
    processes.append(server.process)
    return server


def fill_history(repl: Repl, count: int = 20, nbytes: int = 2 << 20) -> None:
    run_script(
        f"""
        import numpy as np, thing
        handles = [thing.catch(np.full({nbytes}, i, np.uint8), name="history", block=True)
                   for i in range({count})]
        assert all(h.wait(30) for h in handles)
        """,
        repl.port, THING_TRANSPORT="tcp",
    )


# -- the attacks; each returns the sockets it holds open ----------------------------------------


def stalled_header_claims(repl: Repl, count: int = 64) -> list[socket.socket]:
    """Connections that each claim the largest header allowed, send 10 bytes, stall."""
    peers = []
    for _ in range(count):
        peer = repl.peer()
        peer.sendall(wire.FRAME_PREFIX.pack(wire.FRAME_TAG, wire.KIND_CAPTURE, 1 << 20, 0, 0, 0.0,
                                            0, wire.NO_STEP) + b'{"name": 0,')
        peers.append(peer)
    return peers


def nearly_whole_headers(repl: Repl, count: int = 64) -> list[socket.socket]:
    """Connections that each send all but the last bytes of a 1 MiB header, then stall."""
    header = ('{"name":"' + "x" * ((1 << 20) - 64) + '","value":0,"leaves":[],"meta":{}}'
              ).encode()
    peers = []
    for _ in range(count):
        peer = repl.peer()
        peer.sendall(wire.encode_prefix(header, 0, 0, 0.0) + header[:-48])
        peers.append(peer)
    return peers


def tiny_value_headers(repl: Repl, elements: int = 300_000,
                       count: int = 6) -> list[socket.socket]:
    """Connections that each send a header of ``elements`` tiny values, then withhold the
    frame's end."""
    body = ",".join(["0"] * elements)
    header = ('{"name":"tiny","value":{"list":[' + body + ']},"leaves":[],"meta":{}}'
              ).encode()
    peers = []
    for _ in range(count):
        peer = repl.peer()
        peer.sendall(wire.encode_prefix(header, 0, 0, 0.0) + header)
        peers.append(peer)
    return peers


def escaped_names(repl: Repl) -> list[socket.socket]:
    """8,000 captures under 4,000-character names that grow four times when escaped: twice
    the cap in escaped names, half of it as sent (enough to tell; each new name costs the
    REPL milliseconds to check and escape)."""
    run_script(
        """
        import thing
        name = "\\x01" * 4000  # each escaped to four characters in the REPL
        handles = [thing.catch(i, name=name + str(i), block=True) for i in range(8_000)]
        assert all(h.wait(60) for h in handles)
        """,
        repl.port, THING_TRANSPORT="tcp", timeout=180,
    )
    return []


def near_cap_claim(repl: Repl, payload: int = 60 << 20) -> list[socket.socket]:
    """One frame claiming ``payload`` bytes, 1 KB of them sent."""
    peer = repl.peer()
    header = json.dumps({"name": "claim", "value": {"leaf": 0},
                         "leaves": [["numpy", "uint8", [payload], False]], "meta": {}}).encode()
    peer.sendall(wire.encode_prefix(header, payload, 0, 0.0) + header + bytes(1000))
    return [peer]


@pytest.mark.parametrize("flood", [stalled_header_claims, nearly_whole_headers])
def test_header_claims_and_headers_withheld_at_their_end_stay_within_the_budget(
        repl: Repl, flood: Any) -> None:
    """A claim allocates nothing before its bytes arrive; the bytes of a header, held as
    they come until it is whole, are budgeted before they are read, not once parsed (250
    peers withholding the end of 1 MiB headers had grown a 64 MiB server by 262 MiB)."""
    before = repl.rss()
    peers = flood(repl)
    time.sleep(1.5)  # measuring: let every connection thread get as far as it will
    grown = repl.rss() - before
    for peer in peers:
        peer.close()
    assert grown < 32 << 20, f"64 peers of {flood.__name__} grew the server by {grown >> 20} MiB"


@pytest.mark.parametrize("elements", [500_000, 300_000])
def test_headers_of_tiny_nodes_are_refused_or_held_within_a_budget(repl: Repl,
                                                                   elements: int) -> None:
    """A ~1 MiB header of tiny values inflates many times when parsed: over the limit it
    is refused unparsed; under it, what it costs is held against a shared budget, and
    beyond that refused: memory stays bounded and the history is not evicted for it."""
    fill_history(repl)
    before = repl.rss()
    peers = tiny_value_headers(repl, elements)
    time.sleep(1.5)
    grown, stats = repl.rss() - before, repl.stats()
    for peer in peers:
        peer.close()
    assert stats["held"] <= CAP and stats["kept"] == 20 and stats["evicted"] == 0, stats
    assert grown < CAP + SLACK, f"grew by {grown >> 20} MiB against a {CAP >> 20} MiB cap"


def test_long_names_that_grow_when_escaped_count_against_the_cap(repl: Repl) -> None:
    before = repl.rss()
    escaped_names(repl)
    stats, grown = repl.stats(), repl.rss() - before
    assert stats["held"] <= CAP and stats["evicted"] > 0, stats
    assert grown < CAP + SLACK, f"grew by {grown >> 20} MiB against a {CAP >> 20} MiB cap"


def test_a_near_cap_claim_trickled_evicts_no_history_and_is_cut_off(repl: Repl) -> None:
    fill_history(repl)  # 20 captures of 2 MiB: 40 MiB of the 64 MiB cap
    assert repl.stats()["kept"] == 20
    (peer,) = near_cap_claim(repl)
    time.sleep(0.5)
    assert repl.stats()["kept"] == 20  # nothing evicted for bytes that have not come
    peer.close()
    poll(lambda: repl.stats()["held"] < 45 << 20, what="the claim to be released")
    stats = repl.stats()
    assert stats["kept"] == 20 and stats["evicted"] == 0


def test_the_largest_header_a_real_capture_needs_fits(repl: Repl) -> None:
    """The lower header limit (1 MiB) still carries a dict of 2,000 tensors."""
    run_script(
        """
        import numpy as np, thing
        state = {f"model.layers.{i}.mlp.weight": np.full(4, i, np.float32) for i in range(2000)}
        assert thing.catch(state, name="state_dict").wait(30)
        """,
        repl.port, THING_TRANSPORT="tcp",
    )
    assert repl.stats()["received"] == 1




def test_a_structure_too_large_for_any_header_is_refused_at_once() -> None:
    """A list of a million floats, or one list held many times over (x = [x, x], forty
    deep: 2**40 nodes to walk), is refused at the call, in about the time a server's header
    limit allows to walk, with a reason that says what to do instead; 140,000 small ints
    (280 KB of JSON, which a server takes) are not."""
    with socket.create_server(("127.0.0.1", 0)) as listener:  # never answers: not "down"
        out = run_script(f"""
            import json, time, thing
            shared = [1.0]
            for _ in range(40):
                shared = [shared, shared]
            client = thing.Client("127.0.0.1", {listener.getsockname()[1]})
            took, errors = [], []
            for value in ([float(i) for i in range(1_000_000)], shared, [0] * 140_000):
                start = time.perf_counter()
                handle = client.catch(value, name="big")
                took.append(time.perf_counter() - start)
                errors.append(handle.error)
            print(json.dumps([max(took), errors]))
            client.close(0)
        """, THING_TRANSPORT="tcp")
    slowest, errors = json.loads(out)
    for error in errors[:2]:
        assert "values outside arrays" in error and "as an array" in error, errors
    assert errors[2] is None  # queued: the server would take it
    assert slowest < 5  # the whole structure is not walked: it would take hours


def test_text_counts_against_the_queues_bytes() -> None:
    """What a capture holds outside arrays (here 300 KB of text each) is counted by
    THING_QUEUE_BYTES as its arrays are: with no answer from the server, the queue holds a
    few such captures, not THING_QUEUE_ITEMS of them."""
    with socket.create_server(("127.0.0.1", 0)) as listener:  # never answers the handshake
        out = run_script(f"""
            import thing
            client = thing.Client("127.0.0.1", {listener.getsockname()[1]})
            for i in range(20):
                client.catch(str(i) * 300_000, name="text")
            print(client.undelivered)
            client.close(0)
        """, THING_TRANSPORT="tcp", THING_QUEUE_BYTES=str(1 << 20))
    assert out.strip() == "{'queue full': 17}"
