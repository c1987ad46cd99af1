"""What a plot shows, worked out from the history: lines over steps, one capture's histogram.

``thing.plot`` draws, for each name (and each rank with ``rank="all"``, each
run with ``run="all"``), one line over the steps:

- for a name whose captures are single numbers (a loss): the value;
- for arrays: statistics of each capture, by default its L2 norm in one panel
  and its spread in another: the mean, a band of ± one standard deviation and
  a lighter one from the minimum to the maximum.

The numbers are each capture's cached statistics (``history_stats.py``), so
plotting again, or live, reads no array twice. Nothing here draws:
``plot_drawing.py`` does, with whatever is installed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from .captures import Capture
from .display import counted
from .errors import ArgumentError, whole_number
from .history_stats import (
    capture_histogram,
    capture_stats,
    is_header_number,
    top_singular_value,
)
from .reports import is_container, kind
from .store import ALL_RUNS, HistoryStore
from .value_trees import SINGLE_LEAF

# What each stat draws, as its panel's title says it.
STAT_TITLES = {
    "value": "value",
    "norm": "L2 norm",
    "spread": "mean, ± std, min to max",
    "mean": "mean",
    "std": "std",
    "min": "min",
    "max": "max",
    "nan": "NaN count",
    "inf": "Inf count",
    "spectral": "top singular value",
}
AUTO = "auto"  # a single number's value; an array's norm and spread
# A run's ranks drawn a line each, at most; more are drawn as their median and range
# (rank="all" draws every one).
MAX_RANK_LINES = 8
DEFAULT_BINS = 50

Names = Union[str, list[str], tuple[str, ...]]


@dataclass
class Series:
    """One line: ``values`` over ``steps`` (NaN where a capture has no such number).

    ``band`` (mean ± std) and ``extent`` (min to max) are drawn as shaded
    ranges around it; ``non_finite`` are the steps of captures holding a NaN or
    an Inf, marked apart rather than left as a silent gap (or hidden in
    statistics over the finite values).
    """

    label: str
    steps: np.ndarray
    values: np.ndarray
    band: Optional[tuple[np.ndarray, np.ndarray]] = None
    extent: Optional[tuple[np.ndarray, np.ndarray]] = None
    non_finite: np.ndarray = field(default_factory=lambda: np.empty(0))


@dataclass
class Panel:
    """Lines of one statistic (``stat``) sharing a y axis, which shows ``title``."""

    stat: str
    title: str
    series: list[Series]


@dataclass
class Chart:
    """What ``thing.plot`` draws: panels stacked over a shared step axis, and notes."""

    title: str
    panels: list[Panel]
    notes: list[str]
    key: tuple[Any, ...]  # the ids of the captures drawn: a live plot redraws when it changes


@dataclass
class Histogram:
    """What ``thing.hist`` draws: ``counts`` of one capture's values between ``edges``."""

    title: str
    counts: np.ndarray
    edges: np.ndarray
    notes: list[str]


def chart(store: HistoryStore, names: Names, stat: Union[str, list[str]] = AUTO,
          rank: Union[int, str, None] = None, run: Optional[str] = None) -> Chart:
    """The lines ``thing.plot`` draws (see its docstring); raises ``UnknownName`` for an
    unknown name, ``ValueError`` for an unknown stat or nothing to draw."""
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ArgumentError("thing.plot needs a name, or a list of names")
    stats = _stat_list(stat)
    panels: dict[str, Panel] = {}
    notes: list[str] = []
    key: list[Any] = []
    lines = [line for name in names for line in _lines(store, name, rank, run)]
    crowds: dict[str, list[str]] = {}  # what many ranks' lines are drawn as, by its label
    for label, captures, crowd in lines:
        key.append(tuple(capture.id for capture in captures))
        if crowd is not None:
            crowds.setdefault(crowd, []).append(label)
        numbers = [capture_stats(capture).values for capture in captures]
        if all(values is None or values.count == 0 for values in numbers):
            newest = captures[-1]
            why = (f"a {_what(newest)}: plot draws single arrays and numbers; "
                   f"describe({newest.name!r}) gives each of its arrays' statistics"
                   if newest.leaves and is_container(newest.value)
                   else f"{_what(newest)} holds no numbers")
            notes.append(f"{label}: nothing to plot ({why})")
            continue
        single = all(values is None or values.count == 1 for values in numbers)
        wanted = (["value"] if single else ["norm", "spread"]) if stats == [AUTO] else stats
        if "value" in wanted and not single:
            raise ArgumentError(f"stat='value' draws single numbers, and {label} holds arrays "
                             f"({_what(captures[-1])}); try stat='norm' or 'spread'")
        for one in wanted:
            series = _series(label, one, captures)
            panels.setdefault(one, Panel(one, STAT_TITLES[one], [])).series.append(series)
        left_out = sum(values is None or values.count == 0 for values in numbers)
        if left_out:
            notes.append(f"{label}: {left_out} of {len(captures)} captures hold no numbers "
                         "(left out)")
        if any(values is not None and values.magnitude for values in numbers):
            notes.append(f"{label}: complex values, drawn as their magnitudes |x|")
        if len(series.non_finite):  # a silent gap, or a clean norm, would hide them
            notes.append(f"{label}: NaN or Inf in {len(series.non_finite)} of {len(captures)} "
                         f"captures, the first at step {_step_text(series.non_finite[0])}"
                         + ("" if single else " (their statistics are over the finite values)"))
    if not panels:
        raise ArgumentError("; ".join(notes))
    for crowd, members in crowds.items():
        for panel in panels.values():
            panel.series = _gathered(panel.series, crowd, set(members))
        notes.append(f"{crowd}: {len(members)} ranks, drawn as their median at each step, with "
                     "the least and the greatest of them (rank=k draws one rank)")
    if "value" in panels and len(panels["value"].series) <= 3:  # its axis names what it shows
        panels["value"].title = ", ".join(series.label for series in panels["value"].series)
    title = ", ".join(names) if len(names) <= 3 else f"{names[0]} and {len(names) - 1} more"
    return Chart(title, list(panels.values()), notes, tuple(key))


