"""The pure-Python twin of the compiled core: same interface, plain socket calls.

It is the executable specification of ``_transport.pyx``, the baseline the
benchmarks compare against, and the fallback when the extension is missing or
``THING_PUREPYTHON=1`` is set.
"""

from __future__ import annotations

import array
import contextlib
import errno
import mmap
import os
import socket
import struct
import sys
from collections.abc import Sequence
from typing import Any

# Linux and macOS both cap one sendmsg/recvmsg at 1024 buffers.
_IOV_MAX = 1024
# A peer that hung up must raise BrokenPipeError, as in the compiled core, not send SIGPIPE,
# which kills a process that left it at its default.
_NO_SIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
MAX_DESCRIPTORS = 4
_CONTROL_BYTES = socket.CMSG_SPACE(MAX_DESCRIPTORS * array.array("i").itemsize)


def _byte_view(buffer: object, writable: bool) -> memoryview:
    """A flat byte view of ``buffer``, refused the way the compiled core refuses it."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise BufferError("buffer is not C-contiguous")
    if writable and view.readonly:
        raise BufferError("recv_buffers needs writable buffers")
    # memoryview cannot cast an empty N-d view; an empty buffer moves no bytes anyway.
    return view.cast("B") if view.nbytes else memoryview(b"")


def _transfer(sock: socket.socket, buffers: Sequence, sending: bool) -> int:
    views = [_byte_view(b, writable=not sending) for b in buffers]
    total = sum(v.nbytes for v in views)
    done = 0
    pending = [v for v in views if v.nbytes]
    while pending:
        batch = pending[:_IOV_MAX]
        try:
            if sending:
                moved = sock.sendmsg(batch, [], _NO_SIGNAL)
            else:
                moved = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        except BlockingIOError as exc:
            raise TimeoutError(exc.errno, f"timed out after {done} of {total} bytes") from None
        if moved == 0 and not sending:
            raise ConnectionResetError(
                errno.ECONNRESET, f"peer closed the connection after {done} of {total} bytes"
            )
        done += moved
        while moved:
            step = min(moved, pending[0].nbytes)
            moved -= step
            pending[0] = pending[0][step:]
            if not pending[0].nbytes:
                pending.pop(0)
    return total


def send_buffers(sock: socket.socket, buffers: Sequence) -> int:
    """Send every buffer of ``buffers`` in order with ``sendmsg``; return the bytes sent."""
    return _transfer(sock, buffers, sending=True)


def recv_buffers(sock: socket.socket, buffers: Sequence) -> int:
    """Fill every writable buffer of ``buffers`` in order; return the bytes received."""
    return _transfer(sock, buffers, sending=False)


def recv_some(sock: socket.socket, buffer: object, offset: int,
              descriptors: list[int] | None = None) -> int:
    """Receive what has arrived into ``buffer[offset:]``; append passed descriptors."""
    view = _byte_view(buffer, writable=True)
    if not 0 <= offset < view.nbytes:
        raise ValueError(f"offset {offset} is outside a buffer of {view.nbytes} bytes")
    try:
        if descriptors is None:
            return sock.recv_into(view[offset:])
        moved, control, flags, _ = sock.recvmsg_into(
            [view[offset:]], _CONTROL_BYTES, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    except BlockingIOError as exc:
        raise TimeoutError(exc.errno, "timed out waiting for bytes") from None
    for level, kind, data in control:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            passed = array.array("i")
            passed.frombytes(data[: len(data) - len(data) % passed.itemsize])
            descriptors.extend(passed)
    if flags & socket.MSG_CTRUNC:
        raise OSError(errno.EMSGSIZE, "more descriptors came than one receive takes")
    return moved


# An acknowledgement, as wire.ACK lays it out; "stored" is status 0 with no message.
_ACK = struct.Struct("<2sHIQq")
_STORED = (b"TA", 0, 0)


def split_stored_acks(buffer: object, limit: int) -> list[tuple[int, int, int, bytes]]:
    """The "stored" acknowledgements at the start of ``buffer``, up to ``limit``, as
    ``(0, seq, capture_id, b"")``; stops at the first that is anything else."""
    view = _byte_view(buffer, writable=False)
    whole = min(view.nbytes // _ACK.size, max(limit, 0)) * _ACK.size
    acks = []
    for tag, status, length, seq, capture_id in _ACK.iter_unpack(view[:whole]):
        if (tag, status, length) != _STORED:
            break
        acks.append((0, seq, capture_id, b""))
    return acks


# A frame, as wire.FRAME_PREFIX and wire.FRAME_TRAILER lay it out.
_PREFIX = struct.Struct("<2sHIQQdQq")
_TRAILER = struct.Struct("<2sHI")
_KIND_CAPTURE = 1
_FLAG_MODIFIED = 1
_MAX_TIME = 1e11
_NO_STEP = -(1 << 63)


def split_small_frames(buffer: object, limit: int, max_payload: int,
                       headers: dict[bytes, Any]) -> list[tuple]:
    """The small inline capture frames whole at the start of ``buffer``, up to ``limit``,
    whose header's bytes are a key of ``headers``, as ``(end, headers[header], payload,
    seq, caught_at, call, step, modified)``; stops at the first that is anything else."""
    view = _byte_view(buffer, writable=False)
    frames: list[tuple] = []
    offset, header, known = 0, None, None
    while len(frames) < limit and view.nbytes - offset >= _PREFIX.size:
        tag, kind, header_len, payload_len, seq, caught_at, call, step = _PREFIX.unpack_from(
            view, offset)
        header_at = offset + _PREFIX.size
        payload_at = header_at + header_len
        trailer_at = payload_at + payload_len
        if (tag != b"TF" or kind != _KIND_CAPTURE or payload_len >= max_payload
                or trailer_at + _TRAILER.size > view.nbytes):
            break
        trailer_tag, flags, _ = _TRAILER.unpack_from(view, trailer_at)
        if trailer_tag != b"TE" or flags & ~_FLAG_MODIFIED:
            break
        if header is None or view[header_at:payload_at] != header:
            header = bytes(view[header_at:payload_at])
            known = headers.get(header)
        if known is None:
            break
        offset = trailer_at + _TRAILER.size
        frames.append((offset, known, bytearray(view[payload_at:trailer_at]), seq,
                       caught_at if -_MAX_TIME < caught_at < _MAX_TIME else None,
                       call or None, None if step == _NO_STEP else step,
                       bool(flags & _FLAG_MODIFIED)))
    return frames


_MAX_SNAPSHOT_LEAVES = 8


def _all_snapshots(leaves: list) -> bool:
    for leaf in leaves:  # noqa: SIM110 (as the compiled core's loop)
        if type(leaf.source) is not bytes or leaf.version is not None:
            return False
    return True


def _same_header(before: tuple, pending: tuple) -> bool:
    # A frames.Pending's fields by position: name, payload, site, caught_at, rank, handle,
    # notice, call, step, requested.
    payload_before, payload = before[1], pending[1]
    name_before, name = before[0], pending[0]
    return ((name is name_before or (type(name) is str and type(name_before) is str
                                     and name == name_before))
            and payload_before.tree is payload.tree
            and [leaf.spec for leaf in payload_before.leaves]
            == [leaf.spec for leaf in payload.leaves]
            and before[2] == pending[2] and before[4] == pending[4] and before[9] == pending[9])


def send_snapshots(sock: socket.socket, batch: list, start: int, stop: int, max_payload: int,
                   header_of: Any, trailer: bytes) -> int:
    """Send the frames of ``batch[start:stop]`` in one vectored write, up to the first that
    is not a plain snapshot; return its index (see the compiled core's)."""
    if start < 0:
        raise ValueError(f"start {start} is not an index")
    buffers: list[Any] = []
    sent: list[list] = []
    before = header = None
    end = start
    while end < min(stop, len(batch)):  # Python run below may shorten the batch
        seq, pending = batch[end]
        payload = pending[1]
        leaves = payload.leaves
        count = len(leaves)
        if (pending[6] is not None or payload.nbytes >= max_payload
                or count > _MAX_SNAPSHOT_LEAVES or not _all_snapshots(leaves)):
            break
        try:
            same = before is not None and _same_header(before, pending)
        except Exception:
            same = False
        if not same:
            try:
                header = header_of(pending)
            except Exception:
                break
            if type(header) is not bytes:
                break
        try:
            prefix = _PREFIX.pack(b"TF", _KIND_CAPTURE, len(header), payload.nbytes, seq,
                                  pending[3], pending[7],
                                  _NO_STEP if pending[8] is None else pending[8])
        except struct.error:
            break
        held = list(leaves)  # as the header was chosen for, each source read once
        sources = [leaf.source for leaf in held]
        if (len(held) != count or any(leaf.version is not None for leaf in held)
                or any(type(source) is not bytes for source in sources)
                or sum(map(len, sources)) != payload.nbytes):
            break  # changed by code run above
        buffers += [prefix, header, *sources, trailer]
        sent.append(leaves)
        before = pending
        end += 1
    if buffers:
        send_buffers(sock, buffers)
    for leaves in sent:
        leaves.clear()
    return end


def bytes_at(address: int, nbytes: int) -> bytes:
    """A copy of the ``nbytes`` bytes of memory at ``address`` (see the compiled core's)."""
    import ctypes  # only the twin needs it, and only once a tensor is snapshotted

    if nbytes < 0 or (address == 0 and nbytes):
        raise ValueError(f"no {nbytes} bytes at address {address:#x}")
    # Not ctypes.string_at, which takes the size as a C int: 2 GiB and more would fail,
    # and 4 GiB and more wrap around.
    return (ctypes.c_char * nbytes).from_address(address).raw if nbytes else b""


def wake(fd: int) -> None:
    """Add one to the eventfd ``fd``, or write as much to a non-blocking pipe (see the
    compiled core's): here with the GIL let go, as every write from Python is."""
    with contextlib.suppress(BlockingIOError):  # a full pipe: a wake-up is waiting already
        os.write(fd, _ONE)


_ONE = (1).to_bytes(8, sys.byteorder)  # an eventfd's increment, as the kernel reads it


def untrack(obj: object) -> object:
    """``obj`` itself: pure Python cannot take an object out of the cyclic garbage
    collector's lists, so a server on the twin has each full collection walk its history."""
    return obj


def map_file(fd: int, size: int) -> mmap.mmap:
    """``size`` bytes of the file ``fd`` mapped copy-on-write, read only where looked at.

    Python 3.13 maps it without keeping a descriptor (``trackfd=False``), as
    the compiled core does. Before that, the mapping keeps a duplicate of ``fd``
    while it lives: one per recording segment in use, so a recording of more
    segments than the process may open files loads only on the compiled core.
    A copy instead (as :func:`PrivateMapping` makes) would read whole recordings
    into memory.
    """
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE, trackfd=False)
    return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)


def PrivateMapping(fd: int, size: int) -> mmap.mmap:  # noqa: N802 - the compiled one is a class
    """``size`` bytes of ``fd`` as a writable buffer that keeps no descriptor.

    Python 3.13 maps it copy-on-write without a descriptor (``trackfd=False``).
    Before that, ``mmap`` keeps a duplicate of the descriptor as long as the
    mapping lives, one per kept capture; so the bytes are read into anonymous
    memory instead: a copy, which the compiled core does not need.
    """
    if sys.version_info >= (3, 13):
        return map_file(fd, size)
    # Private: mmap's default, shared anonymous memory, is shmem and faults in far slower.
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with memoryview(memory) as view:
        done = 0
        while done < size:
            moved = os.preadv(fd, [view[done:]], done)
            if moved == 0:
                raise OSError(errno.EIO, f"shared memory ended after {done} of {size} bytes")
            done += moved
    return memory
