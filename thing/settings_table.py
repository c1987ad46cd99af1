"""What the REPL said to a job's names: settings of ``every``, ``first`` and pauses.

Settings are statements, and **the latest one that applies wins**: for a
name and a rank, of what was said for that name or every name, for that
rank or every rank, the one said last decides each of every, first and
pause. So ``pause(); resume("loss")`` sends only the loss, and a later
``pause()`` stops it too. The server keeps a :class:`SettingsTable`
(``thing/steering.py``) and replays its statements, oldest first, to a
client that connects later, whose own table (``thing/overrides.py``) so
decides the same.
"""

from __future__ import annotations

from itertools import islice
from typing import NamedTuple, Optional

# Names a table holds settings or requests for; beyond, new ones are ignored (a server
# cannot grow a job's memory, nor the time each message takes to apply, without end).
MAX_STEERED_NAMES = 1000
KINDS = ("every", "first", "pause")
# Statements for one rank, beyond which new ones are ignored: ranks run to 2**31. With the
# statements for every rank (a kind per name at most) a new connection is told fewer than
# answers.MAX_CONTROL_PER_SECOND, past which a job hangs up on its server.
MAX_RANKED_STATEMENTS = 4 * MAX_STEERED_NAMES
# first= counts kept over a "forget" for the replay after it (see SettingsTable), at most.
MAX_KEPT_BUDGETS = MAX_STEERED_NAMES + MAX_RANKED_STATEMENTS
# The operations that change what is set (a request is for the calls of now; "replayed"
# only ends what a new connection is told, see Channel._learn_settings).
STATEMENTS = ("every", "first", "pause", "resume", "reset", "forget")


class Budget:
    """How many more captures a ``first=`` set by the REPL lets through (shared by the
    settings that carry it, so working them out again keeps the count)."""

    __slots__ = ("left",)

    def __init__(self, left: int):
        self.left = left


class Setting:
    """What applies to one name (or to names with no statement of their own): None where
    nothing was said."""

    __slots__ = ("every", "first", "paused")

    def __init__(self, every: Optional[int] = None, first: Optional[Budget] = None,
                 paused: Optional[bool] = None):
        self.every = every
        self.first = first
        self.paused = paused

    def __repr__(self) -> str:
        first = None if self.first is None else self.first.left
        return f"Setting(every={self.every}, first={first}, paused={self.paused})"


class Statement(NamedTuple):
    """One thing the REPL said: ``operation`` (every, first, pause, resume) for ``name``
    (None: every name) on ``rank`` (None: every rank), with its ``value``."""

    order: int
    operation: str
    name: Optional[str]
    rank: Optional[int]
    value: int
    budget: Optional[Budget]  # first's count, while it lasts

    def __str__(self) -> str:
        what = "all names" if self.name is None else repr(self.name)
        said = {"every": "every call" if self.value == 1 else f"every {self.value} calls",
                "first": f"the next {self.value} captures", "pause": "paused",
                "resume": "sent"}[self.operation]
        return f"{what}: {said}" + ("" if self.rank is None else f" (rank {self.rank})")


_Key = tuple[Optional[str], Optional[int], str]  # a statement's name, rank and kind


