"""A capture's value as a tree of JSON nodes, its arrays numbered leaves beside it.

A header carries the tree; the frame's payload carries the leaves' bytes. The
caller's thread takes a value apart (:func:`take_apart`), touching no array
data; the receiver checks every node of a peer's tree (:func:`check_tree`, from
:func:`thing.wire.decode_header`) before anything is built from it; the REPL
builds the value back (:func:`build_value`). A node is a JSON scalar or a
one-key object naming what it holds: ``leaf``, ``list``, ``tuple``, ``dict``,
``set``, ``frozenset``, ``nan``, ``complex``, ``size`` (a ``torch.Size``) or
``sparse``. docs/PROTOCOL.md describes them.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from . import config
from .arrays import (
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
from .errors import ProtocolError, UnsupportedType

# An array's shape, as a capture's tree and a leaf's header give it: at most MAX_NDIM
# extents, each at most MAX_EXTENT.
MAX_NDIM = 64
MAX_EXTENT = 1 << 62
# How deep a capture's containers may nest: deeper is refused when caught, and when received.
MAX_DEPTH = 64

# -- taken apart on the caller's thread -----------------------------------------


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
                              f"{MAX_NDIM} extents from 0 to 2**62")
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


# -- checked when received ------------------------------------------------------


def check_tree(node: Any, specs: tuple[LeafSpec, ...], used: list[bool], depth: int) -> None:
    """Check a peer's tree, node by node, against its header's leaf ``specs`` (marking each
    leaf it uses in ``used``) to at most ``depth`` containers deep; raise
    :class:`ProtocolError` at the first flaw."""
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
            check_tree(item, specs, used, depth - 1)
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
            check_tree(pair[1], specs, used, depth - 1)
    elif tag == "set":
        _check_set(tag, body, depth)
    elif tag in _HASHABLE_TAGS:
        _check_hashable(node, depth)
    elif tag == "size":
        if not _is_shape(body):
            raise ProtocolError(f"size node is not a list of at most {MAX_NDIM} extents")
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
    return isinstance(extents, list) and len(extents) <= MAX_NDIM and all(
        is_int(extent) and 0 <= extent <= MAX_EXTENT for extent in extents)


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
        raise ProtocolError(f"{layout_name} size is not a list of at most {MAX_NDIM} extents")
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


# -- built back in the REPL -----------------------------------------------------


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
