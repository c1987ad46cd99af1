"""thing.plot and thing.hist: what is drawn is what was caught, as pictures and as text.

Jobs in other processes send; this process is the REPL. The pictures are looked at
through matplotlib's own objects (axes, lines, their data) and as decoded PNG pixels;
the terminal plot in a pseudo-terminal of 80×24; the fallbacks in an interpreter where
the plotting libraries and pandas cannot be imported. Notebooks: tests/test_notebook.py.
"""

from __future__ import annotations

import io
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import thing
from thing import live, plot_drawing
from thing.captures import Sender
from thing.history_stats import StatsTable, capture_stats
from thing.plot_series import chart, histogram
from thing.store import HistoryStore

from .conftest import run_script, script_env

matplotlib = pytest.importorskip("matplotlib")
pytest.importorskip("uniplot")
from matplotlib.image import imread  # noqa: E402 - only with matplotlib

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

# A training job: a loss every step (NaN at step 30), a validation loss every 10 steps, a
# weight matrix every 5 and a dict of activations; steps given as the loop's own.
# (Names given: a script run with -c has no source to name them from.)
JOB = """
    import numpy as np, thing
    rng = np.random.default_rng(int(__import__("os").environ.get("SEED", "0")))
    w = np.zeros((16, 4), np.float32)
    handle = None
    for step in range(1, 41):
        loss = np.float32(1.0 / step + 0.01 * rng.standard_normal())
        if step == 30:
            loss = np.float32("nan")
        handle = thing.catch(loss, name="loss", step=step)
        if step % 10 == 0:
            val_loss = 1.5 / step
            thing.catch(val_loss, name="val_loss", step=step)
        w += rng.standard_normal(w.shape).astype(np.float32)
        thing.catch(w, name="w", every=5, copy=True, step=step)
        thing.catch({"h": w[:2]}, name="activations", every=20)
    assert handle.wait(20) and thing.catch(0, name="done").wait(20)
"""


