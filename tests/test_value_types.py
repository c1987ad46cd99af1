"""Value types beyond arrays and plain containers: each arrives as the type it was sent as.

Dicts with int, float, bool and None keys, complex numbers, sets and
frozensets, ``torch.Size``, sparse torch tensors and numpy structured
scalars, round-tripped through the real encode and decode path without a
socket, bit for bit; and every hostile form of their nodes refused with
:class:`ProtocolError`: when the header is decoded, or, for sparse indices
that only their data can show wrong, when the REPL builds the value.
"""

from __future__ import annotations

import enum
import json
import math
import struct
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thing import arrays, value_trees, wire
from thing.arrays import LeafSpec, describe_leaf, leaf_bytes
from thing.buffers import ReceiveBuffers
from thing.errors import ProtocolError, UnsupportedType

from .test_fuzz import mutate_header, read_like_the_server
from .test_security import frame_bytes

LIMITS = wire.Limits(max_capture_bytes=1 << 30, max_header_bytes=1 << 20)
NAN_BITS = (0x7FF8000000000000, 0xFFF8000000000001, 0x7FF0000000000001, 0xFFFFFFFFFFFFFFFF)


def _nan(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _receive(value: Any) -> value_trees.ReceivedValue:
    """What a client sends for ``value`` and a server's connection thread makes of it."""
    payload = value_trees.take_apart(value)
    header = wire.encode_header("value", payload, {})
    decoded = wire.decode_header(header, payload.nbytes, LIMITS)
    buffers = ReceiveBuffers(max_bytes=64 << 20)
    received = []
    for spec, leaf in zip(decoded.leaves, payload.leaves):
        destination = buffers.array(spec)
        destination.reshape(-1).view(np.uint8)[:] = np.frombuffer(leaf_bytes(leaf), np.uint8)
        received.append(destination)
    return value_trees.ReceivedValue(decoded.tree, decoded.leaves, received)


def _round_trip(value: Any) -> Any:
    """``value`` as the REPL gets it."""
    return _receive(value).build()


def _fingerprint(value: Any) -> Any:
    """What identifies a set item exactly: its type, and its bits for floats and complexes."""
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    if isinstance(value, complex):
        return ("complex", struct.pack("<dd", value.real, value.imag))
    if isinstance(value, frozenset):
        return ("frozenset", sorted(map(_fingerprint, value), key=repr))
    return (type(value).__name__, value)


def _same(a: Any, b: Any) -> bool:
    """Equal, of the same type all the way down (keys too), floats and arrays bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (float, complex, set, frozenset)):
        if isinstance(a, (set, frozenset)):
            return sorted(map(_fingerprint, a), key=repr) == sorted(map(_fingerprint, b), key=repr)
        return _fingerprint(a) == _fingerprint(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            _same(ka, kb) and _same(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return _same_tensor(a, b)
    return a == b


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if (a.layout, a.dtype, a.shape) != (b.layout, b.dtype, b.shape):
        return False
    if a.layout is torch.strided:
        if not a.numel():
            return True
        return bytes(a.detach().reshape(-1).view(torch.uint8).numpy()) == \
            bytes(b.detach().reshape(-1).view(torch.uint8).numpy())
    if a.layout is torch.sparse_coo:
        return a.is_coalesced() == b.is_coalesced() and _same_tensor(
            a._indices(), b._indices()) and _same_tensor(a._values(), b._values())
    compressed, plain = arrays.SPARSE_LAYOUTS[str(a.layout).rpartition(".")[2]].parts[:2]
    return all(_same_tensor(getattr(a, name)(), getattr(b, name)())
               for name in (compressed, plain, "values"))


def _built_without_torch(received: value_trees.ReceivedValue,
                         monkeypatch: pytest.MonkeyPatch) -> Any:
    """``received`` built where torch is not installed (the sender had it)."""
    monkeypatch.setattr(arrays, "_torch", lambda: None)
    return received.build()


# -- dicts with keys other than str -----------------------------------------------------------


class Colour(enum.IntEnum):
    RED = 3


KEYED = [
    {1: "one", -(2**70): "big", 0: np.arange(3)},
    {1.5: "a", -0.0: "b", 1e300: "c", 5e-324: "d"},
    {True: 1, False: 0},
    {None: [1, 2]},
    {"1": "str", 1: "int", 2.0: "float", None: "null", False: "bool"},
    {0: {1.0: {None: {True: {"deep": np.float32(2.5)}}}}},
]


@pytest.mark.parametrize("value", KEYED, ids=repr)
def test_dict_keys_keep_their_types(value: dict) -> None:
    received = _round_trip(value)
    assert _same(received, value)
    assert [type(key) for key in received] == [type(key) for key in value]


def test_dict_key_subclasses_travel_as_their_base() -> None:
    received = _round_trip({Colour.RED: 1, np.float64(0.5): 2, np.str_("s"): 3})
    assert _same(received, {3: 1, 0.5: 2, "s": 3})


def test_a_number_subclass_travels_as_its_own_value_whatever_its_methods_say() -> None:
    """float(x), int(x) and x.real call a subclass's overrides: its stored number is sent."""

    class Float(float):
        def __float__(self) -> float:
            return 99.0

    class Int(int):
        def __int__(self) -> int:
            return 99

    class Complex(complex):
        @property
        def real(self) -> float:  # type: ignore[override]
            return 99.0

    received = _round_trip([Float(1.25), Int(5), Complex(1 + 2j), {Float(0.5): 1}])
    assert _same(received, [1.25, 5, 1 + 2j, {0.5: 1}])


def test_str_keyed_dicts_are_encoded_as_before() -> None:
    payload = value_trees.take_apart({"a": 1, "b": [2]})
    assert payload.tree == {"dict": [["a", 1], ["b", {"list": [2]}]]}


@pytest.mark.parametrize(
    "key", [float("nan"), float("inf"), -math.inf, (1,), frozenset(), np.int64(1), b"k", 1j],
    ids=repr)
def test_unsupported_dict_keys_are_refused_with_one_line(key: Any) -> None:
    with pytest.raises(UnsupportedType, match="dict keys must be") as caught:
        value_trees.take_apart({key: 1})
    assert "\n" not in str(caught.value)


# -- complex ----------------------------------------------------------------------------------


COMPLEXES = [1j, complex(-0.0, -0.0), complex(math.inf, -math.inf), complex(5e-324, 1e308),
             *(complex(_nan(bits), _nan(NAN_BITS[-1 - i])) for i, bits in enumerate(NAN_BITS))]


@pytest.mark.parametrize("number", COMPLEXES, ids=repr)
def test_complex_numbers_round_trip_bit_for_bit(number: complex) -> None:
    received = _round_trip([number, {"z": (number,)}])
    for value in (received[0], received[1]["z"][0]):
        assert type(value) is complex and _fingerprint(value) == _fingerprint(number)


def test_complex_arrays_and_numpy_scalars_still_travel_as_leaves() -> None:
    value = [np.complex128(1 + 2j), np.array([1j], np.complex64)]
    assert len(value_trees.take_apart(value).leaves) == 2
    assert _same(_round_trip(value), value)


# -- sets and frozensets ----------------------------------------------------------------------


SETS = [
    set(),
    frozenset(),
    {1, 2.5, "x", None, False, 3j, frozenset({1, frozenset({"deep"})})},
    frozenset({-0.0, math.inf, "ünïcode", 2**80}),
    {_nan(bits) for bits in NAN_BITS},  # NaNs are distinct items, each keeps its bits
    {Colour.RED, np.float64(0.25), np.str_("s")},
]


@pytest.mark.parametrize("value", SETS, ids=repr)
def test_sets_arrive_as_the_same_type(value: set | frozenset) -> None:
    received = _round_trip({"s": value})["s"]
    expected = type(value)(
        int(item) if isinstance(item, Colour) else
        float(item) if isinstance(item, np.float64) else
        str(item) if isinstance(item, np.str_) else item
        for item in value)
    assert type(received) is type(value) and _same(received, expected)


@pytest.mark.parametrize(
    "value", [{(1, 2)}, {frozenset({(1,)})}, {np.float32(1)}, {b"bytes"}, frozenset({Ellipsis})],
    ids=repr)
def test_set_items_that_cannot_travel_are_refused_with_one_line(value: Any) -> None:
    with pytest.raises(UnsupportedType, match="a set can hold") as caught:
        value_trees.take_apart(value)
    assert "\n" not in str(caught.value)


def test_frozensets_nested_past_the_limit_are_refused() -> None:
    value: frozenset = frozenset({1})
    for _ in range(wire.Limits().max_depth):
        value = frozenset({value})
    with pytest.raises(UnsupportedType, match="deeply"):
        value_trees.take_apart(value)


# -- torch.Size -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [torch.Size([2, 3]), torch.Size([]), torch.Size([0, 1 << 40])],
                         ids=repr)
