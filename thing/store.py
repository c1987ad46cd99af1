"""The history store: every capture the server keeps, per name, oldest to newest.

Memory is bounded: the server reserves a capture's bytes *before* it allocates
them, evicting the oldest versions to make room, so a burst of captures can
fill the cap but never push the REPL process past it. A capture that could
never fit is refused before anything is allocated; the REPL never sees it.

Values are stored exactly as received: the arrays the server received into
are the arrays :meth:`HistoryStore.get` hands out, never copies.

The REPL asks while captures arrive, and nothing is stored while the store's
lock is held: what it asks most (a name's newest, summary()'s rows, a status()
frame, runs()) is answered from each name's history split by who sent it,
without walking hours of history; a walk that must be made (``step=``,
get_all) is made on a copy, outside the lock.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

from . import config, wire
from ._core import untrack
from .arrays import LeafSpec
from .captures import Capture, Sender
from .display import counted
from .errors import (
    ArgumentError,
    ArgumentTypeError,
    LimitExceeded,
    UnknownName,
    VersionOutOfRange,
    whole_number,
)
from .log import log
from .names import identifier_for
from .value_trees import ReceivedValue, build_value

# What one capture's record costs beyond its array bytes: the Capture object, its
# Sender, its LeafSpecs and dictionary entries (400-630 bytes measured), and the statistics
# the background worker works out and keeps on it (320-370: history_stats.py; charged from
# the start, as the worker reaches every capture). Charged so that a flood of tiny
# captures (scalars travel in the header, with no payload) is bounded too.
RECORD_BYTES = 1024
# What a name costs while it has a capture, beyond its captures' records: its history's
# deque, its entries by identifier and by update, its sources' table and first source's
# deque (about 2,170 bytes, measured). Charged so that a job that never repeats a name
# (f"step{i}/loss") is held to the cap too.
NAME_BYTES = 2304
# What each further source of a name (another run or rank) costs: its deque and key (about
# 840 bytes). Charged so that a peer giving every frame a rank of its own is held too.
SOURCE_BYTES = 896
COPIED_LEAVES = ("bytes", "jax")  # leaves whose value is a copy of the received array
# Notices of captures that could not be sent, kept at most (each is a few hundred bytes).
MAX_NOTICES = 1000


ALL_RUNS = "all"


@dataclass(frozen=True)
class Run:
    """A training job that sent captures: its id, when its kept captures arrived, how many,
    from which ranks, of which names (in order of first arrival)."""

    id: str | None  # None: from a sender older than runs
    start: float
    end: float
    captures: int
    ranks: tuple[int, ...]
    names: tuple[str, ...]

    def __repr__(self) -> str:  # a line of a terminal, not every field in full
        ranks = ("" if not self.ranks else f", rank {self.ranks[0]}" if len(self.ranks) == 1
                 else f", ranks {min(self.ranks)}-{max(self.ranks)}")
        return (f"Run({self.id!r}: {counted(self.captures, 'capture')}{ranks}, "
                f"{_time(self.start)}-{_time(self.end)}, {counted(len(self.names), 'name')})")


@dataclass(frozen=True)
class Announcement:
    """A sender's word that it catches ``name`` on demand: sent only when the REPL asks
    (``thing.request``). What a capture of it would be: type, shape, dtype (no data)."""

    name: str | None
    type_name: str
    shape: tuple[int, ...] | None
    dtype: str | None
    call_site: str | None
    sender: Sender
    at: float

    def __repr__(self) -> str:  # a line of a terminal, not every field in full
        looks = " ".join(str(part) for part in (self.type_name, self.shape, self.dtype)
                         if part is not None)
        rank = "" if self.sender.rank is None else f" rank {self.sender.rank}"
        return f"Announcement({self.name!r}: {looks}, pid {self.sender.pid}{rank})"


@dataclass(frozen=True)
class UnsentNotice:
    """A sender's word that it could not send a capture of ``name``, and why (no data); or,
    with ``refused``, this server's own word that it refused one on arrival.

    A client tells the server once per name and reason; ``at`` is when the
    newest such notice arrived.
    """

    name: str | None
    type_name: str
    reason: str
    call_site: str | None
    sender: Sender
    at: float
    refused: bool = False


@dataclass(frozen=True)
class StoreOverview:
    """A consistent snapshot of the store, taken under its lock (what ``summary()`` shows).

    ``names`` pairs the newest capture of every name with how many versions are
    kept, most recently updated name first.
    """

    names: list[tuple[Capture, int]]  # one per (name, run, rank) when several send a name
    hidden_rows: int  # of the names shown, runs and ranks past max_names a name, left out
    name_count: int  # names with a kept capture, shown or not
    captures: int  # kept now, named and unnamed
    unnamed: int
    received: int  # stored since the store was created, including those evicted or cleared since
    evicted: int  # dropped to make room (or by max_versions), not by clear()
    rejected: int  # refused because they could never fit
    inconsistent: int  # kept captures whose sender saw them change after the call
    undelivered: dict[str, int]  # caught but never delivered, by reason, as senders reported
    unsent: list[UnsentNotice]  # what senders could not send, and why; newest first
    held_bytes: int
    max_bytes: int
    max_versions: int | None


class HistoryStore:
    """Thread-safe, byte-capped history of captures.

    ``max_bytes`` caps the bytes held: every array's bytes plus
    :data:`RECORD_BYTES` and the size of header-borne values (numbers, strings)
    per capture. Default ``THING_STORE_BYTES``, else half the machine's
    physical RAM. ``max_versions`` optionally caps the versions kept per name
    (default ``THING_MAX_VERSIONS``, else unlimited). The oldest captures are
    evicted first; :attr:`evicted` counts them.
    """

    def __init__(self, max_bytes: int | None = None, max_versions: int | None = None):
        self.max_bytes = config.store_max_bytes() if max_bytes is None else max_bytes
        self.max_versions = config.store_max_versions() if max_versions is None else max_versions
        if self.max_versions is not None and self.max_versions < 1:
            raise ArgumentError("max_versions must be at least 1 (or None for unlimited)")
        # Held to read or change anything; _changed is the condition on it that waiters
        # (get(wait=...), flush) sleep on. Taking the lock itself costs less than the condition.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._restoring = threading.Lock()  # held by restore(), which takes _lock twice
        self._sleepers = 0  # threads in _sleep: an arrival wakes them, and only if there are
        self._by_id: OrderedDict[int, Capture] = OrderedDict()  # oldest first
        self._by_name: dict[str, deque[Capture]] = {}  # each oldest first
        # Each name's history again, split by who sent it ((run, rank), unnamed captures under
        # None), each oldest first: a source's newest and its count for summary(), get()'s
        # n-th newest, runs(), without walking hours of history under the lock.
        self._by_source: dict[str | None, dict[tuple[str | None, int | None],
                                                deque[Capture]]] = {}
        # hash(identifier_for(name)) -> the kept names, so that get("h_3") finds h[3]. Keyed
        # by the hash: a copy of every (possibly long) name would be memory nobody charges.
        self._by_identifier: dict[int, set[str]] = {}
        self._updated: OrderedDict[str, None] = OrderedDict()  # names, least recently updated first
        self._charged: dict[int, int] = {}  # id -> bytes counted in _held
        self._next_id = 0
        self._held = 0  # bytes of stored captures plus reservations
        self._newest_placed = 0.0  # the latest Capture.placed_at kept so far
        self._reserved = 0
        self._unnamed = 0
        self._flagged = 0
        self.evicted = 0
        self.rejected = 0
        # (hostname, pid) -> the sender's own count of captures it could not deliver, by
        # reason, as it last reported them; bounded, the oldest sender forgotten first.
        self._undelivered: OrderedDict[tuple[str, int], dict[str, int]] = OrderedDict()
        # (name, reason) -> the newest notice of it; bounded, the oldest forgotten first.
        self._unsent: OrderedDict[tuple[str | None, str], UnsentNotice] = OrderedDict()
        # On-demand names senders announced, by name, run and rank (the newest word kept).
        self._available: OrderedDict[tuple[Any, ...], Announcement] = OrderedDict()
        self._listeners: list[Callable[[Capture], None]] = []  # replaced, never changed in place

    # -- receiving ---------------------------------------------------------------

    def reserve(self, nbytes: int) -> None:
        """Claim room for ``nbytes`` about to be received; nothing is evicted for a claim.

        Raises :class:`LimitExceeded` if they could never fit, or if captures
        still being received have claimed the rest of the cap.
        """
        with self._lock:
            if nbytes + RECORD_BYTES > self.max_bytes:
                self.rejected += 1
                raise LimitExceeded(
                    f"capture of {nbytes} bytes is larger than the store's cap of {self.max_bytes}"
                )
            if self._reserved + nbytes + RECORD_BYTES > self.max_bytes:
                self.rejected += 1
                raise LimitExceeded("the store is full of captures still being received")
            self._reserved += nbytes

    def could_reserve(self, nbytes: int) -> bool:
        """Whether :meth:`reserve` would take ``nbytes`` now (a look, not a claim)."""
        return self._reserved + nbytes + RECORD_BYTES <= self.max_bytes

    def fill(self, nbytes: int) -> None:
        """``nbytes`` of a claim are arriving now: evict the oldest captures to hold them.

        The history makes room only as a capture's bytes actually come in, so a
        peer that claims much and sends little evicts little.
        """
        with self._lock:
            while self._held + nbytes > self.max_bytes and self._by_id:
                self._drop(next(iter(self._by_id.values())))
                self.evicted += 1
            self._held += nbytes

    def note_undelivered(self, sender: Sender, counts: dict[str, int]) -> None:
        """Record what a sender reports it caught but could not deliver (cumulative counts)."""
        key = (sender.hostname, sender.pid)
        with self._lock:
            self._undelivered.pop(key, None)
            self._undelivered[key] = counts
            while len(self._undelivered) > 1000:
                self._undelivered.popitem(last=False)

    def note_unsent(self, notice: UnsentNotice) -> None:
        """Record a sender's notice that it could not send a capture, or this server's
        refusal of one, and why."""
        key = (notice.name, notice.reason)
        with self._lock:
            self._unsent.pop(key, None)
            self._unsent[key] = notice
            while len(self._unsent) > MAX_NOTICES:
                self._unsent.popitem(last=False)

    def note_available(self, announcement: Announcement) -> None:
        """Record a sender's word that it catches a name on demand (kept per connection: a
        forked child tells its own, and may end before its parent)."""
        sender = announcement.sender
        key = (announcement.name, sender.run, sender.rank, sender)
        with self._lock:
            self._available.pop(key, None)
            self._available[key] = announcement
            while len(self._available) > MAX_NOTICES:
                self._available.popitem(last=False)

    def forget_available(self, sender: Sender) -> None:
        """Forget what ``sender`` catches on demand: its connection ended (a job that connects
        again tells its new connection again)."""
        with self._lock:
            # An announcement's sender has the rank its header gave; the connection's has none.
            for key in [key for key, announcement in self._available.items()
                        if dataclasses.replace(announcement.sender, rank=None,
                                               world_size=None) == sender]:
                del self._available[key]

    def available(self) -> list[Announcement]:
        """The names senders catch on demand, most recently announced first: one for each
        name, run and rank."""
        newest: dict[tuple[Any, ...], Announcement] = {}
        with self._lock:
            for key, announcement in reversed(self._available.items()):
                newest.setdefault(key[:3], announcement)
        return list(newest.values())

    def unsent(self, name: str | None = None) -> list[UnsentNotice]:
        """Notices of captures senders could not send (of ``name``, or all), newest first;
        a name's identifier finds them too, as it finds captures."""
        with self._lock:
            notices = list(reversed(self._unsent.values()))
        if name is None:
            return notices
        return ([notice for notice in notices if notice.name == name]
                or [notice for notice in notices if _names(notice.name, name)])

    def release(self, nbytes: int, filled: int) -> None:
        """Give back a claim of ``nbytes`` (``filled`` of them arrived) not stored after all."""
        with self._lock:
            self._held -= filled
            self._reserved -= nbytes

    @staticmethod
    def record_bytes(name: str | None, value: Any, call_site: str | None) -> int:
        """What keeping a capture costs beyond its arrays: its record, the parts of its
        value that came in the header, its name and call site."""
        # A received value is walked as its header described it, arrays standing in as
        # empty bytes (their bytes were reserved as payload). A bytes object or a jax
        # array is made by copying its received array, which the capture keeps (save()
        # writes it): once built, it holds its bytes twice.
        copied = 0
        if isinstance(value, ReceivedValue):
            copied = sum(spec.nbytes for spec in value.specs if spec.framework in COPIED_LEAVES)
            value = build_value(value.tree, [b""] * len(value.specs))
        return RECORD_BYTES + copied + _header_bytes(value) + sum(
            _header_bytes(text) for text in (name, call_site) if text is not None)

    def add(self, name: str | None, value: Any, leaves: tuple[LeafSpec, ...], nbytes: int,
            sender: Sender, record_bytes: int | None = None, **details: Any) -> Capture:
        """Store a received capture whose ``nbytes`` were reserved and filled; return it.

        ``record_bytes`` is :meth:`record_bytes` for it, when the caller knows it already
        (a receiver works it out once per header).
        """
        # Outside the lock: it walks the value.
        extra = (self.record_bytes(name, value, details.get("call_site"))
                 if record_bytes is None else record_bytes)
        with self._lock:
            if nbytes + extra > self.max_bytes:
                # Values that came in the header were not reserved; alone they may not fit.
                self.rejected += 1
                raise LimitExceeded(
                    f"capture of about {nbytes + extra} bytes is larger than the store's cap "
                    f"of {self.max_bytes}"
                )
            capture = Capture(self._next_id, name, value, leaves, nbytes, sender, **details)
            self._reserved -= nbytes
            self._held -= nbytes  # filled: _keep charges it again, with the record's cost
            listeners = self._keep([capture], [nbytes + extra])
        self._tell(listeners, [capture])
        return capture

    def add_arrived(self, captures: list[Capture], charges: list[int]) -> None:
        """Store received captures, in order, under one lock: each one's bytes are already
        here (nothing was reserved for them) and ``charges`` holds what each costs, its
        arrays and :meth:`record_bytes`, each well within the cap. Their ids are given here.

        A receiver's run of small frames that came together (see receiver.py).
        """
        with self._lock:
            now = time.time()  # under the lock, as add() does: arrival order is id order
            for capture in captures:
                capture.id = self._next_id
                capture.received_at = now
                self._next_id += 1
            listeners = self._keep(captures, charges)
        self._tell(listeners, captures)

    def _keep(self, captures: list[Capture], charges: list[int]
              ) -> list[Callable[[Capture], None]]:
        """Hold new captures as the newest, evicting to keep the cap; wake those waiting for
        them. Returns the listeners to tell (the caller holds the lock)."""
        for capture, charge in zip(captures, charges):
            self._insert(capture, charge)
            if capture.name is not None:
                self._trim(self._by_name[capture.name])
        self._make_room()  # the records' own cost was not reserved
        if self._sleepers:
            self._changed.notify_all()
        return self._listeners

    @staticmethod
    def _tell(listeners: list[Callable[[Capture], None]], captures: list[Capture]) -> None:
        for capture in captures:
            for listener in listeners:
                try:
                    listener(capture)
                except Exception:  # stored and charged already: a listener must not undo that
                    log.exception("a listener of the history failed on capture %d", capture.id)

    def restore(self, captures: list[Capture], charges: list[int]) -> int:
        """Add captures read back from a recording, each charged its ``charges`` entry;
        return how many were added.

        ``captures`` come in the recording's order. They get new ids, after those
        of the captures here; every history stays in order of arrival, loaded
        captures among received ones (see Capture.placed_at). One that is
        here already (a recording loaded twice, or saved from this history) is
        not added again: it would count twice in every history and statistic.
        Listeners (a recorder) are not told: these captures are on disk already.
        """
        with self._restoring:  # one at a time: each checks against what the last added
            names = {capture.name for capture in captures}
            with self._lock:
                mark = self._next_id
                kept = [list(self._captures_named(name)) for name in names]
            # In the recording's own order, which is the history's it was saved from: each
            # placed no earlier than the one before it (see Capture.placed_at), as there.
            placed = -math.inf
            for capture in captures:
                placed = capture.placed_at = max(capture.received_at, placed)
            # The check for captures here already walks the loaded names' whole histories:
            # outside the lock, so that captures go on being stored meanwhile, and looking
            # only at their times first (a float's hash, not a Sender's).
            times = {capture.received_at for capture in captures}
            here: dict[tuple[Any, ...], Capture | None] = {
                _arrival_of(capture): capture for history in kept for capture in history
                if capture.received_at in times}
            fresh, matched = [], []
            for position, (capture, charge) in enumerate(zip(captures, charges)):
                arrival = _arrival_of(capture)
                if arrival not in here:  # nor twice in the recording (a hostile one)
                    fresh.append((position, capture, charge))
                elif here[arrival] is not None:
                    matched.append((position, capture, charge, here[arrival]))
                here[arrival] = None  # a second copy in the recording is never added
            with self._lock:
                # What arrived meanwhile may be here already; what was here may be gone (a
                # clear(), an eviction): then the loaded one is not a second copy of it.
                since = {_arrival_of(capture) for capture in self._arrived_since(mark)}
                gone = [(position, capture, charge) for position, capture, charge, twin
                        in matched if self._by_id.get(twin.id) is not twin]
                added = [(capture, charge) for _, capture, charge in sorted(
                    fresh + gone, key=lambda item: (item[1].placed_at, item[0]))
                    if _arrival_of(capture) not in since]
                self._add_restored(added)
        return len(added)

    def _add_restored(self, fresh: list[tuple[Capture, int]]) -> None:
        """Insert captures (in order of placement) into every history where they belong."""
        for capture, charge in fresh:
            capture.id = self._next_id
            self._insert(capture, charge, received=False)
        captures = [capture for capture, _ in fresh]
        _settle_ids(self._by_id, len(captures))
        named: dict[str | None, int] = {}
        sources: dict[tuple[str | None, tuple[str | None, int | None]], int] = {}
        for capture in captures:
            named[capture.name] = named.get(capture.name, 0) + 1
            source = (capture.name, _source_of(capture))
            sources[source] = sources.get(source, 0) + 1
        for (name, key), added in sources.items():
            _settle(self._by_source[name][key], added)
        names = [name for name in named if name is not None]
        for name in names:
            _settle(self._by_name[name], named[name])
        self._settle_updated(names)
        for name in names:
            self._trim(self._by_name[name])
        self._make_room()
        if self._sleepers:
            self._changed.notify_all()

    def _captures_named(self, name: str | None) -> Iterable[Capture]:
        """The kept captures of ``name`` (None: the unnamed ones), in no particular order."""
        if name is not None:
            return self._by_name.get(name, ())
        return (capture for source in self._by_source.get(None, {}).values()
                for capture in source)

    def _arrived_since(self, mark: int) -> list[Capture]:
        """The captures stored with an id from ``mark`` on: the newest, at the end of the
        history (a restore, which could put any elsewhere, holds ``_restoring``)."""
        since = []
        for capture in reversed(self._by_id.values()):
            if capture.id < mark:
                break
            since.append(capture)
        return since

    def _settle_updated(self, names: list[str]) -> None:
        """Put ``names``, whose newest captures may have changed, where they belong in the
        order of the names' updates (each name's newest capture's arrival)."""
        updated = self._updated

        def newest(name: str) -> tuple[float, int]:
            return _order(self._by_name[name][-1])

        moved = sorted(names, key=newest)
        if not moved:
            return
        for name in moved:
            del updated[name]
        if not updated or newest(moved[0]) >= newest(next(reversed(updated))):
            updated.update(dict.fromkeys(moved))
        elif newest(moved[-1]) <= newest(next(iter(updated))):
            for name in reversed(moved):
                updated[name] = None
                updated.move_to_end(name, last=False)
        else:
            self._updated = OrderedDict.fromkeys(sorted([*updated, *moved], key=newest))

    def listen(self, listener: Callable[[Capture], None]) -> None:
        """Call ``listener(capture)`` for every capture stored from now on, on the thread that
        stored it, once stored (outside the store's lock). It must not raise; it may block,
        which holds up that connection's next frame: a recorder slows a sender it cannot
        keep up with rather than drop what it was sent."""
        with self._lock:
            self._listeners = [*self._listeners, listener]

    def unlisten(self, listener: Callable[[Capture], None]) -> None:
        """Stop calling a listener given to :meth:`listen`."""
        with self._lock:
            # ==, not is: each `obj.method` is a new bound-method object, equal to the last.
            self._listeners = [known for known in self._listeners if known != listener]

    def _insert(self, capture: Capture, charge: int, received: bool = True) -> None:
        """Hold a new capture (its id not yet used) as the newest; the caller holds the lock.
        A ``received`` one is placed after every capture kept (see Capture.placed_at); a
        loaded one where its arrival puts it (restore() puts it there)."""
        untrack(capture)  # hours of history must not be walked by every full collection
        placed = capture.received_at if received else capture.placed_at
        if received and placed < self._newest_placed:
            placed = self._newest_placed
        elif placed > self._newest_placed:
            self._newest_placed = placed
        capture.placed_at = placed
        self._next_id = capture.id + 1
        self._held += charge
        self._charged[capture.id] = charge
        self._by_id[capture.id] = capture
        if not capture.consistent:
            self._flagged += 1
        name = capture.name
        sender = capture.sender
        key = (sender.run, sender.rank)  # _source_of, inline: this runs for every capture
        try:
            self._by_source[name][key].append(capture)
        except KeyError:
            sources = self._by_source.setdefault(name, {})
            if sources:  # a name's first source is in NAME_BYTES
                self._held += SOURCE_BYTES
            sources[key] = deque((capture,))
        if name is None:
            self._unnamed += 1
            return
        history = self._by_name.get(name)
        if history is None:
            self._by_name[name] = deque((capture,))
            self._by_identifier.setdefault(hash(identifier_for(name)), set()).add(name)
            self._held += NAME_BYTES
            self._updated[name] = None
        else:
            history.append(capture)
            self._updated.move_to_end(name)

    def _trim(self, history: deque[Capture]) -> None:
        """Keep at most ``max_versions`` of one name, evicting its oldest."""
        while self.max_versions is not None and len(history) > self.max_versions:
            self._drop(history[0])
            self.evicted += 1

    def _make_room(self) -> None:
        """Evict the oldest captures until the cap holds (the newest stays, whatever it costs)."""
        while self._held > self.max_bytes and len(self._by_id) > 1:
            self._drop(next(iter(self._by_id.values())))
            self.evicted += 1

    def _drop(self, capture: Capture) -> None:
        """Forget one capture (the caller holds the lock and counts it as evicted or cleared)."""
        del self._by_id[capture.id]
        self._held -= self._charged.pop(capture.id)
        if not capture.consistent:
            self._flagged -= 1
        sources = self._by_source[capture.name]
        source = sources[_source_of(capture)]
        _forget(source, capture)
        if not source:
            del sources[_source_of(capture)]
            if sources:
                self._held -= SOURCE_BYTES
            else:
                del self._by_source[capture.name]
        if capture.name is None:
            self._unnamed -= 1
            return
        history = self._by_name[capture.name]
        _forget(history, capture)
        if not history:
            self._held -= NAME_BYTES
            del self._by_name[capture.name]
            del self._updated[capture.name]
            key = hash(identifier_for(capture.name))
            self._by_identifier[key].discard(capture.name)
            if not self._by_identifier[key]:
                del self._by_identifier[key]

    # -- querying ----------------------------------------------------------------

    def get(self, key: str | int, index: int = 0, rank: int | None = None,
            step: int | None = None, run: str | None = None) -> Capture:
        """The capture with integer id ``key``, or the ``index``-th newest of name ``key``.

        ``index=0`` is the newest, ``1`` the one before; negative indices count
        from the oldest (``-1`` is the oldest kept). ``step=`` picks the newest
        capture of that step instead. Only captures of ``run`` count (default:
        the run that sent the newest capture of the name, from ``rank`` if given;
        ``"all"``: any). With an id, none of these selects anything (ValueError).
        """
        index = whole_number(index, "index")
        if step is not None:
            step = whole_number(step, "step")
        with self._lock:
            if isinstance(key, numbers.Integral) and not isinstance(key, bool):
                if index or step is not None or rank is not None or run is not None:
                    raise ArgumentError(f"capture {key} is one capture: index=, step=, rank= and "
                                     "run= select among a name's captures, not by id")
                if int(key) not in self._by_id:
                    raise UnknownName(f"no capture with id {key} (evicted, cleared or never "
                                      "received)")
                return self._by_id[int(key)]
            chosen = self._select(key, rank, run)
            if step is None and chosen.wanted is None:
                return chosen.at(index)  # a deque's own index: no walk
            chosen = chosen.copied()  # walked outside the lock: captures go on being stored
        return _at_step(chosen, step) if step is not None else chosen.at(index)

    def get_all(self, name: str, rank: int | None = None, run: str | None = None
                ) -> list[Capture]:
        """Every kept capture of ``name`` from ``run`` (default: the run that sent the newest,
        from ``rank`` if given; ``"all"``: every run), oldest to newest."""
        with self._lock:
            chosen = self._select(name, rank, run).copied()
        return list(chosen.oldest_first())

    def recent_of(self, name: str, count: int) -> list[Capture]:
        """Up to the ``count`` newest captures of ``name`` from the run and rank of its newest,
        oldest first ([] for a name not kept); it reads no further back than it keeps."""
        with self._lock:
            history = self._by_name.get(name)
            if not history:
                return []
            source = self._by_source[name][_source_of(history[-1])]
            found = list(islice(reversed(source), max(count, 0)))
        return found[::-1]

    def runs(self) -> list[Run]:
        """The runs (training jobs) with a kept capture, the one that started first first."""
        found: dict[str | None, list[tuple[str | None, int | None, deque[Capture]]]] = {}
        with self._lock:
            for name, sources in self._by_source.items():
                for (run, rank), source in sources.items():
                    found.setdefault(run, []).append((name, rank, source))
            runs = [Run(run, min(_arrival(source[0]) for _, _, source in parts),
                        max(_arrival(source[-1]) for _, _, source in parts),
                        sum(len(source) for _, _, source in parts),
                        tuple(sorted({rank for _, rank, _ in parts if rank is not None})),
                        tuple(dict.fromkeys(  # in order of their first arrival
                            name for name, _, _ in sorted(
                                parts, key=lambda part: _order(part[2][0]))
                            if name is not None)))
                    for run, parts in found.items()]
        return sorted(runs, key=lambda run: run.start)

    def _select(self, name: str, rank: int | None, run: str | None = None) -> _Selection:
        """The captures of ``name`` from ``run`` (default: the run that sent the newest; "all":
        every run) and ``rank`` (default: every rank): one source's own history when that is
        what was asked for, so that the n-th newest is found without walking the others."""
        if rank is not None:
            rank = whole_number(rank, "rank")
        name = self._resolve(name)
        history, sources = self._by_name[name], self._by_source[name]
        ranked = [key for key in sources if rank is None or key[1] == rank]
        if not ranked:
            ranks = sorted({key[1] for key in sources}, key=lambda r: (r is None, r))
            came = ("no rank: it was caught outside a distributed job" if ranks == [None] else
                    f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}")
            raise UnknownName(f"no capture named {name!r} from rank {rank}; it came from "
                              + came)
        if run is None:  # a restarted job is a new history
            run = (history[-1] if rank is None
                   else max((sources[key][-1] for key in ranked), key=_order)).sender.run
        chosen = [key for key in ranked if run == ALL_RUNS or key[0] == run]
        if not chosen:
            runs = dict.fromkeys(key[0] for key in sorted(
                ranked, key=lambda key: _order(sources[key][0])))
            raise UnknownName(f"no capture named {name!r} from run {run!r}; it came from "
                              f"run(s) {', '.join(map(repr, runs))} (run='all': every one)")
        count = sum(len(sources[key]) for key in chosen)
        if len(chosen) == 1:
            return _Selection(name, sources[chosen[0]], None, count)
        if len(chosen) == len(sources):
            return _Selection(name, history, None, count)
        wanted = set(chosen)
        return _Selection(name, history, lambda capture: _source_of(capture) in wanted, count)

    def _resolve(self, name: str) -> str:
        """``name`` itself, or the one kept name whose identifier it is (``h_3`` for ``h[3]``)."""
        if not isinstance(name, str):
            raise ArgumentTypeError(
                f"a capture is looked up by name (str) or id (int), not {name!r}")
        if name in self._by_name:
            return name
        aliased = self._aliased(name)
        if len(aliased) == 1:
            return aliased[0]
        if aliased:
            raise _ambiguous(name, aliased)
        raise UnknownName(self._unknown(name))

    def name_to_steer(self, name: str | None) -> str | None:
        """``name`` as the REPL's steering sends it: itself if a kept capture or an on-demand
        announcement has that name, or if nothing here has it as its identifier (a job may
        not have caught it yet); else the one name whose identifier it is (as get() finds
        ``h_3`` for ``h[3]``). UnknownName if it is the identifier of several. A name with
        characters a terminal would act on is steered as the job catches it, escaped
        (``"a\\tb"`` for ``"a\tb"``)."""
        if name is None:
            return None
        if isinstance(name, str):
            name = wire.printable(name)
        with self._lock:
            announced = {announcement.name for announcement in self._available.values()}
            if name in self._by_name or name in announced:
                return name
            aliased = {*self._aliased(name), *(known for known in announced
                                               if known is not None
                                               and identifier_for(known) == name)}
        if len(aliased) > 1:
            raise _ambiguous(name, sorted(aliased))
        return aliased.pop() if aliased else name

    def _aliased(self, ident: str) -> list[str]:
        """The kept names whose identifier is ``ident``."""
        return sorted(known for known in self._by_identifier.get(hash(ident), ())
                      if identifier_for(known) == ident)

    def _unknown(self, name: str) -> str | _NameSuggestions:
        notices = list(reversed(self._unsent.values()))
        notice = next((n for n in notices if n.name == name),
                      next((n for n in notices if _names(n.name, name)), None))
        if notice is not None:
            name = notice.name  # its own, if this is its identifier
        if notice is not None and notice.refused:
            return f"nothing named {name!r} was kept: this server refused it ({notice.reason})"
        if notice is not None:
            return (f"nothing named {name!r} arrived: its sender could not send it "
                    f"({notice.reason})")
        return _NameSuggestions(name, list(self._by_name))

    def names(self) -> list[str]:
        """Names with at least one kept capture, in order of their first arrival."""
        with self._lock:
            return list(self._by_name)

    def latest(self) -> list[Capture]:
        """The newest capture of every name, plus unnamed ones, oldest first."""
        with self._lock:
            named = [history[-1] for history in self._by_name.values()]
            unnamed = [capture for source in self._by_source.get(None, {}).values()
                       for capture in source]
            return sorted(named + unnamed, key=_order)

    def recent(self, count: int) -> list[Capture]:
        """The ``count`` most recent captures, newest first."""
        with self._lock:
            return list(islice(reversed(self._by_id.values()), max(count, 0)))

    def kept(self) -> list[Capture]:
        """Every capture kept at this moment, oldest first (one look, under the lock: what
        arrives meanwhile neither joins it nor pushes its oldest out)."""
        with self._lock:
            return list(self._by_id.values())

    def versions(self, name: str) -> int:
        """How many versions of ``name`` are kept."""
        with self._lock:
            return len(self._by_name.get(name, ()))

    def overview(self, max_names: int | None = None) -> StoreOverview:
        """For summary(): the ``max_names`` most recently updated names (for each, the newest
        capture of its ``max_names`` newest runs and ranks), and counts."""
        with self._lock:
            recent = reversed(self._updated)
            if max_names is not None:
                recent = islice(recent, max(max_names, 0))
            names, hidden = [], 0
            for name in recent:
                rows = _newest_per_source(self._by_source[name])
                names += rows[:max_names]
                hidden += len(rows[max_names:]) if max_names is not None else 0
            return StoreOverview(
                names=names, hidden_rows=hidden, name_count=len(self._by_name),
                captures=len(self._by_id),
                unnamed=self._unnamed,
                received=self._next_id, evicted=self.evicted, rejected=self.rejected,
                inconsistent=self._flagged, undelivered=self._undelivered_total(),
                unsent=list(reversed(self._unsent.values())),
                held_bytes=self._held, max_bytes=self.max_bytes, max_versions=self.max_versions,
            )

    def _undelivered_total(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for counts in self._undelivered.values():
            for reason, count in counts.items():
                total[reason] = total.get(reason, 0) + count
        return total

    @property
    def received(self) -> int:
        """Captures stored since the store was created (also the next capture's id)."""
        return self._next_id

    def wait_for_arrival(self, received: int, timeout: float) -> bool:
        """Block until more than ``received`` captures were stored in all, or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._next_id <= received:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._sleep(remaining)
            return True

    def wait(self, name: str, timeout: float | None = None, after: int | None = None) -> Capture:
        """Block until a capture of ``name`` newer than id ``after`` (default: now) arrives."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not isinstance(name, str):
            raise ArgumentTypeError(f"a capture is waited for by name (str), not {name!r}")
        with self._lock:
            if after is None:
                after = self._next_id - 1
            while True:
                # A cheap look (no message built for a name not there yet): this runs
                # under the lock at every arrival.
                aliased = self._aliased(name) if name not in self._by_name else []
                if len(aliased) > 1:  # as get() says it
                    raise _ambiguous(name, aliased)
                known = name if name in self._by_name else (
                    aliased[0] if len(aliased) == 1 else None)
                history = self._by_name.get(known) if known is not None else None
                if history and history[-1].id > after:
                    return history[-1]
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no new capture of {name!r} within {timeout} s")
                # Wake at least once a second so Ctrl+C is handled promptly in a REPL.
                self._sleep(1.0 if remaining is None else min(remaining, 1.0))

    def _sleep(self, seconds: float) -> None:
        """Wait (the caller holds the lock) until a capture arrives or ``seconds`` pass."""
        self._sleepers += 1
        try:
            self._changed.wait(seconds)
        finally:
            self._sleepers -= 1

    def clear(self, name: str | None = None) -> int:
        """Forget one name's history, or everything; return how many captures were dropped."""
        with self._lock:
            if name is None:
                dropped = list(self._by_id.values())
                self._unsent.clear()
            else:
                name = self._resolve(name)
                dropped = list(self._by_name[name])
                for key in [key for key in self._unsent if key[0] == name]:
                    del self._unsent[key]
            for capture in dropped:
                self._drop(capture)
            if not self._by_id:  # nothing to be placed after: the clock is right again
                self._newest_placed = 0.0
            return len(dropped)

    def save(self, path: str | os.PathLike[str], names: str | Iterable[str] | None = None) -> int:
        """Write the kept history (or that of ``names``) as a recording in the new directory
        ``path``; return how many captures were written (see ``docs/FORMAT.md``)."""
        from . import recording

        return recording.save(self, path, names)

    def load(self, path: str | os.PathLike[str], *, skip_damaged: bool = False) -> int:
        """Add the captures of the recording at ``path``, in order of arrival among those
        here; return how many. A damaged or foreign file is refused, and nothing loaded
        (``skip_damaged=True``: the other files are, see :func:`thing.recording.load`)."""
        from . import recording

        return recording.load(path, self, skip_damaged)

    def charge(self, capture: Capture) -> int:
        """The bytes ``capture`` is counted as holding: its arrays and everything else it
        holds (its record; text and numbers that came in its header); once it is evicted,
        its arrays alone."""
        return self._charged.get(capture.id, capture.nbytes)

    @property
    def held_bytes(self) -> int:
        """Bytes of stored captures and of those being received."""
        return self._held

    def __len__(self) -> int:
        return len(self._by_id)


class _NameSuggestions:
    """An unknown name's message, with the kept names closest to it: worked out when it is
    shown, not where it is raised, under the store's lock (among 100,000 names, seconds in
    which nothing could be stored)."""

    def __init__(self, name: str, known: list[str]):
        self.name, self.known = name, known
        self._text: str | None = None

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._suggest()
        return self._text

    def __repr__(self) -> str:
        return repr(str(self))

    def _suggest(self) -> str:
        name, known = self.name, self.known
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
        # A name typed without its prefix or suffix ("weight" for "model.lm_head.weight").
        close += [k for k in known if name and name in k and k not in close][: 5 - len(close)]
        if close:
            return f"no capture named {name!r}; did you mean {', '.join(map(repr, close))}?"
        if not known:
            return (f"no capture named {name!r}: nothing is kept (none received yet, or "
                    "all cleared or evicted)")
        shown = ", ".join(map(repr, known[:20])) + (", ..." if len(known) > 20 else "")
        return f"no capture named {name!r}; known names: {shown}"


def _at_step(chosen: _Selection, step: int) -> Capture:
    """The newest capture ``chosen`` at ``step``; UnknownName saying which steps it has."""
    for capture in chosen.newest_first():
        if capture.step == step:
            return capture
    name = chosen.name
    steps = sorted({c.step for c in chosen.oldest_first() if c.step is not None})
    if not steps:
        raise UnknownName(f"no capture of {name!r} has a step (its sender is older than "
                          "thing's step numbers)")
    close = sorted(steps, key=lambda known: abs(known - step))[:3]
    raise UnknownName(f"no kept capture of {name!r} at step {step}; it has steps "
                      f"{steps[0]} to {steps[-1]} ({len(steps)} of them), the nearest "
                      f"{', '.join(map(str, sorted(close)))}")


def _arrival(capture: Capture) -> float:
    return capture.received_at


def _ambiguous(name: str, aliased: list[str]) -> UnknownName:
    """The error for an identifier that several kept names share."""
    return UnknownName(f"{name!r} stands for several names: "
                       f"{', '.join(map(repr, aliased))}; use one of them")


def _arrival_of(capture: Capture) -> tuple[Any, ...]:
    """What tells one arrival from every other: no two captures of one sender and name
    share a call number and a time of arrival, and a recording keeps both."""
    return capture.name, capture.sender, capture.call, capture.received_at


def _time(timestamp: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(timestamp))


def _names(known: str | None, name: str) -> bool:
    """Whether ``name`` is the identifier of the name ``known``."""
    return known is not None and identifier_for(known) == name


def _newest_per_source(sources: dict[tuple[str | None, int | None], deque[Capture]]
                       ) -> list[tuple[Capture, int]]:
    """``(newest capture, versions kept)`` of each run and rank that sent a name: the newest
    run first, its ranks in order."""
    newest_of_run: dict[str | None, tuple[float, int]] = {}
    for (run, _), source in sources.items():
        newest_of_run[run] = max(newest_of_run.get(run, _order(source[-1])), _order(source[-1]))
    keys = sorted(sources, key=lambda key: (key[1] is None, key[1] or 0))
    keys.sort(key=lambda key: newest_of_run[key[0]], reverse=True)  # stable: ranks stay in order
    return [(sources[key][-1], len(sources[key])) for key in keys]


@dataclass
class _Selection:
    """Some of a name's captures: ``history`` itself, or those of it ``wanted`` keeps."""

    name: str
    history: deque[Capture] | list[Capture]
    wanted: Callable[[Capture], bool] | None
    count: int

    def copied(self) -> _Selection:
        """The same captures, the history copied (a copy is one C call: it may be walked
        once the store's lock is let go)."""
        return dataclasses.replace(self, history=list(self.history))

    def newest_first(self) -> Iterable[Capture]:
        captures = reversed(self.history)
        return captures if self.wanted is None else filter(self.wanted, captures)

    def oldest_first(self) -> Iterable[Capture]:
        captures = iter(self.history)
        return captures if self.wanted is None else filter(self.wanted, captures)

    def at(self, index: int) -> Capture:
        """The ``index``-th newest (negative: counted from the oldest, -1 the oldest)."""
        if not -self.count <= index < self.count:
            raise VersionOutOfRange(f"{self.name!r} has {self.count} kept versions; "
                                    f"index {index} is out of range")
        if self.wanted is None:
            return self.history[-1 - index if index >= 0 else -index - 1]
        captures = self.newest_first() if index >= 0 else self.oldest_first()
        return next(islice(captures, index if index >= 0 else -index - 1, None))


def _source_of(capture: Capture) -> tuple[str | None, int | None]:
    """Who sent a capture, as the store splits a name's history: its run and rank."""
    return capture.sender.run, capture.sender.rank


def _order(capture: Capture) -> tuple[float, int]:
    """Where a capture stands in the history: where it was placed (Capture.placed_at: its
    arrival, unless the clock went back), ids breaking ties."""
    return capture.placed_at, capture.id


def _settle(captures: deque[Capture], added: int) -> None:
    """Put the ``added`` captures just appended to ``captures`` (in order among themselves)
    where they belong: at the end, at the start, or (rarely) among the others."""
    if not added or added == len(captures):
        return
    if _order(captures[-added - 1]) <= _order(captures[-added]):
        return
    if _order(captures[-1]) <= _order(captures[0]):
        captures.rotate(added)  # a recording older than all that is here: at the start
        return
    ordered = sorted(captures, key=_order)
    captures.clear()
    captures.extend(ordered)


def _settle_ids(by_id: OrderedDict[int, Capture], added: int) -> None:
    """:func:`_settle` for the store's captures by id, in order of arrival."""
    if not added or added == len(by_id):
        return
    captures = reversed(by_id.values())
    appended = [next(captures) for _ in range(added)]  # newest first
    before = next(captures)
    if _order(before) <= _order(appended[-1]):
        return
    if _order(appended[0]) <= _order(next(iter(by_id.values()))):
        for capture in appended:
            by_id.move_to_end(capture.id, last=False)
        return
    ordered = sorted(by_id.values(), key=_order)
    by_id.clear()
    by_id.update((capture.id, capture) for capture in ordered)


def _forget(captures: deque[Capture], capture: Capture) -> None:
    """Take ``capture`` out of ``captures``: eviction takes the oldest, in O(1)."""
    if captures[0] is capture:
        captures.popleft()
    else:
        captures.remove(capture)


def _header_bytes(value: Any) -> int:
    """Rough bytes held by the parts of a value that travelled in the header, not as arrays."""
    total = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, (str, int)):  # a str's 1, 2 or 4 bytes a character; an int's digits
            total += sys.getsizeof(node)
        elif isinstance(node, dict):
            total += 64 + 100 * len(node)
            for key, item in node.items():
                stack.append(key)
                stack.append(item)
        elif isinstance(node, (list, tuple, set, frozenset)):
            total += 56 + 8 * len(node) + (32 * len(node) if isinstance(node, (set, frozenset))
                                           else 0)
            stack.extend(node)
        elif isinstance(node, (float, complex)) or node is None:
            total += 32
        # arrays and bytes: their bytes were reserved as payload
    return total
