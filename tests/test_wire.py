"""The wire format: what is accepted round-trips exactly, everything malformed is refused.

``thing.wire`` is the only code that reads a peer's bytes, so it is tested
here directly, without sockets: every decoder must refuse a malformed input
with :class:`ProtocolError` (or its subclasses :class:`LimitExceeded` and
:class:`HandshakeError`), never with another exception and never by
allocating what the input asks for.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thing import value_trees, wire
from thing.arrays import CARRIER_DTYPES, describe_leaf, finish, leaf_bytes
from thing.buffers import ReceiveBuffers
from thing.errors import HandshakeError, LimitExceeded, ProtocolError, UnsupportedType

LIMITS = wire.Limits(max_capture_bytes=1 << 30, max_header_bytes=1 << 20)


def _send_and_receive(value: Any, limits: wire.Limits = LIMITS) -> Any:
    """Everything a client and a server do to a value, minus the socket."""
    payload = value_trees.take_apart(value)
    header = wire.encode_header("name", payload, {"site": "here"})
    prefix = wire.decode_prefix(wire.encode_prefix(header, payload.nbytes, 7, 1.5))
    header_len, payload_len = prefix.header_len, prefix.payload_len
    wire.check_frame_size(header_len, payload_len, limits)
    assert (header_len, payload_len) == (len(header), payload.nbytes)
    assert (prefix.seq, prefix.caught_at) == (7, 1.5)
    decoded = wire.decode_header(header, payload_len, limits)
    assert decoded.name == "name" and decoded.meta == {"site": "here"}
    received = []
    buffers = ReceiveBuffers(max_bytes=64 << 20)
    for spec, leaf in zip(decoded.leaves, payload.leaves):
        destination = buffers.array(spec)
        destination.reshape(-1).view(np.uint8)[:] = np.frombuffer(leaf_bytes(leaf), np.uint8)
        received.append(finish(spec, destination))
    assert wire.decode_trailer(wire.encode_trailer(False)) is False
    return value_trees.build_value(decoded.tree, received)


def _same(a: Any, b: Any) -> bool:
    """Equal, of the same type all the way down, floats compared bit for bit (NaN, -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)  # NaN payloads and -0.0 too
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return a == b


# -- round trips --------------------------------------------------------------------

PLAIN_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    2**63,
    -(2**64) - 1,
    10**300,  # a big int travels exactly in the JSON
    0.1,
    -0.0,
    float("inf"),
    float("-inf"),
    float("nan"),
    5e-324,
    "",
    "plain",
    "unicodé ✓ 日本語 🚀 \x00 \\ \" \n",
    "\ud800 lone surrogate",
    b"",
    b"\x00\xffraw bytes",
]


@pytest.mark.parametrize("value", PLAIN_VALUES, ids=repr)
def test_plain_values_round_trip(value: Any) -> None:
    assert _same(_send_and_receive(value), value)


def test_numpy_nan_payloads_are_bit_exact() -> None:
    bits = np.array([0x7FF8000000000001, 0xFFF8000000000000, 0x7FF0000000000001], np.uint64)
    received = _send_and_receive([bits.view(np.float64), bits.view(np.float64)[1]])
    assert received[0].view(np.uint64).tolist() == bits.tolist()
    assert received[1].view(np.uint64) == bits[1]


def test_python_float_nan_payload_is_preserved() -> None:
    for bits in (0xFFF8000000000001, 0x7FF0000000000001, 0x7FF8000000000000, 0xFFFFFFFFFFFFFFFF):
        nan = struct.unpack("<d", struct.pack("<Q", bits))[0]
        received = _send_and_receive([nan, {"x": (nan,)}])
        for value in (received[0], received[1]["x"][0]):
            assert type(value) is float and struct.pack("<d", value) == struct.pack("<d", nan)


def test_bytearray_and_memoryview_arrive_as_bytes() -> None:
    assert _send_and_receive(bytearray(b"abc")) == b"abc"
    assert _send_and_receive(memoryview(b"xyz")) == b"xyz"
    assert type(_send_and_receive(bytearray(b"abc"))) is bytes