def test_torch_size_arrives_as_torch_size(size: torch.Size) -> None:
    received = _round_trip({"shape": size, "also": [size, tuple(size)]})
    assert type(received["shape"]) is torch.Size and received["shape"] == size
    assert type(received["also"][0]) is torch.Size and type(received["also"][1]) is tuple


def test_torch_size_arrives_as_a_tuple_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _same(_built_without_torch(_receive(torch.Size([2, 3])), monkeypatch), (2, 3))


# -- sparse torch tensors ---------------------------------------------------------------------


def _dense() -> torch.Tensor:
    return torch.tensor([[0.0, 1.5, 0.0, -2.0], [0.0, 0.0, 0.0, 0.0],
                         [3.25, 0.0, float("nan"), 0.0], [0.0, 0.0, 0.0, 7.0]])


def _sparse_tensors() -> dict[str, torch.Tensor]:
    dense = _dense()
    return {
        "coo coalesced": dense.to_sparse(),
        "coo uncoalesced, duplicates": torch.sparse_coo_tensor(
            torch.tensor([[2, 0, 2], [1, 3, 1]]), torch.tensor([1.0, -1.0, 5.0]), (3, 4),
            check_invariants=True),
        "coo hybrid": torch.arange(24.0).reshape(3, 4, 2).to_sparse(sparse_dim=2),
        "coo empty": torch.sparse_coo_tensor(torch.zeros((2, 0), dtype=torch.long),
                                             torch.zeros(0), (5, 5), check_invariants=True),
        "coo scalar": torch.tensor(5.0).to_sparse(),
        "coo bfloat16": dense.to(torch.bfloat16).to_sparse(),
        "coo complex64": (dense * 1j).to(torch.complex64).to_sparse(),
        "coo bool": (dense > 0).to_sparse(),
        "coo requiring grad": dense.to_sparse().requires_grad_(),
        "csr": dense.to_sparse_csr(),
        "csr int32 indices": torch.sparse_csr_tensor(
            torch.tensor([0, 1, 1, 3], dtype=torch.int32),
            torch.tensor([2, 0, 3], dtype=torch.int32),
            torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), (3, 4), check_invariants=True),
        "csr batched": torch.arange(1.0, 25.0).reshape(2, 3, 4).to_sparse_csr(),
        "csr hybrid": torch.arange(1.0, 25.0).reshape(3, 4, 2).to_sparse_csr(dense_dim=1),
        "csr empty": torch.zeros(3, 0).to_sparse_csr(),
        "csc": dense.to_sparse_csc(),
        "bsr": dense.to_sparse_bsr((2, 2)),
        "bsc": dense.to_sparse_bsc((2, 1)),
    }


