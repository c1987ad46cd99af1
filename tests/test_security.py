"""Who may connect, and what an untrusted peer can make the server do.

Binding, token authentication (through real client processes and a recording
relay), stalled and trickling peers, the connection cap, floods against a
byte-capped store, and text from peers reaching the researcher's terminal.
The helpers at the top (``poll``, ``Relay``, ``frame_bytes`` ...) are shared
with ``test_fuzz.py`` and ``test_resilience.py``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import thing
import thing.auth
from thing import auth, config, value_trees, wire
from thing.arrays import leaf_bytes
from thing.store import HistoryStore

from .conftest import free_port, poll, run_script, script_env, start_script

# -- helpers shared by the robustness tests ------------------------------------------------






def frame_bytes(value: Any, name: str | None = "x", seq: int = 0,
                meta: dict | None = None) -> bytes:
    """One complete, valid capture frame as a client would send it."""
    payload = value_trees.take_apart(value)
    header = wire.encode_header(name, payload, meta or {})
    data = b"".join(bytes(leaf_bytes(leaf)) for leaf in payload.leaves)
    return (wire.encode_prefix(header, payload.nbytes, seq, 0.0) + header + data
            + wire.encode_trailer(False))


def recv_handshake(sock: socket.socket) -> tuple[int, dict]:
    """Read one handshake message from a raw socket."""
    prefix = sock.recv(wire.HANDSHAKE.size, socket.MSG_WAITALL)
    magic, version, status, length = wire.HANDSHAKE.unpack(prefix)
    assert (magic, version) == (wire.MAGIC, wire.VERSION), prefix
    body = sock.recv(length, socket.MSG_WAITALL) if length else b""
    return status, json.loads(body)


def raw_peer(port: int, hostname: str = "raw-peer") -> socket.socket:
    """A socket that completed the handshake with a server that wants no token."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(wire.encode_handshake({"hostname": hostname, "pid": os.getpid()}))
    status, _ = recv_handshake(sock)
    assert status == wire.HANDSHAKE_OK
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the other end closed ``sock`` (EOF or reset); reads and drops any data."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(65536) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def read_to_end(sock: socket.socket, timeout: float = 10) -> bytes:
    """Everything the peer sends until it closes (a reset counts as a close)."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def stored_acks(reply: bytes) -> int:
    """How many 'stored' acknowledgements appear in a server's bytes after its handshake."""
    count, start = 0, 0
    while (at := reply.find(wire.ACK_TAG, start)) >= 0:
        chunk = reply[at : at + wire.ACK.size]
        if len(chunk) == wire.ACK.size:
            try:
                status, *_ = wire.decode_ack(chunk)
                count += status == wire.ACK_STORED
            except thing.ProtocolError:
                pass
        start = at + 1
    return count


class Relay:
    """A TCP relay between clients and a server that can record every byte and cut connections.

    For each connection ``cut_after()`` says how many client-to-server bytes to pass
    before closing both sides (None: never cut). With ``record=True`` every byte is
    kept in :attr:`upstream` (client to server) and :attr:`downstream`.
    """

    def __init__(self, target_port: int, record: bool = False,
                 cut_after: Callable[[], int | None] | None = None):
        self.target = ("127.0.0.1", target_port)
        self.record = record
        self.cut_after = cut_after or (lambda: None)
        self.upstream = bytearray()
        self.downstream = bytearray()
        self.connections = 0
        self.cuts = 0
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="test-relay")
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, server}
                self.connections += 1
            pair = {"open": 2}
            self._spawn(self._pump, client, server, self.upstream, self.cut_after(), pair)
            self._spawn(self._pump, server, client, self.downstream, None, pair)

    def _pump(self, source: socket.socket, destination: socket.socket, record: bytearray,
              budget: int | None, pair: dict) -> None:
        passed = 0
        try:
            while data := source.recv(1 << 16):
                cut = budget is not None and passed + len(data) >= budget
                if cut:
                    data = data[: budget - passed]
                destination.sendall(data)
                passed += len(data)
                if self.record:
                    with self._lock:
                        record += data
                if cut:
                    with self._lock:
                        self.cuts += 1
                    for sock in (source, destination):
                        _shutdown(sock)
                    break
        except OSError:
            pass
        finally:
            _shutdown(destination, socket.SHUT_WR)
            with self._lock:
                pair["open"] -= 1
                if pair["open"] == 0:
                    for sock in (source, destination):
                        self._sockets.discard(sock)
                        sock.close()

    def close(self) -> None:
        _shutdown(self._listener)
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                _shutdown(sock)
        for thread in self._threads:
            thread.join(10)
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


