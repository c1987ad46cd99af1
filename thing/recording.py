"""A recording: a directory of segment files, oldest first, that outlives the REPL.

:func:`save` writes a store's history into one; :func:`load` brings one back
into a store; a :class:`~thing.recorder.Recorder` appends to one as captures
arrive. Each segment is written whole or not at all (``segments.py``), so a
directory is a recording at every moment, even while a recorder that is
killed mid-write was appending to it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Union

from .captures import Capture, Sender
from .display import counted
from .errors import BadRecording, ThingError
from .log import log
from .segments import (
    STAGING,
    KnownHeaders,
    Segment,
    clear_staging,
    flush_names,
    flush_to_disk,
    read_segment,
    staging_directory,
    write_segment,
)
from .sockets import mine_alone
from .store import ALL_RUNS, HistoryStore

PathLike = Union[str, "os.PathLike[str]"]

# What a directory thing makes for a recording may be: readable by all, writable by its
# user alone, whatever the umask (002 would let a group in, which the writer lock refuses).
NEW_DIRECTORY_MODE = 0o755
SEGMENT_NAME = re.compile(r"segment-(\d{6,18})\.safetensors")
MAX_SEGMENT_NUMBER = 10**18  # the first that SEGMENT_NAME does not match
SAVE_SEGMENT_BYTES = 1 << 30  # save() starts a new file after this many bytes of arrays
WRITER_LOCK = ".thing-recorder.lock"  # see lock_for_writing
# There while a save into an existing directory writes: one it still holds was cut short.
SAVING = ".thing-saving"
MAX_DROPPED_REASONS = 16  # distinct reasons for dropped captures kept from one recording


def segment_path(directory: Path, number: int) -> Path:
    """Where segment ``number`` of a recording lives."""
    return directory / f"segment-{number:06d}.safetensors"


def segments_of(directory: Path) -> list[tuple[int, Path]]:
    """The recording's segments as ``(number, path)``, oldest first (none: an empty list)."""
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            match = SEGMENT_NAME.fullmatch(entry.name)
            if match is not None:
                found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found)


def recover_staged(directory: Path) -> None:
    """Move into place the whole segments a stopped writer left staged (written, not yet
    named: a killed process's writes are all there, unless the machine went down too), and
    delete the rest. The caller holds the directory's writer lock."""
    staging = staging_directory(directory)
    taken = {number for number, _ in segments_of(directory)}
    moved = captures = 0
    for number, staged in segments_of(staging):
        if number in taken:
            continue
        try:
            held = len(read_segment(staged, keep=False).captures)
            flush_to_disk(staged)
        except (BadRecording, OSError):
            continue  # cut short, or unreadable: deleted below
        os.rename(staged, segment_path(directory, number))
        taken.add(number)  # segment-000005 and segment-0000005 are one number
        moved += 1
        captures += held
    if moved:
        flush_names(directory)
        log.warning("%s: %s (%s) that a stopped writer left in %s are in the recording now",
                    directory, counted(moved, "whole segment"), counted(captures, "capture"),
                    STAGING)
    removed = clear_staging(directory)
    if removed:
        log.warning("%s: deleted %d files that a stopped writer left half written in %s",
                    directory, removed, STAGING)