with warnings.catch_warnings():  # torch's note, once, that its CSR support is in beta
    warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
    SPARSE = _sparse_tensors()


@pytest.mark.parametrize("name", list(SPARSE))
def test_sparse_tensors_arrive_as_the_same_sparse_tensor(name: str) -> None:
    tensor = SPARSE[name]
    assert describe_leaf(tensor) is None
    received = _round_trip({"t": tensor})["t"]
    assert _same(received, tensor.detach())
    assert not received.requires_grad


def test_a_sparse_tensor_travels_as_its_dense_parts() -> None:
    tensor = SPARSE["coo uncoalesced, duplicates"]
    payload = value_trees.take_apart(tensor)
    assert payload.tree == {"sparse": {"layout": "sparse_coo", "size": [3, 4], "coalesced": False,
                                       "indices": {"leaf": 0}, "values": {"leaf": 1}}}
    assert [leaf.spec for leaf in payload.leaves] == [
        LeafSpec("torch", "int64", (2, 3)), LeafSpec("torch", "float32", (3,))]
    assert payload.nbytes == 2 * 3 * 8 + 3 * 4


def test_a_sparse_tensor_changed_after_a_snapshot_is_sent_as_it_was() -> None:
    tensor = SPARSE["coo coalesced"].clone()
    payload = value_trees.take_apart(tensor)
    payload.hold(copy=True, snapshot_bytes=0)
    tensor._values().mul_(0)
    received = value_trees.build_value(payload.tree, [np.frombuffer(leaf_bytes(leaf), np.uint8)
                                               for leaf in payload.leaves])
    assert received["values"].tobytes() == SPARSE["coo coalesced"]._values().numpy().tobytes()


