"""Acknowledgements are the truth: every capture gets exactly one outcome, and its own.

Stored (with its id), refused (with its own reason), or not delivered: never
"lost" for a capture the server kept, never a refusal pinned on the wrong
capture, never a handle left pending.
"""

from __future__ import annotations

import contextlib
import json
import select
import signal
import socket
import threading
import time

import numpy as np

import thing
from thing import value_trees, wire
from thing.channel import MAX_IN_FLIGHT
from thing.sockets import connect, set_timeouts
from thing.stream import StreamReader

from .conftest import expect_line, poll, run_script, start_script
from .test_catch import STUCK, _StalledServer
from .test_security import frame_bytes


def test_stored_and_oversized_captures_each_get_their_own_outcome(processes) -> None:
    limits = wire.Limits(max_capture_bytes=1 << 20, max_header_bytes=4 << 10)
    with thing.Server(port=0, limits=limits) as server:
        out = run_script(
            """
            import json, numpy as np, thing
            small, big = np.arange(1000, dtype=np.int32), np.zeros(2 << 20, np.uint8)
            handles = []
            for i in range(30):
                if i % 3 == 1:
                    handles.append(thing.catch(big, name=f"big-{i}", block=True))
                elif i % 3 == 2:
                    handles.append(thing.catch(small, name="h" * 8000, block=True))  # header
                else:
                    handles.append(thing.catch(small + i, name=f"small-{i}", block=True))
            for h in handles:
                h.wait(30)
            print(json.dumps([[h.id, h.error] for h in handles]))
            """,
            server.port,
        )
        outcomes = json.loads(out)
        for i, (capture_id, error) in enumerate(outcomes):
            if i % 3 == 0:
                assert error is None and server.capture(capture_id).name == f"small-{i}"
                assert server.get(capture_id).tolist() == (np.arange(1000) + i).tolist()
            elif i % 3 == 1:
                assert capture_id is None and "refused" in error and "capture of" in error, error
            else:
                assert capture_id is None and "header of" in error, error
        # One connection served them all: refusals did not drop it.
        assert len({capture.sender.address for capture in server.store.get_all("small-0")
                    + server.store.get_all("small-27")}) == 1
        assert server.received == 10 and server.dropped_transfers == 20


def _read_all_acks(peer: socket.socket) -> list[tuple[int, int, int, bytes]]:
    """Every acknowledgement a server sends until it hangs up: (status, seq, id, message)."""
    reply = b""
    while chunk := peer.recv(65536):
        reply += chunk
    acks = []
    while reply:
        status, length, seq, capture_id = wire.decode_ack(reply[: wire.ACK.size])
        acks.append((status, seq, capture_id, reply[wire.ACK.size : wire.ACK.size + length]))
        reply = reply[wire.ACK.size + length :]
    return acks


def test_a_small_frame_over_the_limit_is_refused_each_time_it_comes() -> None:
    """Its header is read for its name: a header so read is never kept, or the run of
    small frames would store the next frames under it without a look at their size."""
    limits = wire.Limits(max_capture_bytes=1000)
    with thing.Server(port=0, limits=limits) as server, connect("127.0.0.1", server.port,
                                                                10) as peer:
        peer.sendall(wire.encode_handshake({"hostname": "raw", "pid": 1}))
        assert wire.recv_handshake(peer)[0] == wire.HANDSHAKE_OK
        peer.sendall(b"".join(
            frame_bytes(np.float32([seq]), "small", seq) if seq in (0, 6) else
            frame_bytes(np.zeros(1200, np.uint8), "big", seq) for seq in range(7)))
        peer.shutdown(socket.SHUT_WR)
        acks = _read_all_acks(peer)
    assert [status for status, *_ in acks] == [wire.ACK_STORED] + [wire.ACK_REJECTED] * 5 + [
        wire.ACK_STORED]
    assert server.store.names() == ["small"] and server.store.versions("small") == 2
    [notice] = server.store.unsent("big")
    assert notice.refused and "exceeds 1000" in notice.reason


