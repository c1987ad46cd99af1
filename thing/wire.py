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
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import config
from ._core import split_small_frames, split_stored_acks
from .arrays import (
    CARRIER_DTYPES,
    FRAMEWORKS,
    SPARSE_LAYOUTS,
    Leaf,
    LeafSpec,
    SparseLayout,
    SparseParts,
    check_sparse_indices,
    describe_leaf,
    finish,
    hold,
    is_torch_size,
    sparse_parts,
    sparse_tensor,
    structured_fields,
    torch_size,
)
from .errors import ArgumentError, HandshakeError, LimitExceeded, ProtocolError, UnsupportedType
from .sockets import recv_exactly

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

_NDIM_MAX = 64
_DIM_MAX = 1 << 62
_NUMPY_MAX_BYTES = 1 << 63  # numpy's sizes are signed 64-bit
# How deep a capture's containers may nest: deeper is refused when caught, and when received.
MAX_DEPTH = 64


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


# -- captures: sending side -----------------------------------------------------


class Payload:
    """A capture taken apart on the caller's thread: JSON-ready structure plus array leaves.

    ``nbytes`` is what its arrays send; ``held`` what it holds while it waits to be sent,
    the text and numbers of its tree too (estimated), which the client's queue counts.
    """

    __slots__ = ("tree", "leaves", "nbytes", "held")

    def __init__(self, tree: Any, leaves: list[Leaf], nbytes: int, tree_bytes: int = 0):
        self.tree = tree
        self.leaves = leaves
        self.nbytes = nbytes
        self.held = nbytes + tree_bytes

    def hold(self, copy: bool | None, snapshot_bytes: int) -> None:
        """Snapshot the leaves that must be (see :func:`thing.arrays.hold`)."""
        for leaf in self.leaves:
            hold(leaf, copy, snapshot_bytes)


# The tree of a capture that is one array: shared, so a sender can tell it at a glance.
SINGLE_LEAF = {"leaf": 0}


def take_apart(value: Any) -> Payload:
    """Split ``value`` into a JSON tree and its array leaves, touching no array data.

    What travels: numpy, torch (strided or sparse) and jax arrays, numpy scalars,
    bytes; None, bool, int, float, complex, str; lists, tuples, ``torch.Size``,
    dicts keyed by str, int, bool, None or finite floats, and sets and frozensets
    of hashable scalars, nested. A numpy structured scalar travels, and arrives,
    as a dict of its fields. Raises :class:`UnsupportedType` for anything else.
    """
    leaf = describe_leaf(value)
    if leaf is not None:  # the common case, kept short: catch() runs in training loops
        return Payload(SINGLE_LEAF, [leaf], leaf.nbytes)
    taking = _Taking()
    tree = _walk(value, taking, MAX_DEPTH)
    return Payload(tree, taking.leaves, sum(leaf.nbytes for leaf in taking.leaves),
                   taking.held)


# A tree travels as the header's JSON, which servers refuse past THING_MAX_HEADER_BYTES
# (1 MiB by default; the job's own setting counts here). The walk stops once the least
# that JSON can be passes it, so a list of a million floats, or a list that holds one list
# many times over (x = [x, x], forty deep), costs the caller a millisecond, not seconds,
# and is refused with the reason; what a server would take is never refused here.
MAX_TREE_BYTES = config.max_header_bytes()


class _Taking:
    """What a walk has taken apart so far: the array leaves, the nodes of the tree, and the
    bytes of the text in it."""

    __slots__ = ("leaves", "nodes", "text")

    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self.nodes = self.text = 0

    def node(self, text: int = 0) -> None:
        """Count a node (with ``text`` bytes of a string); refuse past the budget."""
        self.nodes += 1
        self.text += text
        if 2 * self.nodes + self.text > MAX_TREE_BYTES:  # "0," is the least a node takes
            raise UnsupportedType(
                f"a structure of over {MAX_TREE_BYTES} bytes of values outside arrays: "
                "servers refuse it; catch its numbers as an array")

    @property
    def held(self) -> int:
        """What the tree holds while it waits to be sent, roughly: a reference or an
        object a node, and the text."""
        return 8 * self.nodes + self.text