def test_nested_containers_round_trip() -> None:
    value = {
        "list": [1, 2.5, "three", None, [True, (False,)]],
        "tuple": (np.arange(3), {"inner": b"bytes"}, ()),
        "empty": {},
        "leaf": 0,  # a user key that looks like the wire's own tags
        "dict": [["not", "a", "pair"]],
        "ünïcode key": np.float32(1.5),
        "": np.zeros((2, 0)),
    }
    assert _same(_send_and_receive(value), value)


def test_subclasses_travel_as_their_base() -> None:
    import enum

    class Colour(enum.IntEnum):
        RED = 3

    assert _same(_send_and_receive([Colour.RED, np.str_("text")]), [3, "text"])


@pytest.mark.parametrize("dtype", sorted(name for name in CARRIER_DTYPES if name != "bfloat16"))
def test_numpy_arrays_and_scalars_round_trip(dtype: str) -> None:
    try:
        numpy_dtype = np.dtype(dtype)
    except TypeError:
        import ml_dtypes

        numpy_dtype = np.dtype(getattr(ml_dtypes, dtype))
    raw = np.random.default_rng(0).integers(0, 256, 6 * numpy_dtype.itemsize, dtype=np.uint8)
    if dtype == "bool":
        raw = raw % 2
    array = raw.view(numpy_dtype).reshape(2, 3)
    value = [array, array[0, 1], array.T, array[()], np.empty((0, 3), numpy_dtype)]
    received = _send_and_receive(value)
    assert _same(received[0], array)
    assert _same(received[1], array[0, 1])  # a numpy scalar comes back as one
    assert _same(received[2], np.ascontiguousarray(array.T))
    assert _same(received[4], value[4])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(10**200), max_value=10**200)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text()
        | st.binary(max_size=64)
        | st.builds(
            lambda data, dtype: np.frombuffer(data[: len(data) // 8 * 8], dtype),
            st.binary(max_size=64),
            st.sampled_from([np.uint8, np.int16, np.float32, np.float64, np.complex64]),
        ),
        lambda children: st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=30,
    )
)
def test_round_trip_property(value: Any) -> None:
    assert _same(_send_and_receive(value), value)


def test_nesting_up_to_the_limit_round_trips_and_deeper_is_refused() -> None:
    def nest(depth: int) -> Any:
        value: Any = [1]
        for _ in range(depth - 1):
            value = [value]
        return value

    deepest = nest(wire.Limits().max_depth)  # items sit exactly at the limit
    assert _same(_send_and_receive(deepest), deepest)
    with pytest.raises(UnsupportedType):
        value_trees.take_apart(nest(wire.Limits().max_depth + 1))
    looped: list[Any] = []
    looped.append(looped)
    with pytest.raises(UnsupportedType):
        value_trees.take_apart(looped)


@pytest.mark.parametrize(
    "value",
    [object(), {("a",): 1}, {float("nan"): 1}, {(1, 2)}, [lambda: 0], np.array(["strings"]),
     np.zeros(2, "datetime64[s]"), np.array([None], object)],
    ids=repr,
)
def test_unsupported_values_are_refused_on_the_sending_side(value: Any) -> None:
    with pytest.raises(UnsupportedType):
        value_trees.take_apart(value)


def test_take_apart_touches_no_array_data() -> None:
    array = np.arange(10.0)
    payload = value_trees.take_apart({"a": array})
    assert payload.leaves[0].source is array  # a reference, not a copy
    assert payload.nbytes == array.nbytes
    snapshot = value_trees.take_apart(array)
    snapshot.hold(copy=True, snapshot_bytes=0)
    array[:] = -1
    assert np.array_equal(np.frombuffer(leaf_bytes(snapshot.leaves[0]), np.float64),
                          np.arange(10.0))