def test_a_malformed_frame_closes_only_after_the_acks_of_stored_ones() -> None:
    with thing.Server(port=0) as server, connect("127.0.0.1", server.port, 10) as peer:
        peer.sendall(wire.encode_handshake({"hostname": "raw", "pid": 1}))
        status, _ = wire.recv_handshake(peer)
        assert status == wire.HANDSHAKE_OK
        frames = b"".join(frame_bytes(np.arange(i + 1), f"good-{i}", seq=i) for i in range(5))
        peer.sendall(frames + b"XX" + bytes(wire.FRAME_PREFIX.size - 2))  # a prefix that is none
        acks = _read_all_acks(peer)
    assert [(status, seq) for status, seq, _, _ in acks[:5]] == [(wire.ACK_STORED, i)
                                                                    for i in range(5)]
    assert len(acks) == 6 and acks[5][0] == wire.ACK_REJECTED and b"prefix" in acks[5][3]
    assert len(server.store) == 5


def test_frames_that_came_together_are_stored_together_and_the_odd_ones_each_as_before(
        backend) -> None:
    """A burst of small frames of known headers is stored as a run; a frame among them
    that needs more (a header not seen before, a notice, one over a limit, a bad trailer)
    is read with every check, in its place: every ack in frame order, every value exact,
    with either core splitting the run."""
    limits = wire.Limits(max_capture_bytes=1 << 20, max_header_bytes=4 << 10)
    site = {"site": "train.py:1 (step)"}
    frames, expected = [], []  # expected: (seq, name, value) stored, or (seq, None, reason)
    for seq in range(300):
        kind = seq % 50
        if kind == 17:  # a header seen for the first time, halfway through the burst
            value, name = np.arange(seq, seq + 3, dtype=np.int64), f"new-{seq}"
        elif kind == 29:  # a notice of a capture the sender could not send: no data
            frames.append(frame_bytes(None, "loss", seq, {"unsent": {"type": "x", "reason": "r"}}))
            expected.append((seq, None, b""))
            continue
        elif kind == 41:  # over the limit: refused and read past, the run goes on after it
            frames.append(frame_bytes(np.zeros(2 << 20, np.uint8), "loss", seq, site))
            expected.append((seq, None, b"exceeds"))
            continue
        elif kind in (3, 4, 5):  # several arrays in one capture, in the run from the second
            value = {"w": np.float64([seq, 0.5]), "n": np.int16([-seq, 7, 1])}
            frames.append(frame_bytes(value, "pair", seq, site))
            expected.append((seq, "pair", value))
            continue
        else:
            value, name = np.float32([seq, -seq, seq / 7]), "loss"
        frames.append(frame_bytes(value, name, seq, site))
        expected.append((seq, name, value))
    bad = bytearray(frame_bytes(np.float32([1, 2, 3]), "loss", 300, site))
    bad[-wire.FRAME_TRAILER.size] ^= 0xFF  # the trailer's tag: the stream cannot be trusted
    with thing.Server(port=0, limits=limits) as server, connect("127.0.0.1", server.port,
                                                                10) as peer:
        runs: list[int] = []
        store_run = server.store.add_arrived
        server.store.add_arrived = lambda captures, charges: (  # type: ignore[method-assign]
            runs.append(len(captures)), store_run(captures, charges))
        peer.sendall(wire.encode_handshake({"hostname": "raw", "pid": 1}))
        assert wire.recv_handshake(peer)[0] == wire.HANDSHAKE_OK
        peer.sendall(b"".join(frames) + bytes(bad))
        acks = _read_all_acks(peer)
        assert [seq for _, seq, _, _ in acks[:300]] == list(range(300))
        for (status, seq, capture_id, message), (_, name, value) in zip(acks, expected):
            if name is None and value:  # refused, with its own reason
                assert status == wire.ACK_REJECTED and value in message, (seq, message)
                continue
            if name is None:  # a notice: answered, nothing stored
                assert (status, capture_id, message) == (wire.ACK_STORED, -1, b""), seq
                continue
            assert status == wire.ACK_STORED, (seq, message)
            stored = server.capture(capture_id)
            assert stored.name == name and stored.call_site == "train.py:1 (step)"
            for got, sent in ([(stored.value[key], value[key]) for key in value]
                              if name == "pair" else [(stored.value, value)]):
                assert got.dtype == sent.dtype and got.shape == sent.shape, seq
                assert got.tobytes() == sent.tobytes() and got.flags.writeable, seq
                assert got.flags.aligned, seq
        assert len(acks) == 301 and acks[300][0] == wire.ACK_REJECTED
        assert b"trailer" in acks[300][3], acks[300][3]
        kept = [capture.value.tobytes() for capture in server.store.get_all("loss")]
        assert kept == [value.tobytes() for _, name, value in expected if name == "loss"]
        assert server.received == 300 - 6 - 6  # notices and refusals are not captures
        notices = server.store.unsent()
        assert [notice.name for notice in notices if not notice.refused] == ["loss"]
        # The frames over the limit are listed by name: their headers are read, not their data.
        assert [(notice.name, notice.refused) for notice in notices if notice.refused] == [
            ("loss", True)]
        assert max(runs) > 1 and sum(runs) < server.received  # both ways were taken