def expected_loss(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """What the job catches as ``loss``, worked out here the same way."""
    rng = np.random.default_rng(seed)
    w = np.zeros((16, 4), np.float32)
    losses, weights = [], []
    for step in range(1, 41):
        loss = np.float32(1.0 / step + 0.01 * rng.standard_normal())
        losses.append(np.float32("nan") if step == 30 else loss)
        w += rng.standard_normal(w.shape).astype(np.float32)
        if (step - 1) % 5 == 0:
            weights.append(w.copy())
    return np.array(losses, np.float32), np.array(weights)


@pytest.fixture(scope="module")
def history() -> Any:
    """A server holding what the job sent (plus a second run, and two ranks of a third)."""
    with thing.Server(port=0) as server:
        run_script(JOB, port=server.port, THING_RUN="first")
        yield server


def line_data(fig: Any) -> list[list[tuple[str, np.ndarray, np.ndarray]]]:
    """Per axes: (label, x, y) of each line that is a series (not a NaN marker)."""
    return [[(line.get_label(), np.asarray(line.get_xdata(), float),
              np.asarray(line.get_ydata(), float))
             for line in axes.lines if not line.get_label().startswith("_")]
            for axes in fig.axes]


def assert_picture(png: bytes) -> None:
    """A decodable PNG of a plot: mostly white, with drawn pixels."""
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    pixels = imread(io.BytesIO(png))
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 600
    drawn = (pixels[..., :3] < 0.9).any(axis=2).mean()
    assert 0.01 < drawn < 0.5


# -- what each kind of plot draws ---------------------------------------------------------


def test_a_scalar_is_drawn_as_its_values_over_its_steps(history: thing.Server) -> None:
    losses, _ = expected_loss()
    drawing = chart(history.store, "loss")
    fig = plot_drawing.figure(drawing)
    assert len(fig.axes) == 1
    [[(label, x, y)]] = line_data(fig)
    assert label == "loss"
    np.testing.assert_array_equal(x, np.arange(1, 41))
    # Bit for bit the float32 values caught, NaN where the job's loss was NaN.
    np.testing.assert_array_equal(y, losses.astype(np.float64))
    assert fig.axes[0].get_xlabel().splitlines()[0] == "step"
    assert fig.axes[0].get_ylabel() == "loss"
    nan_markers = [line for line in fig.axes[0].lines if line.get_label().startswith("_")]
    assert [line.get_xdata()[0] for line in nan_markers] == [30]  # marked, not a silent gap
    assert any("NaN or Inf in 1 of 40 captures, the first at step 30" in n for n in drawing.notes)
    assert_picture(plot_drawing.png(drawing))


def test_names_are_overlaid_on_their_own_steps(history: thing.Server) -> None:
    fig = plot_drawing.figure(chart(history.store, ["loss", "val_loss"]))
    [lines] = line_data(fig)
    assert [label for label, _, _ in lines] == ["loss", "val_loss"]
    np.testing.assert_array_equal(lines[1][1], [10, 20, 30, 40])
    np.testing.assert_array_equal(lines[1][2], [1.5 / s for s in (10, 20, 30, 40)])
    assert fig.axes[0].get_legend() is not None


def test_an_array_is_drawn_as_its_norm_and_spread(history: thing.Server) -> None:
    _, weights = expected_loss()
    fig = plot_drawing.figure(chart(history.store, "w"))
    assert [axes.get_ylabel() for axes in fig.axes] == ["L2 norm", "mean, ± std, min to max"]
    (norm,), (mean,) = line_data(fig)
    np.testing.assert_array_equal(norm[1], [1, 6, 11, 16, 21, 26, 31, 36])
    flat = weights.reshape(len(weights), -1).astype(np.float64)
    np.testing.assert_allclose(norm[2], np.linalg.norm(flat, axis=1), rtol=1e-12)
    np.testing.assert_allclose(mean[2], flat.mean(axis=1), rtol=1e-9, atol=1e-12)
    # Two shaded bands: ± std inside min to max.
    bands = fig.axes[1].collections
    assert len(bands) == 2
    low, high = (np.asarray(bands[0].get_paths()[0].vertices[:, 1]).min(),
                 np.asarray(bands[0].get_paths()[0].vertices[:, 1]).max())
    assert low == pytest.approx(flat.min(axis=1).min()) and high == pytest.approx(flat.max())
    assert_picture(plot_drawing.png(chart(history.store, "w")))


def test_chosen_statistics_each_get_a_panel(history: thing.Server, tmp_path: Path) -> None:
    _, weights = expected_loss()
    fig = plot_drawing.figure(chart(history.store, "w", stat=["spectral", "max"]))
    assert [axes.get_ylabel() for axes in fig.axes] == ["top singular value", "max"]
    (spectral,), (most,) = line_data(fig)
    np.testing.assert_allclose(spectral[2], [np.linalg.norm(w.astype(np.float64), 2)
                                             for w in weights], rtol=1e-9)
    np.testing.assert_array_equal(most[2], weights.reshape(len(weights), -1).max(axis=1))
    history.plot("w", stat="norm", file=tmp_path / "w.png")
    assert_picture((tmp_path / "w.png").read_bytes())
    history.plot(["loss", "w"], file=tmp_path / "w.svg")  # the format from the suffix
    assert (tmp_path / "w.svg").read_text().lstrip().startswith("<?xml")
    # A path that cannot be written: one line saying so, not matplotlib's and PIL's frames.
    with pytest.raises(thing.ThingError, match=r"^could not write .*nowhere/w.png: No such file"):
        history.plot("w", file=tmp_path / "nowhere" / "w.png")


def test_a_histogram_counts_every_finite_value(history: thing.Server, tmp_path: Path) -> None:
    _, weights = expected_loss()
    newest = weights[-1].astype(np.float64).ravel()
    drawing = histogram(history.store, "w", bins=12)
    expected, edges = np.histogram(newest, 12, (newest.min(), newest.max()))
    np.testing.assert_array_equal(drawing.counts, expected)
    np.testing.assert_allclose(drawing.edges, edges)
    assert drawing.title == "w at step 36: 64 values"
    fig = plot_drawing.figure(drawing)
    assert [round(bar.get_height()) for bar in fig.axes[0].patches] == expected.tolist()
    older = histogram(history.store, "w", step=1, bins=5)
    assert older.counts.sum() == 64 and older.title.startswith("w at step 1:")
    history.hist("w", index=1, file=tmp_path / "h.png")
    assert_picture((tmp_path / "h.png").read_bytes())


def test_nan_and_inf_are_counted_apart_in_a_histogram(server: thing.Server) -> None:
    run_script("""
        import numpy as np, thing
        x = np.array([1, 2, 2, 3, np.nan, np.inf, -np.inf], np.float32)
        assert thing.catch(x, name="x").wait(10)
        assert thing.catch(np.arange(-5, 5, dtype=np.int64), name="ints").wait(10)
    """, port=server.port)
    drawing = histogram(server.store, "x", bins=2)
    assert drawing.counts.tolist() == [1, 3] and drawing.notes == ["3 NaN or Inf values left out"]
    assert histogram(server.store, "ints", bins=10).counts.tolist() == [1] * 10


def test_ranks_and_runs_get_a_line_each(server: thing.Server) -> None:
    for rank in (0, 1):  # a 2-rank job: one run, as torchrun's ranks share their launch's
        run_script(JOB, port=server.port, THING_RUN="ddp", RANK=str(rank), WORLD_SIZE="2",
                   SEED=str(rank))
    run_script(JOB, port=server.port, THING_RUN="restarted", SEED="7")
    fig = plot_drawing.figure(chart(server.store, "loss"))  # the newest run only
    assert [label for label, _, _ in line_data(fig)[0]] == ["loss"]
    np.testing.assert_array_equal(line_data(fig)[0][0][2], expected_loss(7)[0])

    fig = plot_drawing.figure(chart(server.store, "loss", run="ddp"))  # its ranks apart
    lines = line_data(fig)[0]
    assert [label for label, _, _ in lines] == ["loss rank 0", "loss rank 1"]
    for rank, (_, steps, values) in enumerate(lines):
        np.testing.assert_array_equal(steps, np.arange(1, 41))
        np.testing.assert_array_equal(values, expected_loss(rank)[0])
    same = line_data(plot_drawing.figure(chart(server.store, "loss", rank="all", run="ddp")))
    assert [(label, x.tolist(), y[~np.isnan(y)].tolist()) for label, x, y in same[0]] == [
        (label, x.tolist(), y[~np.isnan(y)].tolist()) for label, x, y in lines]
    one = line_data(plot_drawing.figure(chart(server.store, "loss", rank=1, run="ddp")))
    assert [label for label, _, _ in one[0]] == ["loss"]

    everything = line_data(plot_drawing.figure(chart(server.store, "loss", run="all")))[0]
    assert [label for label, _, _ in everything] == [
        "loss run ddp rank 0", "loss run ddp rank 1", "loss run restarted"]


def test_mistakes_are_refused_with_what_to_do(history: thing.Server) -> None:
    with pytest.raises(thing.UnknownName, match="did you mean 'loss'"):
        history.plot("los")
    with pytest.raises(ValueError, match="stat must be 'auto' or some of 'value', 'norm'"):
        history.plot("loss", stat="median")
    with pytest.raises(ValueError, match="stat='value' draws single numbers, and w holds "
                                         r"arrays \(float32 \(16, 4\)\); try stat='norm'"):
        history.plot("w", stat="value")
    # It holds numbers, in arrays: it said "holds no numbers".
    with pytest.raises(ValueError, match=r"activations: nothing to plot \(a dict of 1: plot "
                                         r"draws single arrays and numbers; "
                                         r"describe\('activations'\) gives"):
        history.plot("activations")
    # Nor is its shape one of its arrays' (it read (16, 4), or () for two arrays).
    table = history.stats("activations")
    shapes = table.to_dict()["shape"] if isinstance(table, StatsTable) else list(
        table["shape"])
    assert all(shape is None or shape != shape for shape in shapes)  # None, or pandas' NaN
    with pytest.raises(ValueError, match="bins is a whole number from 1, not 0"):
        history.hist("w", bins=0)
    with pytest.raises(ValueError, match="rank must be a rank number, None or 'all'"):
        history.plot("loss", rank="every")
    with pytest.raises(ValueError, match="has no finite numbers"):
        history.hist("loss", step=30)


def test_status_shows_a_sparkline_per_name_of_single_numbers(history: thing.Server) -> None:
    text = live.view(history.store, history.info(), 5, width=80).text(80)
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:8] if line.strip()}
    assert rows["name"][1] == "last" and "w" not in rows and "activations" not in rows
    losses, _ = expected_loss()
    spark = rows["loss"][1]
    assert len(spark) == 40 and spark[29] == "×"  # NaN at step 30
    assert spark[0] == "█" and set(spark) <= set(plot_drawing.SPARK + "×")
    assert rows["val_loss"][1] == "█▃▂▁" and rows["val_loss"][2] == "0.0375"
    assert all(len(line) <= 80 for line in text.splitlines())