@pytest.mark.parametrize("name", ["coo uncoalesced, duplicates", "csr", "bsc"])
def test_sparse_tensors_arrive_as_their_parts_without_torch(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = SPARSE[name]
    received = _built_without_torch(_receive(tensor), monkeypatch)
    layout = str(tensor.layout).rpartition(".")[2]
    parts = arrays.SPARSE_LAYOUTS[layout].parts
    assert set(received) == {"layout", "size", *parts} | (
        {"coalesced"} if layout == "sparse_coo" else set())
    assert received["layout"] == layout and received["size"] == tuple(tensor.shape)
    sent = arrays.sparse_parts(tensor).parts
    for part in parts:
        assert type(received[part]) is np.ndarray
        assert received[part].tobytes() == sent[part].contiguous().numpy().tobytes()


def test_what_a_connection_thread_builds_needs_no_torch() -> None:
    """The store measures a value on the connection thread: sizes and sparse tensors stay plain."""
    received = _receive({"shape": torch.Size([4, 4]), "t": SPARSE["csr"]})
    measured = value_trees.build_value(received.tree, [b""] * len(received.specs))
    assert measured == {"shape": (4, 4), "t": {"layout": "sparse_csr", "size": (4, 4),
                                               "crow_indices": b"", "col_indices": b"",
                                               "values": b""}}


def test_other_tensor_layouts_are_refused_with_one_line() -> None:
    with pytest.raises(UnsupportedType, match="layout torch._mkldnn") as caught:
        value_trees.take_apart({"m": torch.zeros(2).to_mkldnn()})
    assert "\n" not in str(caught.value)


# -- numpy structured scalars -----------------------------------------------------------------


def test_numpy_bytes_and_str_scalars_arrive_as_bytes_and_str() -> None:
    """np.bytes_ is a bytes, as np.str_ is a str: it was refused ("dtype |S2")."""
    for value in (np.bytes_(b"a\x00b"), np.bytes_(b""), np.str_("ü")):
        received = _round_trip(value)
        assert type(received) is (bytes if isinstance(value, bytes) else str)
        assert received == value
    assert _round_trip({"k": [np.bytes_(b"\xff")]}) == {"k": [b"\xff"]}


def test_numpy_structured_scalars_arrive_as_dicts_of_their_fields() -> None:
    kind = np.dtype([("loss", "f4"), ("ids", "i8", (2,)), ("tag", "U4"),
                     ("inner", [("x", "f8"), ("flag", "?")])])
    record = np.array([(1.5, [3, 4], "ab", (_nan(NAN_BITS[1]), True))], kind)[0]
    received = _round_trip(record)
    assert _same(received, {"loss": np.float32(1.5), "ids": np.array([3, 4]), "tag": "ab",
                            "inner": {"x": np.float64(_nan(NAN_BITS[1])), "flag": np.True_}})


def test_numpy_structured_scalars_with_fields_that_cannot_travel_are_refused() -> None:
    record = np.zeros((), [("when", "M8[s]")])[()]
    with pytest.raises(UnsupportedType):
        value_trees.take_apart(record)
    # A bytes field is a np.bytes_, which travels as the bytes it is.
    assert _round_trip(np.array((b"ab",), [("raw", "S3")])[()]) == {"raw": b"ab"}
    with pytest.raises(UnsupportedType):
        value_trees.take_apart(np.zeros(2, [("a", "f4")]))  # structured arrays do not travel


def test_a_masked_array_is_refused_rather_than_sent_without_its_mask() -> None:
    masked = np.ma.masked_array([1.0, -999.0, 3.0], mask=[False, True, False])
    for value in (masked, {"m": [masked]}, masked[0:1]):
        with pytest.raises(UnsupportedType, match="masked array: its mask would be lost"):
            value_trees.take_apart(value)
    assert _same(_round_trip(masked.filled(0.0)), np.array([1.0, 0.0, 3.0]))


def test_an_arbitrary_object_is_refused_with_one_line_naming_it() -> None:
    class Optimizer:
        pass

    with pytest.raises(UnsupportedType) as caught:
        value_trees.take_apart({"opt": Optimizer()})
    message = str(caught.value)
    assert "Optimizer" in message and "dicts" in message and "\n" not in message


# -- hypothesis -------------------------------------------------------------------------------

FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [_nan(bits) for bits in NAN_BITS])
HASHABLE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**100), 2**100) | FLOATS | st.text(max_size=8)
    | st.builds(complex, FLOATS, FLOATS),
    lambda children: st.frozensets(children, max_size=4),
    max_leaves=10,
)
KEYS = (st.none() | st.booleans() | st.integers(-(2**100), 2**100) | st.text(max_size=8)
        | st.floats(allow_nan=False, allow_infinity=False))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(
    HASHABLE | st.sets(HASHABLE, max_size=4),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(KEYS, children, max_size=4),
    max_leaves=30,
))
def test_round_trip_property(value: Any) -> None:
    assert _same(_round_trip(value), value)


# -- hostile headers: refused when decoded ----------------------------------------------------

COO_LEAVES = [["torch", "int64", [2, 2], False], ["torch", "float32", [2], False]]
CSR_LEAVES = [["torch", "int64", [3], False], ["torch", "int64", [2], False],
              ["torch", "float32", [2], False]]
BSR_LEAVES = [["torch", "int64", [2], False], ["torch", "int64", [1], False],
              ["torch", "float32", [1, 2, 2], False]]


