"""thing.stats(): a row of statistics per capture, equal to numpy's, worked out in the background.

A client process sends every dtype (bf16 and fp8 too), NaN and Inf, empty and
0-d arrays and plain numbers; the server's background worker has the
statistics of each before anyone asks, and they match numpy's on the values
as received.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import thing
from thing.arrays import LeafSpec
from thing.captures import Sender
from thing.history_stats import (
    COLUMNS,
    StatsTable,
    capture_histogram,
    capture_stats,
    stats_table,
)
from thing.store import HistoryStore

from .conftest import poll, run_script

SENDER = """
    import numpy as np, torch, thing
    values = {
        "f32": np.array([[1.5, -2.0, np.nan], [np.inf, 4.0, -np.inf]], np.float32),
        "f64": np.linspace(-3, 7, 101),
        "f16": np.array([0.5, 65504.0, -1.0], np.float16),
        "i64": np.array([2**62, -(2**62), 7], np.int64),
        "u8": np.arange(256, dtype=np.uint8),
        "bool": np.array([True, False, True]),
        "c64": np.array([3 + 4j, 1j], np.complex64),
        "bf16": torch.linspace(-2, 2, 17).to(torch.bfloat16),
        "fp8": torch.tensor([0.5, -1.5, 2.0]).to(torch.float8_e4m3fn),
        "empty": np.zeros((0, 4), np.float32),
        "zero-d": np.array(-2.25),
        "all nan": np.full(3, np.nan),
        "number": 3.25,
        "matrix": np.arange(12.0).reshape(3, 4) ** 1.5,
    }
    for step in range(3):
        for name, value in values.items():
            assert thing.catch(value, name=name).wait(30)