def test_a_server_closing_mid_stream_acknowledges_all_it_kept(processes) -> None:
    server = thing.Server(port=0).start()
    sender = start_script(
        """
        import json, sys, numpy as np, thing
        client = thing.Client("127.0.0.1", PORT)
        handles = [client.catch(np.full(64, i), name="n", block=True) for i in range(500)]
        print("caught", flush=True)
        sys.stdin.readline()
        client.flush(5)  # the server goes away meanwhile
        handles += [client.catch(np.full(64, i), name="n", block=True) for i in range(500, 4000)]
        for h in handles:
            assert h.wait(30) or h.done, "a handle never resolved"
        print(json.dumps([h.id for h in handles]))
        """.replace("PORT", str(server.port)),
        stdin=True,
    )
    processes.append(sender)
    expect_line(sender, "caught")
    poll(lambda: server.store.received >= 500, what="the first captures")
    sender.stdin.write("go\n")
    sender.stdin.flush()
    poll(lambda: server.store.received >= 1000, what="more captures to stream")
    server.close()  # mid-stream
    kept = {capture.id for capture in server.store.get_all("n")}
    out, err = sender.communicate(timeout=60)
    assert sender.returncode == 0, err
    acknowledged = {capture_id for capture_id in json.loads(out) if capture_id is not None}
    assert acknowledged == kept  # stored and told so; nothing kept was reported lost


def test_a_killed_server_leaves_no_handle_pending(processes) -> None:
    repl = start_script(
        """
        import thing
        server = thing.Server(port=0).start()
        print(server.port, flush=True)
        import time
        time.sleep(600)
        """
    )
    processes.append(repl)
    port = int(repl.stdout.readline())
    sender = start_script(
        """
        import sys, numpy as np, thing
        client = thing.Client("127.0.0.1", PORT)
        first = client.catch(np.zeros(4), name="warm-up")
        assert first.wait(30)
        print("connected", flush=True)
        handles = [client.catch(np.full(4096, i), name="n", block=True) for i in range(3000)]
        for h in handles:
            h.wait(30)
        assert all(h.done for h in handles)
        stored = sum(h.id is not None for h in handles)
        told = {h.error.split(":")[0] for h in handles if h.id is None}
        print(stored, sorted(told), flush=True)
        """.replace("PORT", str(port))
    )
    processes.append(sender)
    expect_line(sender, "connected")
    repl.send_signal(signal.SIGKILL)
    out, err = sender.communicate(timeout=90)
    assert sender.returncode == 0, err
    stored, *_ = out.split(maxsplit=1)
    assert int(stored) < 3000  # the kill landed mid-stream


def test_close_resolves_every_queued_and_in_flight_handle(monkeypatch) -> None:
    monkeypatch.setenv("THING_TRANSPORT", "tcp")  # the stalled server has no Unix socket
    stalled = _StalledServer()
    client = thing.Client("127.0.0.1", stalled.port, max_queue_items=50)
    try:
        handles = [client.catch(STUCK, name="big")]
        poll(client.connected, what="the connection")
        handles += [client.catch(np.full(10, i), name="small") for i in range(49)]
        assert not any(h.done for h in handles[:2])
        client.close()  # timeout=0: nothing is flushed
        waiter = threading.Thread(target=lambda: [h.wait() for h in handles])
        waiter.start()
        waiter.join(10)
        assert not waiter.is_alive(), "wait() without a timeout hung after close()"
        assert all(h.done and h.id is None for h in handles)
        assert all("closed" in h.error for h in handles), {h.error for h in handles}
        assert client.catch(1, name="after").error == "not sent: the client is closed"
    finally:
        stalled.close()


def test_the_sender_thread_survives_an_unexpected_error(server: thing.Server,
                                                         monkeypatch) -> None:
    calls = {"n": 0}
    original = wire.encode_trailer

    def broken_once(modified: bool) -> bytes:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in the sender")
        return original(modified)

    monkeypatch.setattr(wire, "encode_trailer", broken_once)
    client = thing.Client("127.0.0.1", server.port)
    try:
        first = client.catch(np.zeros(3), name="first")
        assert first.wait(10) is False and first.done
        later = [client.catch(np.full(3, i), name="later") for i in range(20)]
        assert all(h.wait(10) for h in later)
        assert [int(v[0]) for v in server.get_all("later")] == list(range(20))
    finally:
        client.close()