# -- in a terminal, and without the libraries -----------------------------------------------


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_the_terminal_plot_fits_80_by_24_and_redraws_live(history: thing.Server,
                                                          tmp_path: Path) -> None:
    pexpect = pytest.importorskip("pexpect")
    history.save(tmp_path / "rec")
    script = f"""
        import thing
        thing.load({str(tmp_path / "rec")!r})
        thing.plot("loss")
        print("DRAWN", flush=True)
        server = thing.serve(port=0)
        print("PORT", server.port, flush=True)
        thing.wait("live_loss", timeout=30)
        thing.plot("live_loss", live=True)
        print("after live: running", server.running, flush=True)
    """
    child = pexpect.spawn(sys.executable, ["-c", textwrap.dedent(script)], env=script_env(),
                          encoding="utf-8", timeout=30, dimensions=(24, 80))
    try:
        child.expect("DRAWN")
        lines = ANSI.sub("", child.before).replace("\r", "").strip("\n").splitlines()
        assert "\x1b[" in child.before  # coloured in a terminal
        assert all(len(line) <= 80 for line in lines) and 16 <= len(lines) <= 23
        assert lines[0].strip() == "loss" and lines[1].startswith("┌")
        assert sum(bool(re.search(r"│ -?[\d.]+$", line)) for line in lines) >= 2  # y labels
        bottom = next(i for i, line in enumerate(lines) if line.startswith("└"))
        assert len(re.findall(r"\d+", lines[bottom + 1])) >= 3  # x labels
        assert "x: step" in lines and lines[-1].startswith("loss: NaN or Inf in 1 of 40 captures")

        child.expect(r"PORT (\d+)")
        port = int(child.match.group(1))
        for step in (1, 2, 3):
            run_script(f"import thing\nassert thing.catch({step * 1.5}, name='live_loss', "
                       f"step={step}).wait(10)", port=port)
            if step == 1:
                child.expect("press Ctrl\\+C to stop")
            child.expect("live_loss")  # drawn, then redrawn with each new capture
        child.sendintr()
        child.expect("after live: running True")
    finally:
        child.close(force=True)


