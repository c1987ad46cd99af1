"""Views that follow the history as it grows: ``thing.status()``, and live plots.

``thing.status()`` shows the newest arrivals, and a sparkline of the recent
values of each name that holds single numbers (a loss):

- In a terminal: a view redrawn in place (rich's Live, imported here only)
  with a spinner that turns while it waits; Ctrl+C returns to the prompt.
- In Jupyter: a display that a background thread updates, so the cell ends
  at once and the kernel stays free; ``thing.status(False)``, or running
  ``status()`` again, stops it. Nobody has to interrupt the kernel, which
  would also interrupt whatever else runs in its process group (a training
  job the notebook started, for one).
- Piped, or without rich: one line per arrival, until Ctrl+C.

The server keeps receiving in every case, and after the watching stops.
:class:`NotebookView` and :func:`redraw_until_interrupted` also redraw
``thing.plot(..., live=True)`` (``plot_drawing.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .captures import Capture
from .display import (
    Column,
    Report,
    Table,
    elide,
    in_notebook,
    print_drawing,
    say,
    terminal_width,
)
from .log import log
from .reports import bytes_text, clock, flag, number, rank_text, row_kind, sender_text
from .steering import refusing_steering
from .store import HistoryStore

if TYPE_CHECKING:
    from .server import ServerInfo


REFRESH = 0.25  # seconds between redraws at most, and between spinner steps
MIN_INTERVAL = 0.1  # a flood of arrivals must not turn redrawing into a busy loop

_notebook_watcher: NotebookView | None = None
_watcher_lock = threading.Lock()


def watch(store: HistoryStore, info: Callable[[], ServerInfo], on: bool = True,
          rows: int = 10) -> None:
    """Show the newest ``rows`` arrivals live (see the module's docstring); ``on=False`` stops
    a notebook's view."""
    global _notebook_watcher
    if not on:
        stop_watching()
        return
    if in_notebook():
        with _watcher_lock:
            if _notebook_watcher is not None:
                _notebook_watcher.stop()
            _notebook_watcher = NotebookView(store, view(store, info(), rows),
                                             lambda: view(store, info(), rows), "thing-status",
                                             also=lambda: _what_is_said_of(info()))
        return
    where = info()
    try:
        say(f"Watching arrivals at {where.host}:{where.port}; press Ctrl+C to stop "
            "(the server keeps running).")
        if _terminal_can_redraw():
            _watch_in_terminal(store, info, rows)
        else:
            _watch_as_lines(store, info)
    except KeyboardInterrupt:
        pass
    kept = f"{len(store)} capture{'' if len(store) == 1 else 's'} kept"
    if info().running:
        say(f"Stopped watching; the server is still running at {where.host}:{where.port} "
            f"with {kept}.")
    else:
        say(f"Stopped watching: the server at {where.host}:{where.port} was closed; {kept}.")


def stop_watching() -> None:
    """Stop a notebook's live view, if one runs (a terminal's ends with Ctrl+C)."""
    global _notebook_watcher
    with _watcher_lock:
        if _notebook_watcher is not None:
            _notebook_watcher.stop()
            _notebook_watcher = None


def view(store: HistoryStore, info: ServerInfo, rows: int, width: int | None = None) -> Report:
    """The header line and the newest ``rows`` arrivals, as one report."""
    width = terminal_width() if width is None else width
    recent = store.recent(rows)
    clients = info.clients
    header = elide(f"thing at {info.host}:{info.port}: {store.received} received, "
                   f"{len(store)} kept ({bytes_text(store.held_bytes)}), "
                   f"{clients} client{'s' if clients != 1 else ''}", width - 2)
    table = Table(None, [Column("arrived"), Column("id"), Column("name", 16, "middle"),
                         Column("rank"), Column("shape"), Column("dtype"),
                         Column("value", 8, "number"), Column("sender", 10, "middle")],
                  [_arrival_row(capture) for capture in recent],
                  [] if recent else ["waiting for the first capture..."],
                  [("shrink", "value"), ("shrink", "sender"), ("drop", "sender"),
                   ("drop", "rank"), ("drop", "id"), ("shrink", "name")])
    return Report(header, elide(_steering_line(info), width), _sparkline_table(store, width),
                  table)


def _steering_line(info: ServerInfo) -> str:
    """What the REPL set for the running jobs (empty if nothing), and how many refuse it."""
    if not info.steering:
        return ""
    refusing = f" ({refusing_steering(info.refusing)})" if info.refusing else ""
    return "steering: " + "; ".join(map(str, info.steering)) + refusing


def _sparkline_table(store: HistoryStore, width: int, names: int = 5) -> Table | None:
    """The recent values of the ``names`` most recently updated names that hold single
    numbers, one sparkline each."""
    from .plot_drawing import sparkline
    from .plot_series import recent_values

    columns = max(min(width - 34, 60), 8)
    rows = []
    for capture, _ in store.overview(4 * names).names:
        recent = recent_values(store, capture.name, columns)
        if recent is None or any(row[0] == recent[0] for row in rows):
            continue
        label, values, newest = recent
        # The value as caught (10**400, which the sparkline's floats make inf; a complex
        # drawn as |z|), as the arrivals below show it; an array of one number, as drawn.
        shown = row_kind(newest)[3] or number(float(values[-1]))
        rows.append([label, sparkline(values, columns), shown])
        if len(rows) == names:
            break
    if not rows:
        return None
    shown = max(len(row[1]) for row in rows)  # the longest sparkline: as many values
    return Table(None, [Column("name", 12, "middle"), Column(f"last {shown}"),
                        Column("value", 8, "number")], rows, [],
                 [("shrink", "value"), ("shrink", "name")])


def _arrival_row(capture: Capture) -> list[str]:
    shape, dtype, _, value = row_kind(capture)
    return [clock(capture.received_at)[11:], str(capture.id),
            (capture.name if capture.name is not None else "(unnamed)") + flag(capture),
            rank_text(capture), shape, dtype, value, sender_text(capture)]


class NotebookView:
    """A notebook display that a background thread redraws as captures arrive, until stopped.

    ``redraw()`` returns what to display now, or None when nothing it shows
    changed. Between redraws the thread waits for an arrival (or, every
    REFRESH s, a change in what ``also()`` returns: the clients and the
    steering a status view shows), at least ``min_interval`` s and at least
    three times as long as the last redraw took, so an expensive one (a plot's
    PNG) takes at most a quarter of a core.
    """

    def __init__(self, store: HistoryStore, first: Any, redraw: Callable[[], Any],
                 thread_name: str, min_interval: float = MIN_INTERVAL,
                 also: Callable[[], object] = lambda: None):
        from IPython.display import display

        self.store = store
        self._redraw = redraw
        self._also = also
        self._min_interval = min_interval
        self._stop = threading.Event()
        self._handle = display(first, display_id=True)
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop updating; the display keeps its last state."""
        self._stop.set()
        self._thread.join(timeout=2)

    @property
    def running(self) -> bool:
        """True while the display is being updated."""
        return self._thread.is_alive()

    def __repr__(self) -> str:
        state = "updating as captures arrive; .stop() stops it" if self.running else "stopped"
        return f"<live view {self._thread.name}: {state}>"

    def _state(self) -> tuple[int, object] | None:
        """What the display shows depends on; None once the server is gone."""
        try:
            return self.store.received, self._also()
        except Exception:  # the server closed
            log.debug("%s stopped updating", self._thread.name, exc_info=True)
            return None

    def _run(self) -> None:
        seen = self._state()
        rest = self._min_interval
        while seen is not None and not self._stop.is_set():
            _next_frame(self.store, seen[0], rest, self._stop)
            now = self._state()
            if now is None:
                return
            if now == seen:
                continue
            seen = now
            started = time.perf_counter()
            try:
                shown = self._redraw()
                if shown is not None and not self._stop.is_set():
                    self._handle.update(shown)
            except Exception:  # the server closed, or the kernel's display went away
                log.debug("%s stopped updating", self._thread.name, exc_info=True)
                return
            rest = max(self._min_interval, 3 * (time.perf_counter() - started))


def _what_is_said_of(info: ServerInfo) -> object:
    """What a status view shows besides the arrivals: it is redrawn when this changes (a
    pause said with nothing arriving, a job that connects and sends nothing)."""
    return info.clients, tuple(map(str, info.steering)), info.running


def redraw_until_interrupted(store: HistoryStore, draw: Callable[[], str],
                             min_interval: float) -> None:
    """Print ``draw()`` (text, ANSI colours allowed) and redraw it in place as captures
    arrive, until Ctrl+C; where the output cannot be redrawn (piped), print it once."""
    if not _terminal_can_redraw():
        print_drawing(draw())
        say("(live plots redraw in a terminal or a notebook; this output is not one)")
        return
    from rich.live import Live
    from rich.text import Text

    say("Drawing as captures arrive; press Ctrl+C to stop.")
    try:
        with Live(Text.from_ansi(draw()), auto_refresh=False, transient=False) as shown:
            seen = store.received
            while True:
                _next_frame(store, seen, min_interval)
                if store.received != seen:
                    seen = store.received
                    shown.update(Text.from_ansi(draw()), refresh=True)
    except KeyboardInterrupt:
        pass


def _terminal_can_redraw() -> bool:
    try:
        from rich.console import Console
    except ImportError:
        return False
    console = Console()
    return console.is_terminal and not console.is_dumb_terminal


def _watch_in_terminal(store: HistoryStore, info: Callable[[], ServerInfo], rows: int) -> None:
    from rich.console import Group
    from rich.live import Live
    from rich.spinner import Spinner
    from rich.text import Text

    spinner = Spinner("dots")

    def frame() -> Group:
        report = view(store, info(), rows)
        header, *rest = report.parts
        spinner.update(text=Text(header))
        return Group(spinner, Text(Report(*rest).text()))

    # auto_refresh redraws REFRESH times a second, so the spinner turns while nothing arrives.
    live = Live(frame(), auto_refresh=True, refresh_per_second=1 / REFRESH, transient=False)
    try:
        # Started in the try, not by `with`: a Ctrl+C while it starts (it hides the cursor
        # and stands in for stdout first) must stop it too.
        live.start(refresh=True)
        seen = store.received
        while info().running:
            _next_frame(store, seen)
            seen = store.received
            live.update(frame())
    finally:
        live.stop()


def _watch_as_lines(store: HistoryStore, info: Callable[[], ServerInfo]) -> None:
    seen = store.received
    said = ""  # the steering line last said: a line again whenever it changes
    while (now := info()).running:
        steering = _steering_line(now)
        if steering != said:
            say(elide(steering or "steering: none (the jobs' own every= and first=)",
                      terminal_width()))
            said = steering
        store.wait_for_arrival(seen, REFRESH)
        received = store.received
        fresh = [c for c in reversed(store.recent(min(received - seen, 100))) if c.id >= seen]
        if received - seen > len(fresh):
            say(f"... {received - seen - len(fresh)} more arrived")
        width = terminal_width()
        for capture in fresh:
            cells = _arrival_row(capture)
            cells[2] = elide(cells[2], max(16, width // 3), "middle")  # the name, readable
            say(elide("  ".join(cell for cell in cells if cell), width))
        seen = received


def _next_frame(store: HistoryStore, seen: int, min_interval: float = MIN_INTERVAL,
                stop: threading.Event | None = None) -> None:
    """Return after the next arrival or REFRESH s, but not sooner than ``min_interval`` s."""
    started = time.monotonic()
    store.wait_for_arrival(seen, max(REFRESH, min_interval))
    rest = min_interval - (time.monotonic() - started)
    if rest > 0:
        if stop is not None:
            stop.wait(rest)
        else:
            time.sleep(rest)