def _sparse_node(layout: str, size: list[int], /, **changes: Any) -> dict:
    """A sparse node whose parts are leaves 0, 1 (and 2); a change to ``...`` drops a key."""
    body: dict[str, Any] = {"layout": layout, "size": size}
    if layout == "sparse_coo":
        body["coalesced"] = False
    for index, name in enumerate(arrays.SPARSE_LAYOUTS[layout].parts):
        body[name] = {"leaf": index}
    body.update(changes)
    return {"sparse": {key: value for key, value in body.items() if value is not ...}}


def _coo_node(**changes: Any) -> dict:
    return _sparse_node("sparse_coo", [2, 3], **changes)


def _csr_node(**changes: Any) -> dict:
    return _sparse_node("sparse_csr", [2, 3], **changes)


def _csc_node(**changes: Any) -> dict:
    return _sparse_node("sparse_csc", [3, 2], **changes)


def _bsr_node(**changes: Any) -> dict:
    return _sparse_node("sparse_bsr", [2, 4], **changes)


def _header(value: Any, leaves: list | None = None) -> tuple[bytes, int]:
    """A capture header around ``value``, and the payload length its leaves describe."""
    leaves = leaves or []
    document = {"name": "x", "value": value, "leaves": leaves, "meta": {}}
    nbytes = sum(LeafSpec(f, d, tuple(s), c).nbytes for f, d, s, c in leaves)
    return json.dumps(document).encode(), nbytes


def _with_coo(changes: dict, leaves: list = COO_LEAVES) -> tuple[bytes, int]:
    return _header(_coo_node(**changes), leaves)


def _coo_leaves(indices: list, values: list) -> list:
    return [["torch", "int64", indices, False], ["torch", "float32", values, False]]


