"""The recorder: every capture a store receives, appended to a recording as it arrives.

Captures gather in an open segment, kept in memory, which is written
(``segments.write_segment``: temporary name, fsync, rename) once it holds
``segment_bytes`` of captures (their arrays, text and numbers, as the store
counts them), ``segment_captures`` captures, or its first
capture is ``segment_seconds`` old. A crash loses the open segment at most;
every file in the directory is whole. After each segment the oldest are
deleted while the recording holds more than ``max_bytes``.

One thread writes; the store hands each capture over as it is stored, and the
recorder keeps a copy of it (what arrived: the REPL may change the history's
arrays in place before their segment is written). A sender faster than the
disk is slowed to the disk's pace: with too much waiting to be written, the
connection that brings more waits for room before it reads its next frame, so
the job's own queue fills and drops there, counted, rather than the recorder
acknowledging what it then loses.
When the disk is full, or writing stalls for ``max_wait``, captures are
dropped, counted by reason, logged, and the count is written into the next
segment that can be written; writing resumes by itself when there is room.
"""

from __future__ import annotations

import errno
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

from .captures import Capture
from .errors import ArgumentError, ThingError
from .log import log
from .recording import (
    MAX_SEGMENT_NUMBER,
    NEW_DIRECTORY_MODE,
    PathLike,
    lock_for_writing,
    recover_staged,
    segment_path,
    segments_of,
)
from .segments import commit, write_segment, write_unflushed
from .store import HistoryStore

DISK_FULL = "disk full"
FALLING_BEHIND = "recorder behind"  # more waiting to be written than it may hold
CLOSED = "recorder closed"  # stored as the recorder closed, after its last segment
# The longest a segment may stay open: a week (a crash loses what it holds).
MAX_SEGMENT_SECONDS = 7 * 24 * 3600.0
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class _Waiting(NamedTuple):
    capture: Capture
    arrived: float  # monotonic
    weight: int  # what the store charged it (see HistoryStore.charge)


class _Unflushed(NamedTuple):
    temporary: Path
    path: Path
    captures: int
    dropped: dict[str, int]  # what its metadata says was dropped before it


@dataclass(frozen=True)
class SegmentWritten:
    """What :class:`Recorder` tells its ``on_segment`` callback after each segment."""

    path: Path
    captures: int
    nbytes: int  # the file's size
    kept_segments: int  # in the recording now, after the oldest were deleted for max_bytes
    kept_bytes: int


