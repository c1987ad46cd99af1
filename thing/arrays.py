"""Array adapters: numpy, torch and jax arrays to and from raw little-endian bytes.

The sending side turns an array into a :class:`Leaf` (what it is, plus a
reference to it) on the caller's thread, and into a flat byte view of its own
memory on the sender thread. The receiving side allocates the destination
array up front from a validated :class:`LeafSpec`, receives straight into it,
and hands the user that same memory as the framework it was sent from.

torch and jax are never imported here: an object can only be a torch tensor if
its sender already imported torch, and the receiving side imports them lazily,
on the REPL's thread, the first time the user asks for a capture of theirs.
Connection threads only ever hold numpy arrays, so a slow or concurrent import
can never stall or break a receive.

A sparse torch tensor is not one leaf but several: its dense parts travel as
leaves (:func:`sparse_parts`) and are put together again, checked first, by
:func:`sparse_tensor`.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import warnings
from typing import Any, NamedTuple

import numpy as np

from ._core import bytes_at
from .errors import InvalidValue, UnsupportedType
from .log import WARNING, LogOnce

# The wire's byte order is little-endian: a tensor's memory is sent as it is only here.
_LITTLE_ENDIAN = sys.byteorder == "little"

# Wire dtype name -> (numpy dtype numpy can hold it in, whether numpy names it natively).
# Dtypes numpy lacks travel in an unsigned carrier of the same width.
_NATIVE = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
_CARRIED = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
CARRIER_DTYPES: dict[str, np.dtype] = {
    **{name: np.dtype(name) for name in _NATIVE},
    **{name: np.dtype(carrier) for name, carrier in _CARRIED.items()},
}
FRAMEWORKS = ("numpy", "torch", "jax")


class LeafSpec(NamedTuple):
    """What one array of a capture is: enough to allocate its destination up front.

    ``catch`` makes one per array with ``_new_spec`` (``tuple.__new__``): the
    named tuple's generated ``__new__`` costs half a microsecond, a tenth of a catch.
    """

    framework: str  # "numpy", "torch", "jax", or "bytes" for a bytes object
    dtype: str  # a key of CARRIER_DTYPES
    shape: tuple[int, ...]
    scalar: bool = False  # a numpy scalar, returned as one rather than as a 0-d array

    @property
    def nbytes(self) -> int:
        count = 1
        for extent in self.shape:
            count *= extent
        return count * CARRIER_DTYPES[self.dtype].itemsize


_new_spec = tuple.__new__


class Leaf:
    """An array caught on the sending side: its spec and the object whose memory will be sent.

    ``source`` starts as the caught object itself; :func:`hold` replaces it with
    a snapshot where one is taken. ``ready`` is a CUDA event the sender thread
    waits for before reading ``source``; ``version`` is torch's in-place
    version counter at the call, for a tensor that is read in place later, and
    ``address`` its data pointer when the sender began to read it.
    """

    __slots__ = ("spec", "source", "nbytes", "ready", "version", "address")

    def __init__(self, spec: LeafSpec, source: Any, nbytes: int):
        self.spec = spec
        self.source = source
        self.nbytes = nbytes
        self.ready: Any = None
        self.version: int | None = None
        self.address: int | None = None


def is_array(obj: Any) -> bool:
    """True for the objects that travel as payload bytes rather than in the header."""
    if isinstance(obj, np.str_):
        return False
    if isinstance(obj, (np.ndarray, np.generic, bytes, bytearray, memoryview)):
        return True
    tensor, jax_array = loaded_type("torch", "Tensor"), loaded_type("jax", "Array")
    return (tensor is not None and isinstance(obj, tensor)) or (
        jax_array is not None and isinstance(obj, jax_array)
    )


def loaded_type(module: str, name: str) -> Any:
    """The type ``module.name`` if someone imported ``module`` (thing imports no framework
    to look), else None. Another thread may be importing it: it is then in sys.modules
    half made, perhaps without that type yet, and nothing is an instance of a type that
    does not exist yet."""
    return getattr(sys.modules.get(module), name, None)


def describe_leaf(obj: Any) -> Leaf | None:
    """Describe an array on the caller's thread: its spec and a reference, no data touched.

    Returns None for objects that are not arrays (they travel in the header).
    Nothing is copied yet: the caller makes sure there is room in the send
    queue and calls :func:`hold` (in that order, unless the capture is only a
    few KiB: see ``Channel._enqueue``).
    """
    if type(obj) is np.ndarray:
        return _numpy_leaf(obj)
    tensor = loaded_type("torch", "Tensor")
    if tensor is not None and isinstance(obj, tensor):
        if obj.layout is not sys.modules["torch"].strided:  # sparse: travels as dense parts
            return None
        spec = _new_spec(LeafSpec, ("torch", _wire_name(obj.dtype), tuple(obj.shape), False))
        return Leaf(spec, obj, obj.nbytes)
    if isinstance(obj, np.str_):  # travels as the str it is
        return None
    if isinstance(obj, np.void) and obj.dtype.names is not None:  # travels as a dict
        return None
    masked = sys.modules.get("numpy.ma")  # loaded by whoever made one
    if masked is not None and isinstance(obj, masked.MaskedArray):
        raise UnsupportedType("cannot send a numpy masked array: its mask would be lost "
                              "(catch its .filled(value), or its .data and .mask)")
    if isinstance(obj, (np.ndarray, np.generic)) and not isinstance(obj, np.bytes_):
        return _numpy_leaf(obj)
    if isinstance(obj, (bytes, bytearray, memoryview)):  # np.bytes_ too: it is a bytes
        view = memoryview(obj)
        if view.c_contiguous:  # else its bytes in order are a copy, which hold() makes
            view = view.cast("B")
        return Leaf(LeafSpec("bytes", "uint8", (view.nbytes,)), view, view.nbytes)
    jax_array = loaded_type("jax", "Array")
    if jax_array is not None and isinstance(obj, jax_array):
        try:
            dtype = np.dtype(obj.dtype)
        except TypeError:  # an extended dtype: a typed PRNG key (key<fry>) has no bytes as such
            raise UnsupportedType(
                f"cannot send a jax array of dtype {obj.dtype}: it has no numpy dtype (for a "
                "typed PRNG key, catch jax.random.key_data(key))") from None
        spec = LeafSpec("jax", _wire_name(dtype), tuple(obj.shape))
        return Leaf(spec, obj, obj.nbytes)
    return None


def is_torch_size(obj: Any) -> bool:
    """True for a ``torch.Size`` (a tuple subclass, which must not travel as a plain tuple)."""
    size = loaded_type("torch", "Size")
    return size is not None and isinstance(obj, size)


def structured_fields(obj: Any) -> list[tuple[str, Any]] | None:
    """The fields of a numpy structured scalar, by name; None for anything else."""
    if isinstance(obj, np.void) and obj.dtype.names is not None:
        return [(name, obj[name]) for name in obj.dtype.names]
    return None


class SparseLayout(NamedTuple):
    """How a sparse torch layout travels: the dense tensors it is made of, and how they fit."""

    parts: tuple[str, ...]  # in the order torch's constructor takes them
    compressed_dim: int | None  # the matrix dim the first part compresses: 0 rows, 1 columns
    blocked: bool = False  # values are blocks, whose shape divides the matrix's


# By the name torch gives the layout (``torch.sparse_csr``); COO compresses nothing.
SPARSE_LAYOUTS: dict[str, SparseLayout] = {
    "sparse_coo": SparseLayout(("indices", "values"), None),
    "sparse_csr": SparseLayout(("crow_indices", "col_indices", "values"), 0),
    "sparse_csc": SparseLayout(("ccol_indices", "row_indices", "values"), 1),
    "sparse_bsr": SparseLayout(("crow_indices", "col_indices", "values"), 0, blocked=True),
    "sparse_bsc": SparseLayout(("ccol_indices", "row_indices", "values"), 1, blocked=True),
}


class SparseParts(NamedTuple):
    """A sparse torch tensor taken apart: its layout's name, size and dense component tensors."""

    layout: str  # a key of SPARSE_LAYOUTS
    size: list[int]
    parts: dict[str, Any]  # by the names of SPARSE_LAYOUTS[layout].parts
    coalesced: bool | None  # COO only: whether torch knows its indices sorted and unique