def _primary_address() -> str | None:
    """A non-loopback IPv4 address of this machine, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.255", 9))  # no packet is sent for UDP connect
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


# -- binding ---------------------------------------------------------------------------------

SERVE = """
import os, sys, thing
server = thing.serve(port=0)
print(server.host, server.port, flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("widen", [False, True], ids=["default", "THING_HOST"])
def test_default_bind_is_loopback_and_thing_host_widens_it(tmp_path: Path, widen: bool) -> None:
    runtime = tmp_path / "run"  # the token file and the Unix socket go here, not in ~ or /tmp
    runtime.mkdir(mode=0o700)
    env = {"THING_HOST": "0.0.0.0" if widen else "", "HOME": str(tmp_path),
           "XDG_RUNTIME_DIR": str(runtime)}
    process = subprocess.Popen([sys.executable, "-c", SERVE], env=script_env(**env), text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        assert process.stdout is not None
        host, port = process.stdout.readline().split()
        assert host == ("0.0.0.0" if widen else "127.0.0.1")
        assert _reachable("127.0.0.1", int(port))
        outside = _primary_address()
        if outside is not None:  # this machine's own address on the network
            assert _reachable(outside, int(port)) is widen
    finally:
        process.kill()
        _, err = process.communicate(timeout=10)
    if widen:  # beyond loopback without a token: one was made up, and the export line shown
        assert "export THING_TOKEN=" in err


def test_server_and_serve_default_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    monkeypatch.delenv("THING_HOST", raising=False)
    assert config.serve_host() == "127.0.0.1"
    assert inspect.signature(thing.Server).parameters["host"].default is None  # THING_HOST
    with thing.Server(port=0) as server:
        assert server.host == "127.0.0.1" and server.token is None


# -- tokens -----------------------------------------------------------------------------------

TOKEN_CLIENT = """
import logging, os, threading
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
warned = threading.Event()
class Flag(logging.Handler):
    def emit(self, record):
        warned.set()
logging.getLogger("thing").addHandler(Flag(logging.WARNING))
import numpy as np, thing
handle = thing.catch(np.arange(1000, dtype=np.int32) * 7, name="secret-data")
stored = handle.wait(15)
if not stored:
    warned.wait(10)  # the refusal is logged by the sender thread just after the handle resolves
print("stored" if stored else "not stored", flush=True)
"""


def _run_token_client(port: int, token: str | None, **env: str) -> subprocess.CompletedProcess:
    """Run TOKEN_CLIENT; over TCP unless ``THING_TRANSPORT`` says otherwise."""
    env = {"THING_TRANSPORT": "tcp", **env}
    if token is not None:
        env["THING_TOKEN"] = token
    return run_script(TOKEN_CLIENT, port, timeout=60, full=True, **env)


def test_right_token_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THING_TOKEN", raising=False)
    with thing.Server(port=0, token="correct horse battery staple") as server:
        result = _run_token_client(server.port, "correct horse battery staple")
        assert result.stdout.strip() == "stored", result.stderr
        assert np.array_equal(server.get("secret-data"), np.arange(1000, dtype=np.int32) * 7)


@pytest.mark.parametrize(("token", "transport"),
                         [("wrong token", "tcp"), (None, "tcp"), ("wrong token", "auto")],
                         ids=["wrong", "missing", "wrong-same-host-path"])
def test_wrong_or_missing_token_is_refused_and_nothing_is_stored(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        token: str | None, transport: str) -> None:
    monkeypatch.delenv("THING_TOKEN", raising=False)
    with caplog.at_level(logging.WARNING, logger="thing"), \
            thing.Server(port=0, token="the real token") as server:
        result = _run_token_client(server.port, token, THING_TRANSPORT=transport)
        assert result.stdout.strip() == "not stored"
        # The client says why, and what to do about it.
        if token is None:
            assert "requires a token" in result.stderr and "THING_TOKEN" in result.stderr, \
                result.stderr
        else:
            # The server proves its token first: the client refuses it before sending a thing.
            assert "could not prove it knows the token" in result.stderr, result.stderr
            # The server says someone failed the token check.
            poll(lambda: any("token check" in m for m in caplog.messages),
                 5, f"the server's note in its log, got {caplog.messages}")
        assert len(server.store) == 0 and server.store.received == 0
        assert "the real token" not in result.stderr + "\n".join(caplog.messages)


def test_missing_token_is_logged_by_the_server(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A client without a token still answers the challenge, so the server can say why."""
    monkeypatch.delenv("THING_TOKEN", raising=False)
    with caplog.at_level(logging.WARNING, logger="thing"), \
            thing.Server(port=0, token="the real token") as server:
        client = thing.Client("127.0.0.1", server.port)
        try:
            assert client.catch(np.arange(3), name="x").wait(10) is False
            poll(lambda: any("token" in r.getMessage() and r.threadName.startswith("thing-conn")
                             for r in caplog.records), 3, "a warning from the server")
        finally:
            client.close()


@pytest.mark.parametrize("nonce", ["\ud800" * 40, "z" * 64, "\u00e9" * 40, 12345])
def test_a_hello_with_a_malformed_nonce_is_refused_in_words(
        nonce: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A nonce of unpaired surrogates reached the MAC's encoding: a traceback in the REPL
    for every connection, unthrottled, and no word to the peer."""
    with caplog.at_level(logging.INFO, logger="thing"), \
            thing.Server(port=0, token="t0ken") as server:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as peer:
                peer.sendall(wire.encode_handshake({"hostname": "x", "pid": 1, "nonce": nonce}))
                status, refusal = recv_handshake(peer)
                assert status == wire.HANDSHAKE_REFUSED and "nonce" in refusal["error"]
        client = thing.Client("127.0.0.1", server.port, token="t0ken")
        try:
            assert client.catch(1, name="after").wait(10)
        finally:
            client.close()
    assert not any(record.exc_info for record in caplog.records)
    assert sum("nonce" in m for m in caplog.messages) == 1  # once a minute, per peer


def test_raw_peer_with_a_wrong_proof_gets_a_refusal_and_its_frame_is_never_read(
        caplog: pytest.LogCaptureFixture) -> None:
    with thing.Server(port=0, token="t0ken") as server:
        hello = {"hostname": "intruder", "pid": 1, "nonce": auth.new_nonce()}
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as peer:
            peer.sendall(wire.encode_handshake(hello))
            status, challenge = recv_handshake(peer)
            assert status == wire.HANDSHAKE_CHALLENGE and len(challenge["nonce"]) >= 32
            # A wrong proof, and a frame right behind it, as if the answer did not matter.
            guess = auth.client_proof("guess", hello["nonce"], challenge["nonce"])
            peer.sendall(wire.encode_handshake({"proof": guess})
                         + frame_bytes(np.ones(100), "smuggled"))
            status, refusal = recv_handshake(peer)
            assert status == wire.HANDSHAKE_REFUSED and "token" in refusal["error"]
            assert stored_acks(read_to_end(peer)) == 0
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as peer:
            # No answer to the challenge at all: a frame where the proof should be.
            peer.sendall(wire.encode_handshake(hello))
            assert recv_handshake(peer)[0] == wire.HANDSHAKE_CHALLENGE
            peer.sendall(frame_bytes(np.ones(100), "smuggled"))
            assert stored_acks(read_to_end(peer)) == 0
        assert len(server.store) == 0 and server.store.received == 0
        client = thing.Client("127.0.0.1", server.port, token="t0ken")
        try:
            assert client.catch(np.ones(3), name="legit").wait(10)
        finally:
            client.close()
        assert server.store.names() == ["legit"]


def test_the_token_never_crosses_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THING_TOKEN", raising=False)
    token = "sécret-ключ-" + "Zq9" * 10  # non-ASCII too, so JSON escaping would show
    with thing.Server(port=0, token=token) as server, Relay(server.port, record=True) as relay:
        result = _run_token_client(relay.port, token)
        assert result.stdout.strip() == "stored", result.stderr
        poll(lambda: len(relay.downstream) >= wire.ACK.size, 5, "the acknowledgement")
        assert np.array_equal(server.get("secret-data"), np.arange(1000, dtype=np.int32) * 7)
    both = bytes(relay.upstream) + bytes(relay.downstream)
    assert len(relay.upstream) > 4000  # the frame went through the relay
    for form in (token.encode(), json.dumps(token).encode()[1:-1], token.encode("utf-16-le"),
                 token.encode().hex().encode()):
        assert form not in both
    assert b"proof" in relay.upstream and b"nonce" in relay.downstream  # it was challenged


@pytest.mark.parametrize("where", ["runtime dir", "home"])
def test_server_beyond_loopback_generates_a_private_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        where: str) -> None:
    home, runtime = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime) if where == "runtime dir" else "")
    monkeypatch.delenv("THING_TOKEN", raising=False)
    with caplog.at_level(logging.WARNING, logger="thing"):
        server = thing.Server(port=0, host="0.0.0.0").start()
    try:
        path = auth.token_file(server.port)
        base = runtime / "thing" if where == "runtime dir" else home / ".thing"
        assert path == base / f"token-{server.port}"
        assert server.token and path.read_text() == server.token
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert path.stat().st_uid == os.getuid()
        assert any(f"export THING_TOKEN={server.token}" in m for m in caplog.messages)
        # A client of this user on this machine finds the token by itself...
        result = _run_token_client(server.port, None)
        assert result.stdout.strip() == "stored", result.stderr
        # ... one that cannot read this user's files does not get in.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        result = _run_token_client(server.port, None, HOME=str(elsewhere), XDG_RUNTIME_DIR="")
        assert result.stdout.strip() == "not stored" and "requires a token" in result.stderr
        assert server.store.versions("secret-data") == 1
    finally:
        server.close()
    assert not path.exists()


