"""More fuzzing: the readers of untrusted bytes tests/test_fuzz.py does not drive.

Each test drives the library's own reader (never a copy of it) with seeded random and
mutated input, bounded to a few seconds on two cores, and lets out only the error types
that reader is documented to raise:

- the client's reader of what a server sends (``answers.Answers.read_arrived`` ->
  ``read_server_message`` -> ``wire.decode_ack``/``decode_control``), applying what it
  decodes with the real ``overrides.Overrides``;
- the token handshake on both ends (``receiver.Connection.handshake`` ->
  ``_authenticate``, then signed frames; ``dial._handshake``), with the security property
  that nothing is stored from, or sent to, a peer that did not prove the token;
- shared-memory descriptors (``shm.adopt``; ``Connection`` over a Unix socketpair with
  ``SCM_RIGHTS``);
- recordings on disk (``recording.load`` -> ``segments.read_segment``), then building every
  loaded value as the REPL does;
- the meta a header carries (notices, announcements, ranks, undelivered counts);
- many hostile connections at once against a live server;
- CPU and memory per fuzzed frame.

"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import os
import random
import shutil
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import thing
from thing import auth, dial, recording, reports, shm, value_trees, wire
from thing.answers import Answers
from thing.arrays import LeafSpec
from thing.buffers import ReceiveBuffers
from thing.deadlines import Deadlines
from thing.errors import BadRecording, ProtocolError
from thing.frame_charges import HeaderBudget
from thing.overrides import Overrides
from thing.receiver import ReceiveCounts, ReceiveSettings
from thing.segments import records_checksum
from thing.server import ServerInfo
from thing.store import HistoryStore

from .conftest import open_fds, poll
from .test_fuzz import (
    BOUNDARY_INTS,
    NASTY_JSON,
    SEED_FRAMES,
    fuzzed_frame,
    header_frame,
    mutate_bytes,
    mutate_header,
    read_like_the_server,
    send_then_end,
    serve_against,
)

TOKEN = "fuzz-token"
# Hostile values for the fields a peer fills in: nonces, proofs, names, counts.
NASTY = [None, True, 0, -1, 2**64, 1.5, "", "x" * 70, "0" * 31, "0" * 129, "g" * 32,
         "\u0663" * 32, "\ud800" * 32, "F" * 128, [], {}, ["a" * 64], {"nonce": "a" * 64},
         "a" * 60000]


def settings(store: HistoryStore | None = None, token: str | None = None,
             mappings: int = 4) -> ReceiveSettings:
    """What a server's connections share, small: an 8 MiB capture limit, a 1 s idle timeout."""
    return ReceiveSettings(
        store=HistoryStore(max_bytes=64 << 20) if store is None else store,
        buffers=ReceiveBuffers(0),
        limits=wire.Limits(max_capture_bytes=8 << 20, max_header_bytes=1 << 20), token=token,
        idle_timeout=1.0, min_rate=float(1 << 20), deadlines=Deadlines(),
        header_budget=HeaderBudget(64 << 20), mappings=shm.Mappings(mappings),
        counts=ReceiveCounts(), closing=threading.Event(), warn=lambda address, message: None,
        steering="fuzz")


def handshake(info: Any, status: int = wire.HANDSHAKE_OK) -> bytes:
    """A handshake message around any JSON (surrogates included)."""
    body = json.dumps(info).encode("utf-8", "surrogatepass")
    return wire.HANDSHAKE.pack(wire.MAGIC, wire.VERSION, status, len(body)) + body


