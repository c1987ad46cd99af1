"""One file of a recording: captures in a safetensors file, thing's metadata in its header.

The layout is in ``docs/FORMAT.md``. Arrays are the file's tensors, each in
the dtype it was caught in (bf16 as ``BF16``, so torch and the ``safetensors``
package read it as such); everything else about a capture (its name, the
nesting of its containers, numbers and strings, its sender) is in the file's
``__metadata__``, per capture as the very header its frame carried.

Writing goes through the ``safetensors`` package, which writes straight from
the arrays' memory. Reading does not: :func:`read_segment` is thing's own
reader, because a file is untrusted bytes like a frame. It checks every
length against the file before using it, validates each capture's header with
the function that validates frames (:func:`thing.wire.decode_header`), and
maps the file instead of reading it, so opening a large recording costs
memory only for the arrays one looks at; a file another user may change is
read into memory instead.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import struct
import sys
import zlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np

from . import config, shm, value_trees, wire
from ._core import map_file
from .arrays import CARRIER_DTYPES, LeafSpec
from .captures import Capture, Sender
from .errors import BadRecording, ProtocolError
from .known_headers import KnownHeader
from .log import log
from .run_names import MAX_RUN_NAME
from .sockets import mine_alone

FORMAT = "thing-history"
FORMAT_VERSION = 1
# Where a segment is written before it takes its name: a folder of the recording's own, so
# that whatever a crash leaves there (the safetensors package writes a temporary file of its
# own first) is deleted by the next writer, whatever it is called.
STAGING = ".thing-staging"
# The largest header a reader takes: safetensors' own limit; and what its JSON may cost
# once parsed (wire.parsed_cost), beyond which it is refused unparsed.
MAX_FILE_HEADER = 100_000_000
MAX_FILE_COST = 4 * MAX_FILE_HEADER
# What a writer puts in one segment's header at most, far below what a reader takes: a
# segment of captures with large header-borne values (long lists, dicts) holds fewer.
MAX_WRITTEN_HEADER = 16 << 20
MAX_WRITTEN_COST = 64 << 20

# Wire dtype -> the safetensors dtype that holds it. complex128 has none: it is kept as
# float64 pairs (a last axis of 2: real, imaginary), as numpy lays it out.
SAFETENSORS_DTYPES = {
    "bool": "BOOL", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float16": "F16", "float32": "F32", "float64": "F64", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "complex64": "C64", "complex128": "F64",
}
_ITEMSIZE = {"BOOL": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "U8": 1, "U16": 2, "U32": 4,
             "U64": 8, "F16": 2, "F32": 4, "F64": 8, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
             "C64": 8}
# What the package calls them when it writes (numpy's names, and torch's for the rest).
_PACKAGE_DTYPES = {wire_name: ("float64" if wire_name == "complex128" else wire_name)
                   for wire_name in SAFETENSORS_DTYPES}
_RECORD_KEYS = {"header", "sender", "received_at", "caught_at", "consistent", "call", "step"}


class LoadedCapture(NamedTuple):
    """A capture read back from a segment, checked, ready for :meth:`HistoryStore.restore`."""

    capture: Capture
    charge: int  # what the store holds for it: its record, and its arrays if copied out


class Segment(NamedTuple):
    captures: list[LoadedCapture]
    dropped: dict[str, int]  # what the recorder could not write before this segment, by reason


def tensor_shape(spec: LeafSpec) -> tuple[int, ...]:
    """The shape a leaf has in a segment's tensor table."""
    return (*spec.shape, 2) if spec.dtype == "complex128" else spec.shape


# -- writing ------------------------------------------------------------------------


def write_segment(path: Path, captures: Sequence[Capture],
                  dropped: dict[str, int] | None = None) -> int:
    """Write the first of ``captures`` (all, unless their records would make a header
    larger than a segment's) to ``path``, all or nothing; return how many were written.

    The file is written under a temporary name, flushed to disk, then renamed,
    and the directory flushed too: a crash at any moment leaves either no file
    or the whole file. Raises ``OSError`` (the temporary file removed) when the
    disk is full or the write fails.
    """
    temporary, written = write_unflushed(path, captures, dropped)
    commit(temporary, path)
    return written