def test_senders_report_what_they_could_not_deliver() -> None:
    """Captures dropped while no server listened show up in the REPL once one does."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = thing.Client("127.0.0.1", port)
    try:
        lost = [client.catch(np.zeros(2), name="early") for _ in range(5)]
        poll(lambda: all(h.done for h in lost), what="the early captures to fail")
        assert client.undelivered == {"no server": 5}
        with thing.Server(port=port) as server:
            poll(lambda: client.catch(1.0, name="later").wait(2), what="the late server")
            assert client.catch(2.0, name="last").wait(10)
            reported = server.store.overview().undelivered
            assert reported == client.undelivered and reported["no server"] >= 5
    finally:
        client.close()


def test_a_frame_trickled_slower_than_the_minimum_rate_is_cut_off() -> None:
    server = thing.Server(port=0)
    server.idle_timeout, server.min_rate = 1.0, 1 << 20
    server.start()
    try:
        with connect("127.0.0.1", server.port, 10) as peer:
            peer.sendall(wire.encode_handshake({"hostname": "slow", "pid": 1}))
            assert wire.recv_handshake(peer)[0] == wire.HANDSHAKE_OK
            frame = frame_bytes(np.zeros(1 << 18, np.uint8), "slow", seq=0)  # 256 KiB
            peer.sendall(frame[:1000])
            poll(lambda: server.store.held_bytes >= 1 << 18, what="the reservation")
            answer = b""
            try:
                for _ in range(100):  # a byte every 50 ms: far below 1 MiB/s
                    if not server.clients():
                        break
                    peer.sendall(b"\0")
                    threading.Event().wait(0.05)
                answer = peer.recv(4096)
            except OSError:
                pass
        poll(lambda: not server.clients(), what="the slow peer to be cut off")
        assert server.store.held_bytes == 0 and len(server.store) == 0
        if answer:
            assert wire.decode_ack(answer[: wire.ACK.size])[0] == wire.ACK_REJECTED
    finally:
        server.close()


def _handshaken(port: int, hostname: str) -> socket.socket:
    peer = connect("127.0.0.1", port, 10)
    peer.sendall(wire.encode_handshake({"hostname": hostname, "pid": 1}))
    assert wire.recv_handshake(peer)[0] == wire.HANDSHAKE_OK
    return peer


def test_a_refused_claim_read_past_a_byte_now_and_then_is_cut_off() -> None:
    """A frame refused for the size it claims (2**62 bytes) is read past so the connection
    goes on; read at its claim's pace, a byte now and then held the connection (and its
    slot: 256 such peers locked every job out) for ever. Each 4 MiB of it is now due when
    the minimum rate says."""
    server = thing.Server(port=0)
    server.idle_timeout, server.min_rate = 1.0, 1 << 20
    server.start()
    try:
        header = wire.encode_header("huge", value_trees.take_apart(np.zeros(4, np.uint8)), {})
        with _handshaken(server.port, "claims") as peer:
            peer.sendall(wire.encode_prefix(header, 1 << 62, 0, 0.0) + header)
            started = time.monotonic()
            with contextlib.suppress(OSError):
                while server.clients() and time.monotonic() - started < 30:
                    peer.sendall(b"\0")  # far below 1 MiB/s
                    threading.Event().wait(0.2)
            poll(lambda: not server.clients(), what="the peer to be cut off")
            assert time.monotonic() - started < 1.0 + 4 + 5  # idle, a piece's 4 s, slack
    finally:
        server.close()


def test_headers_trickled_by_many_peers_hold_what_they_sent_of_the_header_budget(
        monkeypatch) -> None:
    """Sixteen peers each claim a 1 MiB header and send it a byte now and then: the budget
    all headers share (16 MiB here) was taken whole at the claim, and every other job's new
    header refused ("headers being received already hold ..."). It is now taken as the
    bytes come, and each header is due by its own length, not its payload's."""
    monkeypatch.setenv("THING_STORE_BYTES", str(128 << 20))  # a header budget of 16 MiB
    server = thing.Server(port=0)
    server.idle_timeout, server.min_rate = 2.0, 1 << 20
    server.start()
    peers = []
    try:
        for i in range(16):
            peer = _handshaken(server.port, f"trickler{i}")
            peer.sendall(wire.FRAME_PREFIX.pack(wire.FRAME_TAG, 1, 1 << 20, 1 << 62, i, 0.0, 0,
                                                wire.NO_STEP) + b"{")
            peers.append(peer)
        with _handshaken(server.port, "honest") as honest:
            honest.sendall(frame_bytes(np.arange(4.0), "loss", seq=0))
            honest.settimeout(10)
            status = wire.decode_ack(honest.recv(4096)[: wire.ACK.size])[0]
        assert status != wire.ACK_REJECTED and server.store.get("loss").value.tolist() == [
            0.0, 1.0, 2.0, 3.0]
        poll(lambda: len(server.clients()) == 0, timeout=2.0 + 1 + 10,
             what="the trickling peers to be cut off by their headers' length")
    finally:
        for peer in peers:
            peer.close()
        server.close()