def recv_message(sock: socket.socket, timeout: float = 2.0) -> tuple[int | None, Any]:
    """A peer's handshake message as a hostile peer reads it: (None, None) if there is none."""
    sock.settimeout(timeout)
    prefix = sock.recv(wire.HANDSHAKE.size, socket.MSG_WAITALL)
    if len(prefix) < wire.HANDSHAKE.size:
        return None, None
    _, _, status, length = wire.HANDSHAKE.unpack(prefix)
    body = sock.recv(length, socket.MSG_WAITALL) if length else b""
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def end_writing(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


# -- the client's reader of what a server sends ------------------------------------------------


def server_message(rng: random.Random) -> bytes:
    """A valid acknowledgement (stored, or refused with a reason) or control message."""
    roll = rng.random()
    if roll < 0.35:
        return wire.encode_ack(rng.randrange(2**64), rng.randrange(-(2**63), 2**63))
    if roll < 0.55:
        return wire.encode_ack(rng.randrange(2**64), -1, "why" * rng.randrange(0, 100))
    operation = rng.choice(list(wire.CONTROL_OPERATIONS.values()))
    name = rng.choice([None, "loss", "w" * rng.randrange(1, 50), "\u2603"])
    if operation in ("request", "first") and name is None:
        name = "n"
    value = rng.randrange(1, 10) if operation in ("request", "every", "first") else 0
    return wire.encode_control(operation, name, rng.choice([None, 0, 1, 2**31 - 1]), value)


def server_stream(rng: random.Random, mac: auth.SessionMac | None) -> bytes:
    messages = [server_message(rng) for _ in range(rng.randrange(1, 12))]
    if mac is not None:
        messages = [message + mac.sign(message) for message in messages]
    data = b"".join(messages)
    roll = rng.random()
    if roll < 0.6:
        return mutate_bytes(data, rng, messages)
    if roll < 0.7:
        return rng.randbytes(rng.randrange(1, 200))
    if roll < 0.85:  # a control message whose name is as long as allowed, or longer
        length = rng.choice([wire.MAX_CONTROL_NAME, wire.MAX_CONTROL_NAME + 1, 2**32 - 1])
        return data + wire.CONTROL.pack(wire.CONTROL_TAG, rng.randrange(10), length,
                                        rng.randrange(-(2**63), 2**63),
                                        rng.randrange(-(2**63), 2**63)) + b"a" * min(length, 5000)
    length = rng.choice([wire.MAX_HANDSHAKE_JSON, wire.MAX_HANDSHAKE_JSON + 1, 2**32 - 1])
    return data + wire.ACK.pack(wire.ACK_TAG, 1, length, 0, -1) + b"m" * min(length, 70_000)


def read_like_a_client(data: bytes, mac: auth.SessionMac | None) -> Overrides:
    """Feed ``data`` to a client's own reader of its server's messages, steering a real
    Overrides, until the stream ends; return the Overrides."""
    ours, theirs = socket.socketpair()
    overrides = Overrides(True, 600.0, lambda: 1)
    answers = Answers(ours, mac, lambda acks: None, overrides.apply_all, lambda exc: None)
    writer = threading.Thread(target=lambda: (theirs.sendall(data), end_writing(theirs)))
    writer.start()
    try:
        for _ in range(1000):  # each read takes what arrived; the end raises
            answers.read_arrived()
            answers._readable.poll(200)
        raise AssertionError("the reader never saw the end of the stream")
    finally:
        writer.join()
        ours.close()
        theirs.close()


def test_the_clients_reader_of_server_messages_raises_only_protocol_errors() -> None:
    rng = random.Random(20240612)
    for case in range(600):
        signed = case % 3 == 0
        key = ("tok", "c" * 32, "s" * 32)
        data = server_stream(rng, auth.SessionMac(*key) if signed else None)
        try:
            overrides = read_like_a_client(data, auth.SessionMac(*key) if signed else None)
        except ProtocolError:  # BadControl is one, and is never let out: read whole, skipped
            continue
        except ConnectionResetError:  # the end of the stream: how every good stream ends
            continue
        # What it applied is bounded and readable.
        assert len(overrides.settings()) <= 1001 and len(overrides.requests()) <= 1000


# -- the token handshake, on both ends ---------------------------------------------------------


def nonce_like(rng: random.Random) -> Any:
    return auth.new_nonce() if rng.random() < 0.6 else copy.deepcopy(rng.choice(NASTY))


def maybe_mutated(data: bytes, rng: random.Random, chance: float) -> bytes:
    return mutate_bytes(data, rng, [data]) if rng.random() < chance else data


class Done(Exception):
    """A hostile peer has sent a broken message: it ends its side, so that nobody waits."""


@contextlib.contextmanager
def peer_side(sock: socket.socket) -> Iterator[None]:
    """A hostile peer's turn: however it ends (the reader hung up, a message cut short), its
    side of the stream ends with it."""
    try:
        yield
    except (OSError, Done):
        pass
    finally:
        end_writing(sock)


def send_maybe_mutated(sock: socket.socket, data: bytes, rng: random.Random,
                       chance: float) -> bytes:
    """Send ``data``, or a mutation of it and then the end of the stream (raising Done): a
    peer waiting for the rest of a message cut short must not wait for a timeout."""
    sent = maybe_mutated(data, rng, chance)
    sock.sendall(sent)
    if sent != data:
        end_writing(sock)
        raise Done
    return sent


def proof_of(make: Callable[..., str], *parts: Any) -> str | None:
    try:
        return make(TOKEN, *parts)
    except (TypeError, AttributeError, UnicodeEncodeError):  # a nasty nonce: no proof of it
        return None


class HostileClient:
    """The client's side of a token handshake, mutated along the way, then signed frames
    (some mutated). Records whether it sent the genuine proof."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.sent_genuine_proof = False

    def __call__(self, sock: socket.socket) -> None:
        rng = self.rng
        with peer_side(sock):
            client_nonce = nonce_like(rng)
            hello = {"nonce": client_nonce, "hostname": rng.choice(["h", ["x"], "\x1b[2J"]),
                     "pid": rng.choice([1, -1, 2**70, "1"]), "control": rng.random() < 0.5,
                     "shared_memory": rng.random() < 0.3, "replay": rng.random() < 0.5}
            send_maybe_mutated(sock, handshake(hello), rng, 0.15)
            _, challenge = recv_message(sock)
            if not isinstance(challenge, dict) or "nonce" not in challenge:
                return
            server_nonce = challenge["nonce"]
            genuine = proof_of(auth.client_proof, client_nonce, server_nonce)
            proof = genuine if rng.random() < 0.5 else copy.deepcopy(rng.choice(
                NASTY + ([genuine.upper(), genuine[:-1]] if genuine else [])))
            plain = handshake({"proof": proof, "hostname": "h"},
                              rng.choice([0, 0, 0, 1, 2, 65535]))
            answer = maybe_mutated(plain, rng, 0.2)
            self.sent_genuine_proof = genuine is not None and genuine.encode() in answer
            sock.sendall(answer)
            if answer != plain:
                return  # broken: end our side (finally), so that nobody waits
            status, _ = recv_message(sock)
            if status != wire.HANDSHAKE_OK or genuine is None:
                return
            mac = auth.SessionMac(TOKEN, client_nonce, server_nonce)
            frames = b""
            for frame in rng.choices(SEED_FRAMES, k=rng.randrange(1, 4)):
                size = wire.FRAME_PREFIX.size
                header_len, payload_len = wire.FRAME_PREFIX.unpack(frame[:size])[2:4]
                prefix, header = frame[:size], frame[size : size + header_len]
                payload = frame[size + header_len : size + header_len + payload_len]
                trailer = frame[size + header_len + payload_len :]
                # Signed as frames.trailer signs: prefix, header, trailer (see PROTOCOL.md).
                frames += prefix + header + payload + trailer + mac.sign(prefix, header, trailer)
            sock.sendall(mutate_bytes(frames, rng, SEED_FRAMES) if rng.random() < 0.5 else frames)


def test_the_servers_token_handshake_and_signed_frames_raise_only_protocol_errors() -> None:
    rng = random.Random(4711)
    genuine = stored = 0
    for _ in range(300):
        peer = HostileClient(rng.randrange(2**32))
        store = HistoryStore(max_bytes=64 << 20)
        try:
            serve_against(peer, settings(store, token=TOKEN), greet=True)
        except (ProtocolError, OSError):  # HandshakeError is one; OSError: the stream ended
            pass
        genuine += peer.sent_genuine_proof
        if store.received:  # only from a peer that proved the token
            assert peer.sent_genuine_proof
            stored += 1
    assert genuine > 30 and stored > 10  # the fuzzer got past the handshake, often


class HostileServer:
    """A server's side of the handshake, mutated: challenges with nasty nonces and proofs,
    refusals of any shape. Records whether it proved the token."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.proved = False

    def __call__(self, sock: socket.socket) -> None:
        rng = self.rng
        with peer_side(sock):
            _, hello = recv_message(sock)
            client_nonce = hello.get("nonce") if isinstance(hello, dict) else None
            roll = rng.random()
            if roll < 0.5:
                server_nonce = nonce_like(rng)
                genuine = proof_of(auth.server_proof, client_nonce, server_nonce)
                proof = genuine if rng.random() < 0.6 else copy.deepcopy(rng.choice(NASTY))
                challenge = handshake({"nonce": server_nonce, "proof": proof},
                                      wire.HANDSHAKE_CHALLENGE)
                self.proved = genuine is not None and genuine == proof
                send_maybe_mutated(sock, challenge, rng, 0.3)
                recv_message(sock)
                reply = rng.choice([{"server": "thing", "control": True,
                                     "steering": rng.choice(["i", 5, ["x"], "z" * 500])},
                                    {"error": rng.choice(["token", ["x"] * 5, "\x1b" * 9000])}])
                sock.sendall(maybe_mutated(handshake(reply, rng.choice([0, 1, 2, 3])), rng, 0.3))
            elif roll < 0.85:
                reply = rng.choice([{"server": "thing", "notices": "yes", "steering": ["x"]},
                                    {"error": "x" * 60000}, [], "str", None, {"error": {"e": 1}}])
                sock.sendall(maybe_mutated(handshake(reply, rng.choice([0, 1, 2, 7])), rng, 0.4))
            else:
                sock.sendall(rng.randbytes(rng.randrange(0, 64)))


def test_the_clients_handshake_raises_only_protocol_errors_and_trusts_only_a_proof() -> None:
    rng = random.Random(8128)
    accepted = proven = 0
    for _ in range(400):
        peer = HostileServer(rng.randrange(2**32))
        token = rng.choice([None, TOKEN])
        must_prove = rng.random() < 0.5
        ours, theirs = socket.socketpair()
        thread = threading.Thread(target=peer, args=(theirs,))
        thread.start()
        try:
            dial._handshake(ours, ("fuzz", 1), token, must_prove, False, True)
        except (ProtocolError, OSError):  # HandshakeError, LimitExceeded; the peer hung up
            continue
        finally:
            ours.close()
            thread.join()
            theirs.close()
        # Accepted: a server that had to prove the token did.
        accepted += 1
        if must_prove and token is not None:
            assert peer.proved
            proven += 1
    assert accepted > 20 and proven > 5  # the fuzzer reached both outcomes


# -- shared memory -----------------------------------------------------------------------------

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def memfd(size: int, seals: int = SEALS | fcntl.F_SEAL_SEAL) -> int:
    fd = os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def reopened(fd: int, flags: int) -> int:
    try:
        return os.open(f"/proc/self/fd/{fd}", flags)
    finally:
        os.close(fd)


def a_file(tmp: Path, size: int, where: str) -> int:
    path = Path(where if where.startswith("/dev/shm") else tmp) / f"fuzz-{random.random()}"
    path.write_bytes(b"\0" * size)
    fd = os.open(path, os.O_RDONLY)
    path.unlink()
    return fd


def descriptor(kind: str, size: int, tmp: Path) -> int:
    """A descriptor a hostile same-host peer could pass instead of a sealed memfd of ``size``."""
    pipe_or_socket = {"pipe": lambda: (lambda r, w: (os.close(w), r)[1])(*os.pipe()),
                      "socket": lambda: socket.socketpair()[0].detach()}
    makers: dict[str, Callable[[], int]] = {
        "sealed": lambda: memfd(size),
        "sealed, larger": lambda: memfd(size + 64),
        "sealed, smaller": lambda: memfd(max(size - 1, 0)),
        "unsealed": lambda: memfd(size, 0),
        "not sealed against writing": lambda: memfd(size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW),
        "O_PATH": lambda: reopened(memfd(size), os.O_PATH),
        "file on disk": lambda: a_file(tmp, size, str(tmp)),
        "file in /dev/shm": lambda: a_file(tmp, size, "/dev/shm"),
        "directory": lambda: os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY),
        "/dev/zero": lambda: os.open("/dev/zero", os.O_RDONLY),
        "eventfd": lambda: os.eventfd(0),
        **pipe_or_socket,
    }
    return makers[kind]()