_SCALARS = (bool, int, float, complex, str)
_WHAT_TRAVELS = ("arrays, bytes, None, bool, int, float, complex, str, and lists, tuples, "
                 "dicts and sets of them")


def _walk(obj: Any, taking: _Taking, depth: int) -> Any:
    if depth < 0:
        raise UnsupportedType("containers nested too deeply")
    if type(obj) is float:
        taking.node()
        return _float_node(obj)
    if obj is None or type(obj) in (bool, int, str):
        taking.node(len(obj) if type(obj) is str else 0)
        return obj
    taking.node(len(obj) if isinstance(obj, str) else 0)  # a str subclass: an Enum's
    leaf = describe_leaf(obj)
    if leaf is not None:
        taking.leaves.append(leaf)
        return {"leaf": len(taking.leaves) - 1}
    if isinstance(obj, _SCALARS):
        return _scalar_node(obj)
    if isinstance(obj, list):
        return {"list": [_walk(item, taking, depth - 1) for item in obj]}
    if isinstance(obj, tuple):
        if is_torch_size(obj):
            return _size_node(obj)
        return {"tuple": [_walk(item, taking, depth - 1) for item in obj]}
    if isinstance(obj, dict):
        return _dict_node(obj.items(), taking, depth)
    if isinstance(obj, (set, frozenset)):
        return _set_node(obj, taking, depth)
    fields = structured_fields(obj)
    if fields is not None:
        return _dict_node(fields, taking, depth)
    sparse = sparse_parts(obj)
    if sparse is not None:
        return _sparse_node(sparse, taking)
    raise UnsupportedType(f"cannot send an object of type {type_name(obj)}: "
                          f"thing sends {_WHAT_TRAVELS}")


def _float_node(number: float) -> Any:
    return number if number == number else _nan_node(number)


def _nan_node(nan: float) -> Any:
    return {"nan": struct.pack("<d", nan).hex()}  # JSON would spell every NaN alike


def _scalar_node(obj: Any) -> Any:
    """None, a bool, int, float, complex or str; a subclass (an IntEnum) travels as its base,
    its own value, read by the base's own methods: a ``(str, Enum)`` member's ``str()`` is
    its class and name, not its text, and a subclass's ``__float__`` may say anything."""
    if obj is None or type(obj) is bool:
        return obj
    if isinstance(obj, float):
        return _float_node(float.__float__(obj))
    if isinstance(obj, complex):
        return {"complex": [_float_node(complex.real.__get__(obj)),
                            _float_node(complex.imag.__get__(obj))]}
    return int.__int__(obj) if isinstance(obj, int) else str.__str__(obj)


def _size_node(size: tuple[int, ...]) -> Any:
    extents = list(size)
    if not _is_shape(extents):
        raise UnsupportedType(f"cannot send {size}: a torch.Size travels with at most "
                              f"{_NDIM_MAX} extents from 0 to 2**62")
    return {"size": extents}


def _dict_node(items: Any, taking: _Taking, depth: int) -> Any:
    return {"dict": [[_dict_key(key, taking), _walk(item, taking, depth - 1)]
                     for key, item in items]}


def _dict_key(key: Any, taking: _Taking) -> Any:
    # JSON keeps these apart (1, 1.0, true, null and "1" all read back as what they were),
    # so a key travels as itself, and a str-keyed dict as compactly as before.
    taking.node(len(key) if isinstance(key, str) else 0)
    if key is None or type(key) in (int, bool, str):
        return key
    if isinstance(key, (int, str)) or isinstance(key, float) and math.isfinite(
            float.__float__(key)):
        return _scalar_node(key)  # a subclass (an IntEnum, a numpy float64) travels as its base
    shown = repr(key) if isinstance(key, float) else type_name(key)
    raise UnsupportedType(f"dict keys must be str, int, bool, None or finite floats, not {shown}")


