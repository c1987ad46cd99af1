"""The pure-Python twin of ``_throttles.pyx``: the same counts (and no call sites, which
only the compiled gate uses: see ``gate.py``)."""

from __future__ import annotations

import types
from typing import Any, Optional


class Throttle:
    """One name's ``every=``/``first=`` counts."""

    __slots__ = ("name", "calls", "sent", "used")

    def __init__(self, name: Any = None) -> None:
        self.name = name
        self.calls = 0  # calls of the name, sent or not
        self.sent = 0
        self.used = 0  # the table's clock at the name's latest call

    def admit(self, every: int, first: Optional[int]) -> int:
        """Count a call; its number (from 1) if it is one to send, else 0 (``every`` below 2
        sends every call)."""
        call = self.calls
        self.calls = call + 1
        if (every > 1 and call % every) or (first is not None and self.sent >= first):
            return 0
        self.sent += 1
        return call + 1

    def count(self) -> int:
        """Count a call whatever the throttles say; its number (from 1)."""
        self.calls += 1
        return self.calls


class Throttles:
    """Every name's :class:`Throttle`, at most ``max_names`` of them (beyond it the least
    recently caught are forgotten, an eighth at a time, and their counting restarts).

    ``steered`` and ``announced`` are kept for the compiled gate, which reads
    them; here ``catch`` reads what they mirror.
    """

    def __init__(self, max_names: int = 10_000) -> None:
        self._by_name: dict[Any, Throttle] = {}
        self._clock = 0
        self.max_names = max_names
        self.steered = False
        self.announced: Any = None

    def __len__(self) -> int:
        return len(self._by_name)

    def of(self, name: Any) -> Throttle:
        """The throttle of ``name``, made if need be, and counted as its latest use."""
        throttle = self._by_name.get(name)
        self._clock += 1
        if throttle is None:  # setdefault: another thread may have made it just now
            throttle = self._by_name.setdefault(name, Throttle(name))
            throttle.used = self._clock
            if len(self._by_name) > self.max_names:
                self._forget_least_recent()
        throttle.used = self._clock
        return throttle

    def _forget_least_recent(self) -> None:
        # An eighth at a time: a job that makes up a new name at every step sorts the
        # table once per max_names / 8 names, not once per name.
        by_use = sorted(self._by_name.items(), key=lambda item: item[1].used)
        for name, throttle in by_use[:len(by_use) - self.max_names + self.max_names // 8]:
            if self._by_name.get(name) is throttle:  # not made again meanwhile
                del self._by_name[name]

    def remember(self, frame: types.FrameType, throttle: Throttle) -> bool:
        """For the compiled gate's call sites; there are none here."""
        return False

    def forget_sites(self, code: Optional[types.CodeType] = None) -> None:
        """For the compiled gate's call sites; there are none here."""