KINDS = ["sealed", "sealed, larger", "sealed, smaller", "unsealed", "not sealed against writing",
         "O_PATH", "file on disk", "file in /dev/shm", "directory", "/dev/zero", "eventfd",
         "pipe", "socket"]
SPECS = [(LeafSpec("numpy", "float32", (2, 3), False),), (LeafSpec("numpy", "uint8", (0,), False),),
         (LeafSpec("numpy", "float64", (), True), LeafSpec("numpy", "uint8", (4096,), False)), ()]


@pytest.mark.parametrize("kind", KINDS)
def test_only_a_sealed_memfd_of_the_right_size_is_adopted(kind: str, tmp_path: Path) -> None:
    fds = open_fds()
    for specs in SPECS:
        _, total = shm.layout([spec.nbytes for spec in specs])
        try:
            arrays, _ = shm.adopt(descriptor(kind, total, tmp_path), specs)
        except ProtocolError:
            assert kind != "sealed"
            continue
        assert kind == "sealed"
        assert [a.shape for a in arrays] == [spec.shape for spec in specs]
    assert open_fds() == fds  # adopt closes what it is given, whatever it is


def test_a_sealed_memfd_reopened_write_only_is_refused_as_a_protocol_error() -> None:
    # DEFECT (found by this review): PrivateMapping's mmap fails with EACCES (compiled core)
    # or EBADF (pure Python), which escapes adopt as an OSError, not its ProtocolError.
    specs = (LeafSpec("numpy", "float32", (2, 3), False),)
    _, total = shm.layout([spec.nbytes for spec in specs])
    with pytest.raises(ProtocolError):
        shm.adopt(reopened(memfd(total), os.O_WRONLY), specs)