def test_token_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(thing.auth.hmac, "compare_digest", spy)
    ours, theirs = auth.new_nonce(), auth.new_nonce()
    expected = auth.client_proof("k", ours, theirs)
    assert auth.verify(expected, auth.client_proof("k", ours, theirs))
    assert not auth.verify(expected, auth.client_proof("other", ours, theirs))
    assert not auth.verify(expected, auth.server_proof("k", ours, theirs))  # roles differ
    assert not auth.verify(expected, "short")  # a length mismatch goes through it too
    assert not auth.verify(expected, "\ud800" * 64)  # unencodable text is no crash
    assert len(calls) == 5
    assert not auth.verify(expected, None) and not auth.verify(expected, 5)
    with thing.Server(port=0, token="k") as server:
        client = thing.Client("127.0.0.1", server.port, token="k")
        try:
            assert client.catch(np.ones(2), name="x").wait(10)
        finally:
            client.close()
    # Both proofs in the handshake, the frame's signature, the ack's and those of the two
    # control messages that start every steered connection (forget, replayed): all so.
    assert len(calls) == 11


# -- stalled and slow peers -------------------------------------------------------------------


def test_stalled_peers_are_dropped_while_another_client_streams() -> None:
    server = thing.Server(port=0)
    server.idle_timeout = 1.0
    server.start()
    client = thing.Client("127.0.0.1", server.port)
    peers: dict[str, socket.socket] = {}
    try:
        assert client.catch(np.zeros(10), name="meanwhile").wait(10)
        held_before = server.store.held_bytes
        started = time.monotonic()
        peers["silent"] = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        peers["half hello"] = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        peers["half hello"].sendall(wire.encode_handshake({"hostname": "h", "pid": 1})[:7])
        peers["half header"] = raw_peer(server.port)
        frame = frame_bytes(np.arange(1 << 18, dtype=np.float32), "stalled")  # 1 MiB payload
        header_end = wire.FRAME_PREFIX.size + wire.FRAME_PREFIX.unpack(
            frame[: wire.FRAME_PREFIX.size])[2]
        peers["half header"].sendall(frame[: header_end - 10])
        peers["half payload"] = raw_peer(server.port)
        peers["half payload"].sendall(frame[: header_end + (1 << 19)])
        poll(lambda: server.store.held_bytes >= held_before + (1 << 20), 5,
             "the half-sent payload's reservation")
        dropped: dict[str, float] = {}
        latencies = []
        i = 0
        while len(dropped) < len(peers):
            assert time.monotonic() - started < 10, f"not dropped: {set(peers) - set(dropped)}"
            for name, peer in peers.items():
                if name not in dropped and closed_by_peer(peer):
                    dropped[name] = time.monotonic() - started
            sent = time.monotonic()
            value = np.full(1000, i, dtype=np.int64)
            assert client.catch(value, name="meanwhile").wait(5), "a stalled peer held us up"
            latencies.append(time.monotonic() - sent)
            assert np.array_equal(server.get("meanwhile"), value)
            i += 1
        assert all(0.8 <= after <= 5 for after in dropped.values()), dropped
        assert max(latencies) < 1.0 and i >= 10, (max(latencies), i)
        assert "stalled" not in server.store.names()
        # A dropped peer is answered and hung up on at once; its slot goes within a second.
        poll(lambda: [c.hostname for c in server.clients()] == [socket.gethostname()], 5,
             "the dropped peers' slots")
        # The reservation of the half-received payload was given back: nothing is held
        # once the kept captures are cleared.
        server.store.clear()
        assert server.store.held_bytes == 0
    finally:
        client.close()
        for peer in peers.values():
            peer.close()
        server.close()