def test_trailer_and_ack_round_trip() -> None:
    assert wire.decode_trailer(wire.encode_trailer(True)) is True
    ack = wire.encode_ack(12, 34)
    assert wire.decode_ack(ack[: wire.ACK.size]) == (wire.ACK_STORED, 0, 12, 34)
    refusal = wire.encode_ack(5, -1, "too big ✗")
    status, length, seq, capture_id = wire.decode_ack(refusal[: wire.ACK.size])
    assert (status, seq, capture_id) == (wire.ACK_REJECTED, 5, -1)
    assert refusal[wire.ACK.size :].decode() == "too big ✗" and length == len("too big ✗".encode())


def test_handshake_round_trip() -> None:
    info = {"hostname": "höst", "pid": 42}
    raw = wire.encode_handshake(info)
    status, length = wire.decode_handshake_prefix(raw[: wire.HANDSHAKE.size])
    assert status == wire.HANDSHAKE_OK and length == len(raw) - wire.HANDSHAKE.size
    assert wire.decode_handshake_info(raw[wire.HANDSHAKE.size :]) == info


# -- malformed input ----------------------------------------------------------------

GOOD_LEAF = ["numpy", "float32", [2, 3], False]


def _header(**changes: Any) -> bytes:
    document = {"name": "x", "value": {"leaf": 0}, "leaves": [GOOD_LEAF], "meta": {}}
    document.update(changes)
    return json.dumps(document).encode()


def test_the_good_header_used_below_is_accepted() -> None:
    header = wire.decode_header(_header(), 24, LIMITS)
    assert header.leaves[0].shape == (2, 3) and header.leaves[0].nbytes == 24


BAD_HEADERS = {
    "not json": b"{nope",
    "not utf-8": b'{"name": "\xff"}',
    "truncated utf-8": _header()[:-3] + b"\xe2\x82",
    "empty": b"",
    "json list": b"[1, 2]",
    "json string": b'"header"',
    "missing key": json.dumps({"name": "x", "value": None, "leaves": []}).encode(),
    "extra key": _header(extra=1),
    "seq, which travels in the prefix": _header(seq=1),
    "name int": _header(name=5),
    "name too long": _header(name="n" * 5000),
    "meta list": _header(meta=[]),
    "leaves not list": _header(leaves={"0": GOOD_LEAF}),
    "leaf not list": _header(leaves=["numpy"]),
    "leaf too short": _header(leaves=[["numpy", "float32", [2, 3]]]),
    "leaf too long": _header(leaves=[[*GOOD_LEAF, 0]]),
    "unknown framework": _header(leaves=[["tensorflow", "float32", [2, 3], False]]),
    "unknown dtype": _header(leaves=[["numpy", "float128", [2, 3], False]]),
    "object dtype": _header(leaves=[["numpy", "object", [2, 3], False]]),
    "dtype as list": _header(leaves=[["numpy", ["float32"], [2, 3], False]]),
    "dtype as dict": _header(leaves=[["numpy", {"float32": 1}, [2, 3], False]]),
    "framework as list": _header(leaves=[[["numpy"], "float32", [2, 3], False]]),
    "dtype null": _header(leaves=[["numpy", None, [2, 3], False]]),
    "bytes not uint8": _header(leaves=[["bytes", "float32", [2, 3], False]]),
    "shape not list": _header(leaves=[["numpy", "float32", 6, False]]),
    "shape dict": _header(leaves=[["numpy", "float32", {"0": 6}, False]]),
    "negative extent": _header(leaves=[["numpy", "float32", [-2, -3], False]]),
    "float extent": _header(leaves=[["numpy", "float32", [2.0, 3], False]]),
    "bool extent": _header(leaves=[["numpy", "float32", [True, 6], False]]),
    "string extent": _header(leaves=[["numpy", "float32", ["2", 3], False]]),
    "null extent": _header(leaves=[["numpy", "float32", [None, 3], False]]),
    "too many dims": _header(leaves=[["numpy", "float32", [1] * 65, False]]),
    "scalar flag not bool": _header(leaves=[["numpy", "float32", [2, 3], 0]]),
    "scalar with shape": _header(leaves=[["numpy", "float32", [2, 3], True]]),
    "value bare list": _header(value=[{"leaf": 0}]),
    "value unknown tag": _header(value={"object": [{"leaf": 0}]}),
    "value two tags": _header(value={"leaf": 0, "list": []}),
    "value empty object": _header(value={}),
    "leaf index missing": _header(value={"leaf": 1}),
    "leaf index negative": _header(value={"leaf": -1}),
    "leaf index float": _header(value={"leaf": 0.0}),
    "leaf index bool": _header(value={"leaf": False}),
    "leaf index string": _header(value={"leaf": "0"}),
    "leaf repeated": _header(value={"list": [{"leaf": 0}, {"leaf": 0}]}),
    "leaf unused": _header(value=None),
    "list body not list": _header(value={"list": {"leaf": 0}}),
    "tuple body not list": _header(value={"tuple": 3}),
    "dict body not list": _header(value={"dict": {"a": {"leaf": 0}}}),
    "dict entry not pair": _header(value={"dict": [["a", {"leaf": 0}, 1]]}),
    "dict entry short": _header(value={"dict": [[{"leaf": 0}]]}),
    "dict key list": _header(value={"dict": [[[1], {"leaf": 0}]]}),
    "dict key object": _header(value={"dict": [[{"leaf": 0}, None]]}),
    "too deep": _header(value=json.loads('{"list": [' * 70 + '{"leaf": 0}' + "]}" * 70)),
    "nan node not hex": _header(value={"list": [{"leaf": 0}, {"nan": "zz"}]}),
    "nan node not a nan": _header(value={"list": [{"leaf": 0}, {"nan": "0000000000000000"}]}),
    "nan node too short": _header(value={"list": [{"leaf": 0}, {"nan": "f87f"}]}),
    "nan node int": _header(value={"list": [{"leaf": 0}, {"nan": 5}]}),
    "json nested past recursion": b'{"seq": 1, "value": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "huge int in tree": _header(value={"list": [{"leaf": 0}, 1]}).replace(
        b", 1]", b", " + b"9" * 5000 + b"]"
    ),
}