def write_unflushed(path: Path, captures: Sequence[Capture],
                    dropped: dict[str, int] | None = None) -> tuple[Path, int]:
    """The first half of :func:`write_segment`: write the file under its temporary name,
    not yet flushed; return that name and how many captures it holds (:func:`commit`
    does the rest)."""
    serialize_file, tensor_spec = _safetensors_writer()
    tensors: dict[str, Any] = {}
    alive: list[np.ndarray] = []  # the package reads raw pointers: keep their arrays alive
    records: list[str] = []
    header_bytes = header_cost = 0
    for index, capture in enumerate(captures):
        parts = capture.parts()
        record = _record_of(capture, parts)
        # The tensor table's entries cost about as much again as each leaf's in the record.
        record_bytes = len(record) + 100 * len(parts.specs)
        record_cost = wire.parsed_cost(record.encode()) + 500 * len(parts.specs)
        if records and (header_bytes + record_bytes > MAX_WRITTEN_HEADER
                        or header_cost + record_cost > MAX_WRITTEN_COST):
            break  # the rest go into the next segment
        header_bytes += record_bytes
        header_cost += record_cost
        records.append(record)
        for leaf, (spec, array) in enumerate(zip(parts.specs, parts.arrays)):
            array = np.ascontiguousarray(array)
            alive.append(array)
            tensors[f"{index}.{leaf}"] = tensor_spec(
                dtype=_PACKAGE_DTYPES[spec.dtype], shape=tensor_shape(spec),
                data_ptr=array.ctypes.data, data_len=array.nbytes)
    metadata = {"format": FORMAT, "version": str(FORMAT_VERSION),
                "captures": "[" + ",".join(records) + "]",
                "dropped": json.dumps(dropped or {})}
    metadata["checksum"] = records_checksum(metadata)
    temporary = staging_directory(path.parent) / path.name
    try:
        serialize_file(tensors, str(temporary), metadata=metadata)
    except BaseException as exc:
        _remove_quietly(temporary)
        if isinstance(exc, Exception) and not isinstance(exc, OSError):
            # The package reports a full disk as its own error; keep the errno if it gave one.
            raise OSError(_errno_in(str(exc)), f"writing {path} failed: {exc}") from exc
        raise
    return temporary, len(records)


def staging_directory(directory: Path) -> Path:
    """``directory``'s staging folder, made if missing. ``OSError`` if it is anything but
    a real directory of this user: a link there (a recording unpacked from someone's
    archive) would have files written, and a crashed writer's cleared, where it points."""
    staging = directory / STAGING
    with contextlib.suppress(FileExistsError):
        staging.mkdir()
    info = staging.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise OSError(errno.EEXIST, f"{staging} is not a directory of this user's own (a "
                      "link?); remove it to write a recording there")
    return staging


def clear_staging(directory: Path) -> int:
    """Delete what a crashed writer left in ``directory``'s staging folder (the caller holds
    the directory's writer lock: no live writer's files are there); return how many files."""
    removed = 0
    for entry in list(os.scandir(staging_directory(directory))):
        if not entry.is_dir(follow_symlinks=False):
            _remove_quietly(Path(entry.path))
            removed += 1
    return removed


def _record_of(capture: Capture, parts: value_trees.ReceivedValue) -> str:
    """A capture's record in a segment's metadata, as JSON (see docs/FORMAT.md)."""
    sender = capture.sender
    meta: dict[str, Any] = {}
    if capture.call_site is not None:
        meta["site"] = capture.call_site
    if sender.rank is not None or sender.world_size is not None:
        meta["rank"], meta["world_size"] = sender.rank, sender.world_size
    if capture.requested:
        meta["requested"] = True
    return json.dumps({
        "header": wire.describe_capture(capture.name, parts.tree, parts.specs, meta).decode(),
        "sender": [sender.address, sender.hostname, sender.pid, sender.run],
        "received_at": capture.received_at,
        "caught_at": capture.caught_at,
        "consistent": capture.consistent,
        "call": capture.call,
        "step": capture.given_step,
    }, separators=(",", ":"))


def commit(temporary: Path, path: Path) -> int:
    """Flush a segment written by :func:`write_unflushed` and give it its name; return its
    size. Raises ``OSError`` (the temporary file removed) if flushing fails."""
    try:
        flush_to_disk(temporary)
        os.replace(temporary, path)
    except BaseException:
        _remove_quietly(temporary)
        raise
    flush_names(path.parent)
    return os.stat(path).st_size


