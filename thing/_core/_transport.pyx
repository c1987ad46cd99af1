# cython: language_level=3
"""The compiled byte movers: scatter/gather socket loops on buffer pointers.

``send_buffers`` and ``recv_buffers`` hold a ``Py_buffer`` view of every buffer for the whole call, so
the memory cannot move or be freed while the GIL is released, and they loop
over partial transfers without taking the GIL back: a training thread that
holds the GIL never slows a transfer down chunk by chunk.

The socket must be in blocking mode; timeouts come from ``SO_SNDTIMEO`` /
``SO_RCVTIMEO`` and surface as ``TimeoutError``.

``send_snapshots`` writes a run of small frames whose arrays were copied at the
call and sends them in one call: a client's share of a flood of small captures.
``split_stored_acks`` splits a burst of the server's "stored" acknowledgements,
and ``split_small_frames`` a run of a client's small frames, in one call each,
on the bytes one receive brought: reading many small messages per system call.

``bytes_at`` copies a tensor's memory from its data pointer at the call.

``untrack`` takes what the server keeps for hours out of the cyclic garbage
collector's lists, which pure Python cannot do.
"""

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_WRITABLE,
    PyBuffer_FillInfo,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytearray cimport PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.number cimport PyIndex_Check
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.errno cimport EAGAIN, ECONNRESET, EINTR, EMSGSIZE, errno
from libc.limits cimport LLONG_MIN
from libc.stdint cimport uint64_t
from libc.string cimport memcmp, memcpy, memset, strerror
from posix.unistd cimport write

from thing._core._build cimport THING_SOURCE_DIGEST

cdef extern from "<sys/uio.h>":
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>":
    struct msghdr:
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    struct cmsghdr:
        size_t cmsg_len
        int cmsg_level
        int cmsg_type
    ssize_t sendmsg(int fd, const msghdr *msg, int flags) nogil
    ssize_t recvmsg(int fd, msghdr *msg, int flags) nogil
    cmsghdr *CMSG_FIRSTHDR(msghdr *msg) nogil
    cmsghdr *CMSG_NXTHDR(msghdr *msg, cmsghdr *cmsg) nogil
    unsigned char *CMSG_DATA(cmsghdr *cmsg) nogil
    size_t CMSG_LEN(size_t length) nogil
    int MSG_WAITALL
    int MSG_CTRUNC
    int SOL_SOCKET
    int SCM_RIGHTS

cdef extern from *:
    """
    #include <errno.h>
    #include <limits.h>
    #ifndef IOV_MAX
    #define IOV_MAX 1024
    #endif
    #ifndef MSG_NOSIGNAL
    #define MSG_NOSIGNAL 0
    #endif
    #ifndef MSG_CMSG_CLOEXEC
    #define MSG_CMSG_CLOEXEC 0
    #endif
    #define THING_IOV_MAX IOV_MAX
    #define THING_MSG_NOSIGNAL MSG_NOSIGNAL
    #define THING_MSG_CMSG_CLOEXEC MSG_CMSG_CLOEXEC
    /* Room for MAX_DESCRIPTORS ints of SCM_RIGHTS, aligned as the kernel writes them. */
    #define THING_MAX_DESCRIPTORS 4
    #define THING_CONTROL_BYTES CMSG_SPACE(THING_MAX_DESCRIPTORS * sizeof(int))
    """
    const int THING_IOV_MAX
    const int THING_MSG_NOSIGNAL
    const int THING_MSG_CMSG_CLOEXEC
    const int THING_MAX_DESCRIPTORS
    const size_t THING_CONTROL_BYTES
    const int EWOULDBLOCK


cdef ssize_t _transfer(int fd, iovec *iov, Py_ssize_t count, bint sending,
                       size_t *done, int *error) noexcept nogil:
    """Move every byte of ``iov``; advances it in place. Returns 0, -1 on error, 1 on EOF."""
    cdef msghdr msg
    cdef ssize_t moved
    cdef size_t step
    cdef Py_ssize_t first = 0
    while first < count:
        if iov[first].iov_len == 0:
            first += 1
            continue
        memset(&msg, 0, sizeof(msg))
        msg.msg_iov = &iov[first]
        msg.msg_iovlen = min(count - first, <Py_ssize_t>THING_IOV_MAX)
        if sending:
            moved = sendmsg(fd, &msg, THING_MSG_NOSIGNAL)
        else:
            moved = recvmsg(fd, &msg, MSG_WAITALL)
        if moved < 0:
            error[0] = errno
            return -1
        if moved == 0 and not sending:
            return 1
        done[0] += moved
        while moved > 0:
            step = min(<size_t>moved, iov[first].iov_len)
            iov[first].iov_base = <char *>iov[first].iov_base + step
            iov[first].iov_len -= step
            moved -= step
            if iov[first].iov_len == 0:
                first += 1
    return 0