def sparse_parts(obj: Any) -> SparseParts | None:
    """Take a sparse torch tensor apart without copying; None for anything but a torch tensor.

    A COO tensor's parts are its indices and values as stored, order and
    duplicates included, so an uncoalesced tensor arrives as it was sent.
    Raises :class:`UnsupportedType` for the layouts that cannot travel (mkldnn).
    """
    tensor = loaded_type("torch", "Tensor")
    if tensor is None or not isinstance(obj, tensor):
        return None
    layout = str(obj.layout).rpartition(".")[2]
    if layout not in SPARSE_LAYOUTS:
        raise UnsupportedType(f"cannot send a torch tensor of layout {obj.layout}: "
                              "strided and sparse (COO, CSR, CSC, BSR, BSC) ones travel")
    if layout == "sparse_coo":  # indices() and values() refuse an uncoalesced tensor
        return SparseParts(layout, list(obj.shape),
                           {"indices": obj._indices(), "values": obj._values()},
                           obj.is_coalesced())
    parts = {name: getattr(obj, name)() for name in SPARSE_LAYOUTS[layout].parts}
    return SparseParts(layout, list(obj.shape), parts, None)


def hold(leaf: Leaf, copy: bool | None, snapshot_bytes: int) -> None:
    """Make ``leaf`` keep the value it has now, whatever the caller does to it afterwards.

    ``copy=None`` (the default) snapshots leaves of at most ``snapshot_bytes``
    on this thread; ``True`` snapshots every leaf, ``False`` none. A leaf that
    is not snapshotted is read in place by the sender thread: torch tensors
    then carry their version counter, so a later in-place update is detected.
    CUDA tensors are copied to pinned host memory on their own device's
    stream, which is a snapshot by construction; jax arrays on a device are
    immutable, but may be donated to a step before they are read, unless
    snapshotted on the device; those on the CPU are snapshotted as numpy arrays
    are (one made from another framework's memory by dlpack changes with it).
    """
    source, framework = leaf.source, leaf.spec.framework
    if type(source) is bytes:  # a snapshot already (the compiled gate's: see thing/_core/_gate.pyx)
        return
    snapshot = copy if copy is not None else leaf.nbytes <= snapshot_bytes
    if framework == "numpy":
        if snapshot and isinstance(source, np.ndarray):
            leaf.source = _snapshot_array(source)
    elif framework == "torch":
        _hold_tensor(leaf, source, snapshot)
    elif framework == "bytes":
        # A bytearray or memoryview may change, or grow, after the call, and nothing counts
        # its versions: copied whatever its size, unless copy=False says it will not. A
        # strided view is copied all the same: its bytes lie in order only in a copy.
        if not source.c_contiguous or (copy is not False and not isinstance(source.obj, bytes)):
            leaf.source = memoryview(bytes(source))
    elif not _on_cpu(source):  # jax: start the device-to-host copy now, read it later
        if snapshot:  # donated to the next step, the array itself would be gone by then
            source = leaf.source = source.copy()
        source.copy_to_host_async()
    elif not source.is_ready():
        # Still being computed, and may be donated to the next step: copied by jax, which
        # does not wait for it (waiting here would block the caller); copy=False reads it
        # in place as asked, and a step that donates it first makes it "not sent".
        if copy is not False:
            leaf.source = source.copy()
    elif snapshot:
        # Immutable, unless it shares memory with another framework's array (dlpack), which
        # may change it: snapshotted like any array (a view of it costs jax about 2 us).
        leaf.source = _snapshot_array(np.asarray(source))
    elif len(source.sharding.device_set) == 1:
        # Read in place, it is held as a numpy view: jax does not donate a buffer that numpy
        # holds to the next step (which would delete the array before it is sent). One
        # across devices is gathered by the sender thread: numpy would copy it here.
        leaf.source = np.asarray(source)


