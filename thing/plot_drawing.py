"""How ``thing.plot`` and ``thing.hist`` are drawn, wherever the user looks.

- In Jupyter: a PNG drawn by matplotlib, displayed inline. thing draws on a
  ``matplotlib.figure.Figure`` of its own with the Agg renderer, not through
  pyplot: no global figure left open, no backend to configure, nothing shown
  twice by the inline backend.
- In a terminal, and piped: a Unicode plot by uniplot, in braille dots,
  fitted to the terminal (80×24 piped), coloured only in a terminal; without
  colour, several lines are each drawn in a symbol of their own (+ x o ...).
- ``file="x.png"`` (or ``.svg``, ``.pdf``): matplotlib writes it, anywhere.
- Where neither library is installed: a sparkline per line with its last,
  lowest and highest value, and once per session the line that names the
  packages that draw it (thing's ``plot`` extra).

uniplot rather than plotext, measured on the development VM: uniplot
imports in 30–46 ms beyond numpy, plotext 6.1 in 164–244 ms; at 80×24
uniplot's braille lines, boxed axes and legend read as well as plotext's.
Both libraries are imported on first draw only.

``live=True`` redraws as captures arrive (``live.py``'s views): the
notebook's image at most twice a second, a terminal's until Ctrl+C.
"""

from __future__ import annotations

import importlib
import io
import math
import os
import shutil
import sys
import threading
from typing import Any, Optional, Union

import numpy as np

from . import live
from .display import elide, in_notebook, print_drawing, say, say_once, terminal_width, wrap
from .errors import ArgumentError, ThingError
from .log import log
from .plot_series import AUTO, DEFAULT_BINS, Chart, Histogram, Names, chart, histogram
from .reports import numbers_apart
from .store import HistoryStore

Drawing = Union[Chart, Histogram]


# By the packages' own names: "thing" on the package index is another project.
INSTALL_HINT = ("pip install matplotlib uniplot (thing's plot extra) draws plots: matplotlib "
                "in Jupyter and for file=, uniplot in a terminal")
LIVE_INTERVAL = 0.5  # seconds between a live plot's redraws, at least
SPARK = "▁▂▃▄▅▆▇█"
# The symbols lines are drawn in where there is no colour to tell them apart, in order: as
# many as a chart draws in one panel (MAX_RANK_LINES ranks, or a band's five lines).
LINE_SYMBOLS = ["+", "x", "o", "*", "~", "#", "@", "%", "=", "&"]

# Live notebook plots by what they draw: drawing the same again (a cell run twice) replaces
# the old one instead of leaving a thread redrawing an output nobody sees.
_live_plots: dict[tuple[Any, ...], live.NotebookView] = {}
_live_lock = threading.Lock()


def plot(store: HistoryStore, names: Names, stat: Union[str, list[str]] = AUTO,
         rank: Union[int, str, None] = None, run: Optional[str] = None, *, live: bool = False,
         file: Union[str, os.PathLike[str], None] = None) -> Optional[live.NotebookView]:
    """``thing.plot`` for ``store`` (see its docstring)."""
    def draw() -> Chart:
        return chart(store, names, stat, rank, run)

    if live and file is not None:
        raise ArgumentError("live=True redraws where you look and file= writes once: pick one")
    drawn = draw()  # a wrong name or stat fails here, in the caller's cell
    if file is not None:
        _save(drawn, file)
        return None
    if not live:
        show(drawn)
        return None
    return _show_live(store, drawn, draw, (tuple([names] if isinstance(names, str) else names),
                                           str(stat), rank, run))


def hist(store: HistoryStore, name_or_id: Union[str, int], index: int = 0,
         rank: Optional[int] = None, *, step: Optional[int] = None, run: Optional[str] = None,
         bins: int = DEFAULT_BINS, file: Union[str, os.PathLike[str], None] = None) -> None:
    """``thing.hist`` for ``store`` (see its docstring)."""
    drawn = histogram(store, name_or_id, index, rank, step, run, bins)
    if file is not None:
        _save(drawn, file)
    else:
        show(drawn)


def show(drawing: Drawing) -> None:
    """Show ``drawing``: an image in a notebook (text where matplotlib is missing), else text."""
    if in_notebook():
        from IPython.display import display

        display(Picture(drawing))
    else:
        print_drawing(text(drawing, *_terminal_size(), color=_colour_terminal()))