cdef size_t _move(int fd, iovec *iov, Py_ssize_t count, bint sending,
                  size_t total) except? 0:
    """Move the ``total`` bytes of ``iov`` with the GIL released; raise as the movers do."""
    cdef size_t done = 0
    cdef ssize_t status
    cdef int error = 0
    while True:
        with nogil:
            status = _transfer(fd, iov, count, sending, &done, &error)
        if status == 1:
            raise ConnectionResetError(
                ECONNRESET, f"peer closed the connection after {done} of {total} bytes")
        if status == 0:
            return total
        if error == EINTR:
            # Let a pending KeyboardInterrupt out, then carry on where we were.
            PyErr_CheckSignals()
            continue
        if error == EAGAIN or error == EWOULDBLOCK:
            raise TimeoutError(error, f"timed out after {done} of {total} bytes")
        raise OSError(error, strerror(error).decode("utf-8", "replace"))


cdef size_t _run(sock, buffers, bint sending) except? 0:
    cdef int fd = sock.fileno()
    cdef Py_ssize_t count = len(buffers)
    cdef Py_ssize_t held = 0
    cdef Py_ssize_t i
    cdef size_t total = 0
    cdef int flags = PyBUF_C_CONTIGUOUS | (0 if sending else PyBUF_WRITABLE)
    cdef Py_buffer *views = <Py_buffer *>PyMem_Malloc(max(count, 1) * sizeof(Py_buffer))
    cdef iovec *iov = <iovec *>PyMem_Malloc(max(count, 1) * sizeof(iovec))
    if views == NULL or iov == NULL:
        PyMem_Free(views)
        PyMem_Free(iov)
        raise MemoryError()
    try:
        for i in range(count):
            PyObject_GetBuffer(buffers[i], &views[i], flags)
            held += 1
            iov[i].iov_base = views[i].buf
            iov[i].iov_len = <size_t>views[i].len
            total += <size_t>views[i].len
        return _move(fd, iov, count, sending, total)
    finally:
        for i in range(held):
            PyBuffer_Release(&views[i])
        PyMem_Free(views)
        PyMem_Free(iov)


def send_buffers(sock, buffers) -> int:
    """Send every buffer of ``buffers`` in order with ``sendmsg``; return the bytes sent.

    Partial writes and EINTR are retried; the call returns only when all bytes
    are in the kernel or an ``OSError`` (with ``errno``) is raised.
    """
    return _run(sock, buffers, True)


def recv_buffers(sock, buffers) -> int:
    """Fill every writable buffer of ``buffers`` in order from ``recvmsg``; return the bytes.

    Raises ``ConnectionResetError`` if the peer closes before all are filled.
    """
    return _run(sock, buffers, False)


MAX_DESCRIPTORS = THING_MAX_DESCRIPTORS
SOURCE_DIGEST = THING_SOURCE_DIGEST.decode("ascii")  # see _build.pxd