def _snapshot_array(array: np.ndarray) -> bytes:
    """The bytes ``array`` sends (C order, little-endian), copied now without releasing the GIL.

    ``np.array(x)`` releases the GIL around larger copies; the sender thread then
    takes it, and the caller waits for it back for far longer than the copy took
    (measured: 28 us instead of 6 us at 64 KiB). ``tobytes`` copies with the GIL held,
    and what it makes is sent as it is.
    """
    return _little_endian(array).tobytes()


def _hold_tensor(leaf: Leaf, tensor: Any, snapshot: bool) -> None:
    try:
        start = _check_memory(tensor, leaf.nbytes)
    except _NoStorage:  # inside a torch.func transform: hold the value it wraps
        value = _value_in_transform(tensor)
        if value is tensor:
            raise
        leaf.source = value
        # Held as outside the transform: inside it, every tensor torch makes (a snapshot's
        # clone, a CUDA tensor's pinned copy) would be wrapped again.
        with sys.modules["torch"]._C._DisableFuncTorch():
            _hold_tensor(leaf, value, snapshot)
        return
    on_cpu = tensor.is_cpu
    if not on_cpu and tensor.is_cuda:
        _copy_to_host(leaf, tensor)
    elif snapshot:
        leaf.source = _snapshot_tensor(tensor, leaf.nbytes, start if on_cpu else None)
    else:
        try:
            leaf.version = tensor._version
        except RuntimeError:  # an inference tensor keeps no version counter: unchecked
            leaf.version = None