def test_the_deadline_watcher_sleeps_while_no_deadline_runs() -> None:
    """Frames stored on the fast path set no deadline: the watcher waits for one to start
    (it had woken every second, as every idle connection had), and closing ends its wait."""
    from thing.deadlines import Deadlines

    deadlines, closing = Deadlines(), threading.Event()
    returned = threading.Event()

    def watch() -> None:
        deadlines.wait_until_armed(closing)
        returned.set()

    for end in ("a deadline starts", "closing"):
        returned.clear()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert not returned.wait(0.3)  # asleep
        if end == "closing":
            closing.set()
            deadlines.wake()
        else:
            with socket.socket() as sock:
                deadlines.start(sock, 60)
                assert returned.wait(5)
                deadlines.wait_until_armed(closing)  # one runs: at once
                deadlines.stop(sock)
        watcher.join(5)
        assert returned.is_set() and not watcher.is_alive()


def test_a_peer_trickling_its_hello_is_dropped_after_the_handshake_timeout() -> None:
    """SO_RCVTIMEO restarts with every byte: the handshake needs a deadline of its own."""
    server = thing.Server(port=0)
    server.idle_timeout = 1.0
    server.start()
    hello = wire.encode_handshake({"hostname": "slowloris", "pid": 1, "pad": "x" * 1000})
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as peer:
            started = time.monotonic()
            for byte in hello:
                if closed_by_peer(peer):
                    break
                try:
                    peer.send(bytes([byte]))
                except OSError:
                    break
                assert time.monotonic() - started < 4, "a trickling peer was never dropped"
                time.sleep(0.25)
    finally:
        server.close()