def test_a_stream_cut_inside_a_prefix_is_answered_as_a_frame_that_did_not_arrive() -> None:
    with thing.Server(port=0) as server, connect("127.0.0.1", server.port, 10) as peer:
        peer.sendall(wire.encode_handshake({"hostname": "raw", "pid": 1}))
        status, _ = wire.recv_handshake(peer)
        assert status == wire.HANDSHAKE_OK
        good = frame_bytes(np.arange(3), "good", seq=0)
        peer.sendall(good + frame_bytes(np.arange(3), "cut", seq=1)[:10])
        peer.shutdown(socket.SHUT_WR)  # the rest of that prefix never comes
        reply = b""
        while chunk := peer.recv(65536):
            reply += chunk
    status, length, seq, capture_id = wire.decode_ack(reply[: wire.ACK.size])
    assert (status, seq) == (wire.ACK_STORED, 0)
    status, length, seq, _ = wire.decode_ack(reply[wire.ACK.size : 2 * wire.ACK.size])
    assert (status, seq) == (wire.ACK_REJECTED, wire.SEQ_OLDEST_UNANSWERED)
    assert b"did not arrive whole" in reply[2 * wire.ACK.size :]
    assert len(server.store) == 1 and server.dropped_transfers == 1


class _AnsweringPeer:
    """A scripted thing server: after the handshake it reads ``count`` frames, writing
    ``answer(seqs)`` (the bytes of its acknowledgements for the frames read so far, each
    answer beginning with the one before) after every hundred of them and at the end,
    and stays open. A client keeps at most MAX_IN_FLIGHT frames unanswered."""

    def __init__(self, count: int, answer) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.peer: socket.socket | None = None
        self.seqs: list[int] = []
        self._count, self._answer = count, answer
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.peer, _ = self.listener.accept()
        set_timeouts(self.peer, 20, 20)  # kernel timeouts: the compiled core reads it
        stream = StreamReader(self.peer)
        _, length = wire.decode_handshake_prefix(stream.read(wire.HANDSHAKE.size))
        stream.read(length)
        self.peer.sendall(wire.encode_handshake({"server": "scripted", "control": True}))
        answered = 0
        while len(self.seqs) < self._count:
            prefix = wire.decode_prefix(stream.read(wire.FRAME_PREFIX.size))
            stream.skip(prefix.header_len + prefix.payload_len + wire.FRAME_TRAILER.size)
            self.seqs.append(prefix.seq)
            if len(self.seqs) % 100 == 0 or len(self.seqs) == self._count:
                answer = self._answer(self.seqs)
                self.peer.sendall(answer[answered:])
                answered = len(answer)

    def close(self) -> None:
        self._thread.join(20)
        for sock in (self.listener, self.peer):
            if sock is not None:
                sock.close()