def _set_node(items: set[Any] | frozenset[Any], taking: _Taking, depth: int) -> Any:
    tag = "frozenset" if isinstance(items, frozenset) else "set"
    return {tag: [_set_item_node(item, taking, depth - 1) for item in items]}


def _set_item_node(item: Any, taking: _Taking, depth: int) -> Any:
    if depth < 0:
        raise UnsupportedType("containers nested too deeply")
    taking.node(len(item) if isinstance(item, str) else 0)
    if item is None or isinstance(item, _SCALARS):
        return _scalar_node(item)
    if isinstance(item, frozenset):
        return _set_node(item, taking, depth)
    raise UnsupportedType(f"a set can hold None, bool, int, float, complex, str and frozensets "
                          f"of them, not {type_name(item)}")


def _sparse_node(sparse: SparseParts, taking: _Taking) -> Any:
    body: dict[str, Any] = {"layout": sparse.layout, "size": sparse.size}
    if sparse.coalesced is not None:
        body["coalesced"] = sparse.coalesced
    leaves = taking.leaves
    for name, part in sparse.parts.items():
        leaves.append(describe_leaf(part))
        body[name] = {"leaf": len(leaves) - 1}
    return {"sparse": body}


def type_name(obj: Any) -> str:
    """The qualified name of ``obj``'s type, as errors and notices name it (``numpy.ndarray``)."""
    kind = type(obj)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


# What a notice calls the type of a capture that was not sent or not kept, from its tree
# (the object itself is not at hand): each node names the type it was made from.
_LEAF_TYPES = {"numpy": "numpy.ndarray", "torch": "torch.Tensor", "jax": "jax.Array",
               "bytes": "bytes"}
_NODE_TYPES = {"nan": "float", "size": "torch.Size", "sparse": "torch.Tensor"}


def caught_type(tree: Any, specs: Sequence[LeafSpec]) -> str:
    """The type of what was caught, as :func:`type_name` would have named it (a numpy
    scalar is named as an array), from its taken-apart ``tree`` and its leaves' ``specs``."""
    if isinstance(tree, dict) and len(tree) == 1:
        node, value = next(iter(tree.items()))
        if node == "leaf":
            framework = specs[value].framework if is_int(value) and 0 <= value < len(specs) \
                else None
            return _LEAF_TYPES.get(framework, "array")
        return _NODE_TYPES.get(node, node)  # "dict", "list", "tuple", "set", "complex", ...
    return type_name(tree)


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


# -- captures: receiving side ---------------------------------------------------


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
        _check_tree(document["value"], leaves, used, limits.max_depth)
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
        if not isinstance(shape, list) or len(shape) > _NDIM_MAX:
            raise ProtocolError("leaf shape is not a list of at most 64 dimensions")
        if framework == "bytes" and (dtype != "uint8" or len(shape) != 1):
            raise ProtocolError("bytes leaves must be uint8 and 1-d")
        if not all(is_int(extent) and 0 <= extent <= _DIM_MAX for extent in shape):
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


def _check_tree(node: Any, specs: tuple[LeafSpec, ...], used: list[bool], depth: int) -> None:
    if depth < 0:
        raise ProtocolError("value nested too deeply")
    if node is None or isinstance(node, (bool, str, int, float)):
        return
    if not isinstance(node, dict) or len(node) != 1:
        raise ProtocolError("value node is not a tagged container")
    ((tag, body),) = node.items()
    if tag == "leaf":
        _use_leaf(node, specs, used)
    elif tag in ("list", "tuple"):
        if not isinstance(body, list):
            raise ProtocolError(f"{tag} node is not a list")
        for item in body:
            _check_tree(item, specs, used, depth - 1)
    elif tag == "dict":
        if not isinstance(body, list):
            raise ProtocolError("dict node is not a list of pairs")
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2 and _is_dict_key(pair[0])):
                raise ProtocolError("dict entry is not a [key, value] pair with a str, int, "
                                    "bool, null or finite float key")
        _refuse_colliding_hashes(pair[0] for pair in body)
        if len({pair[0] for pair in body}) != len(body):  # all but one value would vanish
            raise ProtocolError("dict node repeats a key (1, 1.0 and true are one key)")
        for pair in body:
            _check_tree(pair[1], specs, used, depth - 1)
    elif tag == "set":
        _check_set(tag, body, depth)
    elif tag in _HASHABLE_TAGS:
        _check_hashable(node, depth)
    elif tag == "size":
        if not _is_shape(body):
            raise ProtocolError(f"size node is not a list of at most {_NDIM_MAX} extents")
    elif tag == "sparse":
        _check_sparse(body, specs, used)
    else:
        raise ProtocolError(f"unknown value node {tag!r}")