def _copy_to_host(leaf: Leaf, tensor: Any) -> None:
    """Start copying a CUDA tensor to pinned host memory; ``leaf.ready`` says when it is."""
    torch = sys.modules["torch"]
    tensor = tensor.detach()  # copy_ from a tensor that requires grad would record a graph
    # The copy runs on the current stream of the tensor's own device, which need not
    # be the current device: the event must be recorded on that same stream.
    stream = torch.cuda.current_stream(tensor.device)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    # Made on another stream, its memory could go back to that stream's pool when the
    # caller lets go of it, and be written there before this copy has read it.
    tensor.record_stream(stream)
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
        leaf.ready = torch.cuda.Event()
        leaf.ready.record(stream)
    leaf.source = host


def _snapshot_tensor(tensor: Any, nbytes: int, start: int | None) -> Any:
    """The bytes a tensor sends, copied now with the GIL held (see _snapshot_array).

    A plain CPU tensor whose elements lie in order from ``start`` in memory
    of its own (see :func:`_check_memory`; None for any other), with no
    conjugate or negative bit still to apply, is copied from there: half the
    time of a numpy view's copy, checks included, in the common case, a loss
    caught right after a training step. Anything else goes through a numpy
    view; a tensor numpy cannot view is cloned by torch.
    """
    torch = sys.modules["torch"]
    kind = type(tensor)
    if (start is not None and _LITTLE_ENDIAN
            and (kind is torch.Tensor or kind is torch.nn.Parameter)
            and not tensor.is_conj() and not tensor.is_neg()):
        return bytes_at(start, nbytes)
    # .data, not .detach(): torch may release the GIL in detach(), never in .data.
    try:
        return _snapshot_array(tensor.data.numpy())
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), a conjugate view
        return tensor.detach().clone(memory_format=torch.contiguous_format)


class _NoStorage(UnsupportedType):
    """A tensor with no storage to read: inside a torch.func transform, perhaps."""


def _value_in_transform(tensor: Any) -> Any:
    """What a tensor inside ``torch.func.grad``, ``jvp`` and the like stands for: the tensor
    each level of the transform wraps to track derivatives. Inside ``vmap`` it stands for
    one example of a batch it does not hold apart: refused. Anything else is returned as
    it is (and refused by its storage)."""
    functorch = getattr(sys.modules["torch"]._C, "_functorch", None)
    while functorch is not None and functorch.is_functorch_wrapped_tensor(tensor):
        if functorch.is_batchedtensor(tensor):
            raise UnsupportedType("cannot send a tensor inside torch.vmap: it stands for one "
                                  "example of a batch it does not hold apart (catch the "
                                  "batch outside the vmap)")
        tensor = functorch.get_unwrapped(tensor)
    return tensor