SHM_HELLO = wire.encode_handshake({"hostname": "h", "pid": 1, "shared_memory": True})


def shared_memory_frame(rng: random.Random) -> tuple[bytes, int]:
    """A KIND_SHARED_MEMORY frame (prefix, header, trailer) and the size of its memfd."""
    value = rng.choice([np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros(4096, np.uint8),
                        {"a": np.ones(3), "b": [np.arange(4, dtype=np.int64)]}])
    payload = value_trees.take_apart(value)
    header = wire.encode_header("shm", payload, {})
    prefix = wire.encode_prefix(header, payload.nbytes, 0, 0.0, wire.KIND_SHARED_MEMORY)
    return prefix + header + wire.encode_trailer(False), shm.layout(
        [leaf.nbytes for leaf in payload.leaves])[1]


def test_hostile_descriptors_with_frames_raise_only_protocol_errors(tmp_path: Path) -> None:
    rng = random.Random(99)
    fds = open_fds()
    stored = 0
    for _ in range(250):
        plan = []
        for _ in range(rng.randrange(1, 4)):
            frame, size = shared_memory_frame(rng)
            roll = rng.random()
            if roll < 0.15:
                frame = mutate_bytes(frame, rng, [frame, *SEED_FRAMES])
            elif roll < 0.25:
                frame = rng.choice(SEED_FRAMES)  # inline, with descriptors it does not take
            count = rng.choice([1, 1, 1, 0, 2, 4, 5, 6])  # 4 per receive at most
            plan.append((frame, [rng.choice(["sealed"] * 6 + KINDS) for _ in range(count)], size))

        def peer(sock: socket.socket, plan: list = plan) -> None:
            try:
                sock.sendall(SHM_HELLO)
                recv_message(sock)
                for frame, kinds, size in plan:
                    passed = [descriptor(kind, size, tmp_path) for kind in kinds]
                    try:
                        socket.send_fds(sock, [frame], passed) if passed else sock.sendall(frame)
                    finally:
                        for fd in passed:
                            os.close(fd)
            except OSError:
                pass
            finally:
                end_writing(sock)

        store = HistoryStore(max_bytes=64 << 20)
        try:
            serve_against(peer, settings(store), greet=True)
        except (ProtocolError, OSError):
            pass
        stored += store.received
        for capture in store.kept():
            capture.value  # noqa: B018 - built as the REPL builds it
        store.clear()
    assert stored > 10
    poll(lambda: open_fds() <= fds, 5, "every passed descriptor to be closed")