class Recorder:
    """Appends every capture ``store`` receives to the recording in ``directory``.

    ``max_bytes`` (default: no limit) caps the recording on disk, the oldest
    segments deleted first (the newest is always kept). A segment is written
    at ``segment_bytes`` of captures, as the store counts them (default 64 MiB),
    ``segment_captures``
    captures (10,000), or ``segment_seconds`` (10 s) after its first capture:
    a crash loses at most that. Captures waiting to be written may take up to
    ``max_pending_bytes`` (default four segments' bytes, and four segments'
    captures at most); beyond that, a connection that brings another waits
    for room (so a sender faster than the disk is slowed down, not dropped
    from), for ``max_wait`` seconds at most (default 10), after which its
    capture is dropped and counted, as are those a full disk refuses.
    ``on_segment`` is called with a :class:`SegmentWritten` after each segment
    is on disk, on the recorder's flushing thread. One recorder at a time may
    write to a directory.
    """

    def __init__(self, store: HistoryStore, directory: PathLike, *,
                 max_bytes: Optional[int] = None, segment_bytes: int = 64 << 20,
                 segment_captures: int = 10_000, segment_seconds: float = 10.0,
                 max_pending_bytes: Optional[int] = None, max_wait: float = 10.0,
                 on_segment: Optional[Callable[[SegmentWritten], None]] = None):
        if not (math.isfinite(segment_seconds) and 0 < segment_seconds <= MAX_SEGMENT_SECONDS):
            # inf or 1e300 overflowed the writer's wait, which then lost every capture.
            raise ArgumentError(f"segment_seconds must be more than 0 and at most "
                             f"{MAX_SEGMENT_SECONDS:g}, not {segment_seconds!r}")
        self.store = store
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.segment_captures = segment_captures
        self.segment_seconds = segment_seconds
        self.max_pending_bytes = (4 * segment_bytes if max_pending_bytes is None
                                  else max_pending_bytes)
        self.max_wait = max_wait
        self.on_segment = on_segment
        self.written = 0  # captures written, since start()
        self.segments = 0  # segments written, since start()
        self.dropped: dict[str, int] = {}  # captures not written, by reason, since start()
        self._unreported: dict[str, int] = {}  # dropped, not yet in a segment's metadata
        self._pending: list[_Waiting] = []
        self._finished = False  # the writer took its last segment: nothing more is taken
        self._pending_bytes = 0
        self._changed = threading.Condition()
        self._closing = False
        self._thread: Optional[threading.Thread] = None  # takes segments and writes them
        self._flusher: Optional[threading.Thread] = None  # flushes and names them, in order
        # Written, not yet flushed: one at most, so a slow disk holds up the writer.
        self._unflushed: queue.Queue[Optional[_Unflushed]] = queue.Queue(maxsize=1)
        self._lock_file: Optional[int] = None
        self._next_number = 1
        self._failing: Optional[str] = None  # why the last write failed, while it fails

    def start(self) -> Recorder:
        """Take the directory (creating it), then record every capture stored from now on."""
        if self._thread is not None:
            return self
        self.directory.mkdir(mode=NEW_DIRECTORY_MODE, parents=True, exist_ok=True)
        lock = lock_for_writing(self.directory)
        try:
            recover_staged(self.directory)  # what a crashed writer left
        except OSError:
            os.close(lock)
            raise
        existing = segments_of(self.directory)
        self._next_number = existing[-1][0] + 1 if existing else 1
        if self._next_number >= MAX_SEGMENT_NUMBER:  # a crafted directory: no reader would see it
            os.close(lock)
            raise ThingError(f"{self.directory} holds a segment numbered "
                             f"{existing[-1][0]}; a recorder cannot number one after it")
        self._lock_file = lock
        self._closing = self._finished = False
        self._thread = threading.Thread(target=self._run, name="thing-recorder", daemon=True)
        self._flusher = threading.Thread(target=self._flush_in_order, name="thing-recorder-flush",
                                         daemon=True)
        self._thread.start()
        self._flusher.start()
        self.store.listen(self._arrived)
        return self

    def close(self) -> None:
        """Stop recording: write what is waiting, then release the directory."""
        if self._thread is None:
            return
        self.store.unlisten(self._arrived)
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()
        self._unflushed.put(None)
        assert self._flusher is not None
        self._flusher.join()
        self._thread = self._flusher = None
        if self._unreported:  # a last segment failed: say what was lost, if the disk lets us
            try:
                write_segment(segment_path(self.directory, self._next_number), [],
                              self._unreported)
                self._unreported = {}
            except OSError as exc:
                log.warning("recorder: could not record what was dropped (%s): %s",
                            self.dropped, exc)
        if self._lock_file is not None:
            os.close(self._lock_file)
            self._lock_file = None

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _arrived(self, capture: Capture) -> None:
        """The store's listener, on the receiving thread: waits (``max_wait`` at most) while
        too much is waiting to be written, which slows the sender to the disk's pace."""
        # What the store charges it, text and numbers too: a flood of text is held here as
        # surely as one of arrays.
        weight = self.store.charge(capture)
        # A recording holds what arrived: the history's arrays are the REPL's to change in
        # place, seconds before their segment is written.
        capture = capture.as_arrived()
        with self._changed:
            deadline = time.monotonic() + self.max_wait
            while self._pending and not self._closing and (
                    self._pending_bytes + weight > self.max_pending_bytes
                    or len(self._pending) >= 4 * self.segment_captures):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if FALLING_BEHIND not in self.dropped:
                        log.warning("recorder: writing to %s has not kept up for %.0f s; "
                                    "dropping captures until it does", self.directory,
                                    self.max_wait)
                    self._drop(FALLING_BEHIND, 1)
                    return
                self._changed.wait(remaining)
            if self._finished:  # stored as the recorder closed, after its last segment
                self._drop(CLOSED, 1)
                return
            self._pending.append(_Waiting(capture, time.monotonic(), weight))
            self._pending_bytes += weight
            if len(self._pending) == 1 or self._segment_due():  # the first starts the clock
                self._changed.notify_all()

    def _take_segment(self) -> list[_Waiting]:
        """The oldest pending captures, as many as one segment holds (one at least); the
        caller holds ``_changed``."""
        count, nbytes = 0, 0
        for waiting in self._pending:
            if count and (count >= self.segment_captures
                          or nbytes + waiting.weight > self.segment_bytes):
                break
            count += 1
            nbytes += waiting.weight
        batch = self._pending[:count]
        del self._pending[:count]
        self._pending_bytes -= nbytes
        return batch

    def _segment_due(self) -> bool:
        return (self._pending_bytes >= self.segment_bytes
                or len(self._pending) >= self.segment_captures)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._closing:
                    if self._pending and (self._segment_due() or time.monotonic()
                                          >= self._pending[0].arrived + self.segment_seconds):
                        break
                    wait = (self._pending[0].arrived + self.segment_seconds - time.monotonic()
                            if self._pending else None)
                    self._changed.wait(wait)
                batch = self._take_segment()
                dropped, self._unreported = self._unreported, {}
                self._finished = finished = self._closing and not self._pending
                self._changed.notify_all()  # receivers waiting for room have it
            if batch or (finished and dropped):  # at the end, an empty one tells what dropped
                self._write(batch, dropped)
            del batch  # written: waiting for the next, it keeps none of them
            with self._changed:
                if self._finished:  # still: _write may have given captures back
                    return

    def _write(self, batch: list[_Waiting], dropped: dict[str, int]) -> None:
        """Write a segment; the flusher thread flushes and names it while the next is written
        (flushing each one before writing the next would leave the disk idle between them)."""
        path = segment_path(self.directory, self._next_number)
        self._next_number += 1
        try:
            temporary, written = write_unflushed(path, [w.capture for w in batch], dropped)
        except Exception as exc:
            self._failed(exc, path, len(batch), dropped)
            return
        if written < len(batch):  # their records fill a segment's header: the rest wait
            with self._changed:
                self._pending[:0] = batch[written:]
                self._pending_bytes += sum(waiting.weight for waiting in batch[written:])
                self._finished = False
        self._unflushed.put(_Unflushed(temporary, path, written, dropped))

    def _flush_in_order(self) -> None:
        while (segment := self._unflushed.get()) is not None:
            try:
                self._flush(segment)
            except Exception:  # this thread must outlive anything, or close() would wait
                log.exception("recorder: could not finish %s", segment.path)

    def _flush(self, segment: _Unflushed) -> None:
        try:
            size = commit(segment.temporary, segment.path)
        except Exception as exc:
            self._failed(exc, segment.path, segment.captures, segment.dropped)
            return
        with self._changed:
            self.written += segment.captures
            self.segments += 1
            recovered = self._failing is not None
            self._failing = None
            dropped = dict(self.dropped)
        if recovered:
            log.warning("recorder: writing again to %s (%s)", self.directory,
                        ", ".join(f"{count} dropped: {reason}"
                                  for reason, count in dropped.items()))
        kept = self._enforce_budget()
        if self.on_segment is not None:
            try:
                self.on_segment(SegmentWritten(segment.path, segment.captures, size, len(kept),
                                               sum(size for _, size in kept)))
            except Exception:  # the caller's (printing to a closed pipe): the segment stands
                log.exception("recorder: wrote %s; telling on_segment failed", segment.path)

    def _failed(self, exc: Exception, path: Path, captures: int, dropped: dict[str, int]) -> None:
        """A segment could not be written or flushed: its captures are dropped, counted."""
        if isinstance(exc, OSError):
            reason = DISK_FULL if exc.errno in _FULL_ERRNOS else f"write failed ({exc.strerror})"
        else:  # a capture the writer cannot take must not end the recording
            reason = "write failed"
        with self._changed:
            for earlier, count in dropped.items():  # the segment that would have told is gone
                self._unreported[earlier] = self._unreported.get(earlier, 0) + count
            self._drop(reason, captures)
            new = self._failing != reason
            self._failing = reason
        if new:
            log.warning("recorder: writing %s failed (%s): dropped %d captures; still "
                        "receiving, and writing again as soon as it can", path, exc, captures,
                        exc_info=not isinstance(exc, OSError))

    def _drop(self, reason: str, count: int) -> None:
        """Count captures not recorded (the caller holds ``_changed``)."""
        self.dropped[reason] = self.dropped.get(reason, 0) + count
        self._unreported[reason] = self._unreported.get(reason, 0) + count

    def _enforce_budget(self) -> list[tuple[Path, int]]:
        """Delete the oldest segments while the recording holds more than ``max_bytes``."""
        kept = []
        for _, path in segments_of(self.directory):
            try:
                kept.append((path, path.stat().st_size))
            except FileNotFoundError:
                continue
        total = sum(size for _, size in kept)
        while self.max_bytes is not None and total > self.max_bytes and len(kept) > 1:
            path, size = kept.pop(0)
            path.unlink(missing_ok=True)
            total -= size
        return kept