def test_connection_cap_refuses_the_extra_peer_when_no_one_is_idle(
        caplog: pytest.LogCaptureFixture) -> None:
    """Slots held by peers in the middle of a frame are not taken away: then the cap
    refuses, with a log line; a slot freed is free again."""
    server = thing.Server(port=0)
    server.max_connections = 2
    server.start()
    frame = frame_bytes(np.arange(1 << 18, dtype=np.float32), "slow")
    busy = [raw_peer(server.port, f"busy-{i}") for i in range(2)]
    try:
        for peer in busy:
            peer.sendall(frame[: len(frame) // 2])
        poll(lambda: server.store.held_bytes >= 2 << 20, 10, "both frames under way")
        with caplog.at_level(logging.WARNING, logger="thing"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as third:
                third.sendall(wire.encode_handshake({"hostname": "third", "pid": 1}))
                assert read_to_end(third) == b""  # closed without a word
            poll(lambda: any("refused" in m and "THING_MAX_CONNECTIONS" in m
                             for m in caplog.messages), 5, "the log line")
        assert server.refused == 1
        busy[0].sendall(frame[len(frame) // 2 :])  # one finishes its frame...
        busy[0].close()  # ... and leaves: its slot is free again
        poll(lambda: len(server.clients()) == 1, 10, "the first peer to leave")
        fourth = thing.Client("127.0.0.1", server.port)
        try:
            assert fourth.catch(np.ones(3), name="fourth").wait(10)
        finally:
            fourth.close()
        assert server.get("slow").nbytes == 1 << 20
    finally:
        for peer in busy:
            peer.close()
        server.close()


# -- floods -----------------------------------------------------------------------------------

FLOOD = """
import numpy as np, thing
client = thing.Client("127.0.0.1", int(__import__("os").environ["THING_PORT"]))
for i in range(400):  # 400 x 64 KiB: 25 MiB into a 4 MiB store
    client.catch(np.full(16384, i, dtype=np.int32), name=f"flood-{i}", block=True)
assert client.flush(30)
print(client.sent, client.dropped, flush=True)
"""


def test_a_flood_is_bounded_by_the_store_cap_and_keeps_the_newest() -> None:
    cap = 4 << 20
    with thing.Server(port=0, store=HistoryStore(max_bytes=cap)) as server:
        sender = start_script(FLOOD, server.port)
        peak = 0
        while sender.poll() is None:
            peak = max(peak, server.store.held_bytes)
            time.sleep(0.001)
        out, err = sender.communicate(timeout=30)
        assert sender.returncode == 0, err
        assert out.split() == ["400", "0"]
        assert peak <= cap and server.store.held_bytes <= cap
        assert server.store.received == 400 and server.store.evicted > 300
        kept = server.store.names()
        assert kept == [f"flood-{i}" for i in range(400 - len(kept), 400)]  # the newest
        assert len(kept) >= 50
        for name in kept:
            i = int(name.split("-")[1])
            assert np.array_equal(server.get(name), np.full(16384, i, dtype=np.int32))


def test_header_borne_values_respect_the_store_cap() -> None:
    """Numbers and strings travel in the header, unreserved: alone they may not exceed the cap."""
    with thing.Server(port=0, store=HistoryStore(max_bytes=1 << 20)) as server:
        client = thing.Client("127.0.0.1", server.port)
        try:
            stored = client.catch([0.5] * 500_000, name="listy").wait(30)
            # Stored or refused, but the store holds no more than its cap either way.
            assert server.store.held_bytes <= server.store.max_bytes
            assert stored is False or server.store.names() == ["listy"]
            assert client.catch(np.ones(10), name="after").wait(10)
        finally:
            client.close()


EMFILE_SERVER = """
import logging, os, resource, sys, time, thing
failures = []
class Count(logging.Handler):
    def emit(self, record):
        if "accept failed" in record.getMessage():
            failures.append(time.monotonic())
logging.getLogger("thing").addHandler(Count())
logging.getLogger("thing").setLevel(logging.INFO)
server = thing.Server(port=0).start()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 2, hard))
print(server.port, flush=True)
deadline = time.monotonic() + 10
while not failures and time.monotonic() < deadline:
    time.sleep(0.01)
first, cpu = len(failures), time.process_time()
time.sleep(1)  # a fixed window in which to measure what a spinning accept loop would burn
print(len(failures) - first, time.process_time() - cpu, flush=True)
os._exit(0)
"""


def test_running_out_of_file_descriptors_does_not_spin_the_accept_loop(tmp_path: Path) -> None:
    """accept() failing with EMFILE leaves the connection pending: retrying at once would spin."""
    server = start_script(EMFILE_SERVER, XDG_RUNTIME_DIR=str(tmp_path))
    peers = []
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        for _ in range(4):  # more than the server has descriptors for
            peers.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        out, err = server.communicate(timeout=30)
        assert server.returncode == 0, err
        records, cpu = out.split()
        assert int(records) < 20, f"{records} 'accept failed' records in one second"
        assert float(cpu) < 0.5, f"the accept loop burnt {cpu} s of CPU in one second"
    finally:
        for peer in peers:
            peer.close()
        if server.poll() is None:
            server.kill()
            server.communicate()


# -- text a peer chooses, shown in the researcher's terminal ------------------------------------

PEER_TEXT = r"""
import json, socket, sys
import numpy as np, thing
from thing import value_trees, wire
field, evil = sys.argv[1], sys.argv[2].encode().decode("unicode_escape")
server = thing.Server(port=0).start()
peer = socket.create_connection(("127.0.0.1", server.port), timeout=10)
peer.sendall(wire.encode_handshake({"hostname": evil if field == "hostname" else "h", "pid": 1}))
payload = value_trees.take_apart(evil if field == "value" else np.arange(3))
header = wire.encode_header(evil if field == "name" else "n", payload,
                            {"site": evil} if field == "site" else {})
data = b"".join(bytes(memoryview(leaf.source).cast("B")) for leaf in payload.leaves)
try:
    peer.sendall(wire.encode_prefix(header, payload.nbytes, 0, 0.0) + header + data
                 + wire.encode_trailer(False))
    peer.recv(4096, socket.MSG_WAITALL)  # the handshake and the ack, or the end
except OSError:
    pass  # refused: as good an answer as any
import time; deadline = time.monotonic() + 5
while not server.store.received and time.monotonic() < deadline and server.clients():
    time.sleep(0.01)
server.summary()
for capture in server.store.latest():
    server.describe(capture.id)
server.close()
print("shown")
"""

EVIL_TEXT = {"lone surrogate": "bad\\ud800text",
             "terminal escapes": "esc\\x1b]52;c;cHduZWQ=\\x07\\x1b[2Jtext"}


@pytest.mark.parametrize(("field", "evil"), [
    pytest.param(field, evil, id=f"{field}-{evil}") for field in ("name", "value", "hostname",
                                                                 "site") for evil in EVIL_TEXT])
def test_text_a_peer_chooses_cannot_break_or_hijack_the_terminal(field: str, evil: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PEER_TEXT), field, EVIL_TEXT[evil]],
        env=script_env(PYTHONIOENCODING="utf-8"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "shown" in result.stdout, result.stderr[-3000:]
    assert "\x1b" not in result.stdout  # rich styles nothing into a pipe: any ESC is the peer's


def test_numbers_and_text_a_peer_chooses_cannot_widen_the_summary(monkeypatch, capsys) -> None:
    """A 300-digit rank, world size or pid is no number a sender has: it is dropped, not
    shown (its column cannot give way). An announcement's long type and 64-d shape give way."""
    monkeypatch.setenv("COLUMNS", "80")  # as a pipe
    huge = 10**300
    with thing.Server(port=0) as server:
        server.start()
        peer = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        peer.sendall(wire.encode_handshake({"hostname": "raw-peer", "pid": huge}))
        assert recv_handshake(peer)[0] == wire.HANDSHAKE_OK
        announcement = wire.encode_header("asked", value_trees.Payload(None, [], 0), {
            "on_demand": {"type": "T" * 200, "shape": [2**61] * 64, "dtype": "D" * 40}})
        with peer:
            peer.sendall(frame_bytes(np.float32(1.0), "loss", 0,
                                     {"rank": huge, "world_size": huge})
                         + wire.encode_prefix(announcement, 0, 1, 0.0) + announcement
                         + wire.encode_trailer(False))
            assert stored_acks(peer.recv(4096, socket.MSG_WAITALL)) >= 1
            poll(lambda: server.available(), what="the announcement")
            sender = server.capture("loss").sender
            assert (sender.rank, sender.world_size, sender.pid) == (None, None, 0)
            server.summary()
    lines = capsys.readouterr().out.splitlines()
    assert "asked" in "\n".join(lines) and "loss" in "\n".join(lines)
    assert max(map(len, lines)) <= 80, "\n".join(lines)


# -- the token file ---------------------------------------------------------------------------


@pytest.mark.parametrize("flaw", ["world-writable", "a-symlink"])
def test_the_token_file_is_never_written_into_a_directory_others_control(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        flaw: str) -> None:
    home, runtime, elsewhere = tmp_path / "home", tmp_path / "run", tmp_path / "elsewhere"
    for directory in (home, runtime, elsewhere):
        directory.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("THING_TOKEN", raising=False)
    if flaw == "world-writable":  # ~/.thing that anyone may plant files in
        monkeypatch.setenv("XDG_RUNTIME_DIR", "")
        (home / ".thing").mkdir()
        (home / ".thing").chmod(0o777)
    else:  # $XDG_RUNTIME_DIR/thing pointing at the victim's own notes
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
        (runtime / "thing").symlink_to(elsewhere)
    port = free_port()
    notes = elsewhere / f"token-{port}"
    notes.write_text("my notes")
    with caplog.at_level(logging.WARNING, logger="thing"):
        server = thing.Server(port=port, host="0.0.0.0").start()
    try:
        assert server.token  # it still requires one, and says so
        message = next(m for m in caplog.messages if "export THING_TOKEN=" in m)
        assert "No token file was written" in message and "not a private directory" in message
        assert notes.read_text() == "my notes"
        assert list((home / ".thing").iterdir() if flaw == "world-writable" else []) == []
    finally:
        server.close()
    assert notes.read_text() == "my notes"


def test_a_token_file_others_can_read_is_not_used(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    directory = tmp_path / "thing"
    directory.mkdir(mode=0o700)
    (directory / "token-4242").write_text("secret")
    (directory / "token-4242").chmod(0o644)
    assert auth.local_token(4242) is None
    (directory / "token-4242").chmod(0o600)
    assert auth.local_token(4242) == "secret"


# -- slots: a silent crowd is no barrier ------------------------------------------------------


def test_peers_dialling_at_once_all_come_in_while_slots_are_free() -> None:
    """The ranks of a job start together: every one that finds a free slot finishes its
    handshake, however many are in theirs at once; only a full server refuses."""
    with thing.Server(port=0) as server:
        server.max_connections = 8
        ranks = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
                 for _ in range(8)]
        try:
            poll(lambda: server.info().clients == 8, what="all eight to be accepted")
            for rank, sock in enumerate(ranks):  # all eight in their handshake until now
                sock.sendall(wire.encode_handshake({"hostname": f"rank-{rank}", "pid": rank}))
            assert [recv_handshake(sock)[0] for sock in ranks] == [wire.HANDSHAKE_OK] * 8
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as ninth:
                ninth.sendall(wire.encode_handshake({"hostname": "ninth", "pid": 9}))
                assert read_to_end(ninth) == b""  # full, and nobody idle yet
            assert server.refused == 1
            assert not any(closed_by_peer(sock) for sock in ranks)
        finally:
            for sock in ranks:
                sock.close()


def test_a_full_server_closes_the_longest_silent_peer_for_each_newcomer(
        caplog: pytest.LogCaptureFixture) -> None:
    """Peers that connect and say nothing give way, oldest first, and the count never
    passes the cap: one cut off but not yet gone is not chosen a second time. Said once a
    minute, not once a newcomer."""
    with caplog.at_level(logging.INFO, logger="thing"), thing.Server(port=0) as server:
        server.max_connections = 4
        silent = []
        try:
            for _ in range(24):
                silent.append(socket.create_connection(("127.0.0.1", server.port),
                                                       timeout=10))
                assert server.info().clients <= 4
            poll(lambda: server.info().clients == 4, what="four slots held")
            poll(lambda: all(closed_by_peer(sock) for sock in silent[:20]), 10,
                 "the twenty oldest to be closed")
            assert not any(closed_by_peer(sock) for sock in silent[20:])
            assert server.refused == 0
            assert sum("to make room" in m for m in caplog.messages) == 1
        finally:
            for sock in silent:
                sock.close()


def test_idle_peers_holding_every_slot_do_not_keep_a_client_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("thing.server.IDLE_SECONDS", 0.2)  # idle that long: they make room
    with thing.Server(port=0) as server:
        server.max_connections = 16
        idle = [raw_peer(server.port, f"idle-{i}") for i in range(16)]  # handshake, then nothing
        try:
            poll(lambda: len(server.clients()) == 16, what="the idle peers to take every slot")
            client = thing.Client("127.0.0.1", server.port)
            try:  # (refused while they are idle for less than IDLE_SECONDS: it retries)
                poll(lambda: client.catch(np.arange(4), name="legit").wait(5), 15,
                     "the client to be let in")
            finally:
                client.close()
            assert server.get("legit").tolist() == [0, 1, 2, 3]
            assert sum(closed_by_peer(peer) for peer in idle) >= 1  # the longest idle went
        finally:
            for peer in idle:
                peer.close()


def test_clients_that_send_keep_their_slots_and_lose_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """With every slot held by clients that send, a newcomer is refused (it retries): it
    had cut off the one that sent longest ago, 20 ms before, whose captures in flight were
    lost, and which then cut off another on its way back."""
    monkeypatch.setattr("thing.server.IDLE_SECONDS", 2.0)
    with thing.Server(port=0) as server:
        server.max_connections = 2
        senders = [thing.Client("127.0.0.1", server.port) for _ in range(2)]
        try:
            for client in senders:
                assert client.catch(0, name="warm").wait(10)
            stop = threading.Event()
            handles: list[Any] = []

            def send(client: thing.Client) -> None:
                while not stop.is_set():
                    handles.append(client.catch(np.arange(4), name="steady"))
                    time.sleep(0.02)

            threads = [threading.Thread(target=send, args=(c,)) for c in senders]
            for thread in threads:
                thread.start()
            poll(lambda: len(server.clients()) == 2, what="both senders connected")
            for _ in range(5):  # newcomers, one after another, through the cap
                with socket.create_connection(("127.0.0.1", server.port), timeout=10) as extra:
                    extra.sendall(wire.encode_handshake({"hostname": "extra", "pid": 1}))
                    assert read_to_end(extra) == b""  # refused
            stop.set()
            for thread in threads:
                thread.join(10)
            assert all(handle.wait(10) for handle in handles), {h.error for h in handles}
            assert server.refused == 5
            assert sum("already serving" in m for m in caplog.messages) == 1  # once a minute
        finally:
            for client in senders:
                client.close()


def test_peers_that_never_answer_the_challenge_do_not_keep_a_token_client_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THING_TOKEN", raising=False)
    with thing.Server(port=0, token="right") as server:
        server.max_connections = 16
        stop = threading.Event()

        def stall_forever() -> None:  # hello, never answer the challenge, reconnect at once
            while not stop.is_set():
                try:
                    with socket.create_connection(("127.0.0.1", server.port), timeout=1) as peer:
                        peer.sendall(wire.encode_handshake({"nonce": auth.new_nonce()}))
                        while not stop.is_set() and peer.recv(4096):
                            pass
                except OSError:
                    pass

        attackers = [threading.Thread(target=stall_forever, daemon=True) for _ in range(24)]
        for attacker in attackers:
            attacker.start()
        try:
            stored = []
            for i in range(5):
                client = thing.Client("127.0.0.1", server.port, token="right")
                try:
                    stored.append(client.catch(i, name="legit").wait(15))
                finally:
                    client.close()
            assert stored == [True] * 5
        finally:
            stop.set()
            for attacker in attackers:
                attacker.join(10)
