"""The byte movers, compiled and pure Python, straight over real sockets.

Every test runs against both ``thing._core._transport`` and its twin
``thing._core.fallback``, over a Unix socketpair and over loopback TCP.
"""

from __future__ import annotations

import errno
import os
import platform
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import thing
import thing._core
from thing import wire
from thing._core import _transport, fallback
from thing.arrays import leaf_bytes
from thing.frames import Headers, Pending, new_pending
from thing.handles import CaptureHandle
from thing.names import CallSite
from thing.sockets import set_timeouts
from thing.value_trees import take_apart

from .conftest import run_script

CORES = {"compiled": _transport, "python": fallback}


@pytest.fixture(params=list(CORES))
def core(request: pytest.FixtureRequest) -> ModuleType:
    """One implementation of ``send_buffers`` / ``recv_buffers``."""
    return CORES[request.param]


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        left = socket.create_connection(listener.getsockname(), timeout=5)
        right, _ = listener.accept()
    return left, right


@pytest.fixture(params=["unix", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two connected, blocking sockets with a 20 s kernel timeout so no test can hang."""
    left, right = socket.socketpair() if request.param == "unix" else _tcp_pair()
    for sock in (left, right):
        set_timeouts(sock, 20, 20)
    yield left, right
    left.close()
    right.close()


class Background:
    """Run ``target`` on a thread; ``result()`` re-raises what it raised."""

    def __init__(self, target: Callable[[], Any]):
        self._target = target
        self._outcome: tuple[bool, Any] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._outcome = (True, self._target())
        except BaseException as exc:  # handed to the test thread
            self._outcome = (False, exc)

    def result(self, timeout: float = 30) -> Any:
        self._thread.join(timeout)
        assert self._outcome is not None, "background transfer did not finish"
        ok, value = self._outcome
        if not ok:
            raise value
        return value


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _assert_nothing_pending(sock: socket.socket) -> None:
    try:
        data = sock.recv(1, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return
    raise AssertionError(f"unexpected bytes on the socket: {data!r}")


# -- moving bytes -------------------------------------------------------------------


def test_small_mixed_buffers_round_trip(core, pair) -> None:
    left, right = pair
    sources: list[Any] = [
        b"header",
        bytearray(b"\x00\xff" * 7),
        memoryview(b"a view"),
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array(3.5),  # 0-d
        np.zeros((0, 3)),  # empty, 2-d
        np.array([1 + 2j, -0.5j], np.complex128),
        np.arange(6, dtype=">i4"),  # non-native byte order: bytes go as they are
        np.array([True, False, True]),
        b"",
    ]
    sizes = [memoryview(s).nbytes for s in sources]
    assert core.send_buffers(left, sources) == sum(sizes)
    targets = [bytearray(n) for n in sizes]
    assert core.recv_buffers(right, targets) == sum(sizes)
    for source, target in zip(sources, targets):
        assert bytes(target) == memoryview(source).tobytes()


def test_more_buffers_than_iov_max(core, pair) -> None:
    left, right = pair
    count = 3000  # > IOV_MAX (1024) on the way out and on the way in
    rng = np.random.default_rng(1)
    sizes = [int(n) for n in rng.integers(0, 300, count)]
    sizes[::7] = [0] * len(sizes[::7])  # empty buffers scattered among the others
    whole = _pattern(sum(sizes), 2)
    offsets = np.cumsum([0, *sizes])
    sources = [whole[offsets[i] : offsets[i + 1]] for i in range(count)]
    targets = [np.empty(n, np.uint8) for n in sizes]
    receiving = Background(lambda: core.recv_buffers(right, targets))
    assert core.send_buffers(left, sources) == sum(sizes)
    assert receiving.result() == sum(sizes)
    assert np.array_equal(np.concatenate(targets), whole)


def test_buffer_boundaries_need_not_match(core, pair) -> None:
    """The receiver's buffers are cut differently from the sender's: bytes are a stream."""
    left, right = pair
    whole = _pattern(10_000, 3)
    sources = [whole[:1], whole[1:5000], whole[5000:]]
    targets = [np.empty(n, np.uint8) for n in (4999, 2, 4999)]
    receiving = Background(lambda: core.recv_buffers(right, targets))
    core.send_buffers(left, sources)
    receiving.result()
    assert np.array_equal(np.concatenate(targets), whole)


def test_empty_buffer_lists_move_nothing(core, pair) -> None:
    left, right = pair
    assert core.send_buffers(left, []) == 0
    assert core.send_buffers(left, [b"", bytearray(), np.empty((0, 5))]) == 0
    # Nothing to fill: returns at once instead of waiting for the peer.
    assert core.recv_buffers(right, []) == 0
    assert core.recv_buffers(right, [bytearray(), np.empty((3, 0))]) == 0
    _assert_nothing_pending(right)


def test_64_mib_with_a_reader_thread(core, pair) -> None:
    """Far more than the socket buffers hold: partial writes, and the GIL released while blocked."""
    left, right = pair
    size = 64 << 20
    whole = np.arange(size // 8, dtype=np.uint64).view(np.uint8)
    whole[::4099] = 0xA5  # not just a ramp
    sources = [whole[:12345], whole[12345 : size // 2], whole[size // 2 :]]
    target = np.empty(size, np.uint8)
    header = bytearray(16)
    receiving = Background(lambda: core.recv_buffers(right, [header, target]))
    assert core.send_buffers(left, [b"0123456789abcdef", *sources]) == size + 16
    assert receiving.result(60) == size + 16
    assert bytes(header) == b"0123456789abcdef"
    assert np.array_equal(target, whole)


def test_receiving_side_sends_while_other_thread_receives(core, pair) -> None:
    """Both directions at once on one socket (the client's sender and ack reader do this)."""
    left, right = pair
    size = 8 << 20
    out_left, out_right = _pattern(size, 4), _pattern(size, 5)
    in_left, in_right = np.empty(size, np.uint8), np.empty(size, np.uint8)
    jobs = [
        Background(lambda: core.send_buffers(left, [out_left])),
        Background(lambda: core.send_buffers(right, [out_right])),
        Background(lambda: core.recv_buffers(left, [in_left])),
        Background(lambda: core.recv_buffers(right, [in_right])),
    ]
    for job in jobs:
        assert job.result(60) == size
    assert np.array_equal(in_right, out_left)
    assert np.array_equal(in_left, out_right)


def test_buffers_are_pinned_while_the_gil_is_released(core, pair) -> None:
    """The send holds a view of each buffer: it cannot be resized or freed mid-transfer."""
    left, right = pair
    size = 64 << 20  # far more than the kernel buffers: the send blocks part way
    payload = bytearray(b"\x5a" * size)
    sending = Background(lambda: core.send_buffers(left, [payload]))
    right.settimeout(10)
    assert right.recv(1, socket.MSG_PEEK) == b"\x5a"  # the transfer is under way
    right.settimeout(None)
    set_timeouts(right, 20, 20)
    with pytest.raises(BufferError):
        payload.extend(b"more")  # "Existing exports of data: object cannot be re-sized"
    target = np.empty(size, np.uint8)
    assert core.recv_buffers(right, [target]) == size
    assert sending.result(60) == size
    assert (target == 0x5A).all()
    payload.extend(b"more")  # released once the call returned


# -- refusing bad buffers -----------------------------------------------------------


@pytest.mark.parametrize(
    "readonly",
    [b"12345678", memoryview(bytearray(8)).toreadonly(), np.zeros(8, np.uint8)],
    ids=["bytes", "readonly-memoryview", "readonly-ndarray"],
)
def test_recv_into_read_only_buffer_raises(core, pair, readonly) -> None:
    left, right = pair
    if isinstance(readonly, np.ndarray):
        readonly = readonly.copy()
        readonly.flags.writeable = False
    left.sendall(b"x" * 16)
    # numpy refuses a writable view of its read-only arrays with ValueError.
    expected = (BufferError, ValueError) if isinstance(readonly, np.ndarray) else BufferError
    with pytest.raises(expected):
        core.recv_buffers(right, [bytearray(8), readonly])
    # Refused before reading: the bytes are still there for a correct call.
    target = bytearray(16)
    assert core.recv_buffers(right, [target]) == 16
    assert bytes(target) == b"x" * 16


def test_non_contiguous_buffer_is_refused_before_sending(core, pair) -> None:
    left, right = pair
    strided = np.arange(20, dtype=np.uint8)[::2]
    with pytest.raises((BufferError, ValueError)):
        core.send_buffers(left, [b"first", strided])
    _assert_nothing_pending(right)


def test_non_buffer_object_raises_type_error(core, pair) -> None:
    left, _ = pair
    with pytest.raises(TypeError):
        core.send_buffers(left, [b"ok", "a str is not a buffer"])


# -- errors carry errno -------------------------------------------------------------


def test_peer_closing_mid_transfer_is_connection_reset(core, pair) -> None:
    left, right = pair
    left.sendall(b"y" * 100)
    left.close()
    target = bytearray(1000)
    with pytest.raises(ConnectionResetError) as info:
        core.recv_buffers(right, [target])
    assert info.value.errno == errno.ECONNRESET
    assert "100 of 1000" in str(info.value)
    assert bytes(target[:100]) == b"y" * 100


def test_peer_closed_before_anything_is_connection_reset(core, pair) -> None:
    left, right = pair
    left.close()
    with pytest.raises(ConnectionResetError) as info:
        core.recv_buffers(right, [bytearray(12)])
    assert info.value.errno == errno.ECONNRESET


def test_sending_to_a_closed_peer_raises_with_errno(core, pair) -> None:
    left, right = pair
    right.close()
    chunk = np.zeros(1 << 20, np.uint8)
    with pytest.raises(OSError) as info:
        for _ in range(64):  # the first sends may still land in the kernel's buffers
            core.send_buffers(left, [chunk])
    assert info.value.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)
    assert isinstance(info.value, (BrokenPipeError, ConnectionResetError, OSError))


@pytest.mark.skipif(not hasattr(socket, "MSG_NOSIGNAL"), reason="no MSG_NOSIGNAL here")
@pytest.mark.parametrize("name", list(CORES))
def test_a_peer_that_hung_up_never_kills_a_process_that_restored_sigpipe(name: str) -> None:
    """Python ignores SIGPIPE, but a job may have put it back to its default (a CLI tool,
    a launcher): sending to a peer that hung up must raise, not kill the job."""
    out = run_script(f"""
        import signal, socket
        from thing._core import {CORES[name].__name__.rpartition(".")[2]} as core
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        left, right = socket.socketpair()
        right.close()
        try:
            core.send_buffers(left, [b"x" * 1000])
        except BrokenPipeError:
            print("raised")
    """)
    assert out == "raised\n"


def test_closed_socket_raises_os_error_with_errno(core, pair) -> None:
    left, _ = pair
    left.close()
    with pytest.raises(OSError) as info:
        core.send_buffers(left, [b"data"])
    assert info.value.errno == errno.EBADF


def test_receive_timeout_is_timeout_error_with_errno(core, pair) -> None:
    left, right = pair
    set_timeouts(right, None, 0.2)
    left.sendall(b"z" * 10)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        core.recv_buffers(right, [bytearray(100)])
    assert time.monotonic() - started < 10
    assert info.value.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
    assert "10 of 100" in str(info.value)


def test_send_timeout_is_timeout_error_with_errno(core, pair) -> None:
    left, _ = pair  # nobody ever reads from the other end
    set_timeouts(left, 0.2, None)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        core.send_buffers(left, [np.zeros(64 << 20, np.uint8)])
    assert time.monotonic() - started < 10
    assert info.value.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


# -- signals ------------------------------------------------------------------------


# recvmsg's system call number, to see from /proc that a thread is blocked inside it.
_RECVMSG = {"x86_64": 47, "aarch64": 212}.get(platform.machine())
needs_proc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _RECVMSG is None, reason="reads /proc/<tid>/syscall"
)


def _wait_until_in_recvmsg(native_id: int, timeout: float = 10) -> None:
    """Poll /proc until thread ``native_id`` sleeps inside recvmsg."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/self/task/{native_id}/syscall") as syscall:
            if syscall.read().split()[0] == str(_RECVMSG):
                return
        time.sleep(0.005)
    raise AssertionError("the receiving thread never blocked in recvmsg")


@needs_proc
def test_signal_during_receive_is_retried(core, pair) -> None:
    """EINTR: the signal handler runs, then the transfer carries on where it was."""
    left, right = pair
    main = threading.main_thread()
    assert threading.current_thread() is main
    handled = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda *_: handled.set())
    try:

        def interrupt_then_send() -> None:
            _wait_until_in_recvmsg(main.native_id)
            signal.pthread_kill(main.ident, signal.SIGUSR1)
            assert handled.wait(10)
            left.sendall(b"after the signal")

        helper = Background(interrupt_then_send)
        target = bytearray(16)
        assert core.recv_buffers(right, [target]) == 16
        helper.result()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert bytes(target) == b"after the signal"


class _Interrupted(Exception):
    pass


@needs_proc
def test_exception_from_signal_handler_escapes_a_blocked_receive(core, pair) -> None:
    """A KeyboardInterrupt (here: any exception from a handler) is not swallowed by the loop."""
    _, right = pair
    main = threading.main_thread()

    def handler(*_: Any) -> None:
        raise _Interrupted()

    previous = signal.signal(signal.SIGUSR1, handler)
    try:

        def interrupt() -> None:
            _wait_until_in_recvmsg(main.native_id)
            signal.pthread_kill(main.ident, signal.SIGUSR1)

        helper = Background(interrupt)
        with pytest.raises(_Interrupted):
            core.recv_buffers(right, [bytearray(16)])
        helper.result()
    finally:
        signal.signal(signal.SIGUSR1, previous)


# -- a run of small frames -------------------------------------------------------------


def _pending(seq: int, value: Any, name: str = "x", *, snapshot: bool = True, notice: Any = None,
             call: int = 1, step: int | None = None) -> tuple[int, Pending]:
    """A (seq, Pending) pair as the channel queues it: taken apart and snapshotted at the call
    (or, ``snapshot=False``, read in place by the sender)."""
    payload = take_apart(value)
    payload.hold(None if snapshot else False, 1 << 16)
    site = CallSite("train.py", 7, "step")
    return seq, new_pending(Pending, (name, payload, site, 1.5 + seq, (0, 2), CaptureHandle(name),
                                      notice, call, step, False))


def _as_the_general_path_writes(batch: list[tuple[int, Pending]], headers: Headers) -> bytes:
    """What the channel writes for each frame by itself (Channel._encode's pieces)."""
    written = b""
    for seq, pending in batch:
        header = headers.encode(pending, ())
        data = b"".join(bytes(leaf_bytes(leaf)) for leaf in pending.payload.leaves)
        written += (wire.encode_prefix(header, pending.payload.nbytes, seq, pending.caught_at,
                                       call=pending.call, step=pending.step)
                    + header + data + wire.encode_trailer(False))
    return written


def _received(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    assert thing._core.recv_buffers(sock, [data]) == nbytes
    _assert_nothing_pending(sock)
    return bytes(data)


def test_a_run_of_snapshots_is_sent_as_the_general_path_writes_it(core, pair) -> None:
    left, right = pair
    # Equal trees that are other JSON (1, True, 1.0), arrays of other layouts, several
    # arrays in one capture, other names, steps and call numbers, an empty array.
    values = [np.arange(4, dtype=np.float32), np.arange(4, dtype=np.float32) * 2, 1, True, 1.0,
              1, np.arange(6, dtype=np.int64).reshape(2, 3), {"w": np.ones(3), "b": np.zeros(2)},
              np.zeros(0, dtype=np.float16), "text", [np.ones(2)] * 8]
    names = ["a", "a", "a", "a", "b", "a", "c", "c", "a", "b", "b"]

    def queued() -> list[tuple[int, Pending]]:
        return [_pending(seq, value, name=names[seq], call=seq + 1, step=seq * 10 or None)
                for seq, value in enumerate(values)]

    batch = queued()
    expected = _as_the_general_path_writes(queued(), Headers())
    headers, asked = Headers(), []

    def header_of(pending: Pending) -> bytes:
        asked.append(pending)
        return headers.encode(pending, ())

    end = core.send_snapshots(left, batch, 0, len(batch), 1 << 16, header_of,
                              wire.encode_trailer(False))
    assert end == len(batch)
    assert _received(right, len(expected)) == expected
    assert all(not pending.payload.leaves for _, pending in batch)  # let go once sent
    assert len(asked) < len(batch)  # the second array's header was the first's


@pytest.mark.parametrize("odd_one", ["notice", "large", "in place", "many arrays",
                                     "header fails", "call too large"])
def test_a_run_of_snapshots_stops_before_the_first_frame_that_is_not_one(core, pair,
                                                                         odd_one: str) -> None:
    left, right = pair
    value = np.arange(4, dtype=np.float32)
    batch = [_pending(seq, value) for seq in range(3)]
    odd = {
        "notice": lambda: _pending(3, None, notice={"unsent": {"type": "x", "reason": "y"}}),
        "large": lambda: _pending(3, np.zeros(1 << 14, dtype=np.float32)),
        "in place": lambda: _pending(3, value, snapshot=False),
        "many arrays": lambda: _pending(3, [value] * 9),
        "header fails": lambda: _pending(3, value, name="fails"),
        "call too large": lambda: _pending(3, value, call=1 << 64),
    }[odd_one]()
    batch += [odd, _pending(4, value)]
    headers = Headers()

    def header_of(pending: Pending) -> bytes:
        if pending.name == "fails":
            raise ValueError("cannot encode it")
        return headers.encode(pending, ())

    expected = _as_the_general_path_writes([_pending(seq, value) for seq in range(3)], Headers())
    end = core.send_snapshots(left, batch, 0, len(batch), 1 << 16, header_of,
                              wire.encode_trailer(False))
    assert end == 3
    assert _received(right, len(expected)) == expected
    assert [bool(pending.payload.leaves) for _, pending in batch] == [
        False, False, False, bool(odd[1].payload.leaves), True]
    # From the odd one on, nothing: the caller sends it the general way.
    assert core.send_snapshots(left, batch, 3, len(batch), 1 << 16, header_of,
                               wire.encode_trailer(False)) == 3
    _assert_nothing_pending(right)


def test_code_run_mid_run_cannot_overflow_or_break_the_run(core, pair) -> None:
    """Python runs inside a run (header_of, a float's conversion, a comparison): what it
    does to the queued captures is looked at again before their bytes are pointed to, and
    what it raises ends the run or fails one frame the general way, never the batch."""
    left, right = pair
    value = np.arange(4, dtype=np.float32)
    trailer = wire.encode_trailer(False)
    headers = Headers()
    grown = _pending(0, value)[1].payload.leaves[0]

    def growing(pending: Pending) -> bytes:  # adds 9 arrays to the capture it is asked for
        pending.payload.leaves.extend([grown] * 9)
        return headers.encode(pending, ())

    batch = [_pending(0, value, name="a"), _pending(1, value, name="b")]
    assert core.send_snapshots(left, batch, 0, 2, 1 << 16, growing, trailer) == 0
    _assert_nothing_pending(right)

    class Growing:
        def __float__(self) -> float:
            batch[0][1].payload.leaves.extend([grown] * 1000)
            return 1.0

    batch = [_pending(0, value)]
    batch[0] = (0, batch[0][1]._replace(caught_at=Growing()))
    assert core.send_snapshots(left, batch, 0, 1, 1 << 16, lambda p: headers.encode(p, ()),
                               trailer) == 0
    _assert_nothing_pending(right)

    class Touchy:  # a rank no one can compare
        def __eq__(self, other: object) -> bool:
            raise ValueError("cannot compare")

        __ne__ = __eq__
        __hash__ = object.__hash__

    asked = []
    batch = [_pending(seq, value) for seq in range(3)]
    batch = [(seq, pending._replace(rank=(Touchy(), None), name=name))
             for (seq, pending), name in zip(batch, ["a", "a", 1])]

    header = b'{"name":"a"}'  # what header_of says is sent, whatever it is

    def header_of(pending: Pending) -> bytes:
        asked.append(pending.name)
        return header

    assert core.send_snapshots(left, batch, 0, 3, 1 << 16, header_of, trailer) == 3
    assert asked == ["a", "a", 1]  # not compared is not the same; a name not a str neither
    _received(right, 3 * (wire.FRAME_PREFIX.size + len(header) + value.nbytes + len(trailer)))


class _Meddler:
    """Half of a rank whose comparison does ``act`` (to the batch it is in) and says equal."""

    def __init__(self, act: Callable[[], None]):
        self.act = act

    def __eq__(self, other: object) -> bool:
        self.act()
        return True

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = object.__hash__


@pytest.mark.parametrize("case", ["shrink the frame before", "grow this frame", "empty this frame",
                                  "cut the batch short", "float step", "header not bytes",
                                  "names equal, not the same"])
def test_what_code_run_mid_run_does_is_never_sent_out_of_step(core, pair, case: str) -> None:
    """Whatever code run inside a run does to the batch, nothing reads past what is there,
    and every frame sent is what its prefix and header say, bit for bit."""
    left, right = pair
    value = np.arange(4, dtype=np.float32)
    batch = [_pending(seq, value) for seq in range(40)]
    spare = _pending(0, value)[1].payload.leaves[0]
    header = Headers().encode(batch[0][1], ())  # every frame's, whatever its rank or name
    asked = []

    def header_of(pending: Pending) -> Any:
        asked.append(pending.name)
        if case == "cut the batch short":
            del batch[1:]
        return bytearray(header) if case == "header not bytes" else header

    def meddle(act: Callable[[], None]) -> None:  # in comparing frame 1's rank with frame 0's
        for seq in (0, 1):
            batch[seq] = (seq, batch[seq][1]._replace(rank=(_Meddler(act), 2)))

    if case == "shrink the frame before":
        meddle(lambda: batch[0][1].payload.leaves.clear())
    elif case == "grow this frame":
        meddle(lambda: batch[1][1].payload.leaves.append(spare))
    elif case == "empty this frame":
        meddle(lambda: batch[1][1].payload.leaves.clear())
    elif case == "float step":
        batch[0] = (0, batch[0][1]._replace(step=1.5))
    elif case == "names equal, not the same":
        batch = [(seq, pending._replace(name=name))
                 for (seq, pending), name in zip(batch[:2], [1, True])]
    sent = {"shrink the frame before": 40, "grow this frame": 1, "empty this frame": 1,
            "cut the batch short": 1, "float step": 0, "header not bytes": 0,
            "names equal, not the same": 2}[case]
    trailer = wire.encode_trailer(False)
    expected = b"".join(wire.encode_prefix(header, value.nbytes, seq, 1.5 + seq, call=1)
                        + header + value.tobytes() + trailer for seq in range(sent))
    assert core.send_snapshots(left, batch, 0, 64, 1 << 16, header_of, trailer) == sent
    assert _received(right, len(expected)) == expected
    if case == "names equal, not the same":
        assert asked == [1, True]  # equal names that are not a str: asked for each


def test_a_run_cannot_start_before_the_batch(core, pair) -> None:
    left, _ = pair
    with pytest.raises(ValueError, match="not an index"):
        core.send_snapshots(left, [_pending(0, 1.0)], -1, 1, 1 << 16, bytes,
                            wire.encode_trailer(False))


# -- which core a normal install uses ------------------------------------------------


def test_normal_install_uses_the_compiled_core() -> None:
    if os.environ.get("THING_PUREPYTHON", "") not in ("", "0"):
        pytest.skip("THING_PUREPYTHON is set for this run")
    assert thing.BACKEND == "compiled"
    assert thing._core.send_buffers is _transport.send_buffers
    assert thing._core.recv_buffers is _transport.recv_buffers
    assert _transport.__file__.endswith((".so", ".pyd"))


def test_purepython_environment_variable_selects_the_twin() -> None:
    code = """
        import thing, thing._core, thing.stream
        print(thing.BACKEND, thing._core.send_buffers.__module__,
              thing.stream.recv_some.__module__)
    """
    python = "python thing._core.fallback thing._core.fallback"
    assert run_script(code, THING_PUREPYTHON="1").split() == python.split()
    compiled = "compiled thing._core._transport thing._core._transport"
    assert run_script(code, THING_PUREPYTHON="0").split() == compiled.split()


def test_the_twins_private_mapping_keeps_no_descriptor() -> None:
    data = np.arange(4096, dtype=np.uint8)
    fd = os.memfd_create("thing-test")
    try:
        os.write(fd, data.tobytes())
        before = len(os.listdir("/proc/self/fd"))
        mappings = [fallback.PrivateMapping(fd, data.nbytes) for _ in range(20)]
        assert len(os.listdir("/proc/self/fd")) == before
        assert all(bytes(mapping) == data.tobytes() for mapping in mappings)
        mappings[0][0] = 255  # private: the memfd itself is unchanged
        assert os.pread(fd, 1, 0) == b"\x00"
    finally:
        os.close(fd)


@pytest.mark.parametrize("nbytes", [0, 1, 7, 4096])
def test_bytes_at_copies_the_memory_at_an_address(core, nbytes: int) -> None:
    source = np.frombuffer(os.urandom(nbytes), np.uint8).copy()
    copied = core.bytes_at(source.ctypes.data, nbytes)
    source[:] = ~source  # a copy, not a view: what it holds does not follow the source
    assert type(copied) is bytes and copied == (~source).tobytes()


@pytest.mark.parametrize(("address", "nbytes"), [(0, 4), (4096, -1)])
def test_bytes_at_refuses_a_null_address_or_a_negative_size(core, address: int,
                                                            nbytes: int) -> None:
    with pytest.raises(ValueError, match="no -?[0-9]+ bytes at address"):
        core.bytes_at(address, nbytes)
    assert core.bytes_at(0, 0) == b""  # an empty tensor's data pointer may be null


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="no eventfd here (Python 3.9, macOS)")
def test_wake_adds_one_to_an_eventfd(core) -> None:
    fd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        core.wake(fd)
        core.wake(fd)
        assert os.eventfd_read(fd) == 2  # the sleeper drains however many came
        with pytest.raises(BlockingIOError):
            os.eventfd_read(fd)
    finally:
        os.close(fd)


def test_wake_writes_to_a_pipe_and_a_full_pipe_is_no_error(core) -> None:
    read, write = os.pipe()
    try:
        os.set_blocking(write, False)
        core.wake(write)
        assert os.read(read, 64) == (1).to_bytes(8, sys.byteorder)
        while True:  # fill it: the sleeper has a wake-up waiting, and more change nothing
            try:
                os.write(write, b"\0" * 65536)
            except BlockingIOError:
                break
        core.wake(write)
    finally:
        os.close(read)
        os.close(write)
    with open(os.devnull, "rb") as read_only, pytest.raises(OSError) as raised:
        core.wake(read_only.fileno())  # an error the caller decides about, unlike a full one
    assert raised.value.errno == errno.EBADF