def _safetensors_writer() -> tuple[Any, Any]:
    try:
        from safetensors import TensorSpec, serialize_file
    except ImportError:
        raise ImportError("saving captures needs the safetensors package (0.8 or later): "
                          "pip install 'safetensors>=0.8' (thing's save extra)") from None
    return serialize_file, TensorSpec


def flush_names(directory: Path) -> None:
    """fsync a directory, so that the names in it last a machine's crash. A failure is
    logged, not raised: the files are whole and named, only their names may not last it
    (and some file systems refuse to flush a directory: EINVAL)."""
    try:
        flush_to_disk(directory)
    except OSError as exc:
        log.warning("could not flush the directory %s: %s", directory, exc)


def flush_to_disk(path: Path) -> None:
    """fsync a file or directory (a directory: the names in it)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _errno_in(message: str) -> int:
    """The errno of the OS error a message from the package quotes ("(os error 28)"), else
    EIO: the package wraps the OS's errors in its own."""
    found = re.search(r"\(os error (\d+)\)", message)
    return int(found.group(1)) if found else errno.EIO


# -- reading ------------------------------------------------------------------------


MAX_KNOWN_HEADERS = 4096
# A segment whose arrays take less than this is copied out of its file, not mapped: each
# mapping takes one of the process's limited map entries (often 65,530), and a slow job
# records a segment of one small capture every 10 s, 60,000 in a week.
MAX_COPIED_BYTES = 1 << 20


def _map_entries() -> int:
    """The map entries a process may hold (``vm.max_map_count``; Linux's default where the
    system does not say)."""
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 65530


