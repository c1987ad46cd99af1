"""The wire format: handshake, capture frames, acknowledgements, control messages.

docs/PROTOCOL.md is the prose version of this module. Everything a peer sends
is decoded here and nowhere else (a capture's value tree by
:func:`thing.value_trees.check_tree`, which :func:`decode_header` calls), and
every length, dtype and shape is checked against :class:`Limits` before the
receiver allocates a byte for it. Headers are JSON; nothing on the wire is ever
unpickled or evaluated.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import config
from ._core import split_small_frames, split_stored_acks
from .arrays import CARRIER_DTYPES, FRAMEWORKS, LeafSpec
from .errors import ArgumentError, HandshakeError, LimitExceeded, ProtocolError
from .sockets import recv_exactly
from .value_trees import MAX_DEPTH, MAX_EXTENT, MAX_NDIM, Payload, check_tree, is_int

MAGIC = b"THNG"
VERSION = 4

# magic, protocol version, status (0 = ok) or flags, length of the JSON that follows
HANDSHAKE = struct.Struct("<4sHHI")
HANDSHAKE_OK = 0
HANDSHAKE_REFUSED = 1
HANDSHAKE_CHALLENGE = 2  # the server wants proof of the token: {"nonce": ...}
MAX_HANDSHAKE_JSON = 64 << 10

# b"TF", kind, header length, payload length, the client's sequence number, the time of
# the call, the call number of the name, the step the caller gave; then header, payload,
# trailer. What changes with every call travels here, so the header of one name and
# layout repeats byte for byte and is validated once.
FRAME_PREFIX = struct.Struct("<2sHIQQdQq")
FRAME_TAG = b"TF"
NO_STEP = -(1 << 63)  # a frame's step when its caller gave none
KIND_CAPTURE = 1
# The payload is not in the stream but in a sealed memfd passed with the prefix (SCM_RIGHTS).
KIND_SHARED_MEMORY = 2
# b"TE", flags, reserved: sent after the payload, when the sender knows whether it tore
FRAME_TRAILER = struct.Struct("<2sHI")
TRAILER_TAG = b"TE"
FLAG_MODIFIED_DURING_SEND = 1

# b"TA", status, message length, client's sequence number, server's capture id
ACK = struct.Struct("<2sHIQq")
ACK_TAG = b"TA"
ACK_STORED = 0
ACK_REJECTED = 1
# The seq of a rejection for a frame whose header was not read. Every frame gets exactly
# one ack, in frame order, so this always answers the oldest frame not yet answered.
SEQ_OLDEST_UNANSWERED = (1 << 64) - 1
# b"TC", operation, name length, rank (NO_RANK: every rank), a number; then the name (UTF-8,
# empty: every name). The REPL steering what a client sends: data from a fixed set of
# operations, never code. It travels among the acks, server to client, only to a client
# whose hello said "control": true; the same size as an ack, so one read says which it is.
CONTROL = struct.Struct("<2sHIqq")
CONTROL_TAG = b"TC"
NO_RANK = -(1 << 63)
# What a rank may be, in a control message and in a frame's meta.
RANKS = range(1 << 31)
CONTROL_OPERATIONS = {1: "request", 2: "every", 3: "first", 4: "pause", 5: "resume",
                      6: "reset", 7: "forget", 8: "replayed"}
CONTROL_CODES = {operation: code for code, operation in CONTROL_OPERATIONS.items()}
# The most a control message's number may be: a count of calls, an every=, a first=.
MAX_CONTROL_VALUE = 1 << 40
MAX_CONTROL_NAME = 4096  # as Limits.max_name_length: a longer name was never caught
# A sender's clock reading beyond this many seconds from the epoch (years 1653 to 5138), or
# one that is not finite, is stored as no time: nothing could show it as a date.
MAX_TIME = 1e11

# The longest reason a notice of an unsent capture carries (the rest is cut).
MAX_REASON = 1000
# Why captures were not delivered, as a frame's meta counts them ("undelivered"); the
# client counts "refused" too, the server's refusals, which the server counted itself.
NOT_DELIVERED_REASONS = ("no server", "queue full", "failed", "lost", "closed")
# A payload below this many bytes is small: a client sends such frames together, once a
# tick (see channel.py), and a server reads them many at a time into a buffer it keeps.
SMALL_BYTES = 64 << 10

_NUMPY_MAX_BYTES = 1 << 63  # numpy's sizes are signed 64-bit


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts from one peer; checked before any allocation."""

    max_capture_bytes: int = field(default_factory=config.max_capture_bytes)
    max_header_bytes: int = field(default_factory=config.max_header_bytes)
    max_depth: int = MAX_DEPTH
    max_leaves: int = 100_000
    max_name_length: int = 4096


