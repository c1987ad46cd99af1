"""What one ``catch`` costs right after a training step, and where that time goes.

    python benchmarks/after_a_step.py            # about half a minute
    python benchmarks/after_a_step.py --quick    # fewer steps

A training loop calls ``catch`` after the step's kernels have run, with Python's
code and data pushed out of the caches: every line costs many times what it
costs in a tight loop. Each figure here is one call made right after a step of
a small MLP trained with SGD on the CPU (one torch thread, the server in
another process keeping history), a different call after each step in turn,
and the median over the steps; beside it, the same call's median in a tight
loop (warm), and both as a multiple of an empty Python call measured the same
way. The parts below the calls are what a sent ``catch(loss)`` does on the
caller's thread (taking the tensor apart, its snapshot, reading the rank).

A sent capture costs its caller more when the sender thread is asleep: the
call wakes it (a loop that catches less often than once a tick, 50 ms). So
each sent row is measured with the sender set beforehand either ticking (a
capture sent before the step, as in a loop that catches every step) or asleep.
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
from overhead import make_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 steps per call, not 300")
    args = parser.parse_args()
    steps = 100 if args.quick else 300
    _common.print_machine("catch right after a training step")
    import torch

    server, port = start_thing_server(history=True)
    os.environ.update(THING_SERVER="127.0.0.1", THING_PORT=str(port))
    import thing
    from thing import value_trees

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_model(torch, 1024)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data, targets = torch.randn(128, 256), torch.randint(0, 10, (128,))
    assert thing.catch(torch.zeros(()), name="warm").wait(30)
    client = thing._default_client

    def empty(loss):
        return None

    calls = {
        "empty Python call": empty,
        "loss.item() (torch, for scale)": lambda loss: loss.item(),
        "catch(loss, name=..., every=10**9), throttled": (
            lambda loss: thing.catch(loss, name="throttled", every=10**9)),
        "catch(loss, name='loss'), sent": lambda loss: thing.catch(loss, name="loss"),
        "catch(loss), name traced, sent": lambda loss: thing.catch(loss),
        "catch(loss, name='loss'), sent, sender asleep": (
            lambda loss: thing.catch(loss, name="loss")),
        "  part: value_trees.take_apart(loss)": value_trees.take_apart,
        "  part: take_apart + snapshot (hold)": (
            lambda loss: value_trees.take_apart(loss).hold(None, client.snapshot_bytes)),
        "  part: the rank at the call": lambda loss: client._rank.read(),
    }
    channel = client._channels[None]
    after: dict[str, list[int]] = {label: [] for label in calls}
    try:
        for _ in range(steps):
            for label, call in calls.items():
                if label.endswith("sender asleep"):
                    _until(lambda: channel._idle, "the sender to fall asleep")
                else:  # it ticks for 50 ms after this, longer than a step
                    thing.catch(0.0, name="keep the sender ticking")
                optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(data), targets)
                loss.backward()
                optimizer.step()
                start = time.perf_counter_ns()
                call(loss)
                after[label].append(time.perf_counter_ns() - start)
        warm = {label: _tight(call, loss, client) for label, call in calls.items()}
        if not thing.catch(loss, name="last").wait(30):
            raise RuntimeError("the last capture was not stored")
    finally:
        thing._default_client.close()
        server.close()
    base_after, base_warm = median(after["empty Python call"]), warm["empty Python call"]
    print(f"\n{steps} steps per call; ns, median; x: multiple of the empty call measured "
          "the same way\n")
    print(f"{'call':<48}{'after a step':>14}{'x':>8}{'tight loop':>13}{'x':>8}")
    for label in calls:
        value = median(after[label])
        print(f"{label:<48}{value:>14,.0f}{value / base_after:>8.1f}"
              f"{warm[label]:>13,.0f}{warm[label] / base_warm:>8.1f}")
    return 0


def _until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.002)


def _tight(call, loss, client, calls: int = 50, batches: int = 100) -> float:
    """The median over batches of ``call(loss)``'s mean time in a tight loop, in ns; what
    a batch sent is delivered before the next (untimed), so that no queue fills."""
    timings = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for _ in range(calls):
            call(loss)
        timings.append((time.perf_counter_ns() - start) / calls)
        if not client.flush(30):
            raise RuntimeError("captures were not delivered")
    return median(timings)


if __name__ == "__main__":
    sys.exit(main())
