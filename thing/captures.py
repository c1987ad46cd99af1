"""What the server keeps of one capture: :class:`Capture`, who sent it (:class:`Sender`),
and its value as the REPL hands it out (:func:`value_of`).

A received capture keeps its arrays as they arrived and builds its value (a
torch tensor, a dict of arrays, ...) only when first asked for; the store
(``store.py``) holds them, oldest to newest, within its cap.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import CARRIER_DTYPES, LeafSpec, leaf_bytes
from .log import log
from .value_trees import ReceivedValue, take_apart


@dataclass(frozen=True)
class Sender:
    """Who sent a capture."""

    address: str
    hostname: str = "?"
    pid: int = 0
    rank: int | None = None
    world_size: int | None = None
    run: str | None = None  # the training job it belongs to (see thing/run_names.py)


class Capture:
    """One received capture and everything known about it.

    ``step`` is the step it was caught at (see :attr:`step`).
    ``consistent`` is False when the sender saw the data change between the
    ``catch()`` call and the end of its send (a torch tensor updated in place
    while it was read in place): the value may be a later one, or a mix of two.
    ``value`` is built on first access (see :class:`thing.value_trees.ReceivedValue`).
    """

    __slots__ = ("id", "name", "_value", "_tree", "_arrays", "leaves", "nbytes", "sender",
                 "received_at", "placed_at", "caught_at", "call_site", "consistent", "call",
                 "given_step", "requested", "stats")

    def __init__(self, id: int, name: str | None, value: Any, leaves: tuple[LeafSpec, ...],
                 nbytes: int, sender: Sender, received_at: float | None = None,
                 caught_at: float | None = None, call_site: str | None = None,
                 consistent: bool = True, call: int | None = None,
                 step: int | None = None, requested: bool = False):
        self.id = id
        self.name = name
        if isinstance(value, ReceivedValue):
            # Kept as its parts, also once the value is built (what save() writes, with no
            # framework imported), and not as one more object: the arrays' tuple is one the
            # garbage collector stops tracking (and the store takes the capture itself out of
            # its walks: see _core.untrack).
            self._tree, self._arrays, self._value = value.tree, tuple(value.arrays), _NOT_BUILT
        else:
            self._tree = self._arrays = None
            self._value = value
        self.leaves = leaves
        self.nbytes = nbytes
        self.sender = sender
        self.received_at = time.time() if received_at is None else received_at
        # Where it stands in the history's order (the store sets it): its arrival, or the
        # newest already kept where this clock is behind (it stepped back, or a recording
        # loaded came from a clock ahead), so that the newest kept is the last one stored.
        self.placed_at = self.received_at
        self.caught_at = caught_at
        self.call_site = call_site
        self.consistent = consistent
        self.call = call  # the call number of its name in its sender (None: not counted)
        self.given_step = step  # catch(..., step=): None when not given
        self.requested = requested  # sent because the REPL asked (thing.request)
        self.stats: Any = None  # its statistics, once worked out (thing/history_stats.py)

    @property
    def value(self) -> Any:
        """The captured object: arrays as the framework they were sent from, never copied."""
        value = self._value
        if value is _NOT_BUILT:
            with _building:  # two REPL threads asking at once get the same object
                if self._value is _NOT_BUILT:
                    self._value = self.parts().build()
                value = self._value
        return value

    @property
    def rank(self) -> int | None:
        """The rank of the process that sent it (torch.distributed's, else ``RANK``'s); None
        outside a distributed job."""
        return self.sender.rank

    @property
    def step(self) -> int | None:
        """The step it was caught at: the one given to ``catch(step=)``, else the call number
        of its name (1 for the first call, throttled calls counted)."""
        return self.call if self.given_step is None else self.given_step

    def parts(self) -> ReceivedValue:
        """The capture as frames and recordings carry it: its tree, leaf specs and numpy
        arrays (in their carrier dtypes, sharing the capture's memory where it can)."""
        if self._arrays is not None:
            return ReceivedValue(self._tree, self.leaves, self._arrays)
        payload = take_apart(self.value)
        specs = tuple(leaf.spec for leaf in payload.leaves)
        arrays = [np.frombuffer(leaf_bytes(leaf), CARRIER_DTYPES[leaf.spec.dtype])
                  .reshape(leaf.spec.shape) for leaf in payload.leaves]
        return ReceivedValue(payload.tree, specs, arrays)

    def as_arrived(self) -> Capture:
        """This capture with arrays of its own, copied now: what the REPL then changes in
        place (``get(name) *= 2``, which changes the history) does not reach it."""
        parts = self.parts()
        own = ReceivedValue(parts.tree, parts.specs, [array.copy() for array in parts.arrays])
        copy = Capture(self.id, self.name, own, parts.specs, self.nbytes, self.sender,
                       self.received_at, self.caught_at, self.call_site, self.consistent,
                       self.call, self.given_step, self.requested)
        copy.placed_at = self.placed_at
        return copy

    def _repr_html_(self) -> str:  # Jupyter shows a capture as its description
        from .reports import capture_report

        return capture_report(self).html()

    def __repr__(self) -> str:
        flag = "" if self.consistent else ", inconsistent"
        return f"<Capture {self.id} {self.name!r} from {self.sender.address}{flag}>"


_building = threading.Lock()


class _NotBuilt:
    """A received capture's value until first asked for: one object, also through a copy
    or a pickle of the capture (both find it by its name here)."""

    def __reduce__(self) -> str:
        return "_NOT_BUILT"


_NOT_BUILT = _NotBuilt()


def value_of(capture: Capture) -> Any:
    """``capture.value``, with a warning when it may not hold the value it had when caught."""
    if not capture.consistent:
        log.warning(
            "capture %d of %r changed between catch() and the end of its send: it holds a "
            "later value or a mix (catch(..., copy=True) snapshots it)",
            capture.id, capture.name,
        )
    return capture.value