class Picture:
    """A drawing as Jupyter shows it: a PNG (``image/png``) with its text as ``text/plain``."""

    def __init__(self, drawing: Drawing):
        self.drawing = drawing
        self._png: Optional[bytes] = None
        if not _has("matplotlib"):
            say_once(INSTALL_HINT)
        else:
            try:
                self._png = png(drawing)
            except ThingError:  # values matplotlib cannot scale: shown as text
                log.debug("no picture of %s", drawing.title, exc_info=True)

    def _repr_png_(self) -> Optional[bytes]:
        return self._png

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def __repr__(self) -> str:
        return text(self.drawing, 100, 24, color=False)


# -- matplotlib ----------------------------------------------------------------------------


def figure(drawing: Drawing) -> Any:
    """A ``matplotlib.figure.Figure`` of ``drawing``: a panel per statistic, sharing the
    step axis, or a histogram's bars. Raises ThingError without matplotlib."""
    if not _has("matplotlib"):
        raise ThingError(f"drawing a picture needs matplotlib: {INSTALL_HINT}")
    from matplotlib import rc_context

    # Names come from peers: "$x$" in one must not be parsed as mathtext (a bad one raises).
    with rc_context({"text.parse_math": False}):
        return _figure(drawing)


def _figure(drawing: Drawing) -> Any:
    from matplotlib.figure import Figure

    if isinstance(drawing, Histogram):
        fig = Figure(figsize=(8, 4), layout="constrained")
        axes = fig.subplots()
        widths = np.diff(drawing.edges)
        axes.bar(drawing.edges[:-1], drawing.counts, widths, align="edge", linewidth=0)
        axes.set_ylabel("count")
        _label(fig, axes, "value", drawing)
        return fig
    panels = drawing.panels
    fig = Figure(figsize=(8, 1.3 + 2.6 * len(panels)), layout="constrained")
    for axes, panel in zip(fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0],
                           panels):
        alone = len(panel.series) == 1
        for series in panel.series:
            marker = "." if len(series.steps) <= 50 else None
            # A label starting with "_" would be left out of the legend: matplotlib's rule.
            label = "\u200b" + series.label if series.label.startswith("_") else series.label
            (line,) = axes.plot(series.steps, series.values, marker=marker, label=label)
            colour = line.get_color()
            if series.extent is not None:
                axes.fill_between(series.steps, *series.extent, color=colour, alpha=0.12,
                                  linewidth=0, label="min to max" if alone else None)
            if series.band is not None:
                axes.fill_between(series.steps, *series.band, color=colour, alpha=0.3,
                                  linewidth=0, label="± std" if alone else None)
            for step in series.non_finite:
                axes.axvline(step, color="red", linestyle=":", linewidth=1)
        axes.set_ylabel(panel.title)
        axes.grid(alpha=0.3)
        if not alone or panel.series[0].band is not None:
            axes.legend(fontsize="small")
    _label(fig, axes, "step", drawing)
    return fig


def png(drawing: Drawing) -> bytes:
    """``drawing`` as PNG bytes (matplotlib's Agg renderer)."""
    out = io.BytesIO()
    _render(drawing, out, format="png")
    return out.getvalue()


def _render(drawing: Drawing, to: Any, **options: Any) -> None:
    """Draw ``drawing`` into ``to`` (a file name or a file); raises ThingError where matplotlib
    cannot, as with values near the float64 limits, whose axis it cannot divide."""
    # Near those limits its arithmetic overflows: no warnings printed into the REPL (numpy's
    # own switch, which holds for this thread only: live plots draw on one of their own).
    with np.errstate(all="ignore"):
        try:
            figure(drawing).savefig(to, dpi=100, **options)
        except (OverflowError, ValueError) as exc:
            raise ThingError(f"matplotlib could not draw {drawing.title}: {exc}") from None


def _label(fig: Any, axes: Any, x: str, drawing: Drawing) -> None:
    fig.suptitle(drawing.title)
    # The notes under the x axis's name, where the constrained layout makes room for them.
    axes.set_xlabel("\n".join([x, *drawing.notes]))


def _save(drawing: Drawing, file: Union[str, os.PathLike[str]]) -> None:
    try:
        _render(drawing, os.fspath(file))
    except OSError as exc:  # not a page of matplotlib's and PIL's frames for a bad path
        raise ThingError(f"could not write {os.fspath(file)}: {exc.strerror or exc}") from None
    say(f"Saved {drawing.title} to {os.fspath(file)}.")


# -- text ----------------------------------------------------------------------------------