# The recording files this process keeps mapped, for all its loads together: a quarter of
# its map entries (16,382 files by default), the rest left to the process itself.
MAPPED_SEGMENTS = shm.Mappings(_map_entries() // 4)


class KnownHeaders:
    """What one load validated already, for the segments after it: capture headers, by
    their text and sender (a recording of a training loop repeats a few thousands of
    times, as a connection does: see receiver.py), and each sender once (a scalar's header
    holds its value, so is seldom seen twice: each capture had a sender of its own, and
    100,000 of them held 40% more than the store charged)."""

    def __init__(self) -> None:
        self.headers: dict[tuple[str, str, str, int, Optional[str]], KnownHeader] = {}
        self.senders: dict[tuple[str, str, int, Optional[str]], Sender] = {}

    def sender(self, address: str, hostname: str, pid: int, run: Optional[str]) -> Sender:
        if len(self.senders) >= MAX_KNOWN_HEADERS:
            self.senders.clear()
        return self.senders.setdefault((address, hostname, pid, run),
                                       Sender(address, hostname, pid, run=run))


def read_segment(path: Path, known_headers: KnownHeaders | None = None,
                 keep: bool = True) -> Segment:
    """Read and check a whole segment; raise :class:`BadRecording` if anything is wrong.

    Nothing in the file is executed or trusted: every offset is checked against
    the file's size, every capture's header is validated as a frame's is. The
    arrays returned are the file itself, mapped copy-on-write (writing to one
    changes this process's copy only), or a copy, charged to the store as a
    received capture's arrays are: for a file another user may change (theirs,
    or writable by others) and, if the captures are to be kept (``keep``), a
    segment of less than MAX_COPIED_BYTES of arrays or one past the
    ``MAPPED_SEGMENTS`` this process keeps mapped. ``known_headers`` carries
    what was validated from one segment to the next.
    """
    try:
        return _read(path, KnownHeaders() if known_headers is None else known_headers, keep)
    except ProtocolError as exc:  # a capture header, as the wire's validation found it
        raise BadRecording(f"{path}: {exc}") from None


def _read_at(descriptor: int, offset: int, size: int, path: Path) -> bytearray:
    """``size`` bytes of an open file from ``offset``, read into this process's own memory."""
    try:
        data = bytearray(size)
    except MemoryError:
        raise BadRecording(f"{path}: no memory for the {size} bytes it holds") from None
    view, got = memoryview(data), 0
    os.lseek(descriptor, offset, os.SEEK_SET)
    while got < size:
        read = os.readv(descriptor, [view[got:]])
        if not read:
            raise BadRecording(f"{path} was cut short while it was read")
        got += read
    return data


def _read(path: Path, known_headers: KnownHeaders, keep: bool) -> Segment:
    try:
        # O_NOFOLLOW: a recording's files are its own, never links to elsewhere. O_NONBLOCK:
        # opening a FIFO put in its place would otherwise wait for a writer, forever.
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadRecording(f"{path} is a symbolic link; a recording's files must be "
                               "its own") from None
        if exc.errno == errno.ENXIO:
            raise BadRecording(f"{path} is not a regular file") from None
        raise
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise BadRecording(f"{path} is not a regular file")
        size = info.st_size
        if size < 8:
            raise BadRecording(f"{path} is truncated: {size} bytes")
        # A file another user may change is read, not mapped: a private mapping shows the
        # file's later changes on every page this process has not written, which would
        # undo the checks below (a sparse tensor's indices rewritten once checked: writes
        # out of bounds) or end the process (SIGBUS once truncated). Its header first: the
        # rest is read only once the header says what it holds, as much as the store may.
        foreign = not mine_alone(info)
        if foreign:
            mapped: Any = _read_at(descriptor, 0, min(size, 8 + MAX_FILE_HEADER), path)
        else:
            # Not mmap.mmap, which keeps a duplicate of the descriptor while it lives: a
            # recording of more segments than the process may open descriptors would not load.
            try:
                mapped = map_file(descriptor, size)
            except OSError as exc:  # out of map entries, most likely (see MAX_COPIED_BYTES)
                raise BadRecording(f"{path} could not be mapped: {exc}") from None
        header_len, records, dropped, tensors = _header(mapped, size, path)
        data_start = 8 + header_len
        if foreign:
            if size - data_start > config.store_max_bytes():
                raise BadRecording(
                    f"{path} is another user's (or others may write to it), so it is read, "
                    f"not mapped, and its {size - data_start} bytes of arrays are more than "
                    "the history may hold (THING_STORE_BYTES): copy the recording (cp -r) "
                    "to load it from files of your own")
            mapped, data_start = _read_at(descriptor, data_start, size - data_start, path), 0
    finally:
        os.close(descriptor)
    if foreign:
        copied = True
    else:
        base = np.frombuffer(mapped, np.uint8)  # every array views it: counted while it lives
        # Kept, a small segment is copied out (the mapping goes with this function's end),
        # and so is one past the mappings this process keeps (a recording crafted of many
        # files would take every map entry): a copy is charged to the history's cap. One
        # only checked is read through a mapping that goes with it.
        copied = keep and (size - data_start < MAX_COPIED_BYTES
                           or not MAPPED_SEGMENTS.keep(base))
        mapped = bytearray(base[data_start:]) if copied else base
        data_start = 0 if copied else data_start
    # As a server would take them, and as large as they are (this server may take less).
    limits = wire.Limits()
    limits = replace(limits, max_capture_bytes=max(limits.max_capture_bytes, size))
    captures = [_capture(index, record, tensors, mapped, data_start, limits, known_headers,
                         path, copied) for index, record in enumerate(records)]
    if sum(len(c.capture.leaves) for c in captures) != len(tensors):
        raise BadRecording(f"{path} holds tensors that no capture uses")
    return Segment(captures, dropped)


def _header(mapped: Any, size: int, path: Path
            ) -> tuple[int, list[Any], dict[str, int], Any]:
    """A segment's header, checked: its length, its captures' records, how many captures
    its writer dropped, and its tensor table (checked against the ``size`` of the file)."""
    (header_len,) = struct.unpack_from("<Q", mapped, 0)
    if header_len > min(size - 8, MAX_FILE_HEADER):
        raise BadRecording(f"{path}: its header claims {header_len} bytes but the file "
                           f"holds {size - 8} after the length")
    if header_len % 8:  # padded so that every array lies aligned in memory, once mapped
        raise BadRecording(f"{path}: its header is not padded to a multiple of 8 bytes")
    raw = bytes(memoryview(mapped)[8:8 + header_len])
    _check_cost(raw, path)
    document = wire.load_json(raw, f"{path}: its safetensors header", BadRecording)
    if not isinstance(document, dict):
        raise BadRecording(f"{path}: the safetensors header is not a JSON object")
    metadata = document.pop("__metadata__", None)
    records, dropped = _thing_metadata(metadata, path)
    return header_len, records, dropped, _tensor_table(document, size - 8 - header_len, path)


def _check_cost(raw: bytes, path: Path) -> None:
    """Refuse, unparsed, a header whose JSON would take far more memory than its size."""
    cost = wire.parsed_cost(raw)
    if cost > MAX_FILE_COST:
        raise BadRecording(f"{path}: a header of {len(raw)} bytes holding too many small "
                           f"values (it would take about {cost} bytes once parsed)")


def _thing_metadata(metadata: Any, path: Path) -> tuple[list[Any], dict[str, int]]:
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise BadRecording(f"{path} is a safetensors file, but not one of thing's recordings")
    if metadata.get("version") != str(FORMAT_VERSION):
        raise BadRecording(f"{path} is of recording format version "
                           f"{str(metadata.get('version'))[:20]!r}; this thing reads "
                           f"version {FORMAT_VERSION}")
    records = _json_field(metadata, "captures", path)
    dropped = _json_field(metadata, "dropped", path)
    if "checksum" in metadata and metadata["checksum"] != records_checksum(metadata):
        raise BadRecording(f"{path}: its captures' records do not match their checksum: the "
                           "file was damaged")
    if not isinstance(records, list):
        raise BadRecording(f"{path}: its captures are not a list")
    if not (isinstance(dropped, dict) and all(
            isinstance(reason, str) and value_trees.is_int(count) and 0 <= count < 1 << 62
            for reason, count in dropped.items())):
        raise BadRecording(f"{path}: its count of dropped captures is malformed")
    return records, {wire.printable(reason[:200]): count for reason, count in dropped.items()}


def records_checksum(metadata: dict[str, Any]) -> str:
    """CRC-32 of a segment's records and dropped counts (its numbers, names and strings: a
    flipped bit there would load as another value). Array bytes have none, as in
    safetensors: checking them would read every array at load."""
    checksum = 0
    for key in ("captures", "dropped"):
        checksum = zlib.crc32(metadata[key].encode("utf-8", "surrogatepass"), checksum)
    return f"crc32:{checksum:08x}"


def _json_field(metadata: dict[str, Any], key: str, path: Path) -> Any:
    text = metadata.get(key)
    if not isinstance(text, str):
        raise BadRecording(f"{path}: its metadata has no {key!r}")
    return wire.load_json(text.encode("utf-8", "surrogatepass"), f"{path}: {key!r}",
                           BadRecording)


class _Tensor(NamedTuple):
    dtype: str  # safetensors' name
    shape: tuple[int, ...]
    begin: int  # offsets into the data, after the header
    end: int


def _tensor_table(document: dict[str, Any], data_len: int, path: Path) -> dict[str, _Tensor]:
    """Check the tensor table as safetensors defines it: every tensor's bytes within the
    data, in its dtype's alignment, and together covering the data exactly once."""
    tensors = {}
    for key, entry in document.items():
        if not (isinstance(entry, dict) and set(entry) == {"dtype", "shape", "data_offsets"}):
            raise BadRecording(f"{path}: tensor {key[:100]!r} is not described by a dtype, "
                               "a shape and data offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
            raise BadRecording(f"{path}: tensor {key[:100]!r} has an unknown dtype")
        if not (isinstance(shape, list) and len(shape) <= 65
                and all(value_trees.is_int(extent) and extent >= 0 for extent in shape)):
            raise BadRecording(f"{path}: tensor {key[:100]!r} has a malformed shape")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(value_trees.is_int(offset) for offset in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_len):
            raise BadRecording(f"{path}: tensor {key[:100]!r} claims bytes "
                               f"{str(offsets)[:60]} of data that holds {data_len}")
        begin, end = offsets
        if math.prod(shape) * _ITEMSIZE[dtype] != end - begin:
            raise BadRecording(f"{path}: tensor {key[:100]!r} of shape {shape} has "
                               f"{end - begin} bytes")
        if begin % min(_ITEMSIZE[dtype], 8):
            raise BadRecording(f"{path}: tensor {key[:100]!r} is not aligned")
        tensors[key] = _Tensor(dtype, tuple(shape), begin, end)
    covered = 0
    for tensor in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if tensor.begin != covered:
            raise BadRecording(f"{path}: its tensors overlap or leave a gap at byte {covered}")
        covered = tensor.end
    if covered != data_len:
        raise BadRecording(f"{path}: its tensors end at byte {covered} of {data_len} "
                           "(truncated, or extra bytes)")
    return tensors


def _capture(index: int, record: Any, tensors: dict[str, _Tensor], mapped: Any,
             data_start: int, limits: wire.Limits, known_headers: KnownHeaders,
             path: Path, copied: bool) -> LoadedCapture:
    where = f"{path}, capture {index}"
    if not (isinstance(record, dict) and set(record) == _RECORD_KEYS):
        raise BadRecording(f"{where}: not a capture record")
    raw_header = record["header"]
    sender = record["sender"]
    received_at, caught_at = record["received_at"], record["caught_at"]
    if not isinstance(raw_header, str):
        raise BadRecording(f"{where}: its header is not a string")
    if not (isinstance(sender, list) and len(sender) == 4 and isinstance(sender[0], str)
            and isinstance(sender[1], str) and value_trees.is_int(sender[2])
            and (sender[3] is None or isinstance(sender[3], str))):
        raise BadRecording(f"{where}: its sender is malformed")
    call, step = record["call"], record["step"]
    if not (_is_time(received_at) and (caught_at is None or _is_time(caught_at))
            and isinstance(record["consistent"], bool)):
        raise BadRecording(f"{where}: its times or consistent flag are malformed")
    if not ((call is None or (value_trees.is_int(call) and 0 < call < 1 << 64))
            and (step is None or (value_trees.is_int(step) and wire.NO_STEP < step < 1 << 63))):
        raise BadRecording(f"{where}: its call number or step is malformed")
    keys = []
    for leaf in range(len(tensors) + 1):
        if f"{index}.{leaf}" not in tensors:
            break
        keys.append(f"{index}.{leaf}")
    payload_len = sum(tensors[key].end - tensors[key].begin for key in keys)
    address, hostname, pid = (wire.printable(sender[0][:300]), wire.printable(sender[1][:300]),
                              sender[2])
    run = None if sender[3] is None else wire.printable(sender[3][:MAX_RUN_NAME])
    key = (raw_header, address, hostname, pid, run)
    known = known_headers.headers.get(key)
    if known is None:
        raw = raw_header.encode("utf-8", "surrogatepass")
        wire.header_cost(raw, limits)
        known = KnownHeader.of(wire.decode_header(raw, payload_len, limits),
                               known_headers.sender(address, hostname, pid, run))
        if known.notice:
            raise BadRecording(f"{where}: a sender's notice, not a capture")
        if len(known_headers.headers) >= MAX_KNOWN_HEADERS:
            known_headers.headers.clear()
        known_headers.headers[key] = known
    header = known.header
    wire.check_payload_length(header, payload_len)
    if len(header.leaves) != len(keys):
        raise BadRecording(f"{where}: its header lists {len(header.leaves)} arrays, the file "
                           f"holds {len(keys)}")
    arrays = []
    for spec, key in zip(header.leaves, keys):
        tensor = tensors[key]
        if tensor.dtype != SAFETENSORS_DTYPES[spec.dtype] or tensor.shape != tensor_shape(spec):
            raise BadRecording(f"{where}: tensor {key} is {tensor.dtype} {list(tensor.shape)}, "
                               f"its header says {spec.dtype} {list(spec.shape)}")
        carrier = CARRIER_DTYPES[spec.dtype]
        array = np.frombuffer(mapped, carrier, math.prod(spec.shape), data_start + tensor.begin)
        arrays.append(array.reshape(spec.shape))
    if known.sparse:
        value_trees.check_received(header.tree, arrays)
    value = value_trees.ReceivedValue(header.tree, header.leaves, arrays)
    # One object for each name and call site, however many headers carry them.
    capture = Capture(-1, _one_of(known.name), value, header.leaves, payload_len, known.sender,
                      received_at=received_at, caught_at=caught_at,
                      call_site=_one_of(known.call_site),
                      consistent=record["consistent"], call=call, step=step,
                      requested=known.requested)
    # Arrays copied into this process's memory are charged as a received capture's are; those
    # in a mapped file are the page cache's, which the kernel takes back as it needs.
    return LoadedCapture(capture, known.record_bytes + (payload_len if copied else 0))


def _one_of(text: Optional[str]) -> Optional[str]:
    return None if text is None else sys.intern(text)


def _is_time(value: Any) -> bool:
    """Seconds since the epoch that a clock can show (NaN and infinities are not)."""
    return (isinstance(value, float) or value_trees.is_int(value)) and -wire.MAX_TIME < value < (
        wire.MAX_TIME)