# -- handshake ------------------------------------------------------------------


def encode_handshake(info: dict[str, Any], status: int = HANDSHAKE_OK) -> bytes:
    """The bytes one side sends to open a connection: magic, version, status and ``info``."""
    body = json.dumps(info).encode()
    return HANDSHAKE.pack(MAGIC, VERSION, status, len(body)) + body


def decode_handshake_prefix(prefix: bytes) -> tuple[int, int]:
    """Check the fixed part of a handshake; return ``(status, json_length)``."""
    magic, version, status, length = _unpack(HANDSHAKE, prefix, "handshake", HandshakeError)
    if magic != MAGIC:
        raise HandshakeError(f"peer is not a thing peer (it sent {prefix[:8]!r})")
    if version != VERSION:
        raise HandshakeError(
            f"peer speaks thing protocol version {version}, this side speaks {VERSION}: "
            "install the same thing version on both sides"
        )
    if length > MAX_HANDSHAKE_JSON:
        raise LimitExceeded(f"handshake of {length} bytes exceeds {MAX_HANDSHAKE_JSON}")
    return status, length


def recv_handshake(sock: Any, deadline: float | None = None) -> tuple[int, dict[str, Any]]:
    """Receive one handshake message from ``sock``; return ``(status, info)``.

    ``deadline`` (``time.monotonic()``) bounds the whole message: a socket's own
    timeout restarts with every byte, so a peer dripping one would hold it for days.
    """
    prefix = recv_exactly(sock, HANDSHAKE.size, deadline)
    status, length = decode_handshake_prefix(bytes(prefix))
    return status, decode_handshake_info(recv_exactly(sock, length, deadline))


def decode_handshake_info(body: bytes) -> dict[str, Any]:
    """The JSON object of a handshake; its values are informational and never executed."""
    info = load_json(body, "handshake", HandshakeError)
    if not isinstance(info, dict):
        raise HandshakeError("handshake info is not a JSON object")
    return info


# -- capture frames: sent -------------------------------------------------------


def encode_header(name: str | None, payload: Payload, meta: dict[str, Any]) -> bytes:
    """The JSON header of one capture frame: the same bytes for every call of one name,
    layout and call site (what changes per call is in the prefix)."""
    return describe_capture(name, payload.tree, [leaf.spec for leaf in payload.leaves], meta)


def describe_capture(name: str | None, tree: Any, specs: Iterable[LeafSpec],
                     meta: dict[str, Any]) -> bytes:
    """A capture header from its parts: what a frame carries, and what a recording keeps
    of each capture (read back by :func:`decode_header`, as a frame's is)."""
    leaves = [[spec.framework, spec.dtype, list(spec.shape), spec.scalar] for spec in specs]
    document = {"name": name, "value": tree, "leaves": leaves, "meta": meta}
    return json.dumps(document, separators=(",", ":")).encode()


def encode_prefix(header: bytes, payload_len: int, seq: int, caught_at: float,
                  kind: int = KIND_CAPTURE, *, call: int = 0, step: int | None = None) -> bytes:
    """The fixed-size part that opens a capture frame: ``call`` is the call number of its
    name (0: not counted), ``step`` the step the caller gave (None: none)."""
    return FRAME_PREFIX.pack(FRAME_TAG, kind, len(header), payload_len, seq, caught_at, call,
                             NO_STEP if step is None else step)


def encode_trailer(modified_during_send: bool) -> bytes:
    """The fixed-size part that closes a capture frame."""
    return _MODIFIED_TRAILER if modified_during_send else _WHOLE_TRAILER


_WHOLE_TRAILER = FRAME_TRAILER.pack(TRAILER_TAG, 0, 0)
_MODIFIED_TRAILER = FRAME_TRAILER.pack(TRAILER_TAG, FLAG_MODIFIED_DURING_SEND, 0)


# -- capture frames: received ---------------------------------------------------


@dataclass(frozen=True)
class FrameHeader:
    """A validated capture header: safe to allocate from, and shared by every frame that
    sends the same header bytes (so nothing may change it)."""

    name: str | None
    tree: Any
    leaves: tuple[LeafSpec, ...]
    meta: dict[str, Any]
    nbytes: int  # the payload its leaves describe


