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
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, NamedTuple

import numpy as np

from .errors import UnsupportedType

log = logging.getLogger("thing")

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
    """What one array of a capture is: enough to allocate its destination up front."""

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


class Leaf:
    """An array caught on the sending side: its spec and the object whose memory will be sent.

    ``source`` starts as the caught object itself; :func:`hold` replaces it with
    a snapshot where one is taken. ``ready`` is a CUDA event the sender thread
    waits for before reading ``source``; ``version`` is torch's in-place
    version counter at the call, for a tensor that is read in place later.
    """

    __slots__ = ("spec", "source", "nbytes", "ready", "version")

    def __init__(self, spec: LeafSpec, source: Any, nbytes: int):
        self.spec = spec
        self.source = source
        self.nbytes = nbytes
        self.ready: Any = None
        self.version: int | None = None


def is_array(obj: Any) -> bool:
    """True for the objects that travel as payload bytes rather than in the header."""
    if isinstance(obj, np.str_):
        return False
    if isinstance(obj, (np.ndarray, np.generic, bytes, bytearray, memoryview)):
        return True
    torch, jax = sys.modules.get("torch"), sys.modules.get("jax")
    return (torch is not None and isinstance(obj, torch.Tensor)) or (
        jax is not None and isinstance(obj, jax.Array)
    )


def describe_leaf(obj: Any) -> Leaf | None:
    """Describe an array on the caller's thread: its spec and a reference, no data touched.

    Returns None for objects that are not arrays (they travel in the header).
    Nothing is copied yet: the caller first makes sure there is room in the
    send queue, then calls :func:`hold`.
    """
    if type(obj) is np.ndarray:
        return _numpy_leaf(obj)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        spec = LeafSpec("torch", _wire_name(obj.dtype), tuple(obj.shape))
        return Leaf(spec, obj, obj.nbytes)
    if isinstance(obj, np.str_):  # travels as the str it is
        return None
    if isinstance(obj, (np.ndarray, np.generic)):
        return _numpy_leaf(obj)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        view = memoryview(obj).cast("B")
        return Leaf(LeafSpec("bytes", "uint8", (view.nbytes,)), view, view.nbytes)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(obj, jax.Array):
        spec = LeafSpec("jax", _wire_name(np.dtype(obj.dtype)), tuple(obj.shape))
        return Leaf(spec, obj, obj.nbytes)
    return None


def hold(leaf: Leaf, copy: bool | None, snapshot_bytes: int) -> None:
    """Make ``leaf`` keep the value it has now, whatever the caller does to it afterwards.

    ``copy=None`` (the default) snapshots leaves of at most ``snapshot_bytes``
    on this thread; ``True`` snapshots every leaf, ``False`` none. A leaf that
    is not snapshotted is read in place by the sender thread: torch tensors
    then carry their version counter, so a later in-place update is detected.
    CUDA tensors are copied to pinned host memory on their own device's
    stream, which is a snapshot by construction; jax arrays are immutable.
    """
    source, framework = leaf.source, leaf.spec.framework
    snapshot = copy if copy is not None else leaf.nbytes <= snapshot_bytes
    if framework == "numpy":
        if snapshot and isinstance(source, np.ndarray):
            leaf.source = _snapshot_array(source)
    elif framework == "torch":
        _hold_tensor(leaf, source, snapshot)
    elif framework == "bytes":
        if snapshot and not isinstance(source.obj, bytes):
            leaf.source = memoryview(bytes(source))
    elif not _on_cpu(source):  # jax: start the device-to-host copy now, read it later
        source.copy_to_host_async()


def _snapshot_array(array: np.ndarray) -> np.ndarray:
    """A C-ordered copy of ``array``, made without releasing the GIL.

    ``np.array(x)`` releases the GIL around larger copies; the sender thread then
    takes it, and the caller waits for it back for far longer than the copy took
    (measured: 28 us instead of 6 us at 64 KiB). ``tobytes`` copies with the GIL held.
    """
    return np.frombuffer(array.tobytes(), array.dtype).reshape(array.shape)