_HASHABLE_TAGS = ("nan", "complex", "frozenset")


def _check_set(tag: str, body: Any, depth: int) -> list[Any]:
    """Check a set's (or frozenset's) items; return them built, each once, bottom up:
    building every inner frozenset again at each level above it made a deep one cost
    its size times its depth (seconds for one header)."""
    if not isinstance(body, list):
        raise ProtocolError(f"{tag} node is not a list")
    items = [_check_hashable(item, depth - 1) for item in body]
    _refuse_colliding_hashes(items)
    return items


# Keys (or set items) with one hash at most. Strings hash randomly, but ints, floats and
# complex numbers that differ by multiples of 2**61 - 1 share a hash on purpose: a peer
# sending thousands of them would make every dict or set built of them quadratic.
MAX_EQUAL_HASHES = 8


def _refuse_colliding_hashes(keys: Any) -> None:
    counts = Counter(hash(key) for key in keys if not isinstance(key, str))
    if counts and max(counts.values()) > MAX_EQUAL_HASHES:
        raise ProtocolError(f"more than {MAX_EQUAL_HASHES} keys or set items share one hash "
                            "(a peer slowing the receiver down)")


def _check_hashable(node: Any, depth: int) -> Any:
    """A node that may be a set's item: a scalar, or a nan, complex or frozenset node;
    returns the item it makes."""
    if depth < 0:
        raise ProtocolError("value nested too deeply")
    if node is None or isinstance(node, (bool, str, int, float)):
        return node
    tag = next(iter(node)) if isinstance(node, dict) and len(node) == 1 else None
    if tag == "nan":
        if not _is_nan_node(node):
            raise ProtocolError("nan node is not the 16 hex digits of a NaN")
    elif tag == "complex":
        parts = node[tag]
        if not (isinstance(parts, list) and len(parts) == 2
                and all(type(part) is float or _is_nan_node(part) for part in parts)):
            raise ProtocolError("complex node is not a list of two floats")
    elif tag == "frozenset":
        return frozenset(_check_set(tag, node[tag], depth))
    else:
        raise ProtocolError("a set item is not None, a bool, int, float, complex, str or "
                            "frozenset")
    return build_value(node, [])  # checked: a nan or a complex, made in a few steps


def _is_nan_node(node: Any) -> bool:
    text = node.get("nan") if isinstance(node, dict) and len(node) == 1 else None
    return isinstance(text, str) and math.isnan(_nan_of(text))


def _is_dict_key(key: Any) -> bool:
    return key is None or isinstance(key, (str, int)) or (
        isinstance(key, float) and math.isfinite(key))


def _is_shape(extents: Any) -> bool:
    return isinstance(extents, list) and len(extents) <= _NDIM_MAX and all(
        is_int(extent) and 0 <= extent <= _DIM_MAX for extent in extents)


def _use_leaf(node: Any, specs: tuple[LeafSpec, ...], used: list[bool]) -> LeafSpec:
    """Mark the leaf a ``{"leaf": i}`` node refers to as used; return its spec."""
    index = node.get("leaf") if isinstance(node, dict) and len(node) == 1 else None
    if not is_int(index) or not 0 <= index < len(used) or used[index]:
        raise ProtocolError("value refers to a missing or repeated leaf")
    used[index] = True
    return specs[index]


