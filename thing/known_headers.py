"""What a validated frame header tells a server, read defensively from its ``meta``.

``wire.decode_header`` checks a header's shape, its value tree and its arrays;
what it leaves as JSON (the call site, rank, what the sender did not deliver,
a notice instead of a capture) comes from the peer and is read here: a number
out of range or a text of the wrong type becomes None, a text is cut short and
made printable. The connection that received the header and the reader of a
recording work it out once per header, then for every frame that repeats it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import wire
from .arrays import CARRIER_DTYPES
from .captures import Sender
from .errors import ProtocolError
from .store import Announcement, HistoryStore, UnsentNotice
from .value_trees import ReceivedValue, holds_sparse, is_int


@dataclass(frozen=True)
class KnownHeader:
    """What a validated header tells its connection, worked out once for all its frames."""

    header: wire.FrameHeader
    name: str | None  # printable
    sender: Sender  # the connection's, with the rank the header gives
    undelivered: dict[str, int]
    call_site: str | None
    # A notice, not a capture: "unsent" (a capture that could not be sent) or "on_demand"
    # (a name sent only when the REPL asks); None for a capture.
    notice: str | None
    requested: bool  # sent because the REPL asked (thing.request)
    record_bytes: int  # what the store charges for a capture of it, beyond its arrays
    sparse: bool  # whether its received arrays need checking (check_received)
    # Per array: its carrier dtype, element count and shape, to build it from bytes.
    layout: tuple[tuple[np.dtype, int, tuple[int, ...]], ...]

    @classmethod
    def of(cls, header: wire.FrameHeader, connection: Sender) -> KnownHeader:
        meta = header.meta
        name = None if header.name is None else wire.printable(header.name)
        call_site = str_or(meta.get("site"))
        layout = tuple((CARRIER_DTYPES[spec.dtype], math.prod(spec.shape), spec.shape)
                       for spec in header.leaves)
        notice = next((kind for kind in ("unsent", "on_demand") if kind in meta), None)
        return cls(header, name, sender_of(meta, connection), undelivered_of(meta), call_site,
                   notice, meta.get("requested") is True, HistoryStore.record_bytes(
                       name, ReceivedValue(header.tree, header.leaves, []), call_site),
                   holds_sparse(header.tree), layout)


def sender_of(meta: dict[str, Any], connection: Sender) -> Sender:
    rank, world_size = meta.get("rank"), meta.get("world_size")
    if rank is None and world_size is None:
        return connection
    # Out of range, a number is nonsense, and a 300-digit one would widen every table.
    return dataclasses.replace(connection, rank=int_in(rank, wire.RANKS),
                               world_size=int_in(world_size, range(1, wire.RANKS.stop + 1)))


def notice_of(header: wire.FrameHeader, sender: Sender) -> UnsentNotice:
    """The notice a frame with ``meta["unsent"]`` carries: a name, a type and a reason, no data."""
    unsent = header.meta["unsent"]
    if header.leaves or header.tree is not None or not isinstance(unsent, dict):
        raise ProtocolError("a notice of an unsent capture carries data, or no notice")
    return UnsentNotice(
        None if header.name is None else wire.printable(header.name),
        str_or(unsent.get("type"), 200) or "?",
        str_or(unsent.get("reason"), wire.MAX_REASON) or "?",
        str_or(header.meta.get("site")),
        sender,
        time.time(),
    )


def announcement_of(header: wire.FrameHeader, sender: Sender) -> Announcement:
    """What a frame with ``meta["on_demand"]`` tells: a name caught on demand, what it looks
    like (type, shape, dtype), no data."""
    looks = header.meta["on_demand"]
    if header.leaves or header.tree is not None or not isinstance(looks, dict):
        raise ProtocolError("an announcement of an on-demand name carries data, or nothing")
    shape = looks.get("shape")
    if not (isinstance(shape, list) and len(shape) <= 64
            and all(is_int(size) and 0 <= size < 1 << 62 for size in shape)):
        shape = None
    return Announcement(
        None if header.name is None else wire.printable(header.name),
        str_or(looks.get("type"), 200) or "?",
        None if shape is None else tuple(shape),
        str_or(looks.get("dtype"), 40),
        str_or(header.meta.get("site")),
        sender,
        time.time(),
    )


def undelivered_of(meta: dict[str, Any]) -> dict[str, int]:
    """The sender's own count of captures it could not deliver, by reason (known ones only)."""
    counts = meta.get("undelivered")
    if not isinstance(counts, dict):
        return {}
    return {reason: count for reason, count in counts.items()
            if reason in wire.NOT_DELIVERED_REASONS and int_in(count, range(1 << 62)) is not None}


def int_in(value: Any, numbers: range) -> int | None:
    """``value`` if it is an int (not a bool) in ``numbers``, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value in numbers:
        return value
    return None


def str_or(value: Any, most: int = 1024) -> str | None:
    return wire.printable(value[:most]) if isinstance(value, str) else None