class FramePrefix(NamedTuple):
    """A frame's fixed-size opening, checked: what it is, how long, and the per-call fields."""

    kind: int
    header_len: int
    payload_len: int
    seq: int
    caught_at: float | None  # None if the sender's clock gave no finite time
    call: int | None  # the call number of the capture's name; None if not counted
    step: int | None  # the step its caller gave; None if none


def decode_prefix(prefix: bytes) -> FramePrefix:
    """Check a frame prefix's tag and kind; return its fields.

    The lengths are checked against the limits separately, by :func:`check_frame_size`:
    a frame that is merely too large can be read past, one with a bad prefix cannot.
    """
    tag, kind, header_len, payload_len, seq, caught_at, call, step = _unpack(
        FRAME_PREFIX, prefix, "frame prefix")
    if tag != FRAME_TAG or kind not in (KIND_CAPTURE, KIND_SHARED_MEMORY):
        raise ProtocolError(f"bad frame prefix {bytes(prefix)!r}")
    return FramePrefix(kind, header_len, payload_len, seq,
                       caught_at if -MAX_TIME < caught_at < MAX_TIME else None,
                       call or None, None if step == NO_STEP else step)


def check_frame_size(header_len: int, payload_len: int, limits: Limits) -> None:
    """Raise :class:`LimitExceeded` if a frame's declared sizes exceed ``limits``."""
    if header_len > limits.max_header_bytes:
        raise LimitExceeded(f"header of {header_len} bytes exceeds {limits.max_header_bytes}")
    if header_len + payload_len > limits.max_capture_bytes:
        raise LimitExceeded(
            f"capture of {header_len + payload_len} bytes exceeds {limits.max_capture_bytes}"
        )


def decode_trailer(trailer: bytes | memoryview) -> bool:
    """Check a frame trailer; return whether the sender saw the data change while sending."""
    tag, flags, _ = _unpack(FRAME_TRAILER, trailer, "frame trailer")
    if tag != TRAILER_TAG or flags & ~FLAG_MODIFIED_DURING_SEND:
        raise ProtocolError(f"bad frame trailer {bytes(trailer)!r}")
    return bool(flags & FLAG_MODIFIED_DURING_SEND)


def decode_small_frames(data: Any, limit: int, max_payload: int, headers: dict[bytes, Any]
                        ) -> list[tuple[int, Any, bytearray, int, float | None, int | None,
                                        int | None, bool]]:
    """The inline capture frames with payloads under ``max_payload`` bytes and a header whose
    bytes are a key of ``headers``, whole at the start of ``data``, at most ``limit``: each
    ``(end, headers[its header], payload, seq, caught_at, call, step, modified)``, read as
    :func:`decode_prefix` and :func:`decode_trailer` read it, its payload copied out (``end``:
    its end's offset). Stops at the first that is anything else, for the general reader to
    read (and refuse, if it must); the compiled core splits a run in one call (the
    pure-Python twin as its reference)."""
    return split_small_frames(data, limit, max_payload, headers)


# What parsing one JSON element can make, at most, in bytes of Python objects: an object
# (a dict with its first entries), a list, and anything else (a number, a string, a
# small list entry), each separated by a comma or opened by its bracket.
_OBJECT_COST, _LIST_COST, _ELEMENT_COST = 360, 120, 72
HEADER_COST_FACTOR = 32  # a header may cost at most this many times max_header_bytes


def header_cost(raw: bytes, limits: Limits) -> int:
    """Bytes a header holds in memory once parsed (its text included), counted before parsing.

    A header of tiny nested nodes inflates many times when parsed; this bound
    is what the receiver charges to the store, and one over
    ``HEADER_COST_FACTOR`` times ``max_header_bytes`` is refused unparsed.
    """
    cost = parsed_cost(raw)
    if cost > HEADER_COST_FACTOR * limits.max_header_bytes:
        raise LimitExceeded(f"a header of {len(raw)} bytes holding too many small values "
                            f"(it would take about {cost} bytes once parsed)")
    return cost


