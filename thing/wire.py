"""The wire format: handshake, capture frames, acknowledgements.

docs/PROTOCOL.md is the prose version of this module. Everything a peer sends
is decoded here and nowhere else, and every length, dtype and shape is checked
against :class:`Limits` before the receiver allocates a byte for it. Headers
are JSON; nothing on the wire is ever unpickled or evaluated.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from . import config
from ._core import recv_buffers
from .arrays import CARRIER_DTYPES, FRAMEWORKS, Leaf, LeafSpec, describe_leaf, finish, hold
from .errors import HandshakeError, LimitExceeded, ProtocolError, UnsupportedType

MAGIC = b"THNG"
VERSION = 2

# magic, protocol version, status (0 = ok) or flags, length of the JSON that follows
HANDSHAKE = struct.Struct("<4sHHI")
HANDSHAKE_OK = 0
HANDSHAKE_REFUSED = 1
HANDSHAKE_CHALLENGE = 2  # the server wants proof of the token: {"nonce": ...}
MAX_HANDSHAKE_JSON = 64 << 10

# b"TF", kind, header length, payload length; then header, payload, trailer
FRAME_PREFIX = struct.Struct("<2sHIQ")
FRAME_TAG = b"TF"
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

_NDIM_MAX = 64
_DIM_MAX = 1 << 62


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts from one peer; checked before any allocation."""

    max_capture_bytes: int = field(default_factory=config.max_capture_bytes)
    max_header_bytes: int = field(default_factory=config.max_header_bytes)
    max_depth: int = 64
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


def recv_handshake(sock: Any) -> tuple[int, dict[str, Any]]:
    """Receive one handshake message from ``sock``; return ``(status, info)``."""
    prefix = bytearray(HANDSHAKE.size)
    recv_buffers(sock, [prefix])
    status, length = decode_handshake_prefix(bytes(prefix))
    body = bytearray(length)
    recv_buffers(sock, [body])
    return status, decode_handshake_info(body)


def decode_handshake_info(body: bytes) -> dict[str, Any]:
    """The JSON object of a handshake; its values are informational and never executed."""
    info = _load_json(body, "handshake", HandshakeError)
    if not isinstance(info, dict):
        raise HandshakeError("handshake info is not a JSON object")
    return info


# -- captures: sending side -----------------------------------------------------


class Payload:
    """A capture taken apart on the caller's thread: JSON-ready structure plus array leaves."""

    __slots__ = ("tree", "leaves", "nbytes")

    def __init__(self, tree: Any, leaves: list[Leaf], nbytes: int):
        self.tree = tree
        self.leaves = leaves
        self.nbytes = nbytes

    def hold(self, copy: bool | None, snapshot_bytes: int) -> None:
        """Snapshot the leaves that must be (see :func:`thing.arrays.hold`)."""
        for leaf in self.leaves:
            hold(leaf, copy, snapshot_bytes)


_SINGLE_LEAF = {"leaf": 0}


def take_apart(value: Any, max_depth: int = 64) -> Payload:
    """Split ``value`` into a JSON tree and its array leaves, touching no array data.

    Raises :class:`UnsupportedType` for anything that cannot travel.
    """
    leaf = describe_leaf(value)
    if leaf is not None:  # the common case, kept short: catch() runs in training loops
        return Payload(_SINGLE_LEAF, [leaf], leaf.nbytes)
    leaves: list[Leaf] = []
    tree = _walk(value, leaves, max_depth)
    return Payload(tree, leaves, sum(leaf.nbytes for leaf in leaves))


def _walk(obj: Any, leaves: list[Leaf], depth: int) -> Any:
    if depth < 0:
        raise UnsupportedType("containers nested too deeply")
    if type(obj) is float and obj != obj:  # JSON would spell every NaN alike
        return {"nan": struct.pack("<d", obj).hex()}
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    leaf = describe_leaf(obj)
    if leaf is not None:
        leaves.append(leaf)
        return {"leaf": len(leaves) - 1}
    for plain in (int, float, str):  # subclasses, e.g. an IntEnum, travel as their base
        if isinstance(obj, plain):
            return plain(obj)
    if isinstance(obj, (list, tuple)):
        tag = "list" if isinstance(obj, list) else "tuple"
        return {tag: [_walk(item, leaves, depth - 1) for item in obj]}
    if isinstance(obj, dict):
        items = []
        for key, item in obj.items():
            if not isinstance(key, str):
                raise UnsupportedType(f"dict keys must be str, not {type(key).__qualname__}")
            items.append([key, _walk(item, leaves, depth - 1)])
        return {"dict": items}
    raise UnsupportedType(f"cannot send an object of type {type(obj).__qualname__}")