BAD_NODES = {
    "dict key list": _header({"dict": [[[1], 2]]}),
    "dict key object": _header({"dict": [[{"nan": "000000000000f87f"}, 2]]}),
    "dict key NaN": _header({"dict": [[float("nan"), 2]]}),
    "dict key Infinity": _header({"dict": [[float("inf"), 2]]}),
    "dict key repeated": _header({"dict": [["a", 1], ["a", 2]]}),
    "dict keys 1 and true": _header({"dict": [[1, 1], [True, 2]]}),
    "dict keys 1 and 1.0": _header({"dict": [[1, 1], [1.0, 2]]}),
    "dict keys 0 and -0.0": _header({"dict": [[0, 1], [-0.0, 2]]}),
    "complex not a list": _header({"complex": 1.5}),
    "complex one part": _header({"complex": [1.5]}),
    "complex three parts": _header({"complex": [1.5, 2.5, 3.5]}),
    "complex int part": _header({"complex": [1, 2.5]}),
    "complex bool part": _header({"complex": [True, 2.5]}),
    "complex str part": _header({"complex": ["1", 2.5]}),
    "complex null part": _header({"complex": [None, 2.5]}),
    "complex nested complex": _header({"complex": [{"complex": [1.0, 1.0]}, 2.5]}),
    "complex bad nan part": _header({"complex": [{"nan": "0000000000000000"}, 2.5]}),
    "set body not list": _header({"set": {"a": 1}}),
    "frozenset body not list": _header({"frozenset": 3}),
    "set holding a list": _header({"set": [{"list": [1]}]}),
    "set holding a tuple": _header({"set": [{"tuple": [1]}]}),
    "set holding a dict": _header({"set": [{"dict": []}]}),
    "set holding a set": _header({"set": [{"set": []}]}),
    "set holding a size": _header({"set": [{"size": [1]}]}),
    "set holding a leaf": _header({"set": [{"leaf": 0}]}, [["numpy", "uint8", [1], False]]),
    "set holding a sparse tensor": _header({"set": [_coo_node()]}, COO_LEAVES),
    "set holding a bare list": _header({"set": [[1, 2]]}),
    "frozenset holding a set": _header({"frozenset": [{"frozenset": [{"set": []}]}]}),
    "set holding an unknown node": _header({"set": [{"object": 1}]}),
    "frozensets too deep": _header(json.loads('{"set": [' + '{"frozenset": [' * 70 + "1"
                                              + "]}" * 70 + "]}")),
    "size not a list": _header({"size": 3}),
    "size negative": _header({"size": [2, -1]}),
    "size float": _header({"size": [2.0]}),
    "size bool": _header({"size": [True]}),
    "size huge": _header({"size": [2**63]}),
    "size 65 dims": _header({"size": [1] * 65}),
    "sparse body a list": _header({"sparse": [{"leaf": 0}, {"leaf": 1}]}, COO_LEAVES),
    "sparse unknown layout": _with_coo({"layout": "sparse_dok"}),
    "sparse layout a list": _with_coo({"layout": ["sparse_coo"]}),
    "sparse layout strided": _with_coo({"layout": "strided"}),
    "sparse missing size": _with_coo({"size": ...}),
    "sparse missing coalesced": _with_coo({"coalesced": ...}),
    "sparse missing values": _with_coo({"values": ...}, COO_LEAVES[:1]),
    "sparse extra key": _with_coo({"extra": 1}),
    "csr with coalesced": _header(_csr_node(coalesced=False), CSR_LEAVES),
    "sparse coalesced not bool": _with_coo({"coalesced": 1}),
    "sparse leaf missing": _with_coo({"values": {"leaf": 2}}),
    "sparse leaf negative": _with_coo({"values": {"leaf": -1}}),
    "sparse leaf repeated": _with_coo({"values": {"leaf": 0}}),
    "sparse leaf also used outside": _header(
        {"list": [_coo_node(), {"leaf": 1}]}, COO_LEAVES),
    "sparse part inline": _with_coo({"values": {"list": [1.0, 2.0]}}, COO_LEAVES[:1]),
    "sparse part a bare index": _with_coo({"values": 1}),
    "sparse leaf unused": _with_coo({}, [*COO_LEAVES, ["torch", "uint8", [1], False]]),
    "sparse size not a list": _with_coo({"size": 6}),
    "sparse size negative": _with_coo({"size": [2, -3]}),
    "sparse size bool": _with_coo({"size": [True, 3]}),
    "sparse size 65 dims": _with_coo({"size": [1] * 65}),
    "sparse size overflows int64": _with_coo({"size": [2**62, 2**62]}),
    "sparse parts numpy": _with_coo({}, [["numpy", "int64", [2, 2], False],
                                         ["numpy", "float32", [2], False]]),
    "sparse parts bytes": _with_coo({}, [["bytes", "uint8", [32], False],
                                         ["torch", "float32", [2], False]]),
    "sparse part scalar": _with_coo({}, [COO_LEAVES[0], ["numpy", "float32", [], True]]),
    "coo indices float": _with_coo({}, [["torch", "float64", [2, 2], False], COO_LEAVES[1]]),
    "coo indices int32": _with_coo({}, [["torch", "int32", [2, 2], False], COO_LEAVES[1]]),
    "coo indices 1-d": _with_coo({}, _coo_leaves([4], [2])),
    "coo more sparse dims than size": _with_coo({"size": [2]}),
    "coo values count differs": _with_coo({}, _coo_leaves([2, 2], [3])),
    "coo dense dims differ": _with_coo({"size": [2, 3, 4]}, _coo_leaves([2, 2], [2, 5])),
    "coo dense dims missing": _with_coo({}, _coo_leaves([2, 2], [2, 1])),
    "csr crow too long": _header(_csr_node(), [["torch", "int64", [4], False], *CSR_LEAVES[1:]]),
    "csr crow too short": _header(_csr_node(), [["torch", "int64", [2], False], *CSR_LEAVES[1:]]),
    "csr index dtypes differ": _header(_csr_node(), [["torch", "int32", [3], False],
                                                      *CSR_LEAVES[1:]]),
    "csr index float": _header(_csr_node(), [["torch", "float32", [3], False],
                                              ["torch", "float32", [2], False], CSR_LEAVES[2]]),
    "csr 0-d crow": _header(_csr_node(), [["torch", "int64", [], False], *CSR_LEAVES[1:]]),
    "csr values count differs": _header(_csr_node(), [*CSR_LEAVES[:2],
                                                      ["torch", "float32", [3], False]]),
    "csr batch differs": _header(_csr_node(size=[2, 2, 3]), [
        ["torch", "int64", [2, 3], False], ["torch", "int64", [3, 2], False],
        ["torch", "float32", [2, 2], False]]),
    "csr size 1-d": _header(_csr_node(size=[2]), CSR_LEAVES),
    "csr dense dims differ": _header(_csr_node(size=[2, 3, 5]), [
        *CSR_LEAVES[:2], ["torch", "float32", [2, 4], False]]),
    "bsr block does not divide": _header(_bsr_node(size=[2, 5]), BSR_LEAVES),
    "bsr zero block": _header(_bsr_node(), [*BSR_LEAVES[:2], ["torch", "float32", [1, 0, 2],
                                                             False]]),
    "bsr values not blocks": _header(_bsr_node(), [*BSR_LEAVES[:2],
                                                   ["torch", "float32", [1], False]]),
    "bsr crow counts rows not blocks": _header(_bsr_node(), [["torch", "int64", [3], False],
                                                             *BSR_LEAVES[1:]]),
}


@pytest.mark.parametrize("header", list(BAD_NODES.values()), ids=list(BAD_NODES))
def test_hostile_value_nodes_are_refused_when_decoded(header: tuple[bytes, int]) -> None:
    raw, payload_len = header
    with pytest.raises(ProtocolError):
        wire.decode_header(raw, payload_len, LIMITS)