def _check_memory(tensor: Any, nbytes: int) -> int | None:
    """The address of a tensor's first element if its elements lie in memory of its own,
    in order from there (None for a strided one, or one that only torch can read);
    raises :class:`UnsupportedType` if that memory is gone, or if the tensor has none to
    read. The address is where the data lies on the tensor's own device.

    FSDP frees a parameter's memory between uses by resizing its storage to
    nothing, and leaves the tensor as it was: reading it then, even with
    torch's own ``clone()``, crashes the process (torch's version counter does
    not move). Checked at the call, and again by the sender thread before it
    reads a tensor in place; memory freed while it is being sent is not
    caught, which ``copy=True`` avoids.
    """
    torch = sys.modules["torch"]
    try:
        storage = tensor.untyped_storage()
        # A fake tensor (torch.compile's tracing) has no data, and warns when asked where it
        # lies: its storage is on the meta device. (Asked of a subclass only: two attributes
        # more cost a plain tensor's catch right after a step microseconds.)
        fake = (type(tensor) not in (torch.Tensor, torch.nn.Parameter)
                and storage.device.type == "meta")
        base = 0 if fake else storage.data_ptr()
    except (NotImplementedError, TypeError):  # a wrapper of torch.func's grad, jvp or vmap
        raise _NoStorage("cannot send a tensor that has no storage of its own to read") from None
    except RuntimeError:
        if tensor._is_zerotensor():  # no memory at all: its elements are zeros
            return None
        raise UnsupportedType(  # a wrapper, or a functional tensor: no data where it points
            "cannot send a tensor that has no data of its own (a wrapper subclass such as "
            "DTensor, or a tensor traced by torch.func.functionalize or torch.compile): "
            "catch a plain tensor (a DTensor's full_tensor() or to_local())") from None
    if not base and (fake or storage.device.type == "meta"):
        raise UnsupportedType("cannot send a tensor that has no data: one on the meta device, "
                              "or a fake tensor (torch.compile's tracing)")
    if tensor.is_contiguous():
        start = tensor.storage_offset() * tensor.element_size()
        end = start + nbytes
    else:
        start = None
        last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        end = (tensor.storage_offset() + last + 1) * tensor.element_size()
    if nbytes:
        available = storage.nbytes()
        if end > available:
            raise UnsupportedType(
                f"cannot send this tensor: its memory is gone ({available} bytes left of the "
                f"{end} it reads; FSDP frees parameters' memory between uses). "
                "Catch it while it is in use, with copy=True")
    return None if start is None else base + start


def _on_cpu(array: Any) -> bool:
    return all(device.platform == "cpu" for device in array.devices())


# dtype object (numpy's or torch's) -> wire name; filled as dtypes are first seen,
# because computing a numpy dtype's name costs a microsecond on every catch.
_wire_names: dict[Any, str] = {}


def _wire_name(dtype: Any) -> str:
    name = _wire_names.get(dtype)
    if name is None:
        name = dtype.name if isinstance(dtype, np.dtype) else str(dtype).rpartition(".")[2]
        if name not in CARRIER_DTYPES:
            raise UnsupportedType(f"dtype {dtype} is not supported")
        _wire_names[dtype] = name
    return name


def _numpy_leaf(array: np.ndarray | np.generic) -> Leaf:
    scalar = isinstance(array, np.generic)
    spec = _new_spec(LeafSpec, ("numpy", _wire_name(array.dtype), array.shape, scalar))
    return Leaf(spec, array, array.nbytes)