def test_without_the_plotting_libraries_everything_still_works(history: thing.Server,
                                                               tmp_path: Path) -> None:
    history.save(tmp_path / "rec")
    out = run_script(f"""
        import sys
        for blocked in ("matplotlib", "uniplot", "pandas"):
            sys.modules[blocked] = None  # import fails, as where it is not installed
        import thing
        thing.load({str(tmp_path / "rec")!r})
        thing.plot("loss")
        thing.plot(["w", "val_loss"])
        thing.hist("w", bins=4)
        table = thing.stats("val_loss")
        print(type(table).__name__, table.to_dict()["step"])
        try:
            thing.plot("loss", file="x.png")
        except thing.ThingError as exc:
            print("refused:", exc)
    """, COLUMNS="100")
    lines = out.splitlines()
    assert sum(line.startswith("pip install matplotlib uniplot (thing's plot extra) draws")
               for line in lines) == 1
    assert sum("pandas is not installed" in line for line in lines) == 1
    spark = next(line for line in lines if line.startswith("loss  "))
    assert "×" in spark and "last 0.0" in spark
    assert any(line.startswith("w L2 norm  ") for line in lines)
    assert any(line.startswith("val_loss  ") and "min 0.0375, max 0.15" in line
               for line in lines)
    assert sum(line.count("█") for line in lines if line.startswith(" ")) > 0  # the bars
    assert "StatsTable [10, 20, 30, 40]" in lines
    assert any(line.startswith("refused: drawing a picture needs matplotlib: pip install")
               for line in lines)