def _check_sparse(body: Any, specs: tuple[LeafSpec, ...], used: list[bool]) -> None:
    """A sparse node's keys, leaves and shapes; its indices are checked when it is built."""
    layout_name = body.get("layout") if isinstance(body, dict) else None
    if not isinstance(layout_name, str) or layout_name not in SPARSE_LAYOUTS:
        raise ProtocolError("sparse node is not an object with a known layout")
    layout = SPARSE_LAYOUTS[layout_name]
    keys = {"layout", "size", *layout.parts}
    if layout.compressed_dim is None:
        keys.add("coalesced")
    if set(body) != keys:
        raise ProtocolError(f"{layout_name} node does not hold exactly {sorted(keys)}")
    size = body["size"]
    # torch counts a sparse tensor's elements in an int64, however few are stored
    if not _is_shape(size) or math.prod(size) >= 1 << 63:
        raise ProtocolError(f"{layout_name} size is not a list of at most {_NDIM_MAX} extents")
    if layout.compressed_dim is None and not isinstance(body["coalesced"], bool):
        raise ProtocolError("sparse_coo coalesced is not true or false")
    parts = [_use_leaf(body[name], specs, used) for name in layout.parts]
    if any(part.framework != "torch" or part.scalar for part in parts):
        raise ProtocolError(f"{layout_name} parts are not torch tensors")
    if layout.compressed_dim is None:
        fits = _coo_parts_fit(tuple(size), *parts)
    else:
        fits = _compressed_parts_fit(layout, tuple(size), *parts)
    if not fits:
        shapes = ", ".join(f"{name} {part.dtype}{list(part.shape)}"
                           for name, part in zip(layout.parts, parts))
        raise ProtocolError(f"{layout_name} parts ({shapes}) do not make a tensor of size {size}")


def _coo_parts_fit(size: tuple[int, ...], indices: LeafSpec, values: LeafSpec) -> bool:
    # indices: (sparse dims, nnz); values: (nnz, *dense dims)
    if indices.dtype != "int64" or len(indices.shape) != 2:
        return False
    sparse_dim, nnz = indices.shape
    return sparse_dim <= len(size) and values.shape == (nnz, *size[sparse_dim:])