class SettingsTable:
    """The statements in force (see the module docstring), on the client and the server."""

    def __init__(self) -> None:
        self._statements: dict[_Key, Statement] = {}
        self._keys_of: dict[Optional[str], set[_Key]] = {}  # a name's keys: found at once
        self._ranked = 0  # statements for one rank
        self.said = 0  # statements made so far: the next one's order
        # first= counts of before a "forget" (or the settings' expiry): the replay that
        # follows keeps them, and only that replay (see end_replay).
        self._kept_budgets: dict[tuple[Optional[str], Optional[int], int], Budget] = {}

    def apply(self, operation: str, name: Optional[str], rank: Optional[int],
              value: int) -> bool:
        """Apply one statement; False if ignored (a new name beyond MAX_STEERED_NAMES)."""
        statements = self._statements
        if operation not in STATEMENTS:
            raise ValueError(f"{operation!r} is not a statement")
        if operation == "forget":  # added to what an earlier forget kept (settings expired)
            kept = self._kept_budgets
            kept.update({(s.name, s.rank, s.value): s.budget
                         for s in statements.values() if s.budget is not None})
            # A server that forgets again and again and never ends its replay must not grow
            # them for ever: as many as the table itself holds, the oldest forgotten first.
            for key in list(islice(kept, max(len(kept) - MAX_KEPT_BUDGETS, 0))):
                del kept[key]
            statements.clear()
            self._keys_of.clear()
            self._ranked = 0
            return True
        if operation == "reset":
            self._drop(name, rank, KINDS)
            return True
        if name is not None and name not in self._keys_of and \
                len(self._keys_of) >= MAX_STEERED_NAMES:
            return False
        kind = "pause" if operation in ("pause", "resume") else operation
        if rank is not None and (name, rank, kind) not in statements and \
                self._ranked >= MAX_RANKED_STATEMENTS:
            return False
        # What this covers (its name or every name, its rank or every rank) can never
        # decide again: gone, so what is listed is what decides.
        self._drop(name, rank, (kind,))
        if operation == "resume" and name is None and rank is None:
            return True  # no pause is left for it to undo
        budget = None
        if operation == "first":
            budget = self._kept_budgets.pop((name, rank, value), None) or Budget(value)
        statements[(name, rank, kind)] = Statement(self.said, operation, name, rank, value,
                                                   budget)
        self.said += 1
        self._keys_of.setdefault(name, set()).add((name, rank, kind))
        self._ranked += rank is not None
        return True

    def end_replay(self) -> None:
        """The replay after a ``forget`` is over: a ``first`` said from now on counts anew,
        whatever it said before."""
        self._kept_budgets = {}

    def _drop(self, name: Optional[str], rank: Optional[int], kinds: tuple[str, ...]) -> None:
        """Drop the statements of ``kinds`` that a statement for ``name`` and ``rank`` covers
        (None: every one); only that name's are looked at, so a replay of many names takes
        time in proportion to them, not to their square."""
        keys = self._statements if name is None else self._keys_of.get(name, ())
        for key in [key for key in keys if key[2] in kinds and (rank is None or key[1] == rank)]:
            del self._statements[key]
            self._ranked -= key[1] is not None
            left = self._keys_of[key[0]]
            left.discard(key)
            if not left:
                del self._keys_of[key[0]]

    def statements(self) -> list[Statement]:
        """The statements in force, oldest first: what a later client is told, in order."""
        return sorted(self._statements.values())

    def names(self) -> set[Optional[str]]:
        return set(self._keys_of)

    @property
    def for_a_rank(self) -> bool:
        """Whether a statement is for one rank (not every rank)."""
        return self._ranked > 0

    def settings(self, rank: Optional[int]) -> dict[Optional[str], Setting]:
        """What applies on ``rank``: per name with a statement of its own, and (None) for
        every other name; only what says something."""
        resolved = {}
        for name in self.names() | {None}:
            setting = self.setting(name, rank)
            if setting is not None:
                resolved[name] = setting
        return resolved

    def setting(self, name: Optional[str], rank: Optional[int]) -> Optional[Setting]:
        """What applies to ``name`` (None: names with no statement of their own) on ``rank``;
        None where nothing says anything, and for a name with no statement of its own on
        ``rank`` (the setting for None applies to it)."""
        if name is not None and not any(
                key[1] is None or key[1] == rank for key in self._keys_of.get(name, ())):
            return None
        statements = self._statements
        setting = Setting()
        for kind in KINDS:
            said = [statements.get((who, where, kind)) for who in {name, None}
                    for where in {rank, None}]
            latest = max((s for s in said if s is not None), default=None)
            if latest is None:
                continue
            if kind == "every":
                setting.every = latest.value
            elif kind == "first":
                setting.first = latest.budget
            else:
                setting.paused = latest.operation == "pause"
        if setting.every is None and setting.first is None and setting.paused is None:
            return None
        return setting