def leaf_bytes(leaf: Leaf) -> bytes | np.ndarray:
    """The leaf's bytes as they travel: a snapshot as it is (see :func:`hold`), else a flat
    uint8 view of its memory, made contiguous and little-endian if it was not.

    Runs on the sender thread: any copy it has to make is paid there, not by the caller.
    """
    source = leaf.source
    if type(source) is bytes:  # a snapshot: ready to send
        return source
    if leaf.ready is not None:
        leaf.ready.synchronize()
    framework = leaf.spec.framework
    if isinstance(source, (np.ndarray, np.generic)):
        pass
    elif framework == "torch":
        # Its shape first: one given other memory since the call (set_, .data =) has another
        # shape, and is told so, not that its memory is gone.
        if tuple(source.shape) != leaf.spec.shape:
            raise ValueError(_resized(leaf, f"its shape is {tuple(source.shape)} now"))
        _check_memory(source, leaf.nbytes)  # freed since the call? (read in place)
        leaf.address = source.data_ptr()
        source = source.detach().resolve_conj().resolve_neg().contiguous()
        if source.device.type != "cpu":
            source = source.cpu()
        carrier = CARRIER_DTYPES[leaf.spec.dtype]
        source = source.view(_torch_dtype(_torch(), carrier.name)).numpy()
    elif framework != "bytes":  # jax
        source = np.asarray(source)
    data = (np.frombuffer(source, np.uint8) if framework == "bytes" else
            _little_endian(np.ascontiguousarray(source)).reshape(-1).view(np.uint8))
    # The header, written at the call, says how many bytes follow: any other number would
    # put the stream out of step, and the rest of the data read as the next frames.
    if data.nbytes != leaf.nbytes:
        raise ValueError(_resized(leaf, f"{data.nbytes} bytes now"))
    return data


def _resized(leaf: Leaf, now: str) -> str:
    return (f"it changed size after catch() (resize_, set_ or .data = on a tensor read in "
            f"place): {leaf.spec.shape}, {leaf.nbytes} bytes, at the call; {now}")


def _little_endian(array: np.ndarray) -> np.ndarray:
    """``array``, or a copy of it in little-endian byte order (the wire's) if it is not."""
    byteorder = array.dtype.byteorder
    if byteorder == ">" or (byteorder == "=" and sys.byteorder == "big"):
        return array.astype(array.dtype.newbyteorder("<"))
    return array


def torn(leaf: Leaf) -> bool:
    """True if a torch tensor read in place was modified after it was caught, or its memory
    moved while it was read.

    The version counter only grows, so one look once the bytes are sent
    covers every in-place operation that ended between the call and the end of
    the send. Torch counts an operation when it ends: one still running then is
    not seen (the README says so, and that ``copy=True`` is the way out).
    ``share_memory_()`` counts no version: it copies the storage into shared
    memory and frees the memory being read. A DataLoader worker's queue does
    that to a sample it returns (``batch_size=None``, or a ``collate_fn`` that
    keeps samples as they are), and so does ``multiprocessing.Queue.put``.
    """
    source = leaf.source
    return (leaf.version is not None and source._version != leaf.version) or (
        leaf.address is not None and source.data_ptr() != leaf.address)


def finish(spec: LeafSpec, received: np.ndarray) -> Any:
    """Turn received memory into the object the user gets, without copying array data."""
    if spec.framework == "bytes":
        return received.tobytes()
    if spec.framework == "torch":
        torch = _torch()
        if torch is not None:
            if received.ctypes.data % received.itemsize:
                # torch takes its elements to lie at multiples of their size, complex128's
                # at 16 bytes, and crashes the process where they do not: a recording
                # aligns arrays to 8 bytes at most. A copy is aligned (and the value's own:
                # a change to it in place does not reach what save() writes).
                received = received.copy()
            return torch.from_numpy(received).view(_torch_dtype(torch, spec.dtype))
    array = _as_numpy_dtype(spec.dtype, received)
    if spec.framework == "jax":
        return _to_jax(array)
    if spec.scalar:
        return array[()]
    return array


