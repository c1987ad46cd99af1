"""What the REPL asked this process to send: overrides of ``every=``/``first=``, pauses, requests.

The REPL steers a running job with control messages (``wire.CONTROL``): data
from a fixed set of operations, for a name or every name, for a rank or
every rank. A connection's sender thread decodes them and applies them here;
``catch()`` on the training thread reads the result without a lock, and only
while something is set (:attr:`Overrides.active`; or set for one rank, in a
process that does not know its own yet): otherwise a call costs the one
attribute read.

- ``request(name, n)``: the next n calls of the name are sent, whatever
  the throttles say (an on-demand name is sent only so, or by a setting of
  its own).
- ``every(name, n)`` / ``first(name, n)``: replace the job's own; ``first``
  counts the captures sent from when it was set.
- ``pause(name)`` / ``resume(name)``: nothing of the name (of any, with no
  name) is sent / it is sent again.
- ``reset(name)``: the job's own settings again, and no request left.

Settings are statements, and **the latest one that applies wins**: for a
name and a rank, of what was said for that name or every name, for that
rank or every rank, the one said last decides each of every, first and
pause. So ``pause(); resume("loss")`` sends only the loss, and a later
``pause()`` stops it too. The server keeps the same :class:`SettingsTable`
and replays its statements, oldest first, to a client that connects later,
which so decides the same.

A job whose REPL goes away keeps the settings for ``THING_CONTROL_TTL``
seconds after its last connection ended, then returns to its own.
"""

from __future__ import annotations

import threading
import time
from itertools import islice
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

from . import wire
from .log import INFO, LogOnce, log

if TYPE_CHECKING:
    from ._core import Throttle, Throttles


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