# -- recordings --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed_segment(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A real segment of captures received by the server's own reader from SEED_FRAMES."""
    store = HistoryStore(max_bytes=64 << 20)
    data = b"".join(SEED_FRAMES)
    serve_against(lambda sock: send_then_end(sock, data), settings(store))
    assert store.received == len(SEED_FRAMES)
    directory = tmp_path_factory.mktemp("seed") / "recording"
    recording.save(store, directory)
    (segment,) = directory.glob("segment-*.safetensors")
    return segment.read_bytes()


def mutated_segment(raw: bytes, rng: random.Random) -> bytes:
    """Byte-level damage, or a structural change of the header: a capture's frame header, a
    capture record, the tensor table, the dropped counts."""
    roll = rng.random()
    if roll < 0.3:
        return mutate_bytes(raw, rng, [raw])
    if roll < 0.35:
        return raw[: rng.randrange(len(raw))]
    (length,) = struct.unpack_from("<Q", raw)
    document, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    metadata = document["__metadata__"]
    records = json.loads(metadata["captures"])
    roll = rng.random()
    if roll < 0.35:
        record = rng.choice(records)
        record["header"] = json.dumps(mutate_header(json.loads(record["header"]), rng))
    elif roll < 0.55:
        at = rng.randrange(len(records))
        records[at] = mutate_header(records[at], rng)
    elif roll < 0.85:
        keys = [key for key in document if key != "__metadata__"]
        entry = document[rng.choice(keys)]
        field = rng.choice(["dtype", "shape", "data_offsets"])
        entry[field] = copy.deepcopy(rng.choice(
            NASTY_JSON + [rng.choice(BOUNDARY_INTS), [0, len(data)], [2**63], [1] * 65, "C64"]))
    else:
        metadata["dropped"] = json.dumps(rng.choice(
            [{"x": -1}, {"x": 2**62}, [], {"a" * 10_000: 1}, {str(i): 1 for i in range(50)}]))
    metadata["captures"] = json.dumps(records)
    if rng.random() < 0.9:  # as a hostile writer would, past the check for damage
        metadata["checksum"] = records_checksum(metadata)
    text = json.dumps(document).encode("utf-8", "surrogatepass")
    text += b" " * (-len(text) % 8)
    if rng.random() < 0.2:
        data = mutate_bytes(data, rng, [data])
    return struct.pack("<Q", len(text)) + text + data