def parsed_cost(raw: bytes) -> int:
    """At most how many bytes parsing the JSON ``raw`` holds at its peak, text included.

    Text held: the bytes, their decoded copy and the strings made, 4 bytes a byte
    when ``raw`` is ASCII without escapes (3.0 measured); else 10, for a string
    holds 4 bytes a character once one of them (an escape ``\\u``, or any
    non-ASCII byte, may make it) is past U+FFFF, and parsing builds it with room
    to spare (9.0 measured).
    """
    text = 4 if raw.isascii() and b"\\u" not in raw else 10
    return (text * len(raw) + _OBJECT_COST * raw.count(b"{") + _LIST_COST * raw.count(b"[")
            + _ELEMENT_COST * (raw.count(b",") + 1))


def decode_header(raw: bytes, payload_len: int, limits: Limits) -> FrameHeader:
    """Validate a capture header completely; raise :class:`ProtocolError` on any flaw."""
    document = load_json(raw, "header")
    if not isinstance(document, dict) or set(document) != {"name", "value", "leaves", "meta"}:
        raise ProtocolError("header is not a capture header")
    name = document["name"]
    if name is not None and (not isinstance(name, str) or len(name) > limits.max_name_length):
        raise ProtocolError("header name is not a string of acceptable length")
    try:
        meta = document["meta"]
        if not isinstance(meta, dict):
            raise ProtocolError("header meta is not an object")
        leaves = _decode_leaves(document["leaves"], limits)
        header = FrameHeader(name, document["value"], leaves, meta,
                             sum(spec.nbytes for spec in leaves))
        check_payload_length(header, payload_len)
        used = [False] * len(leaves)
        check_tree(document["value"], leaves, used, limits.max_depth)
        if not all(used):
            raise ProtocolError("header lists leaves its value does not use")
    except ProtocolError as exc:
        exc.capture_name = name
        raise
    return header


def check_payload_length(header: FrameHeader, payload_len: int) -> None:
    """Raise :class:`ProtocolError` unless ``header``'s leaves describe ``payload_len`` bytes."""
    if header.nbytes != payload_len:
        raise ProtocolError(
            f"leaves describe {header.nbytes} bytes but the payload holds {payload_len}")


def _decode_leaves(raw: Any, limits: Limits) -> tuple[LeafSpec, ...]:
    if not isinstance(raw, list) or len(raw) > limits.max_leaves:
        raise ProtocolError("header leaves are not a list of acceptable length")
    specs = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 4):
            raise ProtocolError("leaf entry is not [framework, dtype, shape, scalar]")
        framework, dtype, shape, scalar = entry
        known = isinstance(framework, str) and isinstance(dtype, str)
        if not known or framework not in (*FRAMEWORKS, "bytes") or dtype not in CARRIER_DTYPES:
            raise ProtocolError(f"unknown framework or dtype {framework!r}, {dtype!r}")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise ProtocolError("leaf shape is not a list of at most 64 dimensions")
        if framework == "bytes" and (dtype != "uint8" or len(shape) != 1):
            raise ProtocolError("bytes leaves must be uint8 and 1-d")
        if not all(is_int(extent) and 0 <= extent <= MAX_EXTENT for extent in shape):
            raise ProtocolError(f"leaf shape {shape!r} has a bad extent")
        if not isinstance(scalar, bool) or (scalar and shape):
            raise ProtocolError("leaf scalar flag is invalid")
        # Zero extents make an empty array, which holds nothing; numpy still refuses one
        # whose other extents, times the item size, overflow its sizes.
        span = math.prod(extent for extent in shape if extent) * CARRIER_DTYPES[dtype].itemsize
        if 0 in shape and span >= _NUMPY_MAX_BYTES:
            raise LimitExceeded(f"empty leaf of shape {shape} is beyond what numpy can make "
                                "(its non-zero extents times the item size reach 2**63)")
        if 0 not in shape and span > limits.max_capture_bytes:
            raise LimitExceeded(f"leaf of shape {shape} exceeds {limits.max_capture_bytes} bytes")
        specs.append(LeafSpec(framework, dtype, tuple(shape), scalar))
    return tuple(specs)


def encode_ack(seq: int, capture_id: int, error: str | None = None) -> bytes:
    """The server's answer to one frame: stored under ``capture_id``, or rejected with ``error``."""
    if error is None:  # every stored small capture: kept short
        return ACK.pack(ACK_TAG, ACK_STORED, 0, seq, capture_id)
    message = error.encode()
    return ACK.pack(ACK_TAG, ACK_REJECTED, len(message), seq, capture_id) + message


