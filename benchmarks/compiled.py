"""What a throttled catch costs a ``torch.compile``d step, beside the same step without it.

    python benchmarks/compiled.py            # about a minute
    python benchmarks/compiled.py --quick    # fewer steps

A catch inside a compiled function is a graph break: torch runs the gate as
it is, and the rest of the function in a function it compiles. The step here
is ``h = x @ w; thing.catch(h, every=50); return h.sum()``, compiled with
``backend="eager"`` (the graph break, not the kernels, is what is measured),
on the CPU, one torch thread, the server in another process keeping history;
the baseline is the same step compiled without the catch line, measured in
the same run. Both with one shape of ``x`` every step and with three in turn
(torch then compiles the step for a dynamic shape). Each figure is the median
over trials of the mean step time; every capture must be stored.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import median, start_thing_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 trials of 500 steps, not 7 of 1,000")
    args = parser.parse_args()
    trials, steps = (3, 500) if args.quick else (7, 1000)
    _common.print_machine("a throttled catch in a torch.compiled step")
    import torch

    server, port = start_thing_server(history=True)
    os.environ.update(THING_SERVER="127.0.0.1", THING_PORT=str(port))
    import thing

    torch.set_num_threads(1)

    def without(x, w):
        h = x @ w
        return h.sum()

    def caught(x, w):
        h = x @ w
        thing.catch(h, every=50)
        return h.sum()

    weight = torch.ones(16, 16)
    shapes = {"one shape": [torch.ones(8, 16)],
              "three shapes in turn": [torch.ones(rows, 16) for rows in (8, 9, 10)]}
    try:
        print(f"\n{trials} trials of {steps} steps; µs a step, median of the trials\n")
        print(f"{'inputs':<24}{'without catch':>15}{'with catch':>13}{'added':>9}{'x':>7}")
        for label, inputs in shapes.items():
            timed = {}
            for step in (without, caught):
                compiled = torch.compile(step, backend="eager")
                for i in range(20):  # compiled for each shape, then for a dynamic one
                    compiled(inputs[i % len(inputs)], weight)
                timed[step] = median([_mean_step(compiled, inputs, weight, steps)
                                      for _ in range(trials)])
                torch._dynamo.reset()
            base, with_catch = timed[without], timed[caught]
            print(f"{label:<24}{base:>15.1f}{with_catch:>13.1f}{with_catch - base:>9.1f}"
                  f"{with_catch / base:>7.2f}")
        client = thing._default_client
        delivered = client.flush(30) and not client.undelivered
        print(f"\nevery capture stored: {delivered}; not delivered, by reason: "
              f"{dict(client.undelivered)}")
    finally:
        thing._default_client.close()
        server.close()
    return 0 if delivered else 1


def _mean_step(compiled, inputs, weight, steps: int) -> float:
    """The mean time of a step, in µs, over ``steps`` steps cycling through ``inputs``."""
    started = time.perf_counter()
    for i in range(steps):
        compiled(inputs[i % len(inputs)], weight)
    return (time.perf_counter() - started) / steps * 1e6


if __name__ == "__main__":
    sys.exit(main())
