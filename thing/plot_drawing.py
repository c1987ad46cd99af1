"""How ``thing.plot`` and ``thing.hist`` are drawn, wherever the user looks.

- In Jupyter: a PNG drawn by matplotlib, displayed inline. thing draws on a
  ``matplotlib.figure.Figure`` of its own with the Agg renderer, not through
  pyplot: no global figure left open, no backend to configure, nothing shown
  twice by the inline backend.
- In a terminal, and piped: a Unicode plot by uniplot, in braille dots,
  fitted to the terminal (80×24 piped), coloured only in a terminal.
- ``file="x.png"`` (or ``.svg``, ``.pdf``): matplotlib writes it, anywhere.
- Where neither library is installed: a sparkline per line with its last,
  lowest and highest value, and once per session the line that names the
  extra that draws it: ``pip install 'thing[plot]'``.

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
import os
import shutil
import sys
import threading
from typing import Any, Optional, Union

import numpy as np

from . import live
from .display import in_notebook, say, say_once, terminal_width
from .errors import ThingError
from .plot_series import AUTO, DEFAULT_BINS, Chart, Histogram, Names, chart, histogram
from .reports import number
from .store import HistoryStore

Drawing = Union[Chart, Histogram]

INSTALL_HINT = ("pip install 'thing[plot]' draws plots: matplotlib in Jupyter and for "
                "file=, uniplot in a terminal")
LIVE_INTERVAL = 0.5  # seconds between a live plot's redraws, at least
SPARK = "▁▂▃▄▅▆▇█"

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
        print(text(drawing, *_terminal_size(), color=_colour_terminal()), flush=True)


class Picture:
    """A drawing as Jupyter shows it: a PNG (``image/png``) with its text as ``text/plain``."""

    def __init__(self, drawing: Drawing):
        self.drawing = drawing
        self._png = png(drawing) if _has("matplotlib") else None
        if self._png is None:
            say_once(INSTALL_HINT)

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
            (line,) = axes.plot(series.steps, series.values, marker=marker, label=series.label)
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
    figure(drawing).savefig(out, format="png", dpi=100)
    return out.getvalue()


def _label(fig: Any, axes: Any, x: str, drawing: Drawing) -> None:
    fig.suptitle(drawing.title)
    # The notes under the x axis's name, where the constrained layout makes room for them.
    axes.set_xlabel("\n".join([x, *drawing.notes]))


def _save(drawing: Drawing, file: Union[str, os.PathLike[str]]) -> None:
    figure(drawing).savefig(os.fspath(file), dpi=100)
    say(f"Saved {drawing.title} to {os.fspath(file)}.")


# -- text ----------------------------------------------------------------------------------


def text(drawing: Drawing, width: int = 80, height: int = 24, color: bool = False) -> str:
    """``drawing`` as at most ``width`` columns and about ``height`` lines of text: uniplot's
    braille plot, or sparklines where uniplot is missing (said once)."""
    if not _has("uniplot"):
        say_once(INSTALL_HINT)
        return _sparklines(drawing, width)
    from uniplot import plot_to_string

    # uniplot adds a border on each side and the y labels on the right.
    options = dict(width=max(width - 12, 10), lines=True, color=color, character_set="braille")
    if isinstance(drawing, Histogram):
        # A staircase over the bin edges: each count held flat across its bin.
        xs, ys = np.repeat(drawing.edges, 2)[1:-1], np.repeat(drawing.counts, 2).astype(float)
        plot_height = max(height - 6 - len(drawing.notes), 4)
        body = plot_to_string(ys, xs, title=drawing.title, height=plot_height, **options)
        return "\n".join([body, "x: value, y: count", *drawing.notes])
    parts = []
    plot_height = max((height - 2 - len(drawing.notes)) // len(drawing.panels) - 5, 4)
    for panel in drawing.panels:
        xs, ys, labels = [], [], []
        for series in panel.series:
            lines = [(series.label, series.values)]
            if len(panel.series) == 1:  # bands as their bounds; overlaid, only the lines
                if series.band is not None:
                    lines += [("+ std", series.band[1]), ("- std", series.band[0])]
                if series.extent is not None:
                    lines += [("max", series.extent[1]), ("min", series.extent[0])]
            for label, values in lines:
                kept = np.isfinite(values)
                if kept.any():
                    xs.append(series.steps[kept])
                    ys.append(values[kept])
                    labels.append(label)
        if not ys:
            continue
        alone = len(drawing.panels) == 1 and panel.stat == "value"
        title = drawing.title if alone else f"{drawing.title}: {panel.title}"
        parts.append(plot_to_string(ys, xs, title=title, height=plot_height,
                                    legend_labels=labels if len(labels) > 1 else None,
                                    **options))
    return "\n".join([*parts, "x: step", *drawing.notes])


def sparkline(values: np.ndarray, width: int) -> str:
    """The last ``width`` values as one line of bars ``▁▂▃▄▅▆▇█`` (× where NaN or Inf)."""
    values = np.asarray(values, np.float64)[-width:] if width > 0 else np.empty(0)
    finite = values[np.isfinite(values)]
    if not finite.size:
        return "×" * len(values)
    low, high = float(finite.min()), float(finite.max())
    scale = (len(SPARK) - 1) / (high - low) if high > low else 0.0
    middle = len(SPARK) // 2 if scale == 0 else 0
    return "".join(SPARK[middle + int(round((v - low) * scale))] if np.isfinite(v) else "×"
                   for v in values)


def _sparklines(drawing: Drawing, width: int) -> str:
    if isinstance(drawing, Histogram):
        lines = [drawing.title]
        most = max(int(drawing.counts.max()), 1)
        for low, count in zip(drawing.edges, drawing.counts):
            bar = "█" * int(round(count / most * max(width - 24, 5)))
            lines.append(f"{number(float(low)):>10} {bar} {count}")
        return "\n".join([*lines, *drawing.notes])
    lines = [f"{drawing.title} over steps"]
    for panel in drawing.panels:
        for series in panel.series:
            finite = series.values[np.isfinite(series.values)]
            label = series.label if panel.stat == "value" else \
                f"{series.label} {'mean' if panel.stat == 'spread' else panel.title}"
            span = (f"last {number(float(finite[-1]))}, min {number(float(finite.min()))}, "
                    f"max {number(float(finite.max()))}") if finite.size else "no finite values"
            lines.append(f"{label}  {sparkline(series.values, max(width - 40, 8))}  {span}")
    return "\n".join([*lines, *drawing.notes])


# -- live ----------------------------------------------------------------------------------


def _show_live(store: HistoryStore, drawn: Chart, draw: Any, key: tuple[Any, ...]
               ) -> Optional[live.NotebookView]:
    if in_notebook():
        shown = drawn.key

        def redraw() -> Optional[Picture]:
            nonlocal shown
            fresh = draw()
            if fresh.key == shown:
                return None  # nothing it draws arrived
            shown = fresh.key
            return Picture(fresh)

        with _live_lock:
            previous = _live_plots.pop(key, None)
            if previous is not None:
                previous.stop()
            view = _live_plots[key] = live.NotebookView(
                store, Picture(drawn), redraw, "thing-plot", LIVE_INTERVAL)
        return view
    live.redraw_until_interrupted(
        store, lambda: text(draw(), *_terminal_size(), color=_colour_terminal()), LIVE_INTERVAL)
    return None


def _terminal_size() -> tuple[int, int]:
    # One line fewer than the terminal: the prompt that follows stays with the plot.
    return terminal_width(), max(shutil.get_terminal_size((80, 24)).lines - 1, 12)


def _colour_terminal() -> bool:
    return sys.stdout.isatty() and os.environ.get("NO_COLOR") is None


def _has(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