def decode_ack(prefix: bytes) -> tuple[int, int, int, int]:
    """Check an acknowledgement; return ``(status, message_length, seq, capture_id)``."""
    tag, status, length, seq, capture_id = _unpack(ACK, prefix, "acknowledgement")
    if tag != ACK_TAG or status not in (ACK_STORED, ACK_REJECTED) or length > MAX_HANDSHAKE_JSON:
        raise ProtocolError(f"bad acknowledgement {prefix!r}")
    return status, length, seq, capture_id


def decode_stored_acks(data: Any, limit: int) -> list[tuple[int, int, int, bytes]]:
    """The "stored" acknowledgements whole at the start of ``data``, at most ``limit``: each
    ``(ACK_STORED, seq, capture_id, b"")``, as :func:`decode_ack` and its empty message give
    it. Stops at the first that is anything else, for ``decode_ack`` to read. The compiled
    core splits a burst of them in one call (the pure-Python twin as its reference)."""
    return split_stored_acks(data, limit)


class BadControl(ProtocolError):
    """A control message outside the fixed set; it was read whole, so the stream that
    carried it is still in step: the message is ignored, the connection kept."""


@dataclass(frozen=True)
class ControlMessage:
    """One decoded control message: an ``operation`` of :data:`CONTROL_OPERATIONS` for
    ``name`` (None: every name) and ``rank`` (None: every rank), with its ``value``."""

    operation: str
    name: str | None
    rank: int | None
    value: int


def encode_control(operation: str, name: str | None, rank: int | None, value: int = 0) -> bytes:
    """A control message (see :data:`CONTROL`), unsigned. Raises ValueError for a name a
    client would not read: one of no characters (its length 0 stands for every name) or
    of more than MAX_CONTROL_NAME bytes, which a client takes for a broken stream."""
    raw_name = b"" if name is None else name.encode("utf-8", "surrogatepass")
    if name is not None and not 0 < len(raw_name) <= MAX_CONTROL_NAME:
        raise ArgumentError(f"a name of {len(raw_name)} bytes in UTF-8: a job steers names of "
                         f"1 to {MAX_CONTROL_NAME} bytes (None stands for every name)")
    return CONTROL.pack(CONTROL_TAG, CONTROL_CODES[operation], len(raw_name),
                        NO_RANK if rank is None else rank, value) + raw_name


def decode_control(prefix: bytes, raw_name: bytes) -> ControlMessage:
    """Check a control message whose name was read (``prefix[:2]`` is its tag, its name
    length was bounded by the reader); BadControl for anything outside the fixed set."""
    _, code, _, rank, value = _unpack(CONTROL, prefix, "control message")
    operation = CONTROL_OPERATIONS.get(code)
    if operation is None:
        raise BadControl(f"unknown control operation {code}")
    try:
        name = raw_name.decode("utf-8") if raw_name else None
    except UnicodeDecodeError:
        raise BadControl("a control message's name is not UTF-8") from None
    if rank != NO_RANK and rank not in RANKS:
        raise BadControl(f"a control message for rank {rank}")
    if operation in ("request", "every", "first"):
        least = 0 if operation == "first" else 1
        valid = least <= value <= MAX_CONTROL_VALUE
    else:
        valid = value == 0
    if not valid:
        raise BadControl(f"control {operation} with the number {value}")
    if name is None and operation in ("request", "first"):
        raise BadControl(f"control {operation} without a name")
    return ControlMessage(operation, name, None if rank == NO_RANK else rank, value)


# Characters of a server's reason for a refusal a client keeps (a server sends at most
# 1,000; a hostile one up to 64 KiB, which escaping would take milliseconds over, and
# which the job's log would repeat).
MAX_REFUSAL_TEXT = 4000


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on shown escaped.

    Names, hostnames, call sites and refusal messages are chosen by peers and
    end up in a terminal: no escape sequences, no unpaired surrogates.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _unpack(layout: struct.Struct, data: bytes, what: str,
            error: type[ProtocolError] = ProtocolError) -> tuple[Any, ...]:
    if len(data) != layout.size:
        raise error(f"{what} of {len(data)} bytes, expected {layout.size}")
    return layout.unpack(data)


def load_json(raw: bytes, what: str, error: type[Exception] = ProtocolError) -> Any:
    """Parse untrusted UTF-8 JSON, raising ``error`` naming ``what`` if it is not."""
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(f"{what} is not valid UTF-8 JSON: {exc}") from None