"""


def _columns(table) -> dict:
    """``{column: [values]}`` of a StatsTable or a DataFrame, a missing value as None."""
    columns = table.to_dict() if isinstance(table, StatsTable) else table.to_dict("list")
    return {name: [None if isinstance(v, float) and math.isnan(v) else v for v in values]
            for name, values in columns.items()}


def _expected(value) -> tuple:
    """min, max, mean, std, norm, nan, inf as numpy gives them, over the finite values."""
    if hasattr(value, "detach"):
        value = value.detach().float().numpy()
    x = np.abs(np.asarray(value)) if np.iscomplexobj(value) else np.asarray(value, np.float64)
    x = x.astype(np.float64).reshape(-1)
    finite = x[np.isfinite(x)]
    nan, inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
    if not finite.size:
        return (None,) * 5 + (nan, inf)
    return (finite.min(), finite.max(), finite.mean(), finite.std(), math.sqrt(np.dot(finite,
                                                                                     finite)),
            nan, inf)


def test_every_dtype_matches_numpy_and_is_ready_before_asked(server: thing.Server) -> None:
    run_script(SENDER, server.port, timeout=120)
    captures = server.store.recent(len(server.store))
    poll(lambda: all(capture.stats is not None for capture in captures), 30,
         "the background worker to reach every capture")
    for name in server.store.names():
        rows = _columns(server.stats(name))
        assert rows["step"] == [1, 2, 3]
        expected = _expected(server.get(name))
        for column, want in zip(("min", "max", "mean", "std", "norm", "nan", "inf"), expected):
            got = rows[column][-1]
            if want is None:
                assert got is None, (name, column)
            else:
                assert got == pytest.approx(want, rel=1e-12, abs=1e-12), (name, column)
    assert _columns(server.stats("i64"))["max"][0] == 2**62  # integers exactly


def test_top_singular_values(server: thing.Server) -> None:
    run_script(SENDER.replace("for step in range(3)", "for step in range(1)"), server.port,
               timeout=120)
    spectral = _columns(server.stats("matrix", spectral=True))["spectral"]
    assert spectral[0] == pytest.approx(np.linalg.norm(server.get("matrix"), 2), rel=1e-12)
    assert _columns(server.stats("f64", spectral=True))["spectral"] == [None]  # not 2-D
    # Large: by power iteration, here on a matrix whose top singular value is known.
    store = HistoryStore()
    u, v = np.ones(2048), np.linspace(1, 2, 2049)
    store.add("big", np.outer(u, v), (), 0, Sender("a:1"))
    value = _columns(stats_table(store, "big", spectral=True))["spectral"][0]
    assert value == pytest.approx(np.linalg.norm(u) * np.linalg.norm(v), rel=1e-9)
    # A random weight matrix, whose top singular values lie close together: power iteration
    # read it 0.2 % low.
    weights = np.random.default_rng(1).standard_normal((2100, 2100)).astype(np.float32)
    store.add("weights", weights, (), 0, Sender("a:1"))
    value = _columns(stats_table(store, "weights", spectral=True))["spectral"][0]
    assert value == pytest.approx(np.linalg.norm(weights.astype(np.float64), 2), rel=1e-9)
    # A few long rows (an embedding's few channels): the first version of the estimate
    # read a 1 x 5,000,000 matrix's 2236 as 0.08.
    for shape in ((1, 5_000_000), (3, 2_000_000)):
        rows = np.random.default_rng(2).standard_normal(shape)
        store.add(f"rows{shape}", rows, (), 0, Sender("a:1"))
        value = _columns(stats_table(store, f"rows{shape}", spectral=True))["spectral"][0]
        assert value == pytest.approx(np.linalg.norm(rows, 2), rel=1e-9)


def test_the_large_estimate_holds_at_magnitudes_whose_products_overflow_or_vanish() -> None:
    """Above 2**22 elements: entries near 1e160 made NaN (and printed numpy's overflow
    warning), entries near 1e-100 made 0.0."""
    store = HistoryStore()
    u, v = np.ones(2048), np.linspace(1, 2, 2049)
    for scale in (1e160, 1e-100, 1e-170, 1e-310):
        store.add(f"w{scale}", np.outer(u, v) * scale, (), 0, Sender("a:1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for scale in (1e160, 1e-100, 1e-170, 1e-310):
            value = _columns(stats_table(store, f"w{scale}", spectral=True))["spectral"][0]
            assert value == pytest.approx(np.linalg.norm(u) * np.linalg.norm(v) * scale,
                                          rel=1e-9)


def test_a_matrix_that_went_nan_has_no_spectral_norm_and_breaks_nothing() -> None:
    # A diverged run's weights: LAPACK's SVD refuses them, and stats() and plot() raised.
    store = HistoryStore()
    diverged, infinite = np.eye(3), np.eye(3)
    diverged[0, 1], infinite[2, 2] = np.nan, -np.inf
    for step, matrix in enumerate((np.eye(3), diverged, infinite, np.full((3, 3), np.nan))):
        store.add("w", matrix, (), 0, Sender("a:1"), call=step + 1)
    spectral = _columns(stats_table(store, "w", spectral=True))["spectral"]
    assert spectral == [pytest.approx(1.0), None, None, None]  # NaN: no number


def test_a_plain_table_without_pandas_and_stats_of_a_recording(tmp_path: Path,
                                                               monkeypatch) -> None:
    store = HistoryStore()
    for step in range(4):
        store.add("loss", 1.0 / (step + 1), (), 0, Sender("a:1"), call=step + 1)
    store.save(tmp_path / "rec")
    loaded = HistoryStore()
    loaded.load(tmp_path / "rec")
    assert all(capture.stats is None for capture in loaded.get_all("loss"))  # on demand
    monkeypatch.setitem(sys.modules, "pandas", None)
    table = stats_table(loaded, "loss")
    assert isinstance(table, StatsTable) and len(table) == 4
    assert table.to_dict()["mean"] == [1.0, 0.5, 1 / 3, 0.25]
    assert list(table.to_dict()) == list(COLUMNS)
    text = repr(table)
    assert text.splitlines()[0] == "loss: 4 captures"
    assert text.splitlines()[1].split() == list(COLUMNS)
    assert "<table" in table._repr_html_()
    assert capture_stats(loaded.get("loss")).values.mean == 0.25


def test_a_dataframe_with_pandas(server: thing.Server) -> None:
    pandas = pytest.importorskip("pandas")
    run_script("import thing; [thing.catch(float(i), name='x').wait(10) for i in range(3)]",
               server.port)
    frame = thing.Server.stats(server, "x")
    assert isinstance(frame, pandas.DataFrame) and list(frame.columns) == list(COLUMNS)
    assert frame["mean"].tolist() == [0.0, 1.0, 2.0]
    assert str(frame["arrived"].dtype).startswith("datetime64")


def test_the_rows_of_ranks_and_runs_say_whose_they_are(tmp_path: Path, monkeypatch) -> None:
    """A distributed job's rows repeat every step once per rank: each says its rank, and
    with run="all" its run (a column only then: for one run it would say one thing)."""
    monkeypatch.setitem(sys.modules, "pandas", None)
    store = HistoryStore()
    for run in ("first", "second"):
        for rank in (0, 1):
            store.add("loss", float(rank), (), 0, Sender("a:1", rank=rank, run=run), call=1)
    newest = stats_table(store, "loss").to_dict()
    assert (newest["rank"], newest["mean"]) == ([0, 1], [0.0, 1.0])
    everything = stats_table(store, "loss", run="all")
    assert list(everything.to_dict())[:3] == ["step", "rank", "run"]
    assert everything.to_dict()["run"] == ["first", "first", "second", "second"]
    assert repr(everything).splitlines()[1].split()[:3] == ["step", "rank", "run"]


def test_a_histogram_counts_the_values_as_they_are_now(server: thing.Server) -> None:
    """get() hands out the kept array itself: changed in place, its histogram spans what
    it holds now (the statistics kept from its arrival would have clipped it)."""
    run_script("import numpy as np, thing\n"
               "assert thing.catch(np.arange(10.0), name='w').wait(10)", server.port)
    kept = server.get("w")
    kept *= 100
    counts, edges = capture_histogram(server.store.get("w"), 5)
    assert (edges[0], edges[-1], counts.tolist()) == (0.0, 900.0, [2, 2, 2, 2, 2])


def test_with_no_share_nothing_is_worked_out_until_asked(monkeypatch) -> None:
    monkeypatch.setenv("THING_STATS_SHARE", "0")
    with thing.Server(port=0) as server:
        run_script("import thing; thing.catch(2.0, name='y').wait(10)", server.port)
        assert server.store.get("y").stats is None
        assert _columns(server.stats("y"))["max"] == [2.0]


def test_under_steady_traffic_the_worker_still_works_and_lets_go_when_closed() -> None:
    with thing.Server(port=0) as server:
        script = """
            import time, numpy as np, thing
            for i in range(150):  # every 10 ms: never a 20 ms pause
                thing.catch(np.full(1000, i, np.float32), name="w")
                time.sleep(0.01)
        """
        from .conftest import start_script
        sender = start_script(script, server.port)
        poll(lambda: any(c.stats is not None for c in server.store.recent(200)), 15,
             "statistics while captures keep arriving")
        sender.communicate(timeout=60)
        store = server.store
    assert store._listeners == []  # the worker's listener went with it


def test_under_steady_traffic_the_worker_waits_for_a_pause_once_not_before_each_slice(
        monkeypatch) -> None:
    """It waited up to a second for a pause before every slice: with several ranks sending
    it did one slice a second (about 1 % of a core, not its share) and fell behind for as
    long as the job ran. Once a pause was waited for in vain, the rests alone space it."""
    from thing import history_stats

    store = HistoryStore()
    for step in range(20):
        store.add("w", np.full(4, step, np.float32), (), 16, Sender("a:1"), call=step + 1)
    worker = history_stats.StatsWorker(store, share=1.0)
    worker._waiting.extend(capture.id for capture in store.get_all("w"))
    waits = []
    monkeypatch.setattr(worker, "_wait_for_a_pause", lambda: waits.append(1) or False)
    monkeypatch.setattr(history_stats, "SLICE_SECONDS", 1e-4)  # a few captures a slice
    assert worker._work_through()
    assert len(waits) == 1 and all(c.stats is not None for c in store.get_all("w"))


@pytest.mark.parametrize("value", [
    np.float32(1.5), np.array([-0.0]), np.array([np.nan]), np.array([np.inf], np.float16),
    np.array([-np.inf]), np.array([2**62 + 1], np.int64), np.array([2**64 - 1], np.uint64),
    np.array([1e200]), np.array([5e-324]), np.array([True]), np.array([1 + 2j], np.complex64),
    np.array([[7]], np.int8), np.array(-3.25), np.array(-0.0)])
def test_one_value_is_described_as_the_chunked_loop_describes_it(value) -> None:
    """A single number (a loss) skips the reductions; what it gets is bit for bit what the
    general loop gives (scaled where a square would overflow or underflow), whose first
    chunk no longer turns a huge value's spread into NaN."""
    from thing import array_stats as stats

    flat = stats._flat_numpy_source(value)
    to_float = stats._float_converter(flat, None)
    args = (flat, to_float, stats._is_complex(flat), stats._is_integer(flat))
    with np.errstate(all="ignore"):
        one = stats._one_value_stats(*args)
        chunked = stats._described(stats._chunked_stats, *args)
    assert [repr(field) for field in vars(one).values()] == [  # -0.0 is not 0.0 here
        repr(field) for field in vars(chunked).values()]
    assert [type(field) for field in vars(one).values()] == [
        type(field) for field in vars(chunked).values()]
    assert stats.array_stats(np.array([1e200, 1e200])).std == 0.0