def test_damaged_recordings_raise_only_bad_recording(seed_segment: bytes, tmp_path: Path) -> None:
    rng = random.Random(1618)
    loaded = 0
    for case in range(300):
        directory = tmp_path / str(case)
        directory.mkdir()
        (directory / "segment-000001.safetensors").write_bytes(mutated_segment(seed_segment, rng))
        store = HistoryStore(max_bytes=64 << 20)
        try:
            recording.load(directory, store)
        except BadRecording:
            continue
        finally:
            shutil.rmtree(directory)
        loaded += 1
        for capture in store.kept():  # what loads, builds
            capture.value  # noqa: B018
    assert loaded > 5


@pytest.mark.parametrize("dtype", [[], {}, ["F32"]])
def test_a_tensor_whose_dtype_is_not_a_string_is_bad_recording(dtype: Any, tmp_path: Path) -> None:
    # DEFECT (found by this review): segments._tensor_table tests `dtype not in _ITEMSIZE`
    # on whatever JSON the file holds: a list or an object raises TypeError (unhashable).
    header = json.dumps({"__metadata__": {"format": "thing-history", "version": "1",
                                          "captures": "[]", "dropped": "{}"},
                         "0.0": {"dtype": dtype, "shape": [0], "data_offsets": [0, 0]}}).encode()
    header += b" " * (-len(header) % 8)
    (tmp_path / "segment-000001.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(BadRecording):
        recording.load(tmp_path, HistoryStore(max_bytes=64 << 20))


@pytest.mark.parametrize("what", ["fifo", "directory", "symlink", "unix-socket"])
def test_a_segment_that_is_not_a_regular_file_is_bad_recording(what: str, seed_segment: bytes,
                                                                tmp_path: Path) -> None:
    # DEFECT (found by this review) for "unix-socket": os.open gives ENXIO, which
    # read_segment lets out as OSError; README: "a foreign file ... is refused with
    # thing.BadRecording".
    path = tmp_path / "segment-000001.safetensors"
    if what == "fifo":
        os.mkfifo(path)
    elif what == "directory":
        path.mkdir()
    elif what == "symlink":
        (tmp_path / "elsewhere").write_bytes(seed_segment)
        path.symlink_to(tmp_path / "elsewhere")
    else:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
        listener.close()
    with pytest.raises(BadRecording):
        recording.load(tmp_path, HistoryStore(max_bytes=64 << 20))


# -- the meta a frame's header carries ---------------------------------------------------------

META_VALUES = [{"type": "x", "reason": "y"}, {"type": ["x"], "reason": 5},
               {"type": "t" * 5000, "reason": "\x1b[2J" * 400},
               {"type": "Tensor", "shape": [2, 3], "dtype": "float32"}, {"shape": [2**62] * 70},
               {"shape": [-1]}, {"dtype": {"a": 1}}, {"queue full": 2**70, "dropped": -1},
               "a.py:3 (f)", "\x1b]0;title\x07", 2**31 - 1, 2**31]


def test_notices_announcements_and_meta_raise_only_protocol_errors() -> None:
    rng = random.Random(2718)
    store = HistoryStore(max_bytes=64 << 20)
    for _ in range(500):
        frames = []
        for _ in range(rng.randrange(1, 4)):
            meta = {key: copy.deepcopy(rng.choice(NASTY_JSON + BOUNDARY_INTS + META_VALUES))
                    for key in rng.sample(["unsent", "on_demand", "undelivered", "rank",
                                           "world_size", "site", "requested"], rng.randrange(5))}
            if rng.random() < 0.5:  # a notice carries no data
                document = {"name": rng.choice(["n", None, "\x1b[31m", "x" * 4096]),
                            "value": None, "leaves": [], "meta": meta}
                frames.append(header_frame(document))
            else:
                document = {"name": "n", "value": {"leaf": 0},
                            "leaves": [["numpy", "float32", [2], False]], "meta": meta}
                frames.append(header_frame(document, b"\0" * 8))
        data = b"".join(frames)
        try:
            serve_against(lambda sock, data=data: send_then_end(sock, data), settings(store))
        except (ProtocolError, OSError):
            pass
    # What the REPL shows of them holds no escape sequence, and is bounded.
    shown = reports.summary(store, ServerInfo("h", 1, 0, 0, 0), 5)
    assert "\x1b" not in shown.text() + shown.html()
    assert len(store.unsent()) <= 1000 and len(store.available()) <= 1000


# -- sparse tensors: what only the received bytes can show ----------------------------------------


def test_sparse_tensors_with_mutated_indices_raise_only_protocol_errors() -> None:
    """value_trees.check_received and arrays.sparse_tensor read index bytes a peer chose; the seeds
    of tests/test_fuzz.py hold no sparse tensor."""
    torch = pytest.importorskip("torch")
    import warnings

    from tests.test_security import frame_bytes

    dense = torch.tensor([[0, 1.0, 0], [2.0, 0, 3.0]])
    square = torch.arange(16.0).reshape(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "in beta" notices
        values = [dense.to_sparse(), dense.to_sparse().coalesce(), dense.to_sparse_csr(),
                  dense.to_sparse_csc(), square.to_sparse_bsr((2, 2)),
                  square.to_sparse_bsc((2, 2)),
                  {"a": dense.to_sparse_csr(), "b": [dense.to_sparse()]}]
    seeds = [frame_bytes(value, f"sparse-{i}") for i, value in enumerate(values)]
    assert all(len(read_like_the_server(frame)) == 1 for frame in seeds)
    rng = random.Random(1729)
    stored = 0
    for _ in range(300):
        frame = rng.choice(seeds)
        size = wire.FRAME_PREFIX.size
        header_len, payload_len = wire.FRAME_PREFIX.unpack(frame[:size])[2:4]
        header = frame[size : size + header_len]
        payload = bytearray(frame[size + header_len : size + header_len + payload_len])
        trailer = frame[size + header_len + payload_len :]
        if rng.random() < 0.6:  # the indices (and values), as sent: same length
            for _ in range(rng.randint(1, 6)):
                payload[rng.randrange(len(payload))] = rng.choice(
                    [0, 0xFF, 0x7F, 0x80, 1, 2, 3, 4, rng.randrange(256)])
        else:  # what the header says of them
            header = json.dumps(mutate_header(json.loads(header), rng)).encode()
        data = wire.FRAME_PREFIX.pack(wire.FRAME_TAG, wire.KIND_CAPTURE, len(header), payload_len,
                                      0, 0.0, 0, wire.NO_STEP) + header + bytes(payload) + trailer
        try:
            stored += len(read_like_the_server(data))  # stored values are built, too
        except (ProtocolError, OSError):
            pass
    assert stored > 20


# -- many connections --------------------------------------------------------------------------


def hostile_connection(port: int, seed: int) -> None:
    rng = random.Random(seed)
    hello = wire.encode_handshake({"hostname": "crowd", "pid": seed})
    behaviour = rng.choice(["silent", "half hello", "hello and garbage", "fuzzed frame", "reset",
                            "hello then idle", "many frames"])
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        return
    try:
        if behaviour == "silent":
            time.sleep(rng.uniform(0, 0.5))
        elif behaviour == "half hello":
            sock.sendall(hello[: rng.randrange(len(hello))])
            time.sleep(rng.uniform(0, 0.5))
        elif behaviour == "hello and garbage":
            sock.sendall(hello + rng.randbytes(rng.randrange(1, 500)))
        elif behaviour == "fuzzed frame":
            sock.sendall(hello + fuzzed_frame(rng))
        elif behaviour == "reset":
            sock.sendall(hello + rng.choice(SEED_FRAMES)[:30])
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif behaviour == "hello then idle":
            sock.sendall(hello)
            time.sleep(rng.uniform(0, 0.5))
        else:
            sock.sendall(hello + b"".join(rng.choices(SEED_FRAMES, k=30)))
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(3)
        while sock.recv(65536):
            pass
    except OSError:
        pass
    finally:
        sock.close()


class ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def test_a_crowd_of_hostile_connections_leaves_the_server_serving() -> None:
    errors = ErrorRecords()
    logging.getLogger("thing").addHandler(errors)
    server = thing.Server(port=0)
    server.max_connections = 8
    server.idle_timeout = 1.0
    server.start()
    try:
        threads, fds = threading.active_count(), open_fds()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda seed: hostile_connection(server.port, seed), range(250)))
        poll(lambda: not server.clients(), 5, "the crowd's connections to close")
        client = thing.Client("127.0.0.1", server.port)
        try:
            value = np.arange(1000, dtype=np.float32)
            assert client.catch(value, name="after-the-crowd").wait(10)
            assert server.get("after-the-crowd").tobytes() == value.tobytes()
        finally:
            client.close()
        poll(lambda: threading.active_count() <= threads, 5, "threads back")
        poll(lambda: open_fds() <= fds, 5, "descriptors back")
        assert errors.records == []
    finally:
        server.close()
        logging.getLogger("thing").removeHandler(errors)