def _compressed_parts_fit(layout: SparseLayout, size: tuple[int, ...], compressed: LeafSpec,
                          plain: LeafSpec, values: LeafSpec) -> bool:
    # compressed: (*batch, compressed extent + 1); plain: (*batch, nnz);
    # values: (*batch, nnz, *block, *dense); size: (*batch, rows, columns, *dense)
    if compressed.dtype not in ("int32", "int64") or plain.dtype != compressed.dtype:
        return False
    nbatch = len(compressed.shape) - 1
    if nbatch < 0 or len(plain.shape) != nbatch + 1:
        return False
    batch, nnz = plain.shape[:-1], plain.shape[-1]
    block = values.shape[nbatch + 1 : nbatch + 3] if layout.blocked else (1, 1)
    dense = values.shape[nbatch + 1 + (2 if layout.blocked else 0) :]
    matrix = size[nbatch : nbatch + 2]
    if (compressed.shape[:-1] != batch or values.shape[: nbatch + 1] != (*batch, nnz)
            or len(block) != 2 or 0 in block or len(matrix) != 2
            or size != (*batch, *matrix, *dense)):
        return False
    dim = layout.compressed_dim
    return (matrix[0] % block[0] == 0 and matrix[1] % block[1] == 0
            and compressed.shape[-1] == matrix[dim] // block[dim] + 1)


def check_received(tree: Any, arrays: list[Any]) -> None:
    """What only the received bytes can show: that each sparse tensor's indices fit its size.

    Raises :class:`ProtocolError`; the receiver refuses the frame rather than
    store a value the REPL could not build.
    """
    for body in _sparse_bodies(tree):
        layout = body["layout"]
        parts = {name: arrays[body[name]["leaf"]] for name in SPARSE_LAYOUTS[layout].parts}
        check_sparse_indices(SparseParts(layout, body["size"], parts, body.get("coalesced")))


def holds_sparse(tree: Any) -> bool:
    """Whether a validated tree holds a sparse tensor (so :func:`check_received` has work)."""
    return next(_sparse_bodies(tree), None) is not None


def _sparse_bodies(tree: Any) -> Iterator[dict[str, Any]]:
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        ((tag, body),) = node.items()
        if tag == "sparse":
            yield body
        elif tag in ("list", "tuple"):
            stack.extend(body)
        elif tag == "dict":
            stack.extend(item for _, item in body)


class ReceivedValue:
    """A capture as the connection thread received it: the validated tree and numpy arrays.

    The object the user sees (torch tensors, jax arrays, nested containers) is
    built by :meth:`build` when the REPL first asks for it, on the REPL's
    thread, so no connection thread ever imports a framework.
    """

    __slots__ = ("tree", "specs", "arrays")

    def __init__(self, tree: Any, specs: tuple[LeafSpec, ...], arrays: Sequence[Any]):
        self.tree = tree
        self.specs = specs
        self.arrays = arrays

    def build(self) -> Any:
        """The sent object, sharing the received arrays' memory.

        Raises :class:`ProtocolError` for a sparse tensor whose indices torch would refuse.
        """
        leaves = [finish(s, a) for s, a in zip(self.specs, self.arrays)]
        return build_value(self.tree, leaves, frameworks=True)


def build_value(tree: Any, leaves: list[Any], frameworks: bool = False) -> Any:
    """Rebuild the sent object from a validated tree and its received leaves.

    With ``frameworks``, a ``torch.Size`` and a sparse tensor are built as torch
    objects (importing torch: the REPL's thread only). Without, or where torch is
    not installed, they are a tuple and a dict ``{"layout", "size", ...its parts}``:
    what a connection thread may build, e.g. to measure a value.
    """
    if not isinstance(tree, dict):
        return tree
    ((tag, body),) = tree.items()
    if tag == "leaf":
        return leaves[body]
    if tag == "nan":
        return _nan_of(body)
    if tag == "list":
        return [build_value(item, leaves, frameworks) for item in body]
    if tag == "tuple":
        return tuple(build_value(item, leaves, frameworks) for item in body)
    if tag == "dict":
        return {key: build_value(item, leaves, frameworks) for key, item in body}
    if tag == "complex":
        real, imag = (build_value(part, leaves) for part in body)
        return complex(real, imag)  # from two floats, each kept bit for bit (NaN, -0.0)
    if tag in ("set", "frozenset"):
        items = (build_value(item, leaves) for item in body)
        return set(items) if tag == "set" else frozenset(items)
    if tag == "size":
        return torch_size(body) if frameworks else tuple(body)
    return _build_sparse(body, leaves, frameworks)


def _build_sparse(body: dict[str, Any], leaves: list[Any], frameworks: bool) -> Any:
    layout = body["layout"]
    parts = {name: leaves[body[name]["leaf"]] for name in SPARSE_LAYOUTS[layout].parts}
    sent = SparseParts(layout, body["size"], parts, body.get("coalesced"))
    tensor = sparse_tensor(sent) if frameworks else None
    if tensor is not None:
        return tensor
    described = {"layout": layout, "size": tuple(sent.size), **parts}
    if sent.coalesced is not None:
        described["coalesced"] = sent.coalesced
    return described


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


def _nan_of(text: str) -> float:
    """The float whose 8 little-endian bytes ``text`` spells in hex; 0.0 if it spells none."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return 0.0
    return struct.unpack("<d", raw)[0] if len(raw) == 8 else 0.0


def is_int(value: Any) -> bool:
    """True for an int that is not a bool (JSON's true parses as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


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
