"""Statistics over a name's history: a row per capture, worked out once, off the receive path.

A :class:`StatsWorker` computes each capture's statistics (``array_stats.py``) after
it is stored, on one background thread. Woken by an arrival, or by its own timer
while they keep coming, it lets others gather (``COLLECT_SECONDS``); then it
works through what waits in slices of
``SLICE_SECONDS``, each in a pause between arrivals (none for ``IDLE_GAP``),
or under steady traffic after ``MAX_IDLE_WAIT`` anyway, resting in
proportion after each, so that it takes at most ``share`` of a core and
never competes with a burst being received for long.
Receiving threads only hand it a capture's id (a bounded queue's append;
the thread is woken only from sleep, not for every capture: a wake-up costs
more than a small capture's statistics), and it holds no capture alive:
one evicted before its turn is skipped. The REPL's ``thing.stats`` reads
what it cached, and works out on its own thread what it has not reached yet
(and everything, for a recording opened with no server).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ._core import untrack
from .array_stats import ArrayStats, array_stats, as_float64, value_histogram
from .captures import Capture
from .display import say_once
from .errors import UnknownName
from .log import log
from .store import ALL_RUNS, HistoryStore
from .value_trees import SINGLE_LEAF

COLUMNS = ("step", "rank", "arrived", "shape", "min", "max", "mean", "std", "norm", "nan",
           "inf")
# Above this many elements the top singular value is estimated (see _large_singular_value).
EXACT_SPECTRAL_ELEMENTS = 1 << 22
MAX_WAITING = 10_000  # ids the worker may have queued; beyond, they wait for stats()
IDLE_GAP = 0.02  # seconds without an arrival before the worker starts on what waits
# Woken by an arrival, the worker lets others come for this long first, and under steady
# traffic it wakes this often by itself: at a training loop's pace one wake-up serves
# fifty captures, not one (statistics not worked out yet are worked out when asked for,
# so a plot never waits for this).
COLLECT_SECONDS = 1.0
MAX_IDLE_WAIT = 1.0  # under steady traffic it works anyway after this long, within its share
SLICE_SECONDS = 0.005  # work done between rests: one wake-up per slice, not per capture


@dataclass
class CaptureStats:
    """What is known about a capture's values: its statistics (None for a capture that
    has none: a container, text, bytes) and, once asked for, its top singular value."""

    values: Optional[ArrayStats]
    spectral: Optional[float] = None


def capture_stats(capture: Capture) -> CaptureStats:
    """The statistics of a capture of one array or number, worked out once and kept on it."""
    known = capture.stats
    if known is None:
        # Kept as long as the capture, out of the collector's walks as it is (see untrack).
        known = capture.stats = untrack(CaptureStats(untrack(_values_of(capture))))
    return known


def _values_of(capture: Capture) -> Optional[ArrayStats]:
    parts = capture.parts()  # numpy only: no framework is imported here
    if len(parts.specs) == 1 and parts.tree == SINGLE_LEAF:
        if parts.specs[0].framework == "bytes":
            return None
        return array_stats(parts.arrays[0], parts.specs[0])
    tree = parts.tree
    if parts.specs or not is_header_number(tree):
        return None
    if isinstance(tree, (bool, int, float)):
        return array_stats(_header_number(tree))
    return array_stats(np.array(capture.value))


def _header_number(number: bool | int | float) -> np.ndarray:
    """A number that travelled in the header, as an array: an int that fits 64 bits exact (as
    in an integer array), a larger one as the float it rounds to (its sign's infinity
    beyond float64), a bool as 0.0 or 1.0."""
    if type(number) is int and -(1 << 63) <= number < 1 << 64:
        return np.array(number)
    try:
        return np.array(float(number))
    except OverflowError:
        return np.array(math.inf if number > 0 else -math.inf)


def is_header_number(tree: Any) -> bool:
    """Whether a capture's tree is a number that travelled in its header: as itself, or
    tagged (a NaN's bits, a complex)."""
    return isinstance(tree, (bool, int, float)) or (
        isinstance(tree, dict) and bool(tree) and set(tree) <= {"nan", "complex"})


def top_singular_value(capture: Capture) -> Optional[float]:
    """The largest singular value of a 2-D array capture (None for anything else); exact up
    to 2**22 elements, by Lanczos bidiagonalization above; NaN for one that holds a NaN or an
    infinity, whose norm is no number."""
    known = capture_stats(capture)
    if known.spectral is None and known.values is not None:
        if known.values.finite < known.values.count:
            known.spectral = math.nan  # LAPACK's SVD fails on it ("did not converge")
            return known.spectral
        parts = capture.parts()
        if len(parts.specs) == 1 and len(parts.specs[0].shape) == 2 and parts.arrays[0].size:
            array = parts.arrays[0]
            # A complex matrix keeps its phases: the norm of |A| is not the norm of A.
            matrix = (array.astype(np.complex128) if array.dtype.kind == "c"
                      else as_float64(array, parts.specs[0]))
            if matrix is None:
                return None
            known.spectral = (float(np.linalg.norm(matrix, 2))
                              if matrix.size <= EXACT_SPECTRAL_ELEMENTS
                              else _large_singular_value(matrix))
    return known.spectral


def _orthogonal(vector: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """``vector`` less its projection on the orthonormal rows of ``basis``, twice (once
    leaves rounding of the size of what it took away)."""
    for _ in range(2):
        vector = vector - basis.T @ (basis.conj() @ vector)
    return vector


def capture_histogram(capture: Capture, bins: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """``(counts, edges)`` of the finite values of a capture of one array or number, in
    ``bins`` equal bins from its min to its max; None for a capture with no finite numbers.

    The range is read from the values counted, not from the statistics kept: an array
    handed out by ``get()`` and changed in place since would fall outside them.
    """
    values = capture_stats(capture).values
    if values is None or not values.finite:
        return None
    parts = capture.parts()
    if not parts.specs:  # a number in the header
        low = float(values.min)  # type: ignore[arg-type]
        return value_histogram(np.array(low), None, bins, low, low)
    array, spec = parts.arrays[0], parts.specs[0]
    values = array_stats(array, spec)
    if values is None or not values.finite:
        return None
    return value_histogram(array, spec, bins, float(values.min), float(values.max))


def _large_singular_value(matrix: np.ndarray, steps: int = 64) -> float:
    """The top singular value of a large matrix: exact for one with at most ``steps`` rows
    or columns, else from ``steps`` steps of Golub-Kahan bidiagonalization (Lanczos), every
    new vector orthogonalized against all before it.

    Power iteration (100 steps) read a weight matrix's value 0.1-0.3 % low: a random
    matrix's top singular values lie close together, and power iteration converges as
    fast as they differ. The largest singular value of the small bidiagonal matrix these
    steps build converges far faster: for a random 2100 x 2100 matrix, within 3e-11 of
    the exact value (1e-4 after 32 steps), in as many products with the matrix as 64
    steps of power iteration take (0.25 s here).
    """
    largest = float(np.max(np.abs(matrix)))
    if largest == 0.0:
        return 0.0
    # Worked out on the matrix scaled (exactly, by a power of two) to entries of at most 1:
    # products of entries near 1e160 overflow float64, and of entries near 1e-100 vanish.
    scale = math.frexp(largest)[1]
    half = scale // 2  # in two steps: 2**1074 (a subnormal's scale) is no float64
    matrix = matrix * math.ldexp(1.0, -half) * math.ldexp(1.0, half - scale)
    if matrix.shape[0] > matrix.shape[1]:
        matrix = matrix.T  # the same values, with its shorter side as its rows
    if matrix.shape[0] <= steps:  # a few rows: their Gram matrix, no larger, says exactly
        gram = matrix @ matrix.conj().T
        top = math.sqrt(max(float(np.linalg.eigvalsh(gram)[-1]), 0.0))
    else:
        top = _lanczos(matrix, steps)
    try:
        return math.ldexp(top, scale)
    except OverflowError:  # a norm beyond float64 (a large matrix of 1e308s)
        return math.inf


def _lanczos(matrix: np.ndarray, steps: int) -> float:
    """The top singular value of ``matrix`` (more than ``steps`` rows and columns, entries
    of at most 1) after ``steps`` steps of bidiagonalization."""
    lefts = np.zeros((steps, matrix.shape[0]), matrix.dtype)
    rights = np.zeros((steps, matrix.shape[1]), matrix.dtype)
    diagonal, above = np.zeros(steps), np.zeros(steps)
    right = np.random.default_rng(0).standard_normal(matrix.shape[1]).astype(matrix.dtype)
    right /= np.linalg.norm(right)
    done, negligible = 0, 0.0
    while done < steps:
        rights[done] = right
        left = _orthogonal(matrix @ right, lefts[:done])
        diagonal[done] = alpha = float(np.linalg.norm(left))
        negligible = max(negligible, 1e-12 * alpha)
        done += 1
        if alpha <= negligible:
            break
        lefts[done - 1] = left / alpha
        right = _orthogonal(matrix.conj().T @ lefts[done - 1], rights[:done])
        above[done - 1] = beta = float(np.linalg.norm(right))
        # An invariant subspace: its values are the matrix's (a low-rank matrix). Going on
        # would normalize what is left of rounding into vectors no longer orthogonal.
        if beta <= negligible:
            break
        right /= beta
    # The steps' bidiagonal matrix with the last step's beta beside it: its top value is
    # the norm of the matrix on the left vectors found, never above the matrix's own.
    bidiagonal = np.zeros((done, done + 1))
    bidiagonal[np.arange(done), np.arange(done)] = diagonal[:done]
    bidiagonal[np.arange(done), np.arange(1, done + 1)] = above[:done]
    return float(np.linalg.norm(bidiagonal, 2))


class StatsWorker:
    """Works out the statistics of every capture ``store`` stores, in the background, using
    at most ``share`` (0 to 1) of one core."""

    def __init__(self, store: HistoryStore, share: float = 0.25):
        self.store = store
        self.share = share
        self._waiting: deque[int] = deque(maxlen=MAX_WAITING)  # full: the oldest go
        self._last_arrival = 0.0  # monotonic
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> StatsWorker:
        """Start working on what is stored from now on."""
        if self._thread is None and self.share > 0:
            self._closing.clear()
            self._thread = threading.Thread(target=self._run, name="thing-stats", daemon=True)
            self._thread.start()
            self.store.listen(self._arrived)
        return self

    def close(self) -> None:
        """Stop (what is left is worked out when asked for)."""
        if self._thread is None:
            return
        self.store.unlisten(self._arrived)
        self._closing.set()
        self._wake.set()
        self._thread.join()
        self._thread = None

    def _arrived(self, capture: Capture) -> None:
        self._last_arrival = time.monotonic()
        self._waiting.append(capture.id)
        if not self._wake.is_set():  # asleep, or about to be: see _run
            self._wake.set()

    def _run(self) -> None:
        while True:
            if not self._waiting and time.monotonic() - self._last_arrival > COLLECT_SECONDS:
                # Quiet for a while: sleep until an arrival. Cleared before looking again:
                # an arrival after the look sets it anew.
                self._wake.clear()
                if not self._waiting and not self._closing.is_set():
                    self._wake.wait()
            # Let others come first. Under steady traffic the worker is not woken by
            # arrivals at all: this timer serves all of a second's captures at once.
            if self._closing.wait(COLLECT_SECONDS) or not self._work_through():
                return

    def _work_through(self) -> bool:
        """Work out what waits, a slice at a time, in a pause between arrivals, resting after
        each so that working takes at most ``share`` of the time; False once closing.

        Under steady traffic, once a pause was waited for in vain, the slices follow each
        other with their rests alone: waiting for one before each slice held the worker to
        one slice a second (about 1 % of a core with eight ranks sending, not its share),
        and its backlog grew for as long as the job ran."""
        steady = False
        while self._waiting:
            if not steady:
                paused = self._wait_for_a_pause()
                if paused is None:
                    return False
                steady = not paused
            started = time.perf_counter()
            while self._waiting and time.perf_counter() - started < SLICE_SECONDS:
                self._work_on(self._waiting.popleft())
            if self._waiting and self._closing.wait(
                    (time.perf_counter() - started) * (1 / self.share - 1)):
                return False
        return True

    def _wait_for_a_pause(self) -> Optional[bool]:
        """Wait for a pause in arrivals (IDLE_GAP), so that a burst is received first: True
        once one came, False after MAX_IDLE_WAIT without one (steady traffic), None once
        closing."""
        give_up = time.monotonic() + MAX_IDLE_WAIT
        while (quiet := time.monotonic() - self._last_arrival) < IDLE_GAP:
            if time.monotonic() >= give_up:
                return False
            if self._closing.wait(IDLE_GAP - quiet):
                return None
        return True

    def _work_on(self, capture_id: int) -> None:
        try:
            capture = self.store.get(capture_id)
        except UnknownName:  # evicted or cleared before its turn
            return
        try:
            capture_stats(capture)
        except Exception:  # a value it cannot read must not end the worker
            log.debug("no statistics for capture %d", capture_id, exc_info=True)


class StatsTable:
    """A row per capture (see :data:`COLUMNS`), printed as a table; :meth:`to_dict` gives
    the columns as lists (``arrived`` in seconds since the epoch)."""

    def __init__(self, title: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]):
        self.title = title
        self.columns = columns
        self.rows = rows

    def to_dict(self) -> dict[str, list[Any]]:
        """``{column: [value per capture]}``, ready for ``pandas.DataFrame``."""
        return {column: [row[i] for row in self.rows] for i, column in enumerate(self.columns)}

    def __len__(self) -> int:
        return len(self.rows)

    def _report(self) -> Any:
        from .display import Column, Report, Table
        from .reports import clock, number, shape_text

        def cell(column: str, value: Any) -> str:
            if value is None:
                return "-"
            if column == "arrived":
                return clock(value)[11:]
            if column == "shape":
                return shape_text(value)
            return number(value) if isinstance(value, float) else str(value)

        rows = [[cell(column, value) for column, value in zip(self.columns, row)]
                for row in self.rows]
        return Report(Table(self.title, [Column(column) for column in self.columns], rows))

    def __repr__(self) -> str:
        return repr(self._report())

    def _repr_html_(self) -> str:
        return self._report()._repr_html_()


def stats_table(store: HistoryStore, name: str, rank: Optional[int] = None,
                run: Optional[str] = None, spectral: bool = False) -> Any:
    """``thing.stats``: a pandas DataFrame when pandas is installed, else a StatsTable."""
    captures = store.get_all(name, rank, run)
    # A rank's rows apart from another's, and with every run asked for, a run's too.
    columns = ((COLUMNS[:2] + ("run",) + COLUMNS[2:]) if run == ALL_RUNS else COLUMNS) + (
        ("spectral",) if spectral else ())
    rows = []
    for capture in captures:
        values = capture_stats(capture).values
        # A container's shape is none of its arrays': shown as None, as its statistics are.
        shape = (capture.leaves[0].shape if len(capture.leaves) == 1
                 and capture.parts().tree == SINGLE_LEAF else None)
        row: list[Any] = [capture.step, capture.rank, capture.received_at, shape]
        if run == ALL_RUNS:
            row.insert(2, capture.sender.run)
        if values is None:
            row += [None] * 7
        else:
            row += [values.min, values.max, values.mean, values.std, values.norm, values.nan,
                    values.inf]
        if spectral:
            row.append(top_singular_value(capture))
        rows.append(tuple(row))
    table = StatsTable(f"{name}: {len(rows)} captures", columns, rows)
    try:
        import pandas
    except ImportError:
        say_once("pandas is not installed: thing.stats() returns a plain table "
                  "(pip install pandas for a DataFrame; .to_dict() converts it)")
        return table
    frame = pandas.DataFrame(table.to_dict())
    frame["arrived"] = pandas.to_datetime(frame["arrived"], unit="s")
    return frame