def encode_header(seq: int, name: str | None, payload: Payload, meta: dict[str, Any]) -> bytes:
    """The JSON header of one capture frame."""
    leaves = [
        [leaf.spec.framework, leaf.spec.dtype, list(leaf.spec.shape), leaf.spec.scalar]
        for leaf in payload.leaves
    ]
    document = {"seq": seq, "name": name, "value": payload.tree, "leaves": leaves, "meta": meta}
    return json.dumps(document, separators=(",", ":")).encode()


def encode_prefix(header: bytes, payload_len: int, kind: int = KIND_CAPTURE) -> bytes:
    """The fixed-size part that opens a capture frame."""
    return FRAME_PREFIX.pack(FRAME_TAG, kind, len(header), payload_len)


def encode_trailer(modified_during_send: bool) -> bytes:
    """The fixed-size part that closes a capture frame."""
    return FRAME_TRAILER.pack(
        TRAILER_TAG, FLAG_MODIFIED_DURING_SEND if modified_during_send else 0, 0
    )


# -- captures: receiving side ---------------------------------------------------


@dataclass(frozen=True)
class FrameHeader:
    """A validated capture header: safe to allocate from."""

    seq: int
    name: str | None
    tree: Any
    leaves: tuple[LeafSpec, ...]
    meta: dict[str, Any]


def decode_prefix(prefix: bytes) -> tuple[int, int, int]:
    """Check a frame prefix's tag and kind; return ``(kind, header_length, payload_length)``.

    The lengths are checked against the limits separately, by :func:`check_frame_size`:
    a frame that is merely too large can be read past, one with a bad prefix cannot.
    """
    tag, kind, header_len, payload_len = _unpack(FRAME_PREFIX, prefix, "frame prefix")
    if tag != FRAME_TAG or kind not in (KIND_CAPTURE, KIND_SHARED_MEMORY):
        raise ProtocolError(f"bad frame prefix {prefix!r}")
    return kind, header_len, payload_len


def check_frame_size(header_len: int, payload_len: int, limits: Limits) -> None:
    """Raise :class:`LimitExceeded` if a frame's declared sizes exceed ``limits``."""
    if header_len > limits.max_header_bytes:
        raise LimitExceeded(f"header of {header_len} bytes exceeds {limits.max_header_bytes}")
    if header_len + payload_len > limits.max_capture_bytes:
        raise LimitExceeded(
            f"capture of {header_len + payload_len} bytes exceeds {limits.max_capture_bytes}"
        )


def decode_trailer(trailer: bytes) -> bool:
    """Check a frame trailer; return whether the sender saw the data change while sending."""
    tag, flags, _ = _unpack(FRAME_TRAILER, trailer, "frame trailer")
    if tag != TRAILER_TAG or flags & ~FLAG_MODIFIED_DURING_SEND:
        raise ProtocolError(f"bad frame trailer {trailer!r}")
    return bool(flags & FLAG_MODIFIED_DURING_SEND)


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
    cost = (len(raw) + _OBJECT_COST * raw.count(b"{") + _LIST_COST * raw.count(b"[")
            + _ELEMENT_COST * (raw.count(b",") + 1))
    if cost > HEADER_COST_FACTOR * limits.max_header_bytes:
        raise LimitExceeded(f"a header of {len(raw)} bytes holding too many small values "
                            f"(it would take about {cost} bytes once parsed)")
    return cost


def decode_header(raw: bytes, payload_len: int, limits: Limits) -> FrameHeader:
    """Validate a capture header completely; raise :class:`ProtocolError` on any flaw."""
    document = _load_json(raw, "header")
    if not isinstance(document, dict) or set(document) != {
        "seq",
        "name",
        "value",
        "leaves",
        "meta",
    }:
        raise ProtocolError("header is not a capture header")
    seq = document["seq"]
    if not _is_int(seq) or not 0 <= seq < 1 << 64:
        raise ProtocolError("header seq is not a 64-bit unsigned integer")
    name = document["name"]
    if name is not None and (not isinstance(name, str) or len(name) > limits.max_name_length):
        raise ProtocolError("header name is not a string of acceptable length")
    meta = document["meta"]
    if not isinstance(meta, dict):
        raise ProtocolError("header meta is not an object")
    leaves = _decode_leaves(document["leaves"], limits)
    total = sum(spec.nbytes for spec in leaves)
    if total != payload_len:
        raise ProtocolError(f"leaves describe {total} bytes but the payload holds {payload_len}")
    used = [False] * len(leaves)
    _check_tree(document["value"], used, limits.max_depth)
    if not all(used):
        raise ProtocolError("header lists leaves its value does not use")
    return FrameHeader(seq, name, document["value"], leaves, meta)


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
        if framework == "bytes" and dtype != "uint8":
            raise ProtocolError("bytes leaves must be uint8")
        if not isinstance(shape, list) or len(shape) > _NDIM_MAX:
            raise ProtocolError("leaf shape is not a list of at most 64 dimensions")
        if not all(_is_int(extent) and 0 <= extent <= _DIM_MAX for extent in shape):
            raise ProtocolError(f"leaf shape {shape!r} has a bad extent")
        if not isinstance(scalar, bool) or (scalar and shape):
            raise ProtocolError("leaf scalar flag is invalid")
        # Zero extents make an empty array, but numpy still refuses one whose other
        # extents overflow, so those must fit too.
        span = math.prod(extent for extent in shape if extent)
        if span * CARRIER_DTYPES[dtype].itemsize > limits.max_capture_bytes:
            raise LimitExceeded(f"leaf of shape {shape} exceeds {limits.max_capture_bytes} bytes")
        specs.append(LeafSpec(framework, dtype, tuple(shape), scalar))
    return tuple(specs)