def _float32_bits(*bits: int) -> np.ndarray:
    return np.array(bits, np.uint32).view(np.float32)


SIGNALLING_NAN = 0x7FA00000  # float32 bits


@pytest.mark.parametrize("value, spec, nans", [
    (_float32_bits(SIGNALLING_NAN), None, 1),
    (_float32_bits(SIGNALLING_NAN, 0x3FC00000, 0x40000000), None, 1),  # and 1.5, 2.0
    (_float32_bits(*[SIGNALLING_NAN] * 40), None, 40),
    (np.array([0x7FA0], np.uint16), LeafSpec("torch", "bfloat16", (1,), False), 1),
    (np.array([0x7FA0, 0x3F80], np.uint16), LeafSpec("torch", "bfloat16", (2,), False), 1)])
def test_a_signalling_nan_is_counted_without_a_warning(value, spec, nans: int) -> None:
    """A signalling NaN makes a numpy cast warn: not from the REPL's background worker,
    whichever path (one value, a few, the chunked loop) describes it."""
    from thing import array_stats as stats

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        described = stats.array_stats(value, spec)
    assert (described.count, described.nan) == (value.size, nans)


@pytest.mark.parametrize("value", [
    np.array([1.5, -2.25, 3.0, 1e-3], np.float32), np.array([-0.0, 0.0]),
    np.array([np.nan, 1.0, np.inf, -np.inf, 2.0]), np.array([np.nan, np.inf], np.float16),
    np.array([2**62 + 1, -5, 7], np.int64), np.array([2**64 - 1, 0], np.uint64),
    np.array([1e200, 1e200, -1e200]), np.array([1e308, 1e308]), np.array([True, False, True]),
    np.array([3 + 4j, 0j, -1j], np.complex64), np.arange(32, dtype=np.int8).reshape(4, 8),
    np.random.default_rng(0).normal(size=31)])
