"""Adversity: servers that come late or die, clients that die mid-frame, peers that are not thing.

Real processes and real sockets throughout; every wait has a deadline.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import time

import numpy as np
import pytest

import thing
from thing import wire
from thing.store import HistoryStore

from .conftest import expect_line, free_port, poll, start_script

# A test writes a line on stdin to tell the script "go on".
_start = functools.partial(start_script, stdin=True)


def _round_trip_here(server: thing.Server, name: str) -> None:
    """The server still serves: a fresh client's capture arrives intact."""
    client = thing.Client("127.0.0.1", server.port)
    try:
        value = np.arange(1000, dtype=np.int32) * 3
        assert client.catch(value, name=name).wait(15)
        assert np.array_equal(server.get(name), value)
    finally:
        client.close()


# -- the server comes late, or dies ------------------------------------------------------


def test_server_started_after_the_client(backend: str, processes) -> None:
    port = free_port()
    client = _start(
        """
        import sys, time
        import numpy as np, thing
        started = time.monotonic()
        first = thing.catch(np.arange(3), name="early")
        took = time.monotonic() - started
        delivered = first.wait(10)  # resolves as soon as the connection is refused
        waited = time.monotonic() - started
        started = time.monotonic()
        second = thing.catch(np.arange(3), name="early")
        second_took = time.monotonic() - started
        print("down", delivered, second.wait(0), took, waited, second_took, flush=True)
        sys.stdin.readline()  # the test starts the server now
        deadline = time.monotonic() + 20
        for i in range(10**6):
            if thing.catch(np.full(4, i), name="late").wait(2):
                print("delivered", i, time.monotonic() - started, flush=True)
                break
            assert time.monotonic() < deadline, "never delivered to the late server"
            time.sleep(0.05)
        """,
        port,
    )
    processes.append(client)
    _, delivered, second, took, waited, second_took = expect_line(client, "down").split()
    assert delivered == "False" and second == "False"
    assert float(took) < 0.5 and float(second_took) < 0.1, "catch blocked with no server"
    assert float(waited) < 5
    with thing.Server(port=port) as server:
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
        _, last = expect_line(client, "delivered").split()[:2]
        out, err = client.communicate(timeout=30)
        assert client.returncode == 0, err
        assert np.array_equal(server.get("late"), np.full(4, int(last)))
        assert "early" not in server.store.names()


def test_server_killed_while_a_client_streams(backend: str, processes) -> None:
    port = free_port()
    first_server = _start(
        """
        import os, threading, thing
        server = thing.Server(port=int(os.environ["SERVE_PORT"])).start()
        print("serving", flush=True)
        threading.Event().wait(120)
        """,
        SERVE_PORT=str(port),
    )
    processes.append(first_server)
    expect_line(first_server, "serving")
    client = _start(
        """
        import select, sys, time
        import numpy as np, thing
        raised = acked = 0
        announced = False
        handles = []
        deadline = time.monotonic() + 90
        i = 0
        while time.monotonic() < deadline:
            try:
                handles.append(thing.catch(np.full(256 << 10, i, np.int32), name="stream"))
            except BaseException:
                raised += 1
            i += 1
            done = [h for h in handles if h.done]
            acked += sum(h.wait(0) for h in done)
            handles = [h for h in handles if not h.done]
            if acked and not announced:
                print("acked", flush=True)
                announced = True
            if select.select([sys.stdin], [], [], 0)[0]:
                break
            time.sleep(0.005)
        print(raised, i, flush=True)
        """,
        port,
    )
    processes.append(client)
    expect_line(client, "acked")
    first_server.send_signal(signal.SIGKILL)  # mid-stream, quite possibly mid-frame
    first_server.wait(10)
    with thing.Server(port=port) as second_server:
        second_server.store.wait("stream", timeout=20)  # delivery resumed to the new server
        assert client.poll() is None, "the client process died with its server"
        assert client.stdin is not None
        client.stdin.write("stop\n")
        client.stdin.flush()
        out, err = client.communicate(timeout=30)
    assert client.returncode == 0, err
    raised, caught = map(int, out.split())
    assert raised == 0 and caught > 0
    for value in second_server.get_all("stream"):  # whatever arrived, arrived whole
        assert value.shape == (256 << 10,) and (value == value[0]).all()