def histogram(store: HistoryStore, name_or_id: Union[str, int], index: int = 0,
              rank: Optional[int] = None, step: Optional[int] = None,
              run: Optional[str] = None, bins: int = DEFAULT_BINS) -> Histogram:
    """The distribution of one capture's finite values in ``bins`` equal bins (see
    ``thing.hist``)."""
    bins = whole_number(bins, "bins", least=1)
    capture = store.get(name_or_id, index, rank, step, run)
    binned = capture_histogram(capture, bins)
    label = capture.name if capture.name is not None else f"capture {capture.id}"
    if binned is None:
        raise ArgumentError(f"{label} has no finite numbers to count ({_what(capture)})")
    counts, edges = binned
    values = capture_stats(capture).values
    assert values is not None  # binned: it has numbers
    where = f" at step {capture.step}" if capture.step is not None else ""
    if capture.rank is not None:
        where += f" of rank {capture.rank}"
    notes = []
    if values.finite < values.count:
        notes.append(f"{values.count - values.finite} NaN or Inf values left out")
    if values.magnitude:
        notes.append("complex values: their magnitudes |x|")
    return Histogram(f"{label}{where}: {counted(values.finite, 'value')}", counts, edges, notes)


def recent_values(store: HistoryStore, name: str, count: int
                  ) -> Optional[tuple[str, np.ndarray, Capture]]:
    """``(label, values, newest)``: the last ``count`` values of a name whose ``newest``
    capture is a single number, from the rank and run of that capture (the label names the
    rank); None for any other name. For ``thing.status()``'s sparklines."""
    captures = store.recent_of(name, count)
    if not captures or not _single_number(captures[-1]):
        return None
    rank = captures[-1].rank
    label = name if rank is None else f"{name} rank {rank}"
    values = [capture_stats(c).values if _single_number(c) else None for c in captures]
    if values[-1] is not None and values[-1].magnitude:  # as plot() says of complex values
        label += " |x|"
    return label, _stat_values("value", values), captures[-1]


def _single_number(capture: Capture) -> bool:
    """Whether a capture is one number (told by its layout: no statistics worked out); not
    a container holding one, such as ``{"loss": loss}``, which has no statistics."""
    leaves = capture.leaves
    if not leaves:
        return is_header_number(capture.parts().tree)
    return (len(leaves) == 1 and leaves[0].framework != "bytes"
            and math.prod(leaves[0].shape) == 1 and capture.parts().tree == SINGLE_LEAF)


def _stat_list(stat: Union[str, list[str], tuple[str, ...]]) -> list[str]:
    stats = [stat] if isinstance(stat, str) else list(stat)
    unknown = [one for one in stats if one not in STAT_TITLES and one != AUTO]
    if unknown or not stats or (AUTO in stats and len(stats) > 1):
        raise ArgumentError(f"stat must be 'auto' or some of {', '.join(map(repr, STAT_TITLES))}, "
                         f"not {stat!r}")
    return stats