@pytest.mark.parametrize("raw", list(BAD_HEADERS.values()), ids=list(BAD_HEADERS))
def test_malformed_headers_are_protocol_errors(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.decode_header(raw, 24, LIMITS)


@pytest.mark.parametrize("shape", [[], [2, 12]], ids=["0-d", "2-d"])
def test_a_bytes_leaf_is_one_dimensional(shape: list[int]) -> None:
    # What the REPL shows of a bytes value reads its length as its one extent.
    raw = _header(leaves=[["bytes", "uint8", shape, False]])
    with pytest.raises(ProtocolError, match="bytes leaves must be uint8 and 1-d"):
        wire.decode_header(raw, max(1, 24 * len(shape)), LIMITS)
    assert wire.decode_header(_header(leaves=[["bytes", "uint8", [24], False]]), 24,
                              LIMITS).leaves[0].shape == (24,)


@pytest.mark.parametrize("payload_len", [0, 23, 25, 24 * 2, 2**64 - 1])
def test_payload_length_must_match_the_leaves(payload_len: int) -> None:
    with pytest.raises(ProtocolError, match="payload"):
        wire.decode_header(_header(), payload_len, LIMITS)


@pytest.mark.parametrize(
    "shape",
    [[1 << 62, 1 << 62], [1 << 40], [2**31, 2**31, 2**31], [1 << 62] * 64],
    ids=["overflowing product", "huge extent", "int32 overflow", "64 huge dims"],
)
def test_huge_shapes_are_refused_before_allocation(shape: list[int]) -> None:
    raw = _header(leaves=[["numpy", "float32", shape, False]])
    # Whatever the payload claims, nothing this big may be allocated.
    nbytes = math.prod(shape) * 4
    for payload_len in (24, nbytes % (1 << 64)):
        with pytest.raises(LimitExceeded):
            wire.decode_header(raw, payload_len, LIMITS)


def test_extent_past_the_per_dimension_cap_is_refused() -> None:
    raw = _header(leaves=[["numpy", "float32", [(1 << 62) + 1, 0], False]])
    with pytest.raises(ProtocolError):
        wire.decode_header(raw, 0, LIMITS)


def test_shape_with_zero_extent_is_bounded_by_what_numpy_can_make() -> None:
    """Empty, an array holds nothing, whatever its other extents (np.empty((0, 2**40)) was
    refused as over the capture cap); numpy refuses one whose other extents times the
    item size reach 2**63."""
    for shape in ([0, 1 << 62], [1 << 61, 0, 3]):
        with pytest.raises(LimitExceeded, match="beyond what numpy can make"):
            wire.decode_header(_header(leaves=[["numpy", "float32", shape, False]]), 0, LIMITS)
    for shape in ([0, 1000], [0, 1 << 40], [1 << 58, 0, 7]):
        decoded = wire.decode_header(_header(leaves=[["numpy", "float32", shape, False]]), 0,
                                     LIMITS)
        assert decoded.leaves[0].nbytes == 0
        assert np.empty(shape, np.float32).size == 0  # numpy makes it


def test_leaf_count_and_depth_limits() -> None:
    tight = wire.Limits(max_capture_bytes=1 << 20, max_header_bytes=1 << 20, max_leaves=3,
                        max_depth=2)
    four = [["numpy", "uint8", [1], False]] * 4
    raw = _header(leaves=four, value={"list": [{"leaf": i} for i in range(4)]})
    with pytest.raises(ProtocolError):
        wire.decode_header(raw, 4, tight)
    deep = {"list": [{"list": [{"list": [{"leaf": 0}]}]}]}
    with pytest.raises(ProtocolError, match="deep"):
        wire.decode_header(_header(value=deep), 24, tight)
    shallow = {"list": [{"list": [{"leaf": 0}]}]}
    assert wire.decode_header(_header(value=shallow), 24, tight).tree == shallow


def test_prefix_checks() -> None:
    small = wire.Limits(max_capture_bytes=1000, max_header_bytes=100)
    good = wire.encode_prefix(b"h" * 100, 900, 5, 2.5)
    assert wire.decode_prefix(good) == (wire.KIND_CAPTURE, 100, 900, 5, 2.5, None, None)
    stepped = wire.encode_prefix(b"h", 1, 0, 2.5, call=51, step=-7)
    assert wire.decode_prefix(stepped)[-2:] == (51, -7)
    # A sender's clock that gives no time a clock can show is no time at all.
    for reading in (math.nan, math.inf, -math.inf, 1e300, -1e11):
        assert wire.decode_prefix(wire.encode_prefix(b"h", 1, 0, reading)).caught_at is None
    wire.check_frame_size(100, 900, small)
    with pytest.raises(LimitExceeded, match="header"):
        wire.check_frame_size(101, 0, small)
    with pytest.raises(LimitExceeded, match="capture"):
        wire.check_frame_size(100, 901, small)
    with pytest.raises(LimitExceeded):
        wire.check_frame_size(10, 2**64 - 1, small)
    for bad in (
        wire.FRAME_PREFIX.pack(b"XX", wire.KIND_CAPTURE, 10, 10, 0, 0.0, 0, 0),
        wire.FRAME_PREFIX.pack(wire.FRAME_TAG, 3, 10, 10, 0, 0.0, 0, 0),
        wire.FRAME_PREFIX.pack(wire.FRAME_TAG, 0, 10, 10, 0, 0.0, 0, 0),
        good[:-1],
        good + b"\x00",
        b"",
    ):
        with pytest.raises(ProtocolError):
            wire.decode_prefix(bad)


def test_trailer_checks() -> None:
    for bad in (
        wire.FRAME_TRAILER.pack(b"TX", 0, 0),
        wire.FRAME_TRAILER.pack(wire.TRAILER_TAG, 2, 0),
        wire.FRAME_TRAILER.pack(wire.TRAILER_TAG, 0xFFFF, 0),
        wire.encode_trailer(False)[:-1],
        b"",
    ):
        with pytest.raises(ProtocolError):
            wire.decode_trailer(bad)


def test_ack_checks() -> None:
    for bad in (
        wire.ACK.pack(b"XX", 0, 0, 1, 1),
        wire.ACK.pack(wire.ACK_TAG, 7, 0, 1, 1),
        wire.ACK.pack(wire.ACK_TAG, wire.ACK_REJECTED, wire.MAX_HANDSHAKE_JSON + 1, 1, -1),
        wire.encode_ack(1, 1)[:-1],
    ):
        with pytest.raises(ProtocolError):
            wire.decode_ack(bad)


def test_handshake_checks() -> None:
    prefix = wire.HANDSHAKE.pack
    with pytest.raises(HandshakeError, match="not a thing peer"):
        wire.decode_handshake_prefix(b"GET / HTTP/1")
    with pytest.raises(HandshakeError, match="not a thing peer"):
        wire.decode_handshake_prefix(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\x00")  # TLS
    with pytest.raises(HandshakeError, match="version"):
        wire.decode_handshake_prefix(prefix(wire.MAGIC, wire.VERSION + 1, 0, 10))
    with pytest.raises(HandshakeError, match="version"):
        wire.decode_handshake_prefix(prefix(wire.MAGIC, 0, 0, 10))
    too_long = prefix(wire.MAGIC, wire.VERSION, 0, wire.MAX_HANDSHAKE_JSON + 1)
    with pytest.raises(LimitExceeded):
        wire.decode_handshake_prefix(too_long)
    with pytest.raises(HandshakeError):
        wire.decode_handshake_prefix(b"THNG")
    for body in (b"\xff\xfe", b"{", b"[1, 2]", b'"text"', b"null", b""):
        with pytest.raises(HandshakeError):
            wire.decode_handshake_info(body)


def test_capture_too_large_for_the_limits() -> None:
    small = wire.Limits(max_capture_bytes=1000, max_header_bytes=1000)
    big = _header(leaves=[["numpy", "float64", [200], False]])  # 1600 bytes > 1000
    with pytest.raises(LimitExceeded):
        wire.decode_header(big, 1600, small)


def test_describe_leaf_refuses_unsupported_dtypes() -> None:
    unsupported = [np.zeros(2, "U1"), np.zeros(2, "M8[s]"), np.zeros(2, [("a", "i4")]),
                   np.zeros(2, object)]
    if np.dtype(np.longdouble).itemsize > 8:  # where long double is not just float64
        unsupported.append(np.zeros(2, np.longdouble))
    for array in unsupported:
        with pytest.raises(UnsupportedType):
            describe_leaf(array)


@pytest.mark.parametrize("tail", ["", "\\u00e9", "\\ud83d\\ude00", "\u4e2d", "\U0001F600"])
def test_a_headers_cost_bounds_what_parsing_it_holds_at_its_peak(tail: str) -> None:
    """One escaped character past U+FFFF makes a whole string 4 bytes a character, and
    parsing builds it with room to spare: charged 1 byte a byte, such a header held 8."""
    import tracemalloc

    raw = ('{"name":"x","value":"' + "a" * (1 << 20) + tail + '"}').encode()
    tracemalloc.start()
    try:
        wire.load_json(raw, "header")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(raw) + peak <= wire.parsed_cost(raw)


def test_nested_frozensets_are_checked_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each inner frozenset was built again at every level above it to check its hash: a
    1 MiB header 64 deep took the receiver 6 s. Each item is made once now, bottom up."""
    built = []
    build_value = value_trees.build_value
    monkeypatch.setattr(value_trees, "build_value",
                        lambda *args, **kwargs: built.append(1) or build_value(*args, **kwargs))
    value: Any = {"frozenset": [""] * 10_000 + [{"complex": [1.0, 2.0]}]}
    for _ in range(60):
        value = {"frozenset": [value]}
    raw = json.dumps({"name": "deep", "value": {"set": [value]}, "leaves": [], "meta": {}})
    header = wire.decode_header(raw.encode(), 0, LIMITS)
    assert len(built) <= 3  # the complex number, made once: itself and its two parts
    expected = frozenset({"", complex(1.0, 2.0)})
    for _ in range(60):
        expected = frozenset({expected})
    assert build_value(header.tree, []) == {expected}