def text(drawing: Drawing, width: int = 80, height: int = 24, color: bool = False) -> str:
    """``drawing`` as at most ``width`` columns and about ``height`` lines of text: uniplot's
    braille plot, or sparklines where uniplot is missing (said once) or cannot draw it."""
    if not _has("uniplot"):
        say_once(INSTALL_HINT)
        return _sparklines(drawing, width)
    notes = _notes(drawing, width)
    try:
        if isinstance(drawing, Histogram):
            # A staircase over the bin edges: each count held flat across its bin.
            xs = np.repeat(drawing.edges, 2)[1:-1]
            ys = np.repeat(drawing.counts, 2).astype(np.float64)
            body = _uniplot([(drawing.title, xs, ys)], drawing.title, width,
                            max(height - 6 - len(notes), 4), color)
            return "\n".join([body, "x: value, y: count", *notes])
        parts = []
        plot_height = max((height - 2 - len(notes)) // len(drawing.panels) - 5, 4)
        for panel in drawing.panels:
            lines = []
            for series in panel.series:
                drawn = [(series.label, series.values)]
                if len(panel.series) == 1:  # bands as their bounds; overlaid, only the lines
                    if series.band is not None:
                        drawn += [("+ std", series.band[1]), ("- std", series.band[0])]
                    if series.extent is not None:
                        drawn += [("max", series.extent[1]), ("min", series.extent[0])]
                lines += [(label, series.steps, values) for label, values in drawn]
            alone = len(drawing.panels) == 1 and panel.stat == "value"
            title = drawing.title if alone else f"{drawing.title}: {panel.title}"
            parts.append(_uniplot(lines, title, width, plot_height, color))
        return "\n".join([*parts, "x: step", *notes])
    except (OverflowError, ValueError, ZeroDivisionError):  # a range uniplot cannot scale
        log.debug("uniplot could not draw %s", drawing.title, exc_info=True)
        return _sparklines(drawing, width)


def _uniplot(lines: list[tuple[str, np.ndarray, np.ndarray]], title: str, width: int,
             height: int, color: bool) -> str:
    """One boxed uniplot plot of ``(label, x, y)`` lines, its finite points only, with y
    labels of thing's own at the right of its top, middle and bottom rows.

    uniplot's own y labels are not used: it prints the shortest text that tells its
    labels apart, so 0.5 next to 1 reads "0".
    """
    from uniplot import plot_to_string

    kept = [(label, x[np.isfinite(y)], y[np.isfinite(y)]) for label, x, y in lines]
    kept = [line for line in kept if line[2].size]
    if not kept:
        return f"{title}: no finite values"
    low, high = _span(np.concatenate([y for _, _, y in kept]))
    x_low, x_high = _span(np.concatenate([x for _, x, _ in kept]))
    marks = numbers_apart([high, low / 2 + high / 2, low])  # halved: -1e308 + 1e308 would overflow
    room = max(len(mark) for mark in marks) + 1
    # Without colour, braille lines all look alike: several are each drawn in a symbol of
    # their own, which the legend shows, at a quarter of braille's resolution a row (as
    # many as there are symbols: uniplot has no more).
    in_symbols = not color and 1 < len(kept) <= len(LINE_SYMBOLS)
    with np.errstate(all="ignore"):  # its label search overflows on ranges it then drops
        body = plot_to_string(
            [y for _, _, y in kept], [x for _, x, _ in kept], title=elide(title, width),
            legend_labels=[label for label, _, _ in kept] if len(kept) > 1 else None,
            width=max(width - 2 - room, 10), height=height, y_min=low, y_max=high,
            x_min=x_low, x_max=x_high, y_labels=False, lines=True, color=color,
            character_set="ascii" if in_symbols else "braille",
            force_ascii_characters=LINE_SYMBOLS)
    rows = body.splitlines()
    top = next(i for i, row in enumerate(rows) if row.startswith("┌")) + 1
    bottom = next(i for i, row in enumerate(rows) if row.startswith("└")) - 1
    for row, mark in zip((top, (top + bottom) // 2, bottom), marks):
        rows[row] += " " + mark
    return "\n".join(rows)


def _span(values: np.ndarray) -> tuple[float, float]:
    """The lowest and highest of ``values``, apart: a flat line is drawn in the middle."""
    low, high = float(values.min()), float(values.max())
    if not low < high:
        spread = max(abs(low) * 1e-3, 0.5)
        low, high = low - spread, high + spread
    return low, high


def sparkline(values: np.ndarray, width: int) -> str:
    """The last ``width`` values as one line of bars ``▁▂▃▄▅▆▇█`` (× where NaN or Inf)."""
    values = np.asarray(values, np.float64)[-width:] if width > 0 else np.empty(0)
    finite = values[np.isfinite(values)]
    if not finite.size:
        return "×" * len(values)
    low, high = float(finite.min()), float(finite.max())
    with np.errstate(all="ignore"):  # halved: from -1e308 to 1e308 the range overflows
        position = (values / 2 - low / 2) / (high / 2 - low / 2) * (len(SPARK) - 1)
    bars = []
    for value, place in zip(values, position):
        if not np.isfinite(value):
            bars.append("×")
        elif not np.isfinite(place):  # every value the same (or a range too small to divide)
            bars.append(SPARK[len(SPARK) // 2])
        else:
            bars.append(SPARK[min(max(int(round(place)), 0), len(SPARK) - 1)])
    return "".join(bars)


def _notes(drawing: Drawing, width: int) -> list[str]:
    """The notes under a text plot, wrapped, never cut: where the first NaN was is what
    a note is for, and a long parameter name must not push it off the line."""
    return [line for note in drawing.notes for line in wrap(note, width, indent="  ", first="")]


def _sparklines(drawing: Drawing, width: int) -> str:
    if isinstance(drawing, Histogram):
        lines = [drawing.title]
        most = max(int(drawing.counts.max()), 1)
        edges = numbers_apart([float(low) for low in drawing.edges[:len(drawing.counts)]])
        for edge, count in zip(edges, drawing.counts):
            bar = "█" * int(round(count / most * max(width - 24, 5)))
            lines.append(f"{edge:>10} {bar} {count}")
        return "\n".join([*lines, *_notes(drawing, width)])
    lines = [f"{drawing.title} over steps"]
    for panel in drawing.panels:
        for series in panel.series:
            finite = series.values[np.isfinite(series.values)]
            label = series.label if panel.stat == "value" else \
                f"{series.label} {'mean' if panel.stat == 'spread' else panel.title}"
            # The last value as it is (a NaN too, not the last finite one; a capture with no
            # such number, a dict among numbers, says so); min and max of the finite ones.
            last = float(series.values[-1])
            low, high, shown = numbers_apart([float(finite.min()), float(finite.max()), last]
                                             if finite.size else [math.nan, math.nan, last])
            if not (math.isfinite(last) or np.isin(series.steps[-1], series.non_finite)):
                shown = "(no number)"
            span = f"last {shown}, " + (f"min {low}, max {high}" if finite.size
                                        else "no finite values")
            lines.append(elide(f"{elide(label, 24, 'middle')}  "
                               f"{sparkline(series.values, max(width - 60, 8))}  {span}", width))
    return "\n".join([*lines, *_notes(drawing, width)])


# -- live ----------------------------------------------------------------------------------


def _show_live(store: HistoryStore, drawn: Chart, draw: Any, key: tuple[Any, ...]
               ) -> Optional[live.NotebookView]:
    if in_notebook():
        shown = drawn.key

        def redraw() -> Optional[Picture]:
            nonlocal shown
            fresh = _redrawn(draw)
            if fresh is None or fresh.key == shown:
                return None  # nothing it draws arrived
            shown = fresh.key
            return Picture(fresh)

        key = (id(store), *key)
        with _live_lock:
            previous = _live_plots.pop(key, None)
            if previous is not None:
                previous.stop()
            for old in [old for old, view in _live_plots.items() if not view.running]:
                del _live_plots[old]  # stopped: nothing of them, nor their store, is kept
            view = _live_plots[key] = live.NotebookView(
                store, Picture(drawn), redraw, "thing-plot", LIVE_INTERVAL)
        return view
    last = text(drawn, *_terminal_size(), color=_colour_terminal())

    def redraw_text() -> str:
        nonlocal last
        fresh = _redrawn(draw)
        if fresh is not None:
            last = text(fresh, *_terminal_size(), color=_colour_terminal())
        return last

    live.redraw_until_interrupted(store, redraw_text, LIVE_INTERVAL)
    return None


def _redrawn(draw: Any) -> Optional[Chart]:
    """The chart drawn again; None, keeping the last one shown, while there is nothing to
    draw (the name cleared, a new run's first capture holding no numbers yet)."""
    try:
        return draw()
    except (KeyError, ValueError) as exc:  # UnknownName is a KeyError
        log.debug("live plot: nothing to draw now: %s", exc)
        return None


def _terminal_size() -> tuple[int, int]:
    # One line fewer than the terminal: the prompt that follows stays with the plot.
    return terminal_width(), max(shutil.get_terminal_size((80, 24)).lines - 1, 12)


def _colour_terminal() -> bool:
    return (sys.stdout.isatty() and os.environ.get("NO_COLOR") is None
            and os.environ.get("TERM") != "dumb")


def _has(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