def lock_for_writing(directory: Path) -> int:
    """Hold ``directory``'s writer lock, which a recorder holds while it runs and a save
    into an existing directory while it saves (released when the descriptor closes);
    ThingError if another holds it, if the directory is another user's or others may write
    to it (they could put segments of their own among ours, or take ours away), or if it is
    another user's symbolic link (to where they would have us write, and delete; one an
    administrator made, as root, is followed)."""
    if os.lstat(directory).st_uid not in (os.getuid(), 0):  # in one look: no swap after it
        raise ThingError(f"{directory} is another user's (or a symbolic link another user "
                         "made); record or save into a directory of your own")
    if not mine_alone(os.stat(directory)):
        raise ThingError(f"{directory} is another user's, or others may write to it; record "
                         f"or save into a directory of your own (or chmod go-w {directory})")
    # O_NOFOLLOW: the lock is the recording's own file, never a link to elsewhere.
    descriptor = os.open(directory / WRITER_LOCK,
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise ThingError(f"a recorder (or a save) is writing to {directory}; use another "
                         "directory") from None
    return descriptor


def save(store: HistoryStore, path: PathLike, names: str | Iterable[str] | None = None) -> int:
    """Write the kept history (every capture, or those of ``names``: one name or several)
    as a new recording at ``path``; return how many captures were written.

    A new directory is written under a temporary name beside it and renamed into
    place when whole. An empty directory that exists already (a mount point, say)
    is written into, under its writer lock, segment by segment. A save that fails
    leaves nothing it wrote behind, and one to a directory that holds anything
    already (a recording, a recorder's, your files) is refused.
    """
    captures = _captures_of(store, [names] if isinstance(names, str) else names)
    directory = Path(path)
    if directory.is_dir():
        _save_into(captures, directory)
        return len(captures)
    directory.parent.mkdir(parents=True, exist_ok=True)
    unfinished = directory.parent / f".{directory.name}.saving-{secrets.token_hex(6)}"
    unfinished.mkdir(mode=NEW_DIRECTORY_MODE)
    try:
        _write(captures, unfinished)
        try:
            os.rename(unfinished, directory)  # replaces an empty directory, nothing else
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise
            raise ThingError(f"{directory} exists and is not an empty directory; save to a "
                             "new one") from None
    except BaseException:
        shutil.rmtree(unfinished, ignore_errors=True)
        raise
    return len(captures)


def _save_into(captures: list[Capture], directory: Path) -> None:
    """Write ``captures`` into the empty ``directory``, holding its writer lock (a recorder
    would write its first segment over ours); on failure, take back what was written."""
    made_lock = not os.path.lexists(directory / WRITER_LOCK)
    lock = lock_for_writing(directory)
    written: list[Path] = []
    try:
        # A new file system's lost+found is no one's recording, nor what a save or recorder
        # killed before its first segment was named left (its mark, its staging folder).
        if any(entry.name not in (WRITER_LOCK, SAVING, STAGING, "lost+found")
               for entry in directory.iterdir()):
            raise ThingError(f"{directory} exists and is not an empty directory; save to a "
                             "new one")
        # Segments appear one by one: until the last, a reader is told the save is not whole
        # (it stays so if this process is killed meanwhile).
        os.close(os.open(directory / SAVING, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600))
        written.append(directory / SAVING)
        _write(captures, directory, written)
        (directory / SAVING).unlink()
        flush_names(directory)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # empty unless another writer is at work there
            (directory / STAGING).rmdir()
        if made_lock:
            (directory / WRITER_LOCK).unlink(missing_ok=True)
        raise
    finally:
        os.close(lock)


def _captures_of(store: HistoryStore, names: Iterable[str] | None) -> list[Capture]:
    """What a save writes, in order of arrival (an unknown name raises before anything is
    written)."""
    if names is None:
        return store.kept()
    # By id: two names may be one history (a name and its identifier, h[3] and h_3_).
    chosen = {capture.id: capture for name in names
              for capture in store.get_all(name, run=ALL_RUNS)}
    return sorted(chosen.values(), key=lambda c: (c.placed_at, c.id))  # as kept() has them


def _write(captures: list[Capture], directory: Path, written: list[Path] | None = None
           ) -> None:
    """Write ``captures`` as segments 1, 2, ... of ``directory``, each path added to
    ``written`` once its file is whole."""
    number, start = 0, 0
    while start < len(captures) or not number:  # an empty history is an empty segment
        held, stop = 0, start
        while stop < len(captures) and (stop == start or held < SAVE_SEGMENT_BYTES):
            held += captures[stop].nbytes
            stop += 1
        number += 1
        path = segment_path(directory, number)
        start += write_segment(path, captures[start:stop])
        if written is not None:
            written.append(path)


def load(path: PathLike, store: HistoryStore, skip_damaged: bool = False) -> int:
    """Read a recording into ``store``; return how many captures were added.

    Every segment is read and checked before anything is added: a bad file is
    refused with :class:`~thing.errors.BadRecording` and nothing is loaded,
    unless ``skip_damaged``: then the other segments load, and each one left
    out is logged. Segments are read newest first, and once their captures'
    charges (records, and arrays copied out of the files: see ``read_segment``)
    fill the store's cap the older ones are checked but not kept (the store
    would evict them at once). A segment a live recorder deletes
    meanwhile (its byte budget) is skipped. A save cut short is loaded as far
    as it was written, with a warning.
    """
    directory = Path(path)
    if not os.path.lexists(directory):
        raise BadRecording(f"no recording at {directory}: it does not exist")
    if not directory.is_dir():
        raise BadRecording(f"{directory} is not a directory (a recording is one)")
    if os.path.lexists(directory / SAVING):
        log.warning("%s holds a save() that did not end (its process was killed, or it is "
                    "still saving): what it had written loads, the rest was not saved",
                    directory)
    kept: list[Segment] = []
    held = left_out = 0
    dropped: dict[str, int] = {}
    damaged: list[str] = []
    known_headers = KnownHeaders()
    segments = segments_of(directory)
    for _, segment_file in reversed(segments):
        keeping = held < store.max_bytes
        try:
            segment = read_segment(segment_file, known_headers, keeping)
        except FileNotFoundError:
            log.info("%s was removed while it was being loaded; skipped", segment_file)
            continue
        except BadRecording as exc:
            if not skip_damaged:
                others = (f"; load(..., skip_damaged=True) (thing open --skip-damaged) loads "
                          f"the other {counted(len(segments) - 1, 'segment')} without it"
                          if len(segments) > 1 else "")
                raise BadRecording(f"{exc} (nothing was loaded{others})") from None
            damaged.append(str(exc))
            continue
        # Each says what its recorder dropped since the segment before it. A recorder
        # has a handful of reasons; a file may claim any number.
        for reason, count in segment.dropped.items():
            if reason not in dropped and len(dropped) >= MAX_DROPPED_REASONS:
                reason = "other reasons"
            dropped[reason] = dropped.get(reason, 0) + count
        if keeping:
            kept.append(segment)
            held += sum(entry.charge for entry in segment.captures)
        else:
            left_out += len(segment.captures)
    loaded = [entry for segment in reversed(kept) for entry in segment.captures]
    added = store.restore([entry.capture for entry in loaded], [entry.charge for entry in loaded])
    if added < len(loaded):
        log.warning("%d of the captures of %s were in this history already (loaded before, "
                    "or saved from it); they are not added twice", len(loaded) - added, directory)
    if dropped:
        # One sender per recording: loading another adds its counts, loading it again not.
        where = f"recording {directory.resolve()}"
        store.note_undelivered(Sender(where, where, 0), dropped)
    if left_out:
        log.warning("loaded the newest %d captures of %s; %d older ones do not fit the "
                    "history's cap (HistoryStore(max_bytes=...), THING_STORE_BYTES)",
                    added, directory, left_out)
    for reason in damaged:
        log.warning("left out a damaged segment (skip_damaged=True), none of its captures "
                    "loaded: %s", reason)
    return added