def test_the_plot_functions_are_in_help_and_load_nothing_until_used() -> None:
    out = run_script("""
        import sys, thing
        print(callable(thing.plot), callable(thing.hist))
        print(sorted(m for m in ("matplotlib", "uniplot") if m in sys.modules))
    """)
    assert out.splitlines() == ["True True", "[]"]


def test_piped_output_is_plain_text(history: thing.Server, tmp_path: Path) -> None:
    history.save(tmp_path / "rec")
    result = subprocess.run(
        [sys.executable, "-c", f"import thing\nthing.load({str(tmp_path / 'rec')!r})\n"
                               "thing.plot('w')\nthing.plot('loss', live=True)"],
        env=script_env(), capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "\x1b[" not in result.stdout and all(len(line) <= 80 for line in lines)
    assert "w: L2 norm" in result.stdout and "w: mean, ± std, min to max" in result.stdout
    # No colour tells the mean, its band and its extremes apart: each has a symbol of its own.
    legend = next(line for line in lines if "+ std" in line)
    symbols = re.findall(r"(\S)\1 (?:w|\+ std|- std|max|min)\b", legend)
    assert len(symbols) == len(set(symbols)) == 5, legend
    assert "(live plots redraw in a terminal or a notebook; this output is not one)" in lines
    assert len(lines) <= 2 * 24 + 2  # each plot fits a screen


# -- what a careless plot would hide or choke on --------------------------------------------


HARD_CASES = """
    import numpy as np, thing
    send = lambda value, name, step: thing.catch(value, name=name, step=step)
    for step, value in enumerate(([1.0, 2.0, 3.0], [1.0, np.nan, 3.0], [1.0, 2.0, 3.0]), 1):
        send(np.array(value), "grad", step)
    for step, value in enumerate([1.0] * 10 + [0.5] * 10 + [0.05] * 10, 1):
        send(value, "plateaus", step)
    for step in range(3):
        send(1.0, "far", 10**17 + step)
        send(1e308 * (-1) ** step, "huge", step)
    send(np.full(10, 1e17), "flat", 1)
    send(np.array([[1, 1j], [1j, 1]]), "complex", 1)
    for step, value in enumerate([0.6931470, 0.6931472, 0.6931475, 0.6931471], 1):
        send(value, "slow", step)  # a loss on a plateau
        send({"loss": value}, "in_dict", step)  # one number in a container: no number
        send(1.7e308 * (-1) ** step, "limit", step)  # matplotlib cannot divide its axis
        send(3 + 4j, "phase", step)
    send(np.array([1.0, 1.0 + 2**-52] * 20), "fine", 1)  # finer than 5 bins can cut
    send(np.array([3e38 + 3e38j, 1 + 1j], np.complex64), "c64", 1)
    for name in ("a$\\\\foo$", "_loss"):
        send(1.0, name, 1)
        send(2.0, name, 2)
    assert thing.catch(0, name="done").wait(20)
"""


@pytest.mark.parametrize("uniplot", [True, False])
def test_a_long_names_note_keeps_where_its_first_nan_was(monkeypatch, uniplot: bool) -> None:
    """A transformer parameter's name filled the note's line, and the step was cut off."""
    name = "model.layers.11.self_attn.q_proj.weight"
    store = HistoryStore()
    for step in range(1, 300):
        store.add(name, math.nan if step == 123 else 1.0 / step, (), 0, Sender("a:1"), call=step)
    if not uniplot:
        monkeypatch.setattr(plot_drawing, "_has", lambda module: module != "uniplot")
    drawn = plot_drawing.text(chart(store, name), 80, 24).splitlines()
    assert all(len(line) <= 80 for line in drawn)
    note = " ".join(line.strip() for line in drawn[drawn.index(next(
        line for line in drawn if line.startswith(f"{name}: NaN"))):])
    assert note == f"{name}: NaN or Inf in 1 of 299 captures, the first at step 123"


def test_a_sparkline_gives_the_last_value_as_it_is(monkeypatch) -> None:
    """Without uniplot: a loss that went NaN last was said to be its last finite value."""
    store = HistoryStore()
    for step, value in enumerate([0.9, 0.7, 0.5, math.nan], 1):
        store.add("loss", value, (), 0, Sender("a:1"), call=step)
    store.add("mixed", 1.5, (), 0, Sender("a:1"), call=1)
    store.add("mixed", {"not": "a number"}, (), 0, Sender("a:1"), call=2)
    monkeypatch.setattr(plot_drawing, "_has", lambda module: module != "uniplot")
    drawn = plot_drawing.text(chart(store, "loss"), 100).splitlines()
    assert "last nan, min 0.5, max 0.9" in drawn[1], drawn
    drawn = plot_drawing.text(chart(store, "mixed"), 100).splitlines()
    assert "last (no number), min 1.5, max 1.5" in drawn[1], drawn


def test_hard_cases_are_drawn_truthfully_or_said(server: thing.Server) -> None:
    run_script(HARD_CASES, port=server.port)
    store = server.store
    # A NaN inside an array: its statistics are over the finite values, so it is marked.
    grad = chart(store, "grad")
    assert grad.panels[0].series[0].non_finite.tolist() == [2]
    assert grad.notes == ["grad: NaN or Inf in 1 of 3 captures, the first at step 2 "
                          "(their statistics are over the finite values)"]
    # The y labels are thing's, in full: uniplot's own would print 0.5 as "0".
    plateaus = plot_drawing.text(chart(store, "plateaus"), 80, 16).splitlines()
    marks = [line.rsplit("│ ", 1)[1] for line in plateaus if re.search(r"│ [\d.]+$", line)]
    assert marks == ["1", "0.525", "0.05"]
    # Ranges uniplot cannot scale fall back to sparklines rather than failing.
    for name in ("far", "huge"):
        drawn = plot_drawing.text(chart(store, name), 80, 24).splitlines()
        assert drawn[0].strip().startswith(name) and max(map(len, drawn)) <= 80
    assert histogram(store, "flat").counts.sum() == 10
    assert plot_drawing.sparkline(np.array([-1e308, 1e308]), 4) == "▁█"
    assert plot_drawing.sparkline(np.array([0, 1e-320, np.inf]), 4)[-1] == "×"
    # A complex matrix keeps its phases: the top singular value of A, not of |A|.
    [spectral] = line_data(plot_drawing.figure(chart(store, "complex", stat="spectral")))[0]
    assert spectral[2].tolist() == pytest.approx(
        [np.linalg.norm(np.array([[1, 1j], [1j, 1]]), 2)])
    # Names are peers' text: no mathtext, and "_" does not hide a line from the legend.
    assert_picture(plot_drawing.png(chart(store, "a$\\foo$")))
    legend = plot_drawing.figure(chart(store, ["_loss", "a$\\foo$"])).axes[0].get_legend()
    assert [t.get_text().lstrip("\u200b") for t in legend.get_texts()] == ["_loss", "a$\\foo$"]
    with pytest.raises(ValueError, match="pick one"):
        server.plot("grad", live=True, file="x.png")


def test_what_is_hard_to_draw_is_drawn_truthfully_or_said(server: thing.Server,
                                                          tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    run_script(HARD_CASES, port=server.port)
    store = server.store
    # Labels tell apart the values they mark, however close.
    slow = plot_drawing.text(chart(store, "slow"), 80, 16).splitlines()
    marks = [line.rsplit("│ ", 1)[1] for line in slow if re.search(r"│ [\d.]+$", line)]
    assert marks == ["0.6931475", "0.6931472", "0.693147"]
    # A number inside a dict is no number: no sparkline of NaN ("×") under status().
    shown = live.view(store, server.info(), 5, width=100).text(100)
    assert "in_dict" not in shown.split("arrived")[0] and "×" not in shown
    # Values matplotlib cannot scale: a notebook shows the text plot, a file is refused
    # with the reason, and none of its arithmetic warnings reach the REPL.
    assert plot_drawing.Picture(chart(store, "limit"))._png is None
    with pytest.raises(thing.ThingError, match="matplotlib could not draw limit"):
        server.plot("limit", file=tmp_path / "limit.png")
    assert "Warning" not in capsys.readouterr().err
    # Values finer than float64 can cut in bins: bins one step wide, every value counted.
    fine = histogram(store, "fine", bins=5)
    assert (np.diff(fine.edges) > 0).all() and sorted(fine.counts.tolist()) == [0, 0, 0, 20, 20]
    # Magnitudes of complex64 worked out in float64: |3e38+3e38j| is finite.
    values = capture_stats(store.get("c64")).values
    assert values.inf == 0 and values.max == pytest.approx(3e38 * 2 ** 0.5, rel=1e-7)
    assert chart(store, "phase").notes == ["phase: complex values, drawn as their magnitudes |x|"]


def test_a_live_plot_outlives_its_name_being_cleared(server: thing.Server) -> None:
    run_script("import thing\nassert thing.catch(1.0, name='loss').wait(10)", port=server.port)
    assert plot_drawing._redrawn(lambda: chart(server.store, "loss")) is not None
    server.clear("loss")
    assert plot_drawing._redrawn(lambda: chart(server.store, "loss")) is None  # kept, waits


def test_status_sparklines_keep_ranks_apart(server: thing.Server) -> None:
    for rank, base in ((0, 0), (1, 100)):
        run_script(f"""
            import thing
            for step in range(1, 11):
                handle = thing.catch(float({base} + step), name="loss", step=step)
            assert handle.wait(10)
        """, port=server.port, RANK=str(rank), WORLD_SIZE="2")
    text = live.view(server.store, server.info(), 5, width=80).text(80)
    [row] = [line for line in text.splitlines() if line.startswith("loss")]
    assert row.split()[:3] == ["loss", "rank", "1"] and row.split()[-1] == "110"
    assert row.split()[3] == "▁▂▃▃▄▅▆▆▇█"  # rank 1's ten values alone, no zigzag
    assert "last 10" in text  # as many as it shows (it said "last 46" over ten)


def test_many_ranks_are_drawn_as_their_median_and_range() -> None:
    """Twelve ranks a line each were a tangle with a legend longer than the plot (64 ranks:
    unreadable): past eight, a run's ranks are one line, their median at each step, their
    least to their greatest shaded, and a note says so; rank="all" still draws each."""
    store = HistoryStore()
    for rank in range(12):
        sender = Sender("h:1", "h", 100 + rank, rank, 12, "job")
        for step in range(1, 6):
            if rank == 11 and step == 5:
                continue  # a rank behind the others: the last step has eleven values
            store.add("loss", float(rank * step), (), 0, sender, step=step)
    drawn = chart(store, "loss")
    (series,) = drawn.panels[0].series
    assert series.label == "loss ranks (median)"
    np.testing.assert_array_equal(series.steps, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(series.values, [5.5, 11.0, 16.5, 22.0, 25.0])
    np.testing.assert_array_equal(series.extent[0], [0, 0, 0, 0, 0])
    np.testing.assert_array_equal(series.extent[1], [11, 22, 33, 44, 50])
    assert ("loss ranks: 12 ranks, drawn as their median at each step, with the least and "
            "the greatest of them (rank=k draws one rank)") in drawn.notes
    figure_lines = line_data(plot_drawing.figure(drawn))[0]
    assert [label for label, _, _ in figure_lines] == ["loss ranks (median)"]
    assert len(chart(store, "loss", rank="all").panels[0].series) == 12
    # Piped, twelve lines are more than there are symbols to draw them apart: in braille (it
    # raised IndexError), their legend all there is to tell them apart.
    every_rank = plot_drawing.text(chart(store, "loss", rank="all"), 80)
    assert any("\u2800" <= char <= "\u28ff" for char in every_rank)  # braille
    assert all(f"rank {rank}" in every_rank for rank in range(12))
    assert [s.label for s in chart(store, "loss", rank=3).panels[0].series] == ["loss"]
    assert "loss ranks (median)" in plot_drawing.text(drawn, 80)


def test_colours_only_on_a_terminal_that_shows_them(monkeypatch) -> None:
    """TERM=dumb (an editor's shell, a CI log) still got colour codes; NO_COLOR did not."""
    terminal = type("Terminal", (io.StringIO,), {"isatty": lambda _: True})
    monkeypatch.setattr(sys, "stdout", terminal())
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert plot_drawing._colour_terminal()
    monkeypatch.setenv("TERM", "dumb")
    assert not plot_drawing._colour_terminal()
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("NO_COLOR", "1")
    assert not plot_drawing._colour_terminal()