def _check_tree(node: Any, used: list[bool], depth: int) -> None:
    if depth < 0:
        raise ProtocolError("value nested too deeply")
    if node is None or isinstance(node, (bool, str, int, float)):
        return
    if not isinstance(node, dict) or len(node) != 1:
        raise ProtocolError("value node is not a tagged container")
    ((tag, body),) = node.items()
    if tag == "nan":
        if not (isinstance(body, str) and math.isnan(_nan_of(body))):
            raise ProtocolError("nan node is not the 16 hex digits of a NaN")
    elif tag == "leaf":
        if not _is_int(body) or not 0 <= body < len(used) or used[body]:
            raise ProtocolError("value refers to a missing or repeated leaf")
        used[body] = True
    elif tag in ("list", "tuple"):
        if not isinstance(body, list):
            raise ProtocolError(f"{tag} node is not a list")
        for item in body:
            _check_tree(item, used, depth - 1)
    elif tag == "dict":
        if not isinstance(body, list):
            raise ProtocolError("dict node is not a list of pairs")
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                raise ProtocolError("dict entry is not a [str, value] pair")
            _check_tree(pair[1], used, depth - 1)
    else:
        raise ProtocolError(f"unknown value node {tag!r}")


class ReceivedValue:
    """A capture as the connection thread received it: the validated tree and numpy arrays.

    The object the user sees (torch tensors, jax arrays, nested containers) is
    built by :meth:`build` when the REPL first asks for it, on the REPL's
    thread, so no connection thread ever imports a framework.
    """

    __slots__ = ("tree", "specs", "arrays")

    def __init__(self, tree: Any, specs: tuple[LeafSpec, ...], arrays: list[Any]):
        self.tree = tree
        self.specs = specs
        self.arrays = arrays

    def build(self) -> Any:
        """The sent object, sharing the received arrays' memory."""
        return build_value(self.tree, [finish(s, a) for s, a in zip(self.specs, self.arrays)])


def build_value(tree: Any, leaves: list[Any]) -> Any:
    """Rebuild the sent object from a validated tree and its received leaves."""
    if not isinstance(tree, dict):
        return tree
    ((tag, body),) = tree.items()
    if tag == "leaf":
        return leaves[body]
    if tag == "nan":
        return _nan_of(body)
    if tag == "list":
        return [build_value(item, leaves) for item in body]
    if tag == "tuple":
        return tuple(build_value(item, leaves) for item in body)
    return {key: build_value(item, leaves) for key, item in body}


def encode_ack(seq: int, capture_id: int, error: str | None = None) -> bytes:
    """The server's answer to one frame: stored under ``capture_id``, or rejected with ``error``."""
    message = (error or "").encode()
    status = ACK_REJECTED if error is not None else ACK_STORED
    return ACK.pack(ACK_TAG, status, len(message), seq, capture_id) + message


def decode_ack(prefix: bytes) -> tuple[int, int, int, int]:
    """Check an acknowledgement; return ``(status, message_length, seq, capture_id)``."""
    tag, status, length, seq, capture_id = _unpack(ACK, prefix, "acknowledgement")
    if tag != ACK_TAG or status not in (ACK_STORED, ACK_REJECTED) or length > MAX_HANDSHAKE_JSON:
        raise ProtocolError(f"bad acknowledgement {prefix!r}")
    return status, length, seq, capture_id


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on shown escaped.

    Names, hostnames, call sites and refusal messages are chosen by peers and
    end up in a terminal: no escape sequences, no unpaired surrogates.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _nan_of(text: str) -> float:
    """The float whose 8 little-endian bytes ``text`` spells in hex; 0.0 if it spells none."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return 0.0
    return struct.unpack("<d", raw)[0] if len(raw) == 8 else 0.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unpack(layout: struct.Struct, data: bytes, what: str,
            error: type[ProtocolError] = ProtocolError) -> tuple[Any, ...]:
    if len(data) != layout.size:
        raise error(f"{what} of {len(data)} bytes, expected {layout.size}")
    return layout.unpack(data)


def _load_json(raw: bytes, what: str, error: type[ProtocolError] = ProtocolError) -> Any:
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(f"{what} is not valid UTF-8 JSON: {exc}") from None