# -- a client dies mid-frame ---------------------------------------------------------------

HALF_FRAME = """
import os, socket, sys
import numpy as np
from thing import value_trees, wire
sock = socket.create_connection(("127.0.0.1", int(os.environ["THING_PORT"])), timeout=10)
sock.sendall(wire.encode_handshake({"hostname": "half-frame", "pid": os.getpid()}))
reply = b""
while len(reply) < wire.HANDSHAKE.size:
    reply += sock.recv(wire.HANDSHAKE.size - len(reply))
status, length = wire.decode_handshake_prefix(reply)
assert status == wire.HANDSHAKE_OK
while length:
    length -= len(sock.recv(length))
array = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
payload = value_trees.take_apart({"half": array})
header = wire.encode_header("half", payload, {})
prefix = wire.encode_prefix(header, payload.nbytes, 0, 0.0)
if os.environ["STOP_IN"] == "header":
    sock.sendall(prefix + header[: len(header) // 2])
else:
    sock.sendall(prefix + header)
    sock.sendall(array.view(np.uint8)[: array.nbytes // 2])
print("sent", payload.nbytes, flush=True)
if os.environ["END"] == "close":
    sock.close()
    print("closed", flush=True)
sys.stdin.readline()
"""


def test_a_job_whose_servers_never_answer_exits_in_its_flush_timeout_and_a_bit() -> None:
    """Eight servers that take the connection and never answer the handshake (stopped, or
    hung): the job's exit waits for their channels together, not up to 2 s after 2 s."""
    silent = []
    for _ in range(8):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        silent.append(listener)
    servers = ",".join(f"127.0.0.1:{listener.getsockname()[1]}" for listener in silent)
    try:
        job = start_script(
            """
            import os, numpy as np, thing
            for server in os.environ["SERVERS"].split(","):
                thing.catch(np.zeros(1 << 17), name="x", server=server)
            print("exiting", flush=True)
            """, SERVERS=servers, THING_TRANSPORT="tcp", THING_FLUSH_TIMEOUT="0.5")
        expect_line(job, "exiting")
        started = time.monotonic()
        _, err = job.communicate(timeout=60)
        took = time.monotonic() - started
        assert job.returncode == 0, err
        # The flush (0.5 s), then one wait for all the channels (2 s); 5 s or so before.
        assert took < 4.0, took
    finally:
        for listener in silent:
            listener.close()


@pytest.mark.parametrize(
    ("stop_in", "end"), [("payload", "kill"), ("payload", "close"), ("header", "kill")]
)
def test_client_killed_mid_frame(server: thing.Server, backend: str, processes, stop_in: str,
                                 end: str) -> None:
    healthy = thing.Client("127.0.0.1", server.port)
    try:
        assert healthy.catch(np.ones(10), name="healthy").wait(15)
        held_before, count_before = server.store.held_bytes, len(server.store)
        half = _start(HALF_FRAME, server.port, STOP_IN=stop_in, END=end)
        processes.append(half)
        payload_len = int(expect_line(half, "sent").split()[1])
        if stop_in == "payload":  # the server reserved room for the frame and is receiving it
            if end == "kill":
                # (and its header, while the frame lasts)
                poll(lambda: server.store.held_bytes >= held_before + payload_len,
                      what="the server to hold the frame's bytes")
            else:
                expect_line(half, "closed")
        if end == "kill":
            half.send_signal(signal.SIGKILL)
            half.wait(10)
        poll(lambda: server.store.held_bytes == held_before, what="the reservation to go")
        poll(lambda: all(c.hostname != "half-frame" for c in server.clients()),
              what="the server to drop the dead connection")
        assert len(server.store) == count_before
        assert "half" not in server.store.names()
        # The client that was connected all along is still served, and so is a new one.
        assert healthy.catch(np.zeros(10), name="healthy").wait(15)
        assert server.store.versions("healthy") == 2
        _round_trip_here(server, "afterwards")
    finally:
        healthy.close()