def test_a_few_values_are_described_as_the_chunked_loop_describes_them(value) -> None:
    """Up to FEW_VALUES elements skip numpy's reductions; what they get is what the general
    loop gives, to rounding: counts, extremes (integers exact) and the same types."""
    from thing import array_stats as stats

    flat = stats._flat_numpy_source(value)
    to_float = stats._float_converter(flat, None)
    args = (flat, to_float, stats._is_complex(flat), stats._is_integer(flat))
    assert 1 < value.size <= stats.FEW_VALUES
    with np.errstate(all="ignore"):
        few = stats._described(stats._few_values_stats, *args)
        chunked = stats._described(stats._chunked_stats, *args)
        assert stats.array_stats(value) == few
    for field in ("count", "finite", "nan", "inf", "min", "max", "magnitude"):
        ours, loops = getattr(few, field), getattr(chunked, field)
        assert ours == loops and type(ours) is type(loops), field  # -0.0 == 0.0 here
    for field in ("mean", "std", "norm"):
        ours, loops = getattr(few, field), getattr(chunked, field)
        assert type(ours) is type(loops), field
        assert ours == loops or math.isclose(ours, loops, rel_tol=1e-12, abs_tol=1e-300), field


@pytest.mark.parametrize("values", [
    [1e308] * 3, [3e200] * 40, [1e200], [1e-200, 2e-200], [1e-200] * 40, [1e308, -1e308] * 20,
    [1e300, 1e-320, -7e299], [2e-310, 4e-310, 1e-300]])