def sparse_tensor(sent: SparseParts) -> Any:
    """A peer's sparse tensor, rebuilt from its parts (torch tensors); None without torch.

    The header's validation checked the parts' shapes and dtypes against the
    size; their indices are checked here with numpy before torch sees them,
    and torch checks its own invariants too. Raises :class:`ProtocolError`
    for a tensor torch would not have made.
    """
    torch = _torch()
    if torch is None:
        return None
    check_sparse_indices(sent)
    layout = SPARSE_LAYOUTS[sent.layout]
    tensors = [sent.parts[name] for name in layout.parts]
    if layout.compressed_dim is None:
        construct, options = torch.sparse_coo_tensor, {"is_coalesced": sent.coalesced}
    else:
        construct = torch.sparse_compressed_tensor
        options = {"layout": getattr(torch, sent.layout)}
    try:
        with warnings.catch_warnings():  # torch's "in beta" notice is not the user's business
            warnings.filterwarnings("ignore", "Sparse .* support is in beta")
            return construct(*tensors, sent.size, check_invariants=True, **options)
    except (RuntimeError, ValueError, IndexError) as exc:  # what torch's own checks raise
        reason = str(exc).splitlines()[0]
        raise InvalidValue(f"the peer sent an invalid {sent.layout} tensor: {reason}") from None


def check_sparse_indices(sent: SparseParts) -> None:
    """Raise :class:`InvalidValue` unless a peer's sparse tensor's indices are what torch
    would build: within its size, and sorted as its layout requires.

    The parts may be numpy arrays (the receiver checks them as they arrive, so
    a bad tensor is refused, not stored) or CPU torch tensors.
    """
    layout = SPARSE_LAYOUTS[sent.layout]
    if layout.compressed_dim is None:
        indices = np.asarray(sent.parts["indices"])
        _check_coo_indices(indices, sent.size)
        if sent.coalesced:
            _check_coalesced(indices)
    else:
        compressed, plain = (np.asarray(sent.parts[name]) for name in layout.parts[:2])
        _check_compressed_indices(sent, layout, compressed, plain)


def _check_coo_indices(indices: np.ndarray, size: list[int]) -> None:
    if not indices.size:
        return
    lowest, highest = indices.min(axis=1), indices.max(axis=1)
    outside = np.flatnonzero((lowest < 0) | (highest >= np.array(size[: len(lowest)], np.int64)))
    if outside.size:
        dim = outside[0]
        raise InvalidValue(
            f"the peer sent an invalid sparse_coo tensor: its indices of dim {dim} run from "
            f"{lowest[dim]} to {highest[dim]}, outside its size {size[dim]}")


def _check_coalesced(indices: np.ndarray) -> None:
    """A COO tensor said to be coalesced: each index after the one before, none twice, as
    torch requires of one (it would not build it, and the capture could not be read)."""
    if indices.shape[1] < 2:
        return
    steps = np.diff(indices, axis=1)  # indices are within its size (checked): no overflow
    first = np.argmax(steps != 0, axis=0)  # the dim where each index differs from the last
    if not (steps[first, np.arange(steps.shape[1])] > 0).all():
        raise InvalidValue("the peer sent an invalid sparse_coo tensor: it says it is "
                            "coalesced, but its indices repeat or are out of order (torch "
                            "refuses it; coalesce() it)")


def _check_compressed_indices(sent: SparseParts, layout: SparseLayout, compressed: np.ndarray,
                              plain: np.ndarray) -> None:
    nbatch = compressed.ndim - 1
    nnz = plain.shape[-1]
    values = sent.parts["values"]
    block = tuple(values.shape[nbatch + 1 : nbatch + 3]) if layout.blocked else (1, 1)
    plain_dim = 1 - layout.compressed_dim
    plain_extent = sent.size[nbatch + plain_dim] // block[plain_dim]
    compressed_name, plain_name = layout.parts[:2]
    # Bounded first, so that the differences below cannot overflow and wrap around.
    if compressed.size and (
            compressed.min() < 0 or compressed.max() > nnz or (compressed[..., 0] != 0).any()
            or (compressed[..., -1] != nnz).any() or (np.diff(compressed) < 0).any()):
        raise InvalidValue(f"the peer sent an invalid {sent.layout} tensor: its "
                            f"{compressed_name} do not rise from 0 to its {nnz} elements")
    if plain.size and (plain.min() < 0 or plain.max() >= plain_extent):
        raise InvalidValue(f"the peer sent an invalid {sent.layout} tensor: its {plain_name} "
                            f"run from {plain.min()} to {plain.max()}, not below {plain_extent}")
    if nnz > 1 and not _sorted_within_rows(compressed.reshape(-1, compressed.shape[-1]),
                                           plain.reshape(-1, nnz)):
        raise InvalidValue(f"the peer sent an invalid {sent.layout} tensor: its {plain_name} "
                            f"are not sorted and distinct within each "
                            f"{('row', 'column')[layout.compressed_dim]} "
                            "(torch refuses it; rebuild it, e.g. through to_dense())")