# -- peers that are not (this version of) thing -----------------------------------------

NOT_THING = {
    "http": b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "tls": bytes.fromhex("160301020001000001fc0303") + os.urandom(64),
    "short": b"THN",
    "zeros": bytes(4096),
}


@pytest.mark.parametrize("garbage", list(NOT_THING.values()), ids=list(NOT_THING))
def test_non_thing_peer_is_dropped_and_the_server_keeps_serving(server: thing.Server,
                                                                garbage: bytes) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as peer:
        peer.sendall(garbage)
        if len(garbage) < wire.HANDSHAKE.size:
            peer.shutdown(socket.SHUT_WR)  # an incomplete handshake, then the end of it
        reply = b""
        try:
            while chunk := peer.recv(4096):
                reply += chunk
        except ConnectionResetError:
            pass  # dropped with our bytes unread: a reset instead of a clean close
    assert reply == b""  # nothing of the protocol is revealed to a stranger
    _round_trip_here(server, "after-garbage")


def test_garbage_after_a_valid_handshake_is_dropped(server: thing.Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as peer:
        peer.sendall(wire.encode_handshake({"hostname": "h", "pid": 1}))
        reply = peer.recv(wire.HANDSHAKE.size, socket.MSG_WAITALL)
        assert wire.decode_handshake_prefix(reply)[0] == wire.HANDSHAKE_OK
        peer.recv(4096)  # the rest of the server's handshake
        peer.sendall(b"not a frame prefix at all, nor anything like one")
        poll(lambda: all(c.hostname != "h" for c in server.clients()), what="the drop")
        answer = b""
        try:
            while chunk := peer.recv(4096):
                answer += chunk
        except ConnectionResetError:
            pass
        if answer:  # the reason, as a rejection of the frame being received
            status, length, seq, _ = wire.decode_ack(answer[: wire.ACK.size])
            assert (status, seq) == (wire.ACK_REJECTED, wire.SEQ_OLDEST_UNANSWERED)
            assert b"prefix" in answer[wire.ACK.size :]
    assert len(server.store) == 0
    _round_trip_here(server, "after-bad-frame")


def _refusal_for(server: thing.Server, body: bytes) -> dict:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as peer:
        peer.sendall(wire.HANDSHAKE.pack(wire.MAGIC, wire.VERSION + 1, 0, len(body)) + body)
        reply = b""
        while chunk := peer.recv(4096):
            reply += chunk
    magic, version, status, length = wire.HANDSHAKE.unpack(reply[: wire.HANDSHAKE.size])
    assert (magic, version, status) == (wire.MAGIC, wire.VERSION, wire.HANDSHAKE_REFUSED)
    return json.loads(reply[wire.HANDSHAKE.size : wire.HANDSHAKE.size + length])


def test_other_protocol_version_gets_a_clear_refusal(server: thing.Server) -> None:
    refusal = _refusal_for(server, b"")
    assert "version" in refusal["error"]
    assert str(wire.VERSION + 1) in refusal["error"] and str(wire.VERSION) in refusal["error"]
    _round_trip_here(server, "after-refusal")


def test_other_protocol_version_sending_its_info_gets_the_refusal(server: thing.Server) -> None:
    """As a real client of another version does: its hello comes with its info attached."""
    body = json.dumps({"hostname": "future", "pid": 1, "thing": "9.0"}).encode()
    for _ in range(20):  # the refusal used to be lost to a reset now and then
        assert "version" in _refusal_for(server, body)["error"]
    _round_trip_here(server, "after-refusals")


def test_client_reports_a_server_of_another_version(caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A thing client talking to a newer server logs why it cannot send, once, as a warning."""
    monkeypatch.setenv("THING_TRANSPORT", "tcp")  # the fake server has no Unix socket
    with socket.create_server(("127.0.0.1", 0)) as fake:
        fake.settimeout(10)
        client = thing.Client("127.0.0.1", fake.getsockname()[1])
        with caplog.at_level(logging.WARNING, logger="thing"):
            handle = client.catch(np.arange(3), name="x")
            peer, _ = fake.accept()
            with peer:
                hello = peer.recv(wire.HANDSHAKE.size, socket.MSG_WAITALL)
                _, _, _, length = wire.HANDSHAKE.unpack(hello)
                peer.recv(length, socket.MSG_WAITALL)
                body = json.dumps({"server": "thing"}).encode()
                peer.sendall(wire.HANDSHAKE.pack(wire.MAGIC, wire.VERSION + 1, 0, len(body)) + body)
                assert handle.wait(10) is False
            # The handle is resolved just before the warning is logged.
            poll(lambda: any("version" in r.getMessage() for r in caplog.records),
                  what=f"a warning about the version, got {caplog.messages}")
        client.close()


# -- limits ------------------------------------------------------------------------------


def test_capture_over_the_store_cap_is_refused_and_the_connection_lives_on() -> None:
    with thing.Server(port=0, store=HistoryStore(max_bytes=1 << 20)) as server:
        client = thing.Client("127.0.0.1", server.port)
        try:
            too_big = client.catch(np.zeros(2 << 20, np.uint8), name="big")
            assert too_big.wait(15) is False
            assert "larger than the store" in too_big.error
            assert client.catch(np.ones(100), name="small").wait(15)
            assert 800 <= server.store.held_bytes < 1 << 20  # nothing of "big" is held
            assert server.store.names() == ["small"]
        finally:
            client.close()


def test_frame_over_the_capture_limit_is_dropped_before_allocation() -> None:
    limits = wire.Limits(max_capture_bytes=1 << 20)
    with thing.Server(port=0, limits=limits) as server:
        client = thing.Client("127.0.0.1", server.port)
        try:
            big = client.catch(np.zeros(2 << 20, np.uint8), name="big")
            # The server drops the connection; the client reconnects and sends what fits.
            deadline = time.monotonic() + 15
            while not client.catch(np.ones(10), name="small").wait(5):
                assert time.monotonic() < deadline
            assert big.done and big.wait(0) is False
            assert server.store.names() == ["small"]
            assert server.store.held_bytes < 1 << 20
            assert len(server.store) == 1
        finally:
            client.close()


def test_a_capture_over_the_capture_limit_is_listed_in_the_repl_by_its_name() -> None:
    """Refused for its size before its payload is read, it is still named where the user
    looks (summary, get, describe), with the reason its handle gives."""
    with thing.Server(port=0, limits=wire.Limits(max_capture_bytes=1 << 20)) as server:
        client = thing.Client("127.0.0.1", server.port)
        try:
            big = client.catch({"w": np.zeros(2 << 20, np.uint8)}, name="too_big")
            assert big.wait(10) is False and "exceeds 1048576" in big.error
            assert client.catch(1.0, name="after").wait(10)
            [notice] = server.store.unsent("too_big")
            assert notice.refused and big.error == f"refused by the server: {notice.reason}"
            assert notice.type_name == "dict"
            with pytest.raises(thing.UnknownName, match=r"server refused it \(capture of 2097"):
                server.get("too_big")
        finally:
            client.close()


def test_dropped_connection_resolves_the_handles_in_flight() -> None:
    """The frame is all in the kernel when the server drops the connection: fail it at once."""
    limits = wire.Limits(max_capture_bytes=4096)
    with thing.Server(port=0, limits=limits) as server:
        client = thing.Client("127.0.0.1", server.port)
        try:
            big = client.catch(np.zeros(8192, np.uint8), name="big")  # fits the socket buffers
            assert big.wait(10) is False
            assert big.done, "still pending although the server closed the connection"
        finally:
            client.close()