def test_the_valid_nodes_the_hostile_ones_are_made_from_are_accepted() -> None:
    for value, leaves in [(_coo_node(), COO_LEAVES), (_csr_node(), CSR_LEAVES),
                          (_bsr_node(), BSR_LEAVES), ({"set": [{"frozenset": [1]}, 1.5]}, []),
                          ({"complex": [{"nan": "010000000000f87f"}, -0.0]}, []),
                          ({"dict": [[1, 1], [1.5, 2], [None, 3], [False, 4]]}, []),
                          ({"size": [0, 2**62]}, [])]:
        raw, payload_len = _header(value, leaves)
        assert wire.decode_header(raw, payload_len, LIMITS).tree == value


def test_hostile_value_nodes_are_refused_by_the_servers_reader() -> None:
    """Refused and read past: the frame after one is stored, and nothing of it."""
    for raw, payload_len in (BAD_NODES["sparse leaf missing"], BAD_NODES["set holding a list"],
                             BAD_NODES["dict keys 1 and true"]):
        frame = (wire.encode_prefix(raw, payload_len, 0, 0.0) + raw + bytes(payload_len)
                 + wire.encode_trailer(False))
        stored = read_like_the_server(frame + frame_bytes(np.float32([7]), "after", seq=1))
        assert [value.tobytes() for value in stored] == [np.float32([7]).tobytes()]


# -- hostile sparse data: refused when built --------------------------------------------------


def _built(value: Any, parts: list[np.ndarray]) -> Any:
    """Decode a header around ``value`` whose torch leaves hold ``parts``, then build it."""
    leaves = [["torch", part.dtype.name, list(part.shape), False] for part in parts]
    raw, payload_len = _header(value, leaves)
    header = wire.decode_header(raw, payload_len, LIMITS)
    copies = [part.copy() for part in parts]
    return value_trees.ReceivedValue(header.tree, header.leaves, copies).build()


def _coo(indices: list, coalesced: bool = False) -> tuple[dict, list[np.ndarray]]:
    count = len(indices[0])
    return _coo_node(coalesced=coalesced), [np.array(indices, np.int64),
                                            np.arange(count, dtype=np.float32)]


def _compressed(node: dict, compressed: list, plain: list,
                dtype: type = np.int64) -> tuple[dict, list[np.ndarray]]:
    values_shape = node["sparse"]["layout"] == "sparse_bsr" and (len(plain), 2, 2) or len(plain)
    return node, [np.array(compressed, dtype), np.array(plain, dtype),
                  np.ones(values_shape, np.float32)]


INVALID_DATA = {
    "coo row out of range": (_coo([[0, 2], [0, 0]]), "dim 0"),
    "coo column out of range": (_coo([[0, 1], [0, 3]]), "dim 1"),
    "coo negative index": (_coo([[0, -1], [0, 0]]), "dim 0"),
    "coo huge index": (_coo([[0, 2**63 - 1], [0, 0]]), "dim 0"),
    "coo claimed coalesced, unsorted": (_coo([[1, 0], [0, 0]], coalesced=True), "coalesced"),
    "coo claimed coalesced, duplicates": (_coo([[1, 1], [2, 2]], coalesced=True), "coalesced"),
    "csr crow not from 0": (_compressed(_csr_node(), [1, 1, 2], [0, 1]), "crow_indices"),
    "csr crow falling": (_compressed(_csr_node(), [0, 2, 1], [0, 1]), "crow_indices"),
    "csr crow not ending at nnz": (_compressed(_csr_node(), [0, 1, 1], [0, 1]), "crow_indices"),
    "csr crow wrapping around": (_compressed(_csr_node(), [0, 2**63 - 1, 2], [0, 1]),
                                 "crow_indices"),
    "csr crow negative": (_compressed(_csr_node(), [0, -5, 2], [0, 1]), "crow_indices"),
    "csr column out of range": (_compressed(_csr_node(), [0, 1, 2], [0, 3]), "col_indices"),
    "csr column negative": (_compressed(_csr_node(), [0, 1, 2], [0, -1]), "col_indices"),
    "csr int32 column out of range": (_compressed(_csr_node(), [0, 1, 2], [0, 2**31 - 1],
                                                  np.int32), "col_indices"),
    "csr columns unsorted in a row": (_compressed(_csr_node(), [0, 2, 2], [2, 0]), "sorted"),
    "csr column repeated in a row": (_compressed(_csr_node(), [0, 2, 2], [1, 1]), "sorted"),
    "csc row out of range": (_compressed(_csc_node(), [0, 1, 2], [0, 3]), "row_indices"),
    "bsr block column out of range": (_compressed(_bsr_node(), [0, 1], [2]), "col_indices"),
}