# -- CPU and memory per frame ------------------------------------------------------------------


def test_a_fuzzed_frame_costs_little_cpu_and_memory_for_its_size() -> None:
    rng = random.Random(577)
    tracemalloc.start()
    try:
        for _ in range(200):
            data = fuzzed_frame(rng)
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            started = time.process_time()
            try:
                read_like_the_server(data)
            except (ProtocolError, OSError):
                pass
            took = time.process_time() - started
            peak = tracemalloc.get_traced_memory()[1] - before
            # A connection's fixed cost (its 64 KiB read-ahead buffer, ...) plus what parsing
            # may cost per byte (wire.HEADER_COST_FACTOR bounds it at 32 times the limit).
            assert peak <= (1 << 20) + 64 * len(data), (peak, len(data), data[:80])
            # Generous (the process's CPU, traced by tracemalloc, on a shared machine): what
            # it stops is a cost that grows faster than the input, seconds for a frame.
            assert took < 2.0, (took, data[:80])
    finally:
        tracemalloc.stop()


def test_a_peer_dripping_a_claimed_frame_cannot_lock_others_out_of_the_store() -> None:
    """A claim of most of the store, then a byte now and then: its room was held for
    idle_timeout + claim / min_rate (18 hours for 64 GiB at the defaults), every other
    capture refused meanwhile. Now each 4 MiB piece must come at the minimum rate."""
    server = thing.Server(port=0, store=HistoryStore(max_bytes=64 << 20))
    server.idle_timeout = 1.0
    server.min_rate = float(4 << 20)  # the first piece due after 2 s; the whole claim, 16 s
    server.start()
    stop = threading.Event()
    try:
        peer = socket.create_connection(("127.0.0.1", server.port))
        peer.sendall(wire.encode_handshake({"hostname": "claimer", "pid": 1}))
        recv_message(peer)
        claim = 60 << 20
        header = json.dumps({"name": "claim", "value": {"leaf": 0},
                             "leaves": [["numpy", "uint8", [claim], False]], "meta": {}}).encode()
        peer.sendall(wire.encode_prefix(header, claim, 0, 0.0) + header)  # ~150 bytes

        def drip() -> None:
            while not stop.wait(0.3):
                try:
                    peer.send(b"\0")
                except OSError:
                    return

        threading.Thread(target=drip, daemon=True).start()
        time.sleep(0.3)
        client = thing.Client("127.0.0.1", server.port)
        try:
            deadline = time.monotonic() + 8
            stored = False
            while not stored and time.monotonic() < deadline:
                stored = client.catch(np.ones(8 << 20, np.uint8), name="other").wait(2)
            assert stored, "a capture that fits the store was refused all along"
        finally:
            client.close()
    finally:
        stop.set()
        server.close()