def recv_some(sock, buffer, Py_ssize_t offset, list descriptors=None) -> int:
    """Receive what has arrived (waiting for at least one byte) into ``buffer[offset:]``.

    Returns the byte count, 0 at the end of the stream. With a ``descriptors``
    list, descriptors passed with the bytes (``SCM_RIGHTS``, close-on-exec,
    ``MAX_DESCRIPTORS`` at most) are appended to it; more than that raises
    ``OSError(EMSGSIZE)`` after appending those that came, for the caller to close.
    One ``recvmsg`` with the GIL released: the reader of many small frames at once.
    """
    cdef int fd = sock.fileno()
    cdef Py_buffer view
    cdef msghdr msg
    cdef iovec iov
    cdef cmsghdr *cmsg
    cdef size_t control[8]  # aligned as a cmsghdr must be
    cdef ssize_t moved
    cdef int error = 0
    cdef int received
    cdef int *passed
    cdef Py_ssize_t i
    if THING_CONTROL_BYTES > sizeof(control):
        raise SystemError("descriptor room does not fit")
    PyObject_GetBuffer(buffer, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
    try:
        if not 0 <= offset < view.len:
            raise ValueError(f"offset {offset} is outside a buffer of {view.len} bytes")
        while True:
            memset(&msg, 0, sizeof(msg))
            iov.iov_base = <char *>view.buf + offset
            iov.iov_len = <size_t>(view.len - offset)
            msg.msg_iov = &iov
            msg.msg_iovlen = 1
            if descriptors is not None:
                msg.msg_control = <void *>control
                msg.msg_controllen = THING_CONTROL_BYTES
            with nogil:
                moved = recvmsg(fd, &msg, THING_MSG_CMSG_CLOEXEC)
                if moved < 0:
                    error = errno
            if moved >= 0:
                break
            if error == EINTR:
                PyErr_CheckSignals()
                continue
            if error == EAGAIN or error == EWOULDBLOCK:
                raise TimeoutError(error, "timed out waiting for bytes")
            raise OSError(error, strerror(error).decode("utf-8", "replace"))
        if descriptors is not None:
            cmsg = CMSG_FIRSTHDR(&msg)
            while cmsg != NULL:
                if cmsg.cmsg_level == SOL_SOCKET and cmsg.cmsg_type == SCM_RIGHTS:
                    received = <int>((cmsg.cmsg_len - CMSG_LEN(0)) // sizeof(int))
                    passed = <int *>CMSG_DATA(cmsg)
                    for i in range(received):
                        descriptors.append(passed[i])
                cmsg = CMSG_NXTHDR(&msg, cmsg)
            if msg.msg_flags & MSG_CTRUNC:
                raise OSError(EMSGSIZE, "more descriptors came than one receive takes")
        return moved
    finally:
        PyBuffer_Release(&view)


# An acknowledgement, as wire.ACK lays it out: b"TA", status (u16), message length (u32),
# seq (u64), capture id (i64), little-endian. "Stored" is status 0 with no message.
cdef enum:
    ACK_BYTES = 24


cdef inline unsigned long long _little_u64(const unsigned char *p) noexcept nogil:
    cdef unsigned long long value = 0
    cdef int i
    for i in range(7, -1, -1):
        value = (value << 8) | p[i]
    return value


def split_stored_acks(buffer, Py_ssize_t limit) -> list:
    """The acknowledgements at the start of ``buffer`` that say "stored", up to ``limit``.

    Returns ``(ACK_STORED, seq, capture_id, b"")`` for each whole one, in order,
    and stops at the first that is anything else (a refusal, a control message,
    bad bytes, a partial one), which the caller reads the general way. A burst
    of a training loop's acknowledgements becomes one call instead of one per frame.
    """
    cdef Py_buffer view
    cdef const unsigned char *at
    cdef Py_ssize_t offset = 0
    cdef list acks = []
    PyObject_GetBuffer(buffer, &view, PyBUF_C_CONTIGUOUS)
    try:
        while offset + ACK_BYTES <= view.len and len(acks) < limit:
            at = <const unsigned char *>view.buf + offset
            # tag "TA", status 0, message length 0
            if at[0] != 84 or at[1] != 65 or at[2] or at[3] or at[4] or at[5] or at[6] or at[7]:
                break
            acks.append((0, _little_u64(at + 8), <long long>_little_u64(at + 16), b""))
            offset += ACK_BYTES
        return acks
    finally:
        PyBuffer_Release(&view)


# A frame as wire.FRAME_PREFIX and wire.FRAME_TRAILER lay it out, little-endian: b"TF", kind
# (u16), header length (u32), payload length (u64), seq (u64), time of the call (f64), call
# number (u64), step (i64); the header and payload; b"TE", flags (u16), reserved (u32).
cdef enum:
    PREFIX_BYTES = 48
    TRAILER_BYTES = 8
    KIND_CAPTURE = 1
    FLAG_MODIFIED = 1

cdef double MAX_TIME = 1e11  # wire.MAX_TIME: a time outside +-MAX_TIME is no time
cdef long long NO_STEP = LLONG_MIN  # wire.NO_STEP


def split_small_frames(buffer, Py_ssize_t limit, Py_ssize_t max_payload,
                       dict headers not None) -> list:
    """The small inline capture frames whole at the start of ``buffer``, up to ``limit``,
    whose header's bytes are a key of ``headers``.

    Returns ``(end, known, payload, seq, caught_at, call, step, modified)`` for
    each, in order: ``end`` is its end's offset in ``buffer``, ``known`` the
    value ``headers`` holds for its header (looked up once for a run of frames
    with the same header), ``payload`` a new ``bytearray`` of its payload
    (below ``max_payload`` bytes), and the rest as ``wire.decode_prefix`` and
    ``wire.decode_trailer`` give them. Stops at the first that is anything else
    (another kind, a large or partial one, a bad prefix or trailer, a header
    not in ``headers``), which the caller reads the general way, before
    copying its payload: the server's share of splitting many small frames
    per receive.
    """
    cdef Py_buffer view
    cdef const unsigned char *at
    cdef const unsigned char *trailer
    cdef Py_ssize_t offset = 0
    cdef size_t left, header_len
    cdef unsigned long long payload_len, bits, call
    cdef double caught_at
    cdef long long step
    cdef bytes header = None
    cdef object known = None
    cdef const char *last_header = NULL
    cdef size_t last_header_len = 0
    cdef list frames = []
    if max_payload <= 0:
        return frames
    PyObject_GetBuffer(buffer, &view, PyBUF_C_CONTIGUOUS)
    try:
        while len(frames) < limit:
            left = <size_t>(view.len - offset)
            if left < PREFIX_BYTES:
                break
            at = <const unsigned char *>view.buf + offset
            if at[0] != 84 or at[1] != 70 or at[2] != KIND_CAPTURE or at[3]:  # "TF", kind
                break
            header_len = <size_t>(at[4] | (at[5] << 8) | (at[6] << 16) | (<size_t>at[7] << 24))
            payload_len = _little_u64(at + 8)
            # Below max_payload (at most 2**63 - 1), so the sum below cannot wrap.
            if payload_len >= <unsigned long long>max_payload:
                break
            if left < PREFIX_BYTES + header_len + <size_t>payload_len + TRAILER_BYTES:
                break
            trailer = at + PREFIX_BYTES + header_len + payload_len
            if trailer[0] != 84 or trailer[1] != 69 or trailer[3] or trailer[2] & ~FLAG_MODIFIED:
                break  # not "TE", or flags it does not know
            if header is None or header_len != last_header_len or memcmp(
                    last_header, at + PREFIX_BYTES, header_len):
                header = PyBytes_FromStringAndSize(<const char *>at + PREFIX_BYTES,
                                                   <Py_ssize_t>header_len)
                last_header, last_header_len = <const char *>header, header_len
                known = headers.get(header)
            if known is None:
                break
            bits = _little_u64(at + 24)
            memcpy(&caught_at, &bits, sizeof(double))
            call = _little_u64(at + 32)
            step = <long long>_little_u64(at + 40)
            offset += PREFIX_BYTES + header_len + payload_len + TRAILER_BYTES
            frames.append((
                offset, known,
                PyByteArray_FromStringAndSize(<const char *>at + PREFIX_BYTES + header_len,
                                              <Py_ssize_t>payload_len),
                _little_u64(at + 16),
                caught_at if -MAX_TIME < caught_at < MAX_TIME else None,
                call if call else None,
                None if step == NO_STEP else step,
                bool(trailer[2] & FLAG_MODIFIED)))
        return frames
    finally:
        PyBuffer_Release(&view)


cdef enum:
    MAX_SNAPSHOT_LEAVES = 8  # a frame of more arrays goes the general way
    FRAME_VIEWS = 3 + MAX_SNAPSHOT_LEAVES  # prefix, header, its arrays, trailer

# A frames.Pending's fields, by position (it is a named tuple).
cdef enum:
    PENDING_NAME = 0
    PENDING_PAYLOAD = 1
    PENDING_SITE = 2
    PENDING_CAUGHT_AT = 3
    PENDING_RANK = 4
    PENDING_NOTICE = 6
    PENDING_CALL = 7
    PENDING_STEP = 8
    PENDING_REQUESTED = 9
    PENDING_FIELDS = 10


cdef inline object _field(pending, Py_ssize_t i):
    """A field of a frames.Pending (a tuple of PENDING_FIELDS, checked by the caller): read
    directly, as a named tuple's indexing by the generic path costs a slice and a call."""
    return <object>PyTuple_GET_ITEM(pending, i)


cdef inline void _put_little(unsigned char *at, unsigned long long value,
                             int size) noexcept nogil:
    cdef int i
    for i in range(size):
        at[i] = <unsigned char>(value >> (8 * i))


cdef inline unsigned long long _double_bits(double value) noexcept nogil:
    cdef unsigned long long bits
    memcpy(&bits, &value, sizeof(bits))
    return bits


cdef bint _same_header(before, pending, list leaves) except -1:
    """Whether ``pending``'s header is ``before``'s: the same name (a ``str``, whose
    comparison runs no one's code), the very same tree (an equal one may be other JSON:
    1, 1.0 and True), equal leaf specs, site, rank and request. A comparison may run
    code that changes the lists: each index is checked against them as they are then."""
    cdef list leaves_before = _field(before, PENDING_PAYLOAD).leaves
    cdef Py_ssize_t i
    name_before, name = _field(before, PENDING_NAME), _field(pending, PENDING_NAME)
    if name is not name_before and not (
            type(name) is str and type(name_before) is str and name == name_before):
        return False
    if _field(before, PENDING_PAYLOAD).tree is not _field(pending, PENDING_PAYLOAD).tree:
        return False
    if len(leaves_before) != len(leaves):
        return False
    for i in range(len(leaves)):
        if i >= len(leaves_before) or i >= len(leaves):
            return False
        leaf_before, leaf = leaves_before[i], leaves[i]  # both read before any code runs
        if leaf_before.spec != leaf.spec:
            return False
    for i in (PENDING_SITE, PENDING_RANK, PENDING_REQUESTED):
        if _field(before, i) != _field(pending, i):
            return False
    return True


cdef inline object _integer(value):
    """An integer field of a prefix, as ``struct`` packs one: never a float's whole part."""
    if not PyIndex_Check(value):
        raise TypeError(f"{type(value).__name__} is not an integer")
    return value


cdef bint _all_snapshots(list leaves) except -1:
    """Whether every leaf is a copy made at the call (see ``arrays.hold``): bytes, not
    read in place."""
    for leaf in leaves:
        if leaf.version is not None or type(leaf.source) is not bytes:
            return False
    return True


cdef Py_ssize_t _point_to(list leaves, Py_ssize_t count, iovec *iov, list keep) except -2:
    """Point ``iov`` (room for ``count``) at the bytes of each of the ``count`` leaves,
    keeping each in ``keep``; their byte count, or -1 if one is not a snapshot or the
    list is not of ``count`` (reading an attribute may run code that changes it: each
    index is checked as it is read). Each source is read once: what is pointed at is kept."""
    cdef Py_ssize_t i
    cdef size_t nbytes = 0
    for i in range(count):
        if i >= len(leaves):
            return -1
        leaf = leaves[i]
        source = leaf.source
        if leaf.version is not None or type(source) is not bytes:
            return -1
        keep.append(source)
        iov[i].iov_base = <char *><bytes>source
        iov[i].iov_len = <size_t>len(<bytes>source)
        nbytes += <size_t>len(<bytes>source)
    return <Py_ssize_t>nbytes if len(leaves) == count else -1


def send_snapshots(sock, list batch, Py_ssize_t start, Py_ssize_t stop, Py_ssize_t max_payload,
                   header_of, bytes trailer) -> int:
    """Send the frames of ``batch[start:stop]`` (``(seq, frames.Pending)`` pairs) in one
    vectored write, up to the first that is not a plain snapshot; return its index.

    A plain snapshot is a capture (not a notice) whose arrays, below ``max_payload``
    bytes together and at most ``MAX_SNAPSHOT_LEAVES``, were all copied at the
    call (``bytes``, not read in place). Its header is ``header_of(pending)``,
    asked again only where it may differ from the frame before's; its trailer is
    ``trailer``. An exception from ``header_of``, or a number that does not fit
    the prefix, ends the run before that frame too, for the caller to read the
    general way. Once the bytes are in the kernel, each sent frame's leaves are
    cleared (its arrays may be freed). The sender's share of a flood of small
    captures: prefixes written in C, no object made per frame.
    """
    cdef Py_ssize_t end = start
    cdef Py_ssize_t count = 0
    cdef Py_ssize_t frames, nleaves
    cdef size_t total = 0
    cdef Py_ssize_t frame_bytes
    cdef unsigned char *prefix
    cdef unsigned long long seq, call, nbytes
    cdef long long step
    cdef double caught_at
    cdef bint same
    cdef object pending, before = None
    cdef list leaves
    cdef bytes header = None
    cdef list keep = []  # what the iovecs point into, alive while the GIL is let go
    cdef list sent = []  # each sent frame's leaves
    if start < 0:
        raise ValueError(f"start {start} is not an index")
    stop = min(stop, len(batch))
    if stop <= start:
        return start
    frames = stop - start
    cdef unsigned char *prefixes = <unsigned char *>PyMem_Malloc(frames * PREFIX_BYTES)
    cdef iovec *iov = <iovec *>PyMem_Malloc(frames * FRAME_VIEWS * sizeof(iovec))
    if prefixes == NULL or iov == NULL:
        PyMem_Free(prefixes)
        PyMem_Free(iov)
        raise MemoryError()
    try:
        # Python may run inside the loop (a comparison, header_of, a conversion, a finalizer
        # the collector calls): the batch's and the leaves' lengths are checked as each is
        # indexed, and what the iovecs point to is read once and kept.
        while end < stop and end < len(batch):
            seq_object, pending = batch[end]
            if (not PyTuple_Check(pending) or PyTuple_GET_SIZE(pending) != PENDING_FIELDS
                    or _field(pending, PENDING_NOTICE) is not None):
                break
            payload = _field(pending, PENDING_PAYLOAD)
            leaves = payload.leaves
            nleaves = len(leaves)
            if (payload.nbytes >= max_payload or nleaves > MAX_SNAPSHOT_LEAVES
                    or not _all_snapshots(leaves)):
                break
            try:
                same = before is not None and _same_header(before, pending, leaves)
            except Exception:  # the general path fails this capture alone, if it must
                same = False
            if not same:
                try:
                    header = header_of(pending)
                except Exception:
                    break
                keep.append(header)
            try:
                seq = _integer(seq_object)
                caught_at = _field(pending, PENDING_CAUGHT_AT)
                call = _integer(_field(pending, PENDING_CALL))
                step_object = _field(pending, PENDING_STEP)
                step = NO_STEP if step_object is None else _integer(step_object)
                nbytes = _integer(payload.nbytes)
            except (OverflowError, TypeError):
                break
            # Into this frame's iovecs; counted in only once the frame is whole.
            frame_bytes = _point_to(leaves, nleaves, iov + count + 2, keep)
            if frame_bytes < 0 or <unsigned long long>frame_bytes != nbytes:
                break  # no longer the snapshots it was, or their bytes not what it says
            prefix = prefixes + (end - start) * PREFIX_BYTES
            prefix[0], prefix[1] = 84, 70  # "TF"
            _put_little(prefix + 2, KIND_CAPTURE, 2)
            _put_little(prefix + 4, len(header), 4)
            _put_little(prefix + 8, nbytes, 8)
            _put_little(prefix + 16, seq, 8)
            _put_little(prefix + 24, _double_bits(caught_at), 8)
            _put_little(prefix + 32, call, 8)
            _put_little(prefix + 40, <unsigned long long>step, 8)
            iov[count].iov_base, iov[count].iov_len = prefix, PREFIX_BYTES
            iov[count + 1].iov_base = <char *>header
            iov[count + 1].iov_len = <size_t>len(header)
            count += 2 + nleaves
            iov[count].iov_base, iov[count].iov_len = <char *>trailer, <size_t>len(trailer)
            count += 1
            total += (PREFIX_BYTES + <size_t>len(header) + <size_t>frame_bytes
                      + <size_t>len(trailer))
            sent.append(leaves)
            before = pending
            end += 1
        if count:
            _move(sock.fileno(), iov, count, True, total)
        for leaves in sent:  # the bytes are in the kernel: the arrays may be freed
            _clear_list(leaves, 0, len(leaves), NULL)
        return end
    finally:
        PyMem_Free(prefixes)
        PyMem_Free(iov)


def bytes_at(size_t address, Py_ssize_t nbytes):
    """A copy of the ``nbytes`` bytes of memory at ``address``, made with the GIL held.

    For a CPU tensor's snapshot at the call (``arrays.hold``): its data
    pointer is all torch has to give without making a tensor or a numpy view
    first, which cost a training loop several microseconds a capture. The
    caller vouches that the memory is the tensor's, contiguous, and alive.
    """
    if nbytes < 0 or (address == 0 and nbytes):
        raise ValueError(f"no {nbytes} bytes at address {address:#x}")
    return PyBytes_FromStringAndSize(<char *>address, nbytes)


# A file mapped copy-on-write, read only where looked at, keeping no descriptor: a recording
# of more segments than the process may open files loads (the twin's differs).
map_file = PrivateMapping


def wake(int fd):
    """Add one to the eventfd ``fd`` (write 8 bytes to a non-blocking pipe where there is
    none) with the GIL held; a full pipe is left as it is (a wake-up is waiting already).

    To wake a thread asleep in ``poll`` from a training thread's ``catch``:
    written with the GIL let go (``os.write``), the woken thread could take
    the GIL before the write returned, and the call waited for it (measured
    right after a training step: a sent capture that woke the sender cost its
    caller 219–230 µs that way, 172–183 µs this way). An eventfd costs the
    kernel less than the socket pair this wrote to before (measured the same
    way: 36 against 49 µs a write).
    """
    cdef uint64_t one = 1
    cdef int error
    if write(fd, &one, sizeof(one)) < 0:
        error = errno
        if error != EAGAIN and error != EWOULDBLOCK:
            raise OSError(error, strerror(error).decode("utf-8", "replace"))


cdef extern from "Python.h":
    int _clear_list "PyList_SetSlice"(object items, Py_ssize_t low, Py_ssize_t high,
                                      PyObject *empty) except -1
    int PyObject_IS_GC(PyObject *obj)
    void PyObject_GC_UnTrack(void *obj)


def untrack(obj):
    """Take ``obj`` out of the cyclic garbage collector's lists and return it.

    Every full collection walks every object the collector tracks, and the
    REPL's history holds one or more per capture: with hours of captures, each
    collection held the GIL for a long pause of the user's REPL (and took a
    fifth of the server's time in a flood of small captures). Reference
    counting still frees an untracked object, and the objects it refers to
    stay tracked, so nothing is freed early; only a reference cycle through
    it would never be collected. So this is for objects that cannot be in
    one: the store's captures and their statistics, which refer to what came
    off the wire, never back.
    """
    if PyObject_IS_GC(<PyObject *>obj):
        PyObject_GC_UnTrack(<PyObject *>obj)
    return obj


cdef extern from "<sys/mman.h>":
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset) nogil
    int munmap(void *addr, size_t length) nogil
    int PROT_READ
    int PROT_WRITE
    int MAP_PRIVATE
    void *MAP_FAILED


cdef class PrivateMapping:
    """A copy-on-write mapping of a file descriptor, exposed as a writable buffer.

    Unlike ``mmap.mmap`` it keeps no duplicate of the descriptor: a server
    holding thousands of shared-memory captures holds no descriptors for them.
    The mapping is removed when the last array viewing it is gone.
    """

    cdef void *address
    cdef Py_ssize_t size
    cdef Py_ssize_t exports

    def __cinit__(self, int fd, Py_ssize_t size):
        self.address = NULL
        if size <= 0:
            raise ValueError("a mapping needs at least one byte")
        self.address = mmap(NULL, <size_t>size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0)
        if self.address == MAP_FAILED:
            self.address = NULL
            raise OSError(errno, strerror(errno).decode("utf-8", "replace"))
        self.size = size

    def __len__(self):
        return self.size

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        PyBuffer_FillInfo(buffer, self, self.address, self.size, 0, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self.exports -= 1

    def __dealloc__(self):
        if self.address != NULL:
            munmap(self.address, <size_t>self.size)