@pytest.mark.parametrize("case", list(INVALID_DATA.values()), ids=list(INVALID_DATA))
def test_invalid_sparse_indices_are_refused_when_built(case: Any) -> None:
    (value, parts), reason = case
    with pytest.raises(ProtocolError, match=f"invalid sparse_[a-z]+ tensor: .*{reason}"):
        _built(value, parts)


def test_invalid_sparse_indices_arrive_as_parts_without_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    (value, parts), _ = INVALID_DATA["coo row out of range"]
    monkeypatch.setattr(arrays, "_torch", lambda: None)
    received = _built(value, parts)
    assert received["layout"] == "sparse_coo" and received["indices"].tolist() == [[0, 2], [0, 0]]


@pytest.mark.parametrize("case", ["csr column out of range", "csr columns unsorted in a row"])
def test_invalid_sparse_indices_are_refused_by_the_servers_reader_which_reads_on(
        case: str) -> None:
    """Refused when its frame has been read whole, not stored (it could not be read), and
    the connection goes on: the next frame is stored."""
    (value, parts), _ = INVALID_DATA[case]
    leaves = [["torch", part.dtype.name, list(part.shape), False] for part in parts]
    raw, payload_len = _header(value, leaves)
    payload = b"".join(part.tobytes() for part in parts)
    frame = (wire.encode_prefix(raw, payload_len, 0, 0.0) + raw + payload
             + wire.encode_trailer(False))
    after = frame_bytes(np.float32([1.5]), "after", 1)
    assert [value.tolist() for value in read_like_the_server(frame + after)] == [[1.5]]


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False), st.sampled_from(
    [{"t": SPARSE["coo uncoalesced, duplicates"]}, SPARSE["csr batched"], SPARSE["bsr"],
     {"s": {1, 2j, frozenset({"a"})}, 2: torch.Size([3]), None: complex(_nan(NAN_BITS[1]), 0)}]))
def test_mutated_value_nodes_raise_only_protocol_errors(rng: Any, value: Any) -> None:
    received = _receive(value)
    raw = json.dumps(mutate_header({"name": "m", "value": received.tree, "meta": {},
                                    "leaves": [[*spec[:2], list(spec[2]), spec[3]]
                                               for spec in received.specs]}, rng)).encode()
    try:
        header = wire.decode_header(raw, sum(spec.nbytes for spec in received.specs), LIMITS)
        arrays_ = [ReceiveBuffers(0).array(spec) for spec in header.leaves]
        value_trees.ReceivedValue(header.tree, header.leaves, arrays_).build()
        value_trees.build_value(header.tree, [b""] * len(header.leaves))
    except ProtocolError:
        pass


# -- through the server's own reader ----------------------------------------------------------


def test_new_types_round_trip_through_the_servers_reader() -> None:
    value = {"z": 1j, "s": {1, "a"}, "f": frozenset({2.5}), "shape": torch.Size([4, 4]),
             "t": SPARSE["csr"], "coo": SPARSE["coo uncoalesced, duplicates"]}
    (received,) = read_like_the_server(frame_bytes(value))
    assert _same(received, value)


def test_non_str_keys_and_sets_round_trip_through_the_servers_reader() -> None:
    # The store measures what a capture's header holds: keys of every kind and set items too.
    value = {1: "a", None: {"b", 2.5}, 1.5: frozenset({3j})}
    (received,) = read_like_the_server(frame_bytes(value))
    assert _same(received, value)


@pytest.mark.parametrize("node", [
    {"set": [i * ((1 << 61) - 1) for i in range(2000)]},
    {"dict": [[i * ((1 << 61) - 1), 1] for i in range(2000)]},
    {"list": [{"set": [{"frozenset": [i * ((1 << 61) - 1) for i in range(2000)]}]}]},
])
def test_keys_that_share_one_hash_are_refused_at_once(node) -> None:
    # Ints that differ by multiples of 2**61 - 1 share a hash: a set of thousands of them
    # would take the receiver seconds of the GIL to build, on every connection's thread.
    raw = json.dumps({"name": "x", "value": node, "leaves": [], "meta": {}}).encode()
    started = time.perf_counter()
    with pytest.raises(ProtocolError, match="share one hash"):
        wire.decode_header(raw, 0, wire.Limits())
    assert time.perf_counter() - started < 1


def test_sets_and_int_keyed_dicts_of_ordinary_values_are_fine() -> None:
    node = {"set": list(range(5000))}
    raw = json.dumps({"name": "x", "value": node, "leaves": [], "meta": {}}).encode()
    tree = wire.decode_header(raw, 0, wire.Limits()).tree
    assert value_trees.build_value(tree, []) == set(range(5000))