def test_statistics_near_the_float64_limits_are_those_of_the_values(values: list[float]
                                                                    ) -> None:
    """Squares of values beyond about 1e154 overflow, and of values below 1e-154
    underflow: the mean, std and norm are worked out on values scaled by a power of two,
    so they are what exact arithmetic gives, rounded (inf only for a norm beyond float64)."""
    from fractions import Fraction

    from thing.array_stats import array_stats

    def root(square: Fraction) -> float:  # its square root, rounded once, inf beyond
        if not square:
            return 0.0
        half = (square.numerator.bit_length() - square.denominator.bit_length()) // 2
        try:
            return math.ldexp(math.sqrt(square / Fraction(4) ** half), half)
        except OverflowError:
            return math.inf

    for array in (np.array(values), np.array(values * 40)):  # a few, and the chunked loop
        exact = [Fraction(value) for value in array.tolist()]
        mean = sum(exact) / len(exact)
        std = root(sum((value - mean) ** 2 for value in exact) / len(exact))
        norm = root(sum(value * value for value in exact))
        described = array_stats(array)
        assert math.isclose(described.mean, float(mean), rel_tol=1e-12)
        assert math.isclose(described.std, std, rel_tol=1e-9, abs_tol=abs(float(mean)) * 1e-15)
        assert described.norm == norm or math.isclose(described.norm, norm, rel_tol=1e-12)


def test_numbers_that_travel_in_the_header_keep_their_magnitude_and_exactness(
        server: thing.Server) -> None:
    """A float near float64's limits is finite, with its sign; an int of 64 bits stays exact,
    as in an integer array; a larger one is the float it rounds to, or its sign's infinity."""
    values = [1.5e308, -1.5e308, 2**62 + 1, 2**64 - 1, -(2**63), 10**30, -(10**400), True]
    run_script(f"""
        import thing
        for value in {values!r}:
            assert thing.catch(value, name="n", block=True).wait(10)
    """, server.port)
    described = [capture_stats(capture).values for capture in server.store.get_all("n")]
    assert [(stats.min, stats.max, stats.inf, stats.nan) for stats in described] == [
        (1.5e308, 1.5e308, 0, 0), (-1.5e308, -1.5e308, 0, 0), (2**62 + 1, 2**62 + 1, 0, 0),
        (2**64 - 1, 2**64 - 1, 0, 0), (-(2**63), -(2**63), 0, 0), (1e30, 1e30, 0, 0),
        (None, None, 1, 0), (1.0, 1.0, 0, 0)]
    assert [type(stats.min) for stats in described[2:5]] == [int, int, int]


def test_a_constant_at_the_largest_float_has_a_histogram_of_finite_edges() -> None:
    """Its one bin was widened past the largest float: every edge NaN, and numpy's
    overflow warnings printed into the REPL."""
    from thing.array_stats import value_histogram

    for constant in (np.finfo(np.float64).max, -np.finfo(np.float64).max):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            counts, edges = value_histogram(np.full(5, constant), None, 10, float(constant),
                                            float(constant))
        assert np.isfinite(edges).all() and counts.sum() == 5
        assert edges[0] <= constant <= edges[-1]
