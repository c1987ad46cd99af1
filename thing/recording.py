"""A recording: a directory of segment files, oldest first, that outlives the REPL.

:func:`save` writes a store's history into one; :func:`load` brings one back
into a store; a :class:`~thing.recorder.Recorder` appends to one as captures
arrive. Each segment is written whole or not at all (``segments.py``), so a
directory is a recording at every moment, even while a recorder that is
killed mid-write was appending to it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Union

from .errors import BadRecording, ThingError
from .segments import Segment, read_segment, write_segment
from .store import Capture, HistoryStore, Sender

log = logging.getLogger("thing")

PathLike = Union[str, "os.PathLike[str]"]
SEGMENT_NAME = re.compile(r"segment-(\d{6,18})\.safetensors")
# A segment's temporary name while it is written; left behind only by a crash.
TEMPORARY_NAME = re.compile(r"\.segment-(\d{6,18})\.safetensors\.tmp")
SAVE_SEGMENT_BYTES = 1 << 30  # save() starts a new file after this many bytes of arrays


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


def save(store: HistoryStore, path: PathLike, names: Iterable[str] | None = None) -> int:
    """Write the kept history (every capture, or those of ``names``) as a new recording at
    ``path``; return how many captures were written. ``path`` is created; one that holds a
    recording already is refused."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    if segments_of(directory):
        raise ThingError(f"{directory} holds a recording already; save to a new directory")
    if names is None:
        captures = store.recent(len(store))[::-1]
    else:
        captures = sorted((capture for name in dict.fromkeys(names)
                           for capture in store.get_all(name)), key=lambda c: c.received_at)
    batch: list[Capture] = []
    held, number = 0, 0
    for capture in captures:
        batch.append(capture)
        held += capture.nbytes
        if held >= SAVE_SEGMENT_BYTES:
            number += 1
            write_segment(segment_path(directory, number), batch)
            batch, held = [], 0
    if batch or not number:
        write_segment(segment_path(directory, number + 1), batch)
    return len(captures)


def load(path: PathLike, store: HistoryStore) -> int:
    """Read a recording into ``store``; return how many captures it held.

    Every segment is read and checked before anything is added: a bad file is
    refused with :class:`~thing.errors.BadRecording` and nothing is loaded. A
    segment a live recorder deletes meanwhile (its byte budget) is skipped.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise BadRecording(f"{directory} is not a directory (a recording is one)")
    segments: list[Segment] = []
    for _, segment in segments_of(directory):
        try:
            segments.append(read_segment(segment))
        except FileNotFoundError:
            log.info("%s was removed while it was being loaded; skipped", segment)
    loaded = [entry for segment in segments for entry in segment.captures]
    store.restore([entry.capture for entry in loaded], [entry.charge for entry in loaded])
    dropped: dict[str, int] = {}
    for segment in segments:  # each says what its recorder dropped since the segment before
        for reason, count in segment.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + count
    if dropped:
        store.note_undelivered(Sender(f"recording {directory}", "recorder", 0), dropped)
    return len(loaded)
