"""What plotting costs the REPL: importing the drawing libraries, drawing a long history.

1. Import cost, beyond numpy (which every REPL here has loaded), median of
   ``--imports`` fresh interpreters each: uniplot and plotext (the two terminal
   libraries the choice was between), matplotlib's Figure with its Agg
   renderer. Baseline: importing numpy itself.
2. Drawing a history as a user has one: a server that received ``--steps``
   scalar losses and ``--arrays`` captures of a 256×256 float32 weight, from a
   client in this process. Figures: ``thing.plot`` as text (uniplot) and as a
   PNG (matplotlib), median of ``--trials``, once with every capture's
   statistics still to work out (cold: a server without its stats worker) and
   once cached. Baseline: the same lines drawn straight from numpy arrays the
   user made by hand (``get_all``, ``np.array``, the library's own call).
3. A live notebook plot's share of a core: it redraws a PNG at most every
   0.5 s and rests three times as long as a redraw took.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time
from functools import partial
from typing import Any, Callable

import numpy as np
from _common import child_env, median, print_machine

IMPORT = """
import time, numpy
started = time.perf_counter()
{statement}
print(time.perf_counter() - started)
"""


def import_ms(statement: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", IMPORT.format(statement=statement)],
                             env=child_env(), capture_output=True, text=True, check=True)
        times.append(float(out.stdout) * 1000)
    return median(times)


def numpy_import_ms(runs: int) -> float:
    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", "import time\nstarted = time.perf_counter()\n"
                              "import numpy\nprint(time.perf_counter() - started)"],
                             env=child_env(), capture_output=True, text=True, check=True)
        times.append(float(out.stdout) * 1000)
    return median(times)


def timed(function: Callable[[], Any], trials: int) -> float:
    times = []
    for _ in range(trials):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imports", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--arrays", type=int, default=200)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    print_machine("plots: import cost of the drawing libraries, drawing a long history")

    numpy_ms = numpy_import_ms(args.imports)
    print(f"\nimport, ms beyond numpy (median of {args.imports}); baseline numpy itself "
          f"{numpy_ms:.1f} ms")
    for label, statement in (("uniplot", "import uniplot"), ("plotext", "import plotext"),
                             ("matplotlib Figure + Agg", "import matplotlib.figure\n"
                              "import matplotlib.backends.backend_agg")):
        try:
            ms = import_ms(statement, args.imports)
        except subprocess.CalledProcessError:
            print(f"  {label:26} not installed")
            continue
        print(f"  {label:26} {ms:7.1f} ms   {ms / numpy_ms:5.2f}× numpy's import")

    os.environ["THING_STATS_SHARE"] = "0"  # cold: nothing worked out before the plot
    import thing
    from thing import plot_drawing
    from thing.plot_series import chart

    with thing.Server(port=0) as server:
        client = thing.Client("127.0.0.1", server.port)
        rng = np.random.default_rng(0)
        weight = rng.standard_normal((256, 256)).astype(np.float32)
        for step in range(1, args.steps + 1):
            client.catch(np.float32(1 / step), name="loss", step=step, block=True)
            if step % max(args.steps // args.arrays, 1) == 0:
                weight += np.float32(0.01)
                client.catch(weight, name="weight", step=step, copy=True, block=True)
        assert client.catch(0, name="done").wait(60)
        client.close()
        store = server.store
        print(f"\ndrawing {len(store.get_all('loss'))} losses and "
              f"{len(store.get_all('weight'))} weights of 256×256 float32, ms "
              f"(median of {args.trials})")

        def text(name: str) -> str:
            return plot_drawing.text(chart(store, name), 80, 24)

        def png(name: str) -> bytes:
            return plot_drawing.png(chart(store, name))

        cold_text = timed(lambda: text("weight"), 1)  # works out 200 captures' statistics
        for kind, draw in (("text", text), ("png", png)):
            for name in ("loss", "weight"):
                ours = timed(partial(draw, name), args.trials)
                by_hand = timed(partial(_by_hand, store, name, kind), args.trials)
                print(f"  {name:7} as {kind:4}: thing.plot {ours:8.1f}   by hand {by_hand:8.1f}"
                      f"   {ours / by_hand:5.2f}×")
        print(f"  weight as text, statistics not yet worked out (cold): {cold_text:.1f} ms")
        redraw = timed(lambda: png("loss"), args.trials) / 1000
        share = redraw / (redraw + max(0.5, 3 * redraw))
        print(f"\nlive notebook plot of {args.steps} losses: a redraw takes "
              f"{redraw * 1000:.0f} ms; at most {share:.0%} of a core while captures keep arriving")


def _by_hand(store: Any, name: str, kind: str) -> Any:
    """What a user would write for the same picture: the numbers worked out by hand from
    get_all (for a weight: norm, mean, std, min and max of each), drawn with the library."""
    captures = store.get_all(name)
    steps = np.array([capture.step for capture in captures], np.float64)
    values = [np.asarray(capture.value, np.float64) for capture in captures]
    if name == "weight":
        norm = np.array([np.linalg.norm(v) for v in values])
        mean, std = np.array([v.mean() for v in values]), np.array([v.std() for v in values])
        low, high = np.array([v.min() for v in values]), np.array([v.max() for v in values])
        panels = [[norm], [mean, mean + std, mean - std, high, low]]
    else:
        panels = [[np.array([float(v) for v in values])]]
    if kind == "text":
        from uniplot import plot_to_string

        return [plot_to_string(ys, [steps] * len(ys), width=68, height=15 // len(panels),
                               lines=True, character_set="braille", color=False)
                for ys in panels]
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 1.3 + 2.6 * len(panels)), layout="constrained")
    for axes, ys in zip(fig.subplots(len(panels), 1, squeeze=False)[:, 0], panels):
        axes.plot(steps, ys[0])
        if len(ys) > 1:
            axes.fill_between(steps, ys[4], ys[3], alpha=0.12)
            axes.fill_between(steps, ys[2], ys[1], alpha=0.3)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    return out.getvalue()


if __name__ == "__main__":
    main()
