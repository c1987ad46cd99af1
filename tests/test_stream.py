"""Reading many frames at once: the read-ahead reader, and headers validated once.

Real sockets throughout: a socketpair for the reader itself, a real server
(in this process, so its connection can be inspected) for the header cache.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

import thing
from thing import _core, value_trees, wire
from thing._core import fallback
from thing.errors import ProtocolError
from thing.receiver import CACHED_HEADER_MAX, HEADER_CACHE_BYTES
from thing.sockets import set_timeouts
from thing.stream import BUFFER_BYTES, StreamReader

from .conftest import poll
from .test_security import raw_peer, read_to_end

MOVERS = {"compiled": _core, "python": fallback}


@pytest.mark.parametrize("movers", sorted(MOVERS))
def test_recv_some_takes_what_has_arrived_and_the_descriptors_with_it(movers: str) -> None:
    recv_some = MOVERS[movers].recv_some
    left, right = socket.socketpair()
    reader, writer = os.pipe()
    try:
        left.sendall(b"first")
        socket.send_fds(left, [b"second"], [reader])
        buffer, passed = bytearray(64), []
        received = 0
        while received < 11:
            received += recv_some(right, buffer, 2 + received, passed)
        assert bytes(buffer[2:13]) == b"firstsecond" and len(passed) == 1
        assert os.fstat(passed[0]).st_ino == os.fstat(reader).st_ino  # the same pipe
        os.close(passed.pop())
        # More descriptors than one receive takes: an error, and those that came are listed.
        socket.send_fds(left, [b"x"], [reader] * (_core.MAX_DESCRIPTORS + 2))
        with pytest.raises(OSError) as refused:
            recv_some(right, buffer, 0, passed)
        assert refused.value.errno == errno.EMSGSIZE and len(passed) == _core.MAX_DESCRIPTORS
        for fd in passed:
            os.close(fd)
        with pytest.raises(ValueError):
            recv_some(right, buffer, 64)
        left.close()
        assert recv_some(right, buffer, 0) == 0  # the end of the stream
    finally:
        for fd in (reader, writer):
            os.close(fd)
        right.close()


def test_the_reader_takes_a_burst_of_messages_in_one_receive_and_splits_them() -> None:
    left, right = socket.socketpair()
    records = [i.to_bytes(4, "little") * 8 for i in range(1000)]  # 32 KB in all
    left.sendall(b"".join(records))
    stream = StreamReader(right)
    assert stream.read(32) == records[0]
    # The rest came with the same receive, or with a few: not one per record.
    assert stream.buffered >= 16 * 32
    for record in records[1:]:
        assert stream.read(32) == record
    left.close()
    with pytest.raises(ConnectionResetError):
        stream.read(1)
    right.close()


def test_a_large_read_goes_past_the_buffer_straight_into_the_array() -> None:
    left, right = socket.socketpair()
    payload = np.random.default_rng(1).integers(0, 255, 3 * BUFFER_BYTES + 7, dtype=np.uint8)
    waits = []
    stream = StreamReader(right, before_wait=lambda: waits.append(1))
    left.sendall(b"head" + payload.tobytes() + b"tail")
    assert stream.read(4) == b"head"
    received, tail = np.empty_like(payload), bytearray(4)
    stream.read_into([received, tail])
    assert np.array_equal(received, payload) and tail == b"tail" and not stream.buffered
    assert waits  # each read that may wait is announced (the receiver starts a deadline)
    # Reads that straddle the buffer's end: what is left moves to the front first.
    chunks = [bytes([i]) * 1000 for i in range(200)]
    left.sendall(b"".join(chunks))
    for chunk in chunks:
        assert stream.read(1000) == chunk
    left.close()
    right.close()


def test_descriptors_are_taken_by_frames_in_the_order_they_came() -> None:
    left, right = socket.socketpair()
    pipes = [os.pipe() for _ in range(3)]
    try:
        for number, (reader, _) in enumerate(pipes):
            socket.send_fds(left, [bytes([number]) * 10], [reader])
        stream = StreamReader(right)
        stream.take_descriptors()
        taken = []
        for number in range(3):
            assert stream.read(10) == bytes([number]) * 10
            taken.append(stream.take_descriptor())
        assert [os.fstat(fd).st_ino for fd in taken] == [
            os.fstat(reader).st_ino for reader, _ in pipes]
        assert stream.take_descriptor() is None and stream.descriptors_waiting == 0
        for fd in taken:
            os.close(fd)
        # Descriptors no frame takes are closed with the reader, not leaked.
        socket.send_fds(left, [b"z"], [pipes[0][0]])
        stream.read(1)
        before = len(os.listdir("/proc/self/fd"))
        stream.close()
        assert len(os.listdir("/proc/self/fd")) == before - 1
    finally:
        for pair in pipes:
            for fd in pair:
                os.close(fd)
        left.close()
        right.close()


def test_more_descriptors_waiting_than_frames_can_take_are_refused() -> None:
    left, right = socket.socketpair()
    reader, writer = os.pipe()
    try:
        stream = StreamReader(right)
        stream.take_descriptors()
        for _ in range(_core.MAX_DESCRIPTORS + 1):
            socket.send_fds(left, [b"y"], [reader])
        with pytest.raises(ProtocolError, match="more descriptors"):
            stream.read(_core.MAX_DESCRIPTORS + 1)
        stream.close()
    finally:
        os.close(reader)
        os.close(writer)
        left.close()
        right.close()


# -- headers validated once per connection ---------------------------------------------------


def _frame(header: bytes, payload: bytes, seq: int, caught_at: float) -> bytes:
    return (wire.encode_prefix(header, len(payload), seq, caught_at) + header + payload
            + wire.encode_trailer(False))


def _connection(server: thing.Server) -> object:
    poll(lambda: len(server._connections) == 1, what="the connection")
    return next(iter(server._connections.values()))


def test_a_repeated_header_is_validated_once_and_each_frame_keeps_its_own_time(
        server: thing.Server) -> None:
    payload = value_trees.take_apart(np.arange(6, dtype=np.float32))
    header = wire.encode_header("loss", payload, {"site": "train.py:1 (step)"})
    with raw_peer(server.port) as peer:
        peer.sendall(b"".join(
            _frame(header, np.full(6, i, np.float32).tobytes(), i, 1000.0 + i)
            for i in range(50)))
        poll(lambda: server.store.received == 50, what="50 captures")
        connection = _connection(server)
        assert list(connection._headers) == [header]
        # The same header bytes with a payload they do not describe: refused, not trusted,
        # and read past (the prefix says where the frame ends): the next one is stored.
        peer.sendall(_frame(header, bytes(48), 50, 0.0)
                     + _frame(header, np.full(6, 50, np.float32).tobytes(), 51, 1050.0))
        poll(lambda: server.store.received == 51, what="the frame after the refused one")
        peer.shutdown(socket.SHUT_WR)
        reply = read_to_end(peer)
    captures = server.store.get_all("loss")
    assert [float(c.value[0]) for c in captures] == list(range(51))
    assert [c.caught_at for c in captures] == [1000.0 + i for i in range(51)]
    assert all(c.call_site == "train.py:1 (step)" for c in captures)
    assert b"leaves describe 24 bytes but the payload holds 48" in reply
    assert server.store.received == 51
    # Gone with the connection: what the cache held is given back to the header budget.
    poll(lambda: server._header_budget._used == 0, what="the budget given back")


def test_a_refused_header_holds_no_budget_while_its_payload_is_discarded(
        server: thing.Server, caplog: pytest.LogCaptureFixture) -> None:
    """A header refused for what it says (a name that is no str) gives its share of the
    budget all connections share back before the payload it announced is read past: a peer
    that trickles that payload holds nothing meanwhile."""
    caplog.set_level(logging.DEBUG, logger="thing")
    payload = bytes(1 << 20)
    frame = _frame(wire.encode_header(7, value_trees.take_apart(payload), {}), payload, 0, 0.0)
    cut = len(frame) - len(payload) // 2
    with raw_peer(server.port) as peer:
        peer.sendall(frame[:cut])
        poll(lambda: "refused a capture" in caplog.text, what="the refusal")
        assert server._header_budget._used == 0
        after = np.float32([1.5])
        header = wire.encode_header("after", value_trees.take_apart(after), {})
        peer.sendall(frame[cut:] + _frame(header, after.tobytes(), 1, 0.0))
        poll(lambda: server.store.received == 1, what="the frame after it")
    assert server.get("after").tobytes() == after.tobytes()


def test_the_header_cache_of_a_connection_is_bounded(server: thing.Server) -> None:
    array = np.arange(2, dtype=np.float32)
    frames = []
    for i in range(1500):
        payload = value_trees.take_apart(array)
        header = wire.encode_header(f"name-{i:05d}-" + "x" * 200, payload, {})
        frames.append(_frame(header, array.tobytes(), i, time.time()))
    long_header = json.dumps({"name": "long", "value": {"leaf": 0}, "meta": {"pad": "p" * 4000},
                              "leaves": [["numpy", "float32", [2], False]]}).encode()
    assert len(long_header) > CACHED_HEADER_MAX
    frames.append(_frame(long_header, array.tobytes(), 1500, time.time()))
    with raw_peer(server.port) as peer:
        peer.sendall(b"".join(frames))
        poll(lambda: server.store.received == 1501, what="every capture")
        connection = _connection(server)
        assert 0 < connection._headers_cost <= HEADER_CACHE_BYTES
        assert len(connection._headers) < 1500 and long_header not in connection._headers
        assert server._header_budget._used == connection._headers_cost
        # Full, it keeps the newest: a header seen from now on (a sender's counts of what it
        # could not deliver changed its headers once) is kept, the oldest forgotten.
        steady = wire.encode_header("steady", value_trees.take_apart(array), {})
        peer.sendall(_frame(steady, array.tobytes(), 1501, time.time()))
        poll(lambda: server.store.received == 1502, what="the steady name")
        assert steady in connection._headers
        assert f"name-{0:05d}-".encode() not in b"".join(connection._headers)
        assert 0 < connection._headers_cost <= HEADER_CACHE_BYTES
        assert server._header_budget._used == connection._headers_cost
    assert len(server.store) == 1502


# -- what the review found: descriptors at a refused handshake, acks cut inside a batch -------


def test_descriptors_sent_with_a_refused_handshake_are_not_kept(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    tmp_path.chmod(0o700)
    with thing.Server(port=0, token="t" * 40) as server:
        assert server.unix_path is not None
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(10):
            with socket.socket(socket.AF_UNIX) as peer:
                set_timeouts(peer, 10, 10)  # blocking, as thing's own readers need
                peer.connect(str(server.unix_path))
                peer.sendall(wire.encode_handshake({"hostname": "h", "pid": 1, "nonce": "ab" * 20,
                                                    "shared_memory": True}))
                status, _ = wire.recv_handshake(peer)
                assert status == wire.HANDSHAKE_CHALLENGE
                reader, writer = os.pipe()
                socket.send_fds(peer, [wire.encode_handshake({"proof": "wrong"})],
                                [reader, writer])
                os.close(reader)
                os.close(writer)
                read_to_end(peer)
        poll(lambda: len(os.listdir("/proc/self/fd")) <= before and not server.clients(),
             what="the refused peers' descriptors closed")


def test_acks_read_whole_count_when_the_next_one_is_cut_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that stored two frames acknowledges them, and the connection breaks inside
    the third acknowledgement: the client reports the two as stored, the third as lost."""
    monkeypatch.setenv("THING_TRANSPORT", "tcp")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def pretend_to_be_a_server() -> None:
        peer, _ = listener.accept()
        with peer:
            stream = StreamReader(peer)
            _, length = wire.decode_handshake_prefix(stream.read(wire.HANDSHAKE.size))
            stream.read(length)
            peer.sendall(wire.encode_handshake({"server": "thing", "pid": 1, "notices": True}))
            seqs = []
            while len(seqs) < 3:
                prefix = wire.decode_prefix(stream.read(wire.FRAME_PREFIX.size))
                stream.skip(prefix.header_len + prefix.payload_len + wire.FRAME_TRAILER.size)
                seqs.append(prefix.seq)
            third = wire.encode_ack(seqs[2], -1, "x" * 50)
            peer.sendall(wire.encode_ack(seqs[0], 100) + wire.encode_ack(seqs[1], 101)
                         + third[:30])

    pretender = threading.Thread(target=pretend_to_be_a_server, daemon=True)
    pretender.start()
    client = thing.Client("127.0.0.1", listener.getsockname()[1])
    try:
        handles = [client.catch(np.arange(10) + i, name=f"x{i}", block=True) for i in range(3)]
        for handle in handles:
            handle.wait(10)
        assert [handle.id for handle in handles] == [100, 101, None]
        assert "unacknowledged" in handles[2].error
    finally:
        client.close()
        listener.close()
        pretender.join(10)