def _lines(store: HistoryStore, name: str, rank: Union[int, str, None],
           run: Optional[str]) -> list[tuple[str, list[Capture], Optional[str]]]:
    """``(label, captures, crowd)`` per line of ``name``: one per rank when several ranks
    sent it (unless ``rank`` picks one), and one per run with ``run="all"``. A run's
    ranks past MAX_RANK_LINES of them are one ``crowd`` (its label), drawn as one line."""
    if isinstance(rank, str) and rank != "all":
        raise ArgumentError(f"rank must be a rank number, None or 'all', not {rank!r}")
    captures = store.get_all(name, None if rank == "all" else rank, run)
    # One line through several ranks' values would zigzag between them: a line per rank.
    per_rank = rank == "all" or len({capture.rank for capture in captures}) > 1
    groups: dict[tuple[Any, ...], list[Capture]] = {}
    for capture in captures:
        by = (capture.sender.run if run == ALL_RUNS else None,
              capture.rank if per_rank else None)
        groups.setdefault(by, []).append(capture)
    # Runs in the order they first sent, and within a run the ranks in order.
    runs = list(dict.fromkeys(run_id for run_id, _ in groups))
    ordered = sorted(groups.items(), key=lambda item: (
        runs.index(item[0][0]), item[0][1] is not None, item[0][1] or 0))
    ranks_of_run: dict[Any, int] = {}
    for run_id, rank_number in groups:
        ranks_of_run[run_id] = ranks_of_run.get(run_id, 0) + (rank_number is not None)
    lines = []
    for (run_id, rank_number), group in ordered:
        label = name
        if len(runs) > 1:
            label += f" run {run_id}"
        crowd = (f"{label} ranks" if rank_number is not None and rank != "all"
                 and ranks_of_run[run_id] > MAX_RANK_LINES else None)
        if rank_number is not None:
            label += f" rank {rank_number}"
        lines.append((label, group, crowd))
    return lines


def _gathered(series: list[Series], crowd: str, members: set[str]) -> list[Series]:
    """``series`` with those of ``members`` drawn as one: at each step their median, and
    their least to their greatest as its extent (a line each, past a few, is a tangle
    with a legend longer than the plot)."""
    gathered = [one for one in series if one.label in members]
    if not gathered:
        return series
    steps = np.unique(np.concatenate([one.steps for one in gathered]))
    table = np.full((len(gathered), len(steps)), np.nan)
    for row, one in zip(table, gathered):
        row[np.searchsorted(steps, one.steps)] = one.values  # a step twice: its last value
    with warnings.catch_warnings():  # a step no rank has a number at: NaN, as it should
        warnings.simplefilter("ignore", RuntimeWarning)
        median = np.nanmedian(table, axis=0)
        extent = (np.nanmin(table, axis=0), np.nanmax(table, axis=0))
    non_finite = np.unique(np.concatenate([one.non_finite for one in gathered]))
    line = Series(f"{crowd} (median)", steps, median, None, extent, non_finite)
    first = series.index(gathered[0])
    rest = [one for one in series if one.label not in members]
    return rest[:first] + [line] + rest[first:]


def _series(label: str, stat: str, captures: list[Capture]) -> Series:
    # Captures caught before steps existed (old recordings) count from 1 by position.
    steps = np.array([capture.step if capture.step is not None else position + 1
                      for position, capture in enumerate(captures)], np.float64)
    numbers = [capture_stats(capture).values for capture in captures]
    if stat == "spectral":
        values = np.array([_or_nan(top_singular_value(capture)) for capture in captures])
    else:
        values = _stat_values("mean" if stat == "spread" else stat, numbers)
    band = extent = None
    if stat == "spread":
        std = _stat_values("std", numbers)
        band = (values - std, values + std)
        extent = (_stat_values("min", numbers), _stat_values("max", numbers))
    non_finite = steps[[n is not None and bool(n.nan or n.inf) for n in numbers]]
    return Series(label, steps, values, band, extent, non_finite)


def _stat_values(stat: str, numbers: list[Any]) -> np.ndarray:
    """One statistic of each capture as float64 (NaN where it has none); "value" is a single
    number's own value (its mean, as its only element)."""
    attribute = "mean" if stat == "value" else stat
    return np.array([np.nan if values is None else _or_nan(getattr(values, attribute))
                     for values in numbers], np.float64)


def _or_nan(number: Any) -> float:
    return np.nan if number is None else float(number)


def _what(capture: Capture) -> str:
    shape, dtype, _ = kind(capture)
    return shape if is_container(capture.value) else f"{dtype} {shape}"


def _step_text(step: float) -> str:
    return str(int(step)) if float(step).is_integer() else str(step)