def _hold_tensor(leaf: Leaf, tensor: Any, snapshot: bool) -> None:
    if tensor.is_cuda:
        torch = sys.modules["torch"]
        tensor = tensor.detach()  # copy_ from a tensor that requires grad would record a graph
        # The copy runs on the current stream of the tensor's own device, which need not
        # be the current device: the event must be recorded on that same stream.
        stream = torch.cuda.current_stream(tensor.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            leaf.ready = torch.cuda.Event()
            leaf.ready.record(stream)
        leaf.source = host
    elif snapshot:
        # A numpy view of the tensor, copied with the GIL held (see _snapshot_array);
        # .data, not .detach(): torch may release the GIL in detach(), never in .data.
        try:
            leaf.source = _snapshot_array(tensor.data.numpy())
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), a conjugate view
            leaf.source = tensor.detach().clone(
                memory_format=sys.modules["torch"].contiguous_format)
    else:
        try:
            leaf.version = tensor._version
        except RuntimeError:  # an inference tensor keeps no version counter: unchecked
            leaf.version = None


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
    spec = LeafSpec("numpy", _wire_name(array.dtype), array.shape, scalar)
    return Leaf(spec, array, array.nbytes)


def leaf_bytes(leaf: Leaf) -> np.ndarray:
    """A flat uint8 view of the leaf's memory, made contiguous and little-endian if it was not.

    Runs on the sender thread: any copy it has to make is paid there, not by the caller.
    """
    if leaf.ready is not None:
        leaf.ready.synchronize()
    source = leaf.source
    framework = leaf.spec.framework
    if isinstance(source, (np.ndarray, np.generic)):  # numpy, or a torch tensor's snapshot
        pass
    elif framework == "torch":
        source = source.detach().resolve_conj().resolve_neg().contiguous()
        if source.device.type != "cpu":
            source = source.cpu()
        carrier = CARRIER_DTYPES[leaf.spec.dtype]
        source = source.view(_torch_dtype(_torch(), carrier.name)).numpy()
    elif framework == "bytes":
        return np.frombuffer(source, np.uint8)
    else:  # jax
        source = np.asarray(source)
    array = np.ascontiguousarray(source)
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.reshape(-1).view(np.uint8)


def torn(leaf: Leaf) -> bool:
    """True if a torch tensor read in place was modified after it was caught.

    The version counter only grows, so one look once the bytes are sent
    covers the whole time from the call to the end of the send.
    """
    return leaf.version is not None and leaf.source._version != leaf.version


def finish(spec: LeafSpec, received: np.ndarray) -> Any:
    """Turn received memory into the object the user gets, without copying array data."""
    if spec.framework == "bytes":
        return received.tobytes()
    if spec.framework == "torch":
        torch = _torch()
        if torch is not None:
            return torch.from_numpy(received).view(_torch_dtype(torch, spec.dtype))
    array = _as_numpy_dtype(spec.dtype, received)
    if spec.framework == "jax":
        return _to_jax(array)
    if spec.scalar:
        return array[()]
    return array


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
        name,
        f"received {name} data but neither torch nor ml_dtypes is installed here; "
        f"it is kept as raw {received.dtype} bits (describe() shows the real dtype)",
    )
    return received


def _to_jax(array: np.ndarray) -> Any:
    jax = _optional("jax")
    if jax is None:
        _warn_once(
            "jax", "received jax arrays but jax is not installed here; they are numpy arrays"
        )
        return array
    if jax.dtypes.canonicalize_dtype(array.dtype) != array.dtype:
        # Without jax_enable_x64, jax would narrow 64-bit data (float64 -> float32) in silence.
        _warn_once(
            f"jax-{array.dtype}",
            f"received jax {array.dtype} data but jax_enable_x64 is off here; "
            "it is kept as a numpy array so that it is not narrowed",
        )
        return array
    return jax.numpy.asarray(array)


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _optional(module: str) -> Any:
    # Always through the import system, never a peek at sys.modules: a module another
    # thread is still importing is in sys.modules half-initialised, and import waits for it.
    if module in _missing:
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        _missing.add(module)
        return None


_missing: set[str] = set()