class Overrides:
    """This process's table of what the REPL set (see the module docstring).

    ``enabled=False`` (``THING_CONTROL=0``, ``Client(control=False)``) ignores
    every message. ``rank()`` is this process's rank now: statements for every
    rank are kept, and what applies is worked out again when it changes (a
    job under ``mp.spawn`` connects before it knows its rank). ``throttles``,
    the client's counts, is told whether anything is set
    (``Throttles.steered``): its compiled gate then leaves every call to catch().
    """

    def __init__(self, enabled: bool, ttl: float, rank: Callable[[], Optional[int]],
                 throttles: Optional[Throttles] = None):
        self.enabled = enabled
        self.ttl = ttl
        self._rank = rank
        self.active = False  # anything set or requested: catch() consults the table only then
        self._throttles = throttles  # told of each change of active
        self._table = SettingsTable()
        # Replaced whole by writers, never changed in place: catch() reads them unlocked.
        self._settings: dict[Optional[str], Setting] = {}
        self._settings_rank: Optional[int] = None  # the rank _settings were worked out for
        self._requests: dict[str, int] = {}
        # Names requested that have brought nothing yet: someone at the REPL waits for them.
        self._unanswered: set[str] = set()
        self._write = threading.Lock()  # the sender's: the table and the settings
        # What catch() takes, held for a few steps: the requests, never behind the table.
        self._asked = threading.Lock()
        self._refreshing = threading.Lock()  # see _refresh
        self._connections: set[int] = set()  # ids of channels connected now
        self._expires_at: Optional[float] = None  # monotonic; once no connection is left
        self._server: Optional[str] = None  # the instance of the server the table is from
        self._say_once = LogOnce()

    # -- the training thread ---------------------------------------------------------

    def admit(self, name: Optional[str], throttle: Throttle, every: int,
              first: Optional[int], on_demand: bool) -> tuple[int, bool]:
        """Count a call of ``name``: ``(call number, requested)`` when it is to be sent,
        ``(0, False)`` when not. Called by catch() while :attr:`active`."""
        if name in self._requests and self._take_request(name):
            return throttle.count(), True
        # Checked here too, not only by a channel reconnecting: a forked worker whose every
        # call is paused opens none.
        if self._expires_at is not None and time.monotonic() >= self._expires_at:
            self.expire()
        if self._rank() != self._settings_rank:  # learnt since the settings came
            with self._write:
                self._resolve_all()
                self._refresh()
        settings = self._settings
        setting = settings.get(name) or settings.get(None)
        if setting is None:
            if on_demand:
                throttle.count()
                return 0, False
            return throttle.admit(every, first), False
        own = name in settings
        budget = setting.first
        # An on-demand name goes only when asked for: a request, or a setting of its own.
        if (setting.paused or (budget is not None and budget.left <= 0)
                or (on_demand and not (own and (setting.every or budget)))):
            throttle.count()
            return 0, False
        call = throttle.admit(setting.every or every, None if budget is not None else first)
        if call and budget is not None:
            budget.left -= 1
        return call, False

    def paused(self, name: Optional[str]) -> bool:
        """Whether the REPL paused ``name`` (on this rank) now."""
        settings = self._settings
        setting = settings.get(name) or settings.get(None)
        return setting is not None and bool(setting.paused)

    def _take_request(self, name: str) -> bool:
        with self._asked:
            left = self._requests.get(name, 0)
            if left <= 0:
                return False
            requests = dict(self._requests)
            if left == 1:
                del requests[name]
            else:
                requests[name] = left - 1
            self._requests = requests
            self._refresh()
            return True

    def first_answer(self, name: str) -> bool:
        """Whether a requested capture of ``name`` is the first its request brings (once
        per request): that one is sent at once, the rest of a request for many calls with
        the sender's tick."""
        with self._asked:
            if name not in self._unanswered:
                return False
            self._unanswered.discard(name)
            return True

    # -- connection threads -----------------------------------------------------------

    def apply(self, message: wire.ControlMessage) -> None:
        """Apply one decoded control message (see :meth:`apply_all`)."""
        self.apply_all([message])

    def apply_all(self, messages: list[wire.ControlMessage]) -> None:
        """Apply decoded control messages, in order (those for this rank, if control is
        on), then work out once what they change: a flood of statements for every name
        cost a job's sender the settings of every name at each (7 ms apiece)."""
        if not self.enabled:
            self._say_once("ignored", INFO, "thing: ignoring the REPL's control messages "
                           "(THING_CONTROL=0 or Client(control=False))")
            return
        kept = True
        with self._write:
            changed: set[Optional[str]] = set()  # names whose setting may have changed
            everything = False  # ... or every name's
            for message in messages:
                operation, name = message.operation, message.name
                if operation == "replayed":  # the channel reads it too (_learn_settings)
                    self._table.end_replay()
                elif operation == "request":
                    kept &= self._request(message)
                else:
                    if operation == "reset" and message.rank in (None, self._rank()):
                        self._forget_requests(name)  # no call asked for is left waiting
                    kept &= self._table.apply(operation, name, message.rank, message.value)
                    everything |= name is None or operation == "forget"
                    changed.add(name)
            if everything or (changed and self._rank() != self._settings_rank):
                self._resolve_all()
            elif changed:  # only these names' settings can have changed
                settings = dict(self._settings)
                for name in changed:
                    setting = self._table.setting(name, self._settings_rank)
                    if setting is None:
                        settings.pop(name, None)
                    else:
                        settings[name] = setting
                self._settings = settings
            self._refresh()
        log.debug("thing: the REPL set %s%s", messages[0],
                  f" and {len(messages) - 1} more" if len(messages) > 1 else "")
        if not kept:
            self._say_once("full", INFO, f"thing: ignoring the REPL's settings for more than "
                                   f"{MAX_STEERED_NAMES} names, or {MAX_RANKED_STATEMENTS} "
                                   "for single ranks")

    def _request(self, message: wire.ControlMessage) -> bool:
        """Count a request's calls; False if ignored (a new name beyond MAX_STEERED_NAMES)."""
        name = message.name
        assert name is not None  # wire.decode_control refuses a request for no name
        if message.rank is not None and message.rank != self._rank():
            return True  # for the calls of now, of another rank
        with self._asked:
            if name not in self._requests and len(self._requests) >= MAX_STEERED_NAMES:
                return False
            self._requests = {**self._requests, name: self._requests.get(name, 0) + message.value}
            self._unanswered.add(name)
        return True

    def _forget_requests(self, name: Optional[str]) -> None:
        """Drop what was requested of ``name`` (None: of every name)."""
        with self._asked:
            self._requests = {} if name is None else {
                key: left for key, left in self._requests.items() if key != name}
            self._unanswered.intersection_update(self._requests)

    def connected(self, channel: int, server: Optional[str]) -> None:
        """A connection to the server instance ``server`` is up: the settings stay (the server
        replays its own). Under another server (a REPL since restarted) nothing of the
        last one's is kept: not a ``first`` count used up, for the same ``first`` said
        anew, nor a request, which that server could neither show nor stop."""
        with self._write:
            self._connections.add(channel)
            self._expires_at = None
            if server != self._server:  # its replay decides all; nothing is kept from before
                self._table, self._server = SettingsTable(), server
                self._forget_requests(None)
                self._resolve_all()
                self._refresh()

    def disconnected(self, channel: int) -> None:
        """A connection ended: with none left, the settings last ``ttl`` seconds more."""
        with self._write:
            self._connections.discard(channel)
            if not self._connections and self.active and self._expires_at is None:
                self._expires_at = time.monotonic() + self.ttl

    def expire(self) -> bool:
        """Drop the settings if no server connected for ``ttl`` seconds; True if it did.
        Called by a channel's thread while it tries to reconnect."""
        with self._write:
            if self._expires_at is None or time.monotonic() < self._expires_at:
                return False
            self._forget_all()
        log.info("thing: no REPL for %.0f s: back to this job's own every=/first=", self.ttl)
        return True

    def after_fork(self) -> None:
        """In a forked child: the parent's connections and requests are the parent's; the
        settings stay (the child's own connection replays the server's), for ``ttl`` at most
        if it never connects."""
        # A sender thread of the parent may have held them.
        self._write, self._asked, self._refreshing = (threading.Lock(), threading.Lock(),
                                                      threading.Lock())
        self._connections = set()
        self._requests, self._unanswered = {}, set()
        if self._expires_at is None and self._table.statements():  # the parent was connected
            self._expires_at = time.monotonic() + self.ttl
        self._refresh()

    def settings(self) -> dict[Optional[str], Setting]:
        """What applies now, by name (None: every name without a setting of its own)."""
        return dict(self._settings)

    def requests(self) -> dict[str, int]:
        """Calls still requested, by name."""
        return dict(self._requests)

    def _resolve_all(self) -> None:
        """Work out what applies to every name, on the rank this process has now."""
        self._settings_rank = rank = self._rank()
        self._settings = self._table.settings(rank)

    def _forget_all(self) -> None:
        # As a "forget": what a first= let through is kept for the replay of the same
        # server's statements, should it come back (another server's starts a new table).
        self._table.apply("forget", None, None, 0)
        self._settings, self._expires_at = {}, None
        self._forget_requests(None)
        self._refresh()

    def _refresh(self) -> None:
        # So does a statement for one rank while this process does not know its own: it
        # may learn that it is that rank (see admit), which a call then finds out. Under a
        # lock of its own: a catch taking a request (under _asked) and the sender applying
        # statements (under _write) must not write what each read before the other wrote.
        with self._refreshing:
            self.active = bool(self._settings or self._requests or (
                self._settings_rank is None and self._table.for_a_rank))
            if self._throttles is not None:
                self._throttles.steered = self.active

