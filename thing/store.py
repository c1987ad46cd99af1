"""The history store: every capture the server keeps, per name, oldest to newest.

Memory is bounded: the server reserves a capture's bytes *before* it allocates
them, evicting the oldest versions to make room, so a burst of captures can
fill the cap but never push the REPL process past it.
"""

from __future__ import annotations

import difflib
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from . import config
from .arrays import LeafSpec
from .errors import LimitExceeded


@dataclass(frozen=True)
class Sender:
    """Who sent a capture."""

    address: str
    hostname: str = "?"
    pid: int = 0
    rank: int | None = None
    world_size: int | None = None


@dataclass
class Capture:
    """One received capture and everything known about it."""

    id: int
    name: str | None
    value: Any
    leaves: tuple[LeafSpec, ...]
    nbytes: int
    sender: Sender
    received_at: float = field(default_factory=time.time)
    caught_at: float | None = None
    call_site: str | None = None
    modified_during_send: bool = False

    @property
    def rank(self) -> int | None:
        return self.sender.rank


class HistoryStore:
    """Thread-safe, byte-capped history of captures.

    ``max_bytes`` caps the array bytes held (default ``THING_STORE_BYTES``, half
    the machine's RAM); ``max_versions`` optionally caps the versions kept per
    name. The oldest captures are evicted first.
    """

    def __init__(self, max_bytes: int | None = None, max_versions: int | None = None):
        self.max_bytes = config.store_max_bytes() if max_bytes is None else max_bytes
        self.max_versions = config.store_max_versions() if max_versions is None else max_versions
        self._changed = threading.Condition()
        self._by_id: OrderedDict[int, Capture] = OrderedDict()
        self._by_name: dict[str, deque[Capture]] = {}
        self._next_id = 0
        self._held = 0  # bytes of stored captures plus reservations
        self.evicted = 0
        self.rejected = 0

    # -- receiving ---------------------------------------------------------------

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` about to be received, evicting the oldest captures."""
        with self._changed:
            if nbytes > self.max_bytes:
                self.rejected += 1
                raise LimitExceeded(
                    f"capture of {nbytes} bytes is larger than the store's cap of {self.max_bytes}"
                )
            while self._held + nbytes > self.max_bytes and self._by_id:
                self._evict(next(iter(self._by_id.values())))
            if self._held + nbytes > self.max_bytes:
                self.rejected += 1
                raise LimitExceeded("the store is full of captures still being received")
            self._held += nbytes

    def release(self, nbytes: int) -> None:
        """Give back a reservation whose capture never arrived."""
        with self._changed:
            self._held -= nbytes

    def add(self, name: str | None, value: Any, leaves: tuple[LeafSpec, ...], nbytes: int,
            sender: Sender, **details: Any) -> Capture:
        """Store a received capture whose ``nbytes`` were reserved; return it with its new id."""
        with self._changed:
            capture = Capture(self._next_id, name, value, leaves, nbytes, sender, **details)
            self._next_id += 1
            self._by_id[capture.id] = capture
            if name is not None:
                history = self._by_name.setdefault(name, deque())
                history.append(capture)
                if self.max_versions is not None and len(history) > self.max_versions:
                    self._evict(history[0])
            self._changed.notify_all()
            return capture

    def _evict(self, capture: Capture) -> None:
        del self._by_id[capture.id]
        self._held -= capture.nbytes
        self.evicted += 1
        if capture.name is not None:
            history = self._by_name[capture.name]
            history.remove(capture)
            if not history:
                del self._by_name[capture.name]

    # -- querying ----------------------------------------------------------------

    def get(self, key: str | int, index: int = 0, rank: int | None = None) -> Capture:
        """The capture with id ``key``, or the ``index``-th newest of name ``key``."""
        with self._changed:
            if isinstance(key, int) and not isinstance(key, bool):
                if key not in self._by_id:
                    raise KeyError(f"no capture with id {key} (evicted, cleared or never received)")
                return self._by_id[key]
            history = self._history(key, rank)
            if not 0 <= index < len(history):
                raise IndexError(f"{key!r} has {len(history)} versions; index {index} is out of range")
            return history[-1 - index]

    def get_all(self, name: str, rank: int | None = None) -> list[Capture]:
        """Every kept capture of ``name``, oldest to newest."""
        with self._changed:
            return self._history(name, rank)

    def _history(self, name: str, rank: int | None) -> list[Capture]:
        if name not in self._by_name:
            close = difflib.get_close_matches(str(name), list(self._by_name), n=5, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            known = "" if close else f"; known names: {', '.join(sorted(self._by_name)[:20]) or 'none yet'}"
            raise KeyError(f"no capture named {name!r}{hint}{known}")
        history = list(self._by_name[name])
        if rank is not None:
            history = [capture for capture in history if capture.rank == rank]
            if not history:
                raise KeyError(f"no capture named {name!r} from rank {rank}")
        return history

    def names(self) -> list[str]:
        """Names with at least one kept capture, in order of their first arrival."""
        with self._changed:
            return list(self._by_name)

    def latest(self) -> list[Capture]:
        """The newest capture of every name, plus unnamed ones, oldest first."""
        with self._changed:
            named = [history[-1] for history in self._by_name.values()]
            unnamed = [capture for capture in self._by_id.values() if capture.name is None]
            return sorted(named + unnamed, key=lambda capture: capture.id)

    def recent(self, count: int) -> list[Capture]:
        """The ``count`` most recent captures, newest first."""
        with self._changed:
            ids = list(self._by_id)[-count:] if count > 0 else []
            return [self._by_id[i] for i in reversed(ids)]

    def versions(self, name: str) -> int:
        """How many versions of ``name`` are kept."""
        with self._changed:
            return len(self._by_name.get(name, ()))

    def wait(self, name: str, timeout: float | None = None, after: int | None = None) -> Capture:
        """Block until a capture of ``name`` newer than id ``after`` arrives (default: newer than now)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            if after is None:
                after = self._next_id - 1
            while True:
                history = self._by_name.get(name)
                if history and history[-1].id > after:
                    return history[-1]
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no new capture of {name!r} within {timeout} s")
                self._changed.wait(remaining if remaining is None else min(remaining, 1.0))

    def clear(self, name: str | None = None) -> int:
        """Forget one name's history, or everything; return how many captures were dropped."""
        with self._changed:
            if name is None:
                dropped = list(self._by_id.values())
            else:
                if name not in self._by_name:
                    raise KeyError(f"no capture named {name!r}")
                dropped = list(self._by_name[name])
            for capture in dropped:
                self._evict(capture)
                self.evicted -= 1  # cleared on purpose, not evicted for room
            return len(dropped)

    @property
    def held_bytes(self) -> int:
        """Bytes of stored captures and of those being received."""
        return self._held

    def __len__(self) -> int:
        return len(self._by_id)
