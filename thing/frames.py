"""What a client sends for a capture: the queued capture, and the pieces of its frame.

A :class:`Pending` is what ``catch`` queues and the sender thread turns into a
frame: prefix, header, the arrays' bytes, trailer (the layout is in
``wire.py``). From call to call of a name caught with the same layout, from
the same place, only the prefix and the trailer change, so :class:`Headers`
encodes a single array's header once; the trailer is known only once the
bytes are sent, for a tensor read in place may have moved on meanwhile.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from . import auth, value_trees, wire
from ._core import untrack
from .handles import CaptureHandle
from .names import CallSite

# Headers of single arrays a channel keeps: a name caught every step is encoded once.
MAX_KEPT_HEADERS = 1024

# The sender's counts of captures not delivered, by reason, as a frame's header gives them.
Undelivered = tuple[tuple[str, int], ...]


class Pending(NamedTuple):
    """A capture waiting to be sent, or sent and waiting for its acknowledgement.

    ``catch`` makes one with ``new_pending`` (``tuple.__new__``, every field given):
    the named tuple's generated ``__new__`` costs half a microsecond on every call.
    """

    name: str | None
    payload: value_trees.Payload
    site: CallSite | None
    caught_at: float
    rank: tuple[int | None, int | None]  # (rank, world size) at the call
    handle: CaptureHandle
    # A notice, not a capture: its meta entry, {"unsent": {"type": ..., "reason": ...}} for
    # a capture that could not be sent, {"on_demand": {"type": ..., ...}} for a name that
    # is sent only when the REPL asks.
    notice: dict[str, Any] | None = None
    call: int = 0  # the call number of its name (0: not counted)
    step: int | None = None  # the step the caller gave
    requested: bool = False  # sent because the REPL asked for it (thing.request)


new_pending = tuple.__new__


def untrack_pending(pending: Pending) -> Pending:
    """Take a capture's own objects out of the cyclic garbage collector's lists (see
    ``_core.untrack``) and return it.

    For a capture that waits behind many others (a flood: a thousand at a
    time) or holds many objects (see ``Channel._queue_up``): it lives long
    enough to be moved to the oldest generation, and each full collection
    walks every object of a job's (torch's are 170,000 of them): tracked,
    such captures made one every 20,000 captures, 90 ms each. None of them can
    be in a reference cycle once its handle is resolved, which drops the one
    reference back (to the channel, whose queue holds the capture), and a
    channel resolves every handle it accepts. (A forked child keeps its copies
    of the parent's queue on purpose: see ``Channel.let_go_in_child``.)
    """
    untrack(pending)
    untrack(pending.handle)
    payload = untrack(pending.payload)
    untrack(payload.leaves)
    for leaf in payload.leaves:
        untrack(leaf)
        untrack(leaf.spec)  # a named tuple: the collector untracks plain tuples only
    return pending

# A capture that ended: (pending, capture id if stored, error, reason it counts under).
Finished = tuple[Pending, Optional[int], Optional[str], Optional[str]]  # noqa: UP007 (3.9)


class Headers:
    """The headers a channel encoded for single arrays, kept by everything a header says:
    name, layout, call site, rank, what the sender had not delivered, and whether the
    REPL asked for it (at most ``MAX_KEPT_HEADERS``)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, ...], bytes] = {}

    def encode(self, pending: Pending, undelivered: Undelivered) -> bytes:
        """A capture's header: for a single array, the one encoded before for the same key,
        if any."""
        payload = pending.payload
        if payload.tree is not value_trees.SINGLE_LEAF or pending.notice is not None:
            return wire.encode_header(pending.name, payload, _meta(pending, undelivered))
        key = (pending.name, payload.leaves[0].spec, pending.site, pending.rank, undelivered,
               pending.requested)
        header = self._kept.get(key)
        if header is None:
            if len(self._kept) >= MAX_KEPT_HEADERS:
                self._kept.clear()
            header = wire.encode_header(pending.name, payload, _meta(pending, undelivered))
            self._kept[key] = header
        return header


def read_in_place(payload: value_trees.Payload) -> bool:
    """Whether a leaf of ``payload`` is a torch tensor read in place, whose trailer can say
    whether it moved on only once its bytes are sent. A loop, not any() of a generator,
    which costs twice as much, for every frame."""
    for leaf in payload.leaves:  # noqa: SIM110
        if leaf.version is not None:
            return True
    return False


def trailer(mac: auth.SessionMac | None, prefix: bytes, header: bytes,
             modified: bool) -> bytes:
    """A frame's trailer, once its bytes are sent: whether its data was ``modified`` while
    it was sent, and its MAC."""
    unsigned = wire.encode_trailer(modified)
    return unsigned if mac is None else unsigned + mac.sign(prefix, header, unsigned)


def _meta(pending: Pending, undelivered: Undelivered) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    if pending.site is not None:
        site = pending.site
        meta["site"] = f"{site.file}:{site.line} ({site.function})"
    rank, world_size = pending.rank
    if rank is not None:
        meta["rank"], meta["world_size"] = rank, world_size
    if undelivered:
        meta["undelivered"] = dict(undelivered)
    if pending.notice is not None:
        meta.update(pending.notice)
    if pending.requested:
        meta["requested"] = True
    return meta