def test_a_burst_of_acks_with_refusals_and_control_messages_among_them(monkeypatch,
                                                                      backend) -> None:
    # The reader splits runs of plain "stored" acks in one call, and reads whatever breaks a
    # run (a refusal with its message, a control message) the general way, then goes on.
    monkeypatch.setenv("THING_TRANSPORT", "tcp")  # the scripted peer has no Unix socket

    def answer(seqs: list[int]) -> bytes:
        out = []
        for i, seq in enumerate(seqs):
            if i % 50 == 25:
                out.append(wire.encode_control("every", f"steered-{i}", None, 3))
            out.append(wire.encode_ack(seq, -1, f"no room for {i}") if i % 7 == 3
                       else wire.encode_ack(seq, 1000 + i))
        return b"".join(out)

    split: list[int] = []  # how many acks each bulk split took
    decode_stored_acks = wire.decode_stored_acks
    monkeypatch.setattr(wire, "decode_stored_acks", lambda data, limit: split.append(
        len(acks := decode_stored_acks(data, limit))) or acks)
    peer = _AnsweringPeer(300, answer)
    client = thing.Client("127.0.0.1", peer.port)
    try:
        handles = [client.catch(np.full(4, i, np.float32), name="burst", block=True)
                   for i in range(300)]
        assert client.flush(20)
        for i, handle in enumerate(handles):
            if i % 7 == 3:
                assert handle.id is None and handle.error == (
                    f"refused by the server: no room for {i}"), (i, handle)
            else:
                assert handle.id == 1000 + i and handle.error is None, (i, handle)
        assert client.sent == 300 - len(range(3, 300, 7))
        assert peer.seqs == list(range(300))
        steered = client._overrides._table.names()
        assert steered == {f"steered-{i}" for i in range(25, 300, 50)}, steered
        # The runs between refusals and control messages went through the bulk split (but
        # for an ack cut by the end of a receive, which is read whole the general way).
        assert sum(split) >= client.sent * 3 // 4 and max(split) >= 5, split
    finally:
        client.close()
        peer.close()


def test_a_client_keeps_at_most_max_in_flight_frames_unanswered(monkeypatch) -> None:
    # The sender reads answers between its sends: the server's unread answers must never
    # fill its socket buffer while a long send of ours waits for it to read. A peer that
    # reads without answering gets MAX_IN_FLIGHT frames, then none until it answers.
    monkeypatch.setenv("THING_TRANSPORT", "tcp")
    count = MAX_IN_FLIGHT + 50
    listener = socket.create_server(("127.0.0.1", 0))
    seen: dict[str, object] = {}

    def serve() -> None:
        peer, _ = listener.accept()
        with peer:
            set_timeouts(peer, 20, 20)
            stream = StreamReader(peer)
            _, length = wire.decode_handshake_prefix(stream.read(wire.HANDSHAKE.size))
            stream.read(length)
            peer.sendall(wire.encode_handshake({"server": "scripted"}))
            seqs: list[int] = []

            def read_frames(until: int) -> None:
                while len(seqs) < until:
                    prefix = wire.decode_prefix(stream.read(wire.FRAME_PREFIX.size))
                    stream.skip(prefix.header_len + prefix.payload_len + wire.FRAME_TRAILER.size)
                    seqs.append(prefix.seq)

            read_frames(MAX_IN_FLIGHT)
            seen["more before an answer"] = bool(
                stream.buffered or select.select([peer], [], [], 0.5)[0])
            peer.sendall(b"".join(wire.encode_ack(seq, 1000 + seq) for seq in seqs))
            read_frames(count)
            peer.sendall(b"".join(wire.encode_ack(seq, 1000 + seq)
                                  for seq in seqs[MAX_IN_FLIGHT:]))
            peer.recv(1)  # until the client leaves

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    # Room in the queue comes back once a frame is sent, not once it is answered: a queue of
    # ten still fills the wire up to MAX_IN_FLIGHT, and then waits (block=True) for answers.
    client = thing.Client("127.0.0.1", listener.getsockname()[1], max_queue_items=10)
    try:
        handles = [client.catch(np.full(4, i, np.float32), name="capped", block=True)
                   for i in range(count)]
        assert client.flush(20)
        assert [handle.id for handle in handles] == [1000 + seq for seq in range(count)]
        assert seen == {"more before an answer": False}
    finally:
        client.close()
        thread.join(20)
        listener.close()


def test_a_stored_ack_out_of_order_in_a_burst_breaks_the_connection(monkeypatch) -> None:
    # Those before it are settled; it and the rest are not pinned on the wrong captures.
    monkeypatch.setenv("THING_TRANSPORT", "tcp")

    def answer(seqs: list[int]) -> bytes:
        order = seqs[:5] + [seqs[6], seqs[5]] + seqs[7:]
        return b"".join(wire.encode_ack(seq, 1000 + seq) for seq in order)

    peer = _AnsweringPeer(10, answer)
    client = thing.Client("127.0.0.1", peer.port)
    try:
        handles = [client.catch(np.full(4, i, np.float32), name="order", block=True)
                   for i in range(10)]
        client.flush(20)
        assert [h.id for h in handles[:5]] == [1000 + seq for seq in peer.seqs[:5]]
        assert all(h.id is None and "lost" in h.error for h in handles[5:]), handles[5:]
    finally:
        client.close()
        peer.close()
