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

What is set is worked out from the statements said, the latest that applies
winning (``thing/settings_table.py``).

A job whose REPL goes away keeps the settings for ``THING_CONTROL_TTL``
seconds after its last connection ended, then returns to its own.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

from . import wire
from .log import INFO, LogOnce, log
from .settings_table import MAX_RANKED_STATEMENTS, MAX_STEERED_NAMES, Setting, SettingsTable

if TYPE_CHECKING:
    from ._core import Throttle, Throttles


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