def _sorted_within_rows(compressed: np.ndarray, plain: np.ndarray) -> bool:
    """Whether, in each batch, the plain indices rise within each compressed row (a new row
    may start anywhere): what torch checks of a compressed tensor."""
    rises = np.diff(plain, axis=1) > 0  # (batches, nnz - 1): element k to element k + 1
    starts = compressed[:, 1:-1]  # where rows 1 .. n-1 start: k + 1 for the step from k
    batch = np.broadcast_to(np.arange(len(starts))[:, None], starts.shape)
    inside = (starts > 0) & (starts < plain.shape[1])
    rises[batch[inside], starts[inside] - 1] = True  # a step into a new row may fall
    return bool(rises.all())


def torch_size(extents: list[int]) -> Any:
    """``torch.Size(extents)``, or a tuple of them where torch is not installed."""
    torch = _torch()
    return tuple(extents) if torch is None else torch.Size(extents)


def _torch() -> Any:
    return _optional("torch")


def _torch_dtype(torch: Any, name: str) -> Any:
    return getattr(torch, name)


def _as_numpy_dtype(name: str, received: np.ndarray) -> np.ndarray:
    if name in _NATIVE:
        return received
    ml_dtypes = _optional("ml_dtypes")
    if ml_dtypes is not None:
        return received.view(getattr(ml_dtypes, name))
    _warn_once(
        name, WARNING,
        f"received {name} data but neither torch nor ml_dtypes is installed here; "
        f"it is kept as raw {received.dtype} bits (describe() shows the real dtype)",
    )
    return received


def _to_jax(array: np.ndarray) -> Any:
    jax = _optional("jax")
    if jax is None:
        _warn_once(
            "jax", WARNING,
            "received jax arrays but jax is not installed here; they are numpy arrays",
        )
        return array
    if jax.dtypes.canonicalize_dtype(array.dtype) != array.dtype:
        # Without jax_enable_x64, jax would narrow 64-bit data (float64 -> float32) in silence.
        _warn_once(
            f"jax-{array.dtype}", WARNING,
            f"received jax {array.dtype} data but jax_enable_x64 is off here; "
            "it is kept as a numpy array so that it is not narrowed",
        )
        return array
    return jax.numpy.asarray(array)


_warn_once = LogOnce()


def _optional(module: str) -> Any:
    # Always through the import system, never a peek at sys.modules: a module another
    # thread is still importing is in sys.modules half-initialised, and import waits for it.
    if module in _missing:
        return None
    if module not in sys.modules and threading.current_thread() is threading.main_thread():
        _import_apart(module)
    try:
        return importlib.import_module(module)
    except ImportError:
        _missing.add(module)
        return None


def _import_apart(module: str) -> None:
    """Import ``module`` on a thread of its own and wait for it: Ctrl+C in the REPL (the main
    thread; thing.status() invites it, and its first frame may build the first torch value)
    then ends the wait, not the import. torch stopped halfway stays broken for the session
    ("Only a single TORCH_LIBRARY can be used to register the namespace prims")."""

    def run() -> None:
        with contextlib.suppress(BaseException):  # ImportError: the caller's import says so
            importlib.import_module(module)

    importing = threading.Thread(target=run, name=f"thing-import-{module}", daemon=True)
    importing.start()
    importing.join()


_missing: set[str] = set()
