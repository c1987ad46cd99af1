"""What ``thing.catch`` costs the thread that calls it, and a training loop that uses it.

    python benchmarks/overhead.py                   # about a minute
    python benchmarks/overhead.py --quick           # fewer batches and rounds
    python benchmarks/overhead.py --transport tcp   # THING_TRANSPORT for the client

A ``thing.Server`` runs in another process throughout, so captures are really
sent; the default client is pointed at it with ``THING_SERVER`` and, unless
``--transport`` says otherwise, takes the path it takes by default on one
host (printed).

Per-call costs are timed with ``time.perf_counter_ns`` around a batch of calls
in a plain ``for`` loop (the loop's own cost is included, for the empty call
too) and reported as the median over batches of the mean per call, in
nanoseconds and as a multiple of an empty Python function call timed the same
way in the same run.

- throttled away: ``thing.catch(x, every=1000)`` on a 64 MiB tensor. Each
  batch is the 999 calls that ``every=1000`` skips; the one call per cycle it
  sends is made before the batch, at the same call site, untimed, and waited
  for. The compiled core answers such a call before any Python runs; the rows
  "through Python" time the same calls through ``thing.catch.__wrapped__``,
  the Python function behind that gate, which answers every call the
  pure-Python twin's way (the twin has no gate): compiled against the Python
  path in the same run.
- enqueued: ``thing.catch(x)`` (name traced from the source) and
  ``thing.catch(x, name=...)`` of a 64 MiB and of a 4 KiB tensor, in bursts of
  one call timed alone and then 7 timed as a batch. After each burst, untimed,
  the script waits until the server acknowledged the whole burst, so the queue
  is empty when the next burst starts and nothing is dropped (checked against
  the server's count; the queue is also set far larger than a burst). The
  first call of a burst comes right after the thread blocked in that wait, and
  is shown apart, beside what this machine charges an empty call after a
  10 ms sleep.
- on demand: ``thing.catch(x, name=..., on_demand=True)`` that nobody
  requested, against the throttled call's target (1 µs); and the delay from
  ``thing.request()`` in the server process to the arrival of the first
  capture it brings, while a loop of 5 ms steps catches on demand (median and
  p99; target: 2 steps).
- snapshot at the call: ``thing.catch(x, name=..., copy=True)`` against
  ``copy=False`` (queued by reference, read later by the sender thread) for
  numpy arrays and torch tensors of 4 KiB, 64 KiB and 1 MiB, in the same
  bursts, beside the bare copy (``np.array(x)`` / ``x.clone()``). By default
  thing snapshots arrays up to ``THING_SNAPSHOT_BYTES`` (64 KiB): the table
  shows what that costs next to what queueing costs anyway.
- training loop: a small MLP trained with SGD on random data on the CPU, with
  ``thing.catch(loss)`` every step and ``thing.catch(model.fc1.weight,
  every=10)``, against the same loop without thing; with torch's default
  thread count and, in the full run, with one torch thread (which leaves a core
  to thing's threads and the server). The variants alternate in rounds of about
  half a second (ABBA order); the slowdown is the median over rounds of the
  ratio of adjacent rounds' per-step times. The time spent inside the two
  ``catch`` calls is measured too: the caller's share of the slowdown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT = 120.0
TARGET_THROTTLED_NS = 1_000
TARGET_ENQUEUED_NS = 10_000
TARGET_SLOWDOWN = 0.03
# With one torch thread a core is left to thing's threads and the server: less is allowed.
TARGET_SLOWDOWN_ONE_THREAD = 0.01


def noop(obj):
    """The empty function every per-call cost is compared with."""


def median_ns(batches: list[int], calls: int) -> float:
    return statistics.median(batches) / calls


# Each batch function is one call site run ``calls`` times: thing traces a name and keeps
# its every= count per call site, so the untimed and the timed calls of a case must share it.

def batch_empty(thing, x, calls: int, clock) -> tuple[int, object]:
    start = clock()
    for _ in range(calls):
        handle = noop(x)
    return clock() - start, handle


def batch_throttled(thing, x, calls: int, clock) -> tuple[int, object]:
    start = clock()
    for _ in range(calls):
        handle = thing.catch(x, every=1000)
    return clock() - start, handle


def batch_throttled_named(thing, x, calls: int, clock) -> tuple[int, object]:
    start = clock()
    for _ in range(calls):
        handle = thing.catch(x, name="throttled", every=1000)
    return clock() - start, handle


def batch_throttled_python(thing, x, calls: int, clock) -> tuple[int, object]:
    catch = getattr(thing.catch, "__wrapped__", thing.catch)  # the Python behind the gate
    start = clock()
    for _ in range(calls):
        handle = catch(x, every=1000)
    return clock() - start, handle


def batch_throttled_named_python(thing, x, calls: int, clock) -> tuple[int, object]:
    catch = getattr(thing.catch, "__wrapped__", thing.catch)
    start = clock()
    for _ in range(calls):
        handle = catch(x, name="throttled, Python", every=1000)
    return clock() - start, handle


def batch_on_demand(thing, x, calls: int, clock) -> tuple[int, object]:
    start = clock()
    for _ in range(calls):
        handle = thing.catch(x, name="on_demand", on_demand=True)
    return clock() - start, handle


def batch_enqueued(thing, x, calls: int, clock) -> tuple[int, int, object]:
    start = clock()
    handle = thing.catch(x)  # the first call of a burst: after the thread waited for the last
    first = clock() - start
    start = clock()
    for _ in range(calls):
        handle = thing.catch(x)
    return first, clock() - start, handle


def batch_enqueued_named(thing, x, calls: int, clock) -> tuple[int, int, object]:
    start = clock()
    handle = thing.catch(x, name="named")
    first = clock() - start
    start = clock()
    for _ in range(calls):
        handle = thing.catch(x, name="named")
    return first, clock() - start, handle


def batch_copy(thing, x, calls: int, clock, copy: bool) -> tuple[int, int, object]:
    start = clock()
    handle = thing.catch(x, name=f"copy={copy}", copy=copy)
    first = clock() - start
    start = clock()
    for _ in range(calls):
        handle = thing.catch(x, name=f"copy={copy}", copy=copy)
    return first, clock() - start, handle


def time_bare_copy(x, batches: int, calls: int) -> float:
    """ns per copy of ``x`` the way thing snapshots it, without thing."""
    copy = x.clone if hasattr(x, "clone") else lambda: x.copy(order="C")
    timings = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for _ in range(calls):
            copy()
        timings.append(time.perf_counter_ns() - start)
    return median_ns(timings, calls)


def snapshot_rows(thing, torch, server, bursts: int, burst: int) -> tuple[list, int]:
    """Rows comparing a snapshot at the call with queueing by reference, per size."""
    import functools

    import numpy as np

    rows, lost_total = [], 0
    for framework in ("numpy", "torch"):
        for nbytes in (4 * KiB, 64 * KiB, MiB):
            x = (np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
                 if framework == "numpy" else torch.randn(nbytes // 4))
            costs = {}
            for copy in (False, True):
                _, timings, lost = time_enqueued(
                    thing, functools.partial(batch_copy, copy=copy), x, bursts, burst, server)
                lost_total += lost
                costs[copy] = median_ns(timings, burst)
            bare = time_bare_copy(x, bursts, burst)
            default = "snapshot" if nbytes <= thing.config.snapshot_bytes() else "by reference"
            rows.append((f"{framework} {nbytes // KiB:>5} KiB", costs[False], costs[True], bare,
                         default))
    return rows, lost_total


def time_cold_empty(x, samples: int, pause: float) -> list[int]:
    """One empty call right after the thread slept: what this machine charges a cold call."""
    timings = []
    clock = time.perf_counter_ns
    for _ in range(samples):
        time.sleep(pause)
        start = clock()
        noop(x)
        timings.append(clock() - start)
    return timings


def time_throttled(thing, batch, x, batches: int) -> list[int]:
    """Batches of the 999 calls in each cycle of 1000 that ``every=1000`` skips."""
    timings = []
    for _ in range(batches):
        # The first call of a cycle is sent: make it untimed and wait until it is stored.
        _, sent = batch(thing, x, 1, time.perf_counter_ns)
        if not sent.wait(TIMEOUT):
            raise RuntimeError(f"the call every=1000 sends was not stored: {sent!r}")
        elapsed, skipped = batch(thing, x, 999, time.perf_counter_ns)
        if skipped.wait(0):
            raise RuntimeError("a call that every=1000 should skip was sent")
        timings.append(elapsed)
    return timings


def time_enqueued(thing, batch, x, bursts: int, calls: int, server) -> tuple[list, list, int]:
    """Bursts of 1 + ``calls`` catches, each burst waited for untimed.

    Returns the first calls' timings, the other calls' batch timings, and how
    many captures the server did not receive.
    """
    firsts, timings = [], []
    received = server.ask("count")["received"]
    for _ in range(bursts):
        first, elapsed, last = batch(thing, x, calls, time.perf_counter_ns)
        firsts.append(first)
        timings.append(elapsed)
        last.wait(TIMEOUT)  # acknowledgements come in order: the whole burst is in
    lost = received + bursts * (calls + 1) - server.ask("count")["received"]
    return firsts, timings, lost


# -- the training loop -----------------------------------------------------------------

def time_on_demand(thing, x, batches: int, calls: int) -> list[int]:
    """Batches of on-demand calls nobody asked for (the first, which tells the server the
    name exists, untimed)."""
    batch_on_demand(thing, x, 1, time.perf_counter_ns)
    timings = []
    for _ in range(batches):
        elapsed, handle = batch_on_demand(thing, x, calls, time.perf_counter_ns)
        if handle.wait(0):
            raise RuntimeError("an on-demand call nobody asked for was sent")
        timings.append(elapsed)
    return timings


def measure_request_delay(thing, server, samples: int, step: float) -> list[float]:
    """Seconds from ``request()`` in the REPL to the arrival of the first capture it brings,
    while a loop of ``step``-second steps catches a name on demand (its steps sleep: torch
    runs a step with the GIL released, and so leaves it to thing's threads)."""
    import random
    import threading

    import numpy as np

    stop = threading.Event()

    def training_loop() -> None:
        x = np.zeros(16, np.float32)
        while not stop.is_set():
            thing.catch(x, name="probe", on_demand=True)
            time.sleep(step)

    loop = threading.Thread(target=training_loop, daemon=True)
    loop.start()
    delays = []
    try:
        time.sleep(0.2)  # the name is announced, the connection warm
        for _ in range(samples):
            time.sleep(random.uniform(0.02, 0.06))  # asked at any moment of a step
            answer = server.ask("request probe 1")
            if "delay" not in answer:
                raise RuntimeError(f"request failed: {answer}")
            delays.append(answer["delay"])
    finally:
        stop.set()
        loop.join()
    return delays


def make_model(torch, width: int):
    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(256, width)
            self.fc2 = torch.nn.Linear(width, width)
            self.fc3 = torch.nn.Linear(width, 10)

        def forward(self, inputs):
            hidden = torch.relu(self.fc1(inputs))
            hidden = torch.relu(self.fc2(hidden))
            return self.fc3(hidden)

    return MLP()


def train_plain(torch, model, optimizer, data, targets, steps: int) -> float:
    """Seconds per step of the loop without thing."""
    loss_fn = torch.nn.functional.cross_entropy
    start = time.perf_counter()
    for step in range(steps):
        batch = step % len(data)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(data[batch]), targets[batch])
        loss.backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


def train_caught(thing, torch, model, optimizer, data, targets,
                 steps: int) -> tuple[float, float, object]:
    """Seconds per step of the same loop with two catches, seconds per step inside the two
    catch calls (the caller's share), and the last loss handle."""
    loss_fn = torch.nn.functional.cross_entropy
    clock = time.perf_counter_ns
    in_catch = 0
    start = time.perf_counter()
    for step in range(steps):
        batch = step % len(data)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(data[batch]), targets[batch])
        before = clock()
        handle = thing.catch(loss)
        thing.catch(model.fc1.weight, every=10)
        in_catch += clock() - before
        loss.backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps, in_catch / 1e9 / steps, handle


def measure_training(thing, torch, rounds: int, seconds_per_round: float,
                     width: int) -> dict:
    torch.manual_seed(0)
    model = make_model(torch, width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = [torch.randn(128, 256) for _ in range(8)]
    targets = [torch.randint(0, 10, (128,)) for _ in range(8)]

    # Warm up both variants, then size a round to about seconds_per_round.
    train_plain(torch, model, optimizer, data, targets, 20)
    _, _, handle = train_caught(thing, torch, model, optimizer, data, targets, 20)
    handle.wait(TIMEOUT)
    step = statistics.median(train_plain(torch, model, optimizer, data, targets, 20)
                             for _ in range(3))
    steps = max(20, int(seconds_per_round / step))

    plain: list[float] = []
    caught: list[float] = []
    in_catch: list[float] = []
    unstored = 0
    for index in range(rounds):
        order = ("plain", "caught") if index % 2 == 0 else ("caught", "plain")
        for variant in order:
            if variant == "plain":
                plain.append(train_plain(torch, model, optimizer, data, targets, steps))
            else:
                per_step, caller, handle = train_caught(thing, torch, model, optimizer, data,
                                                        targets, steps)
                caught.append(per_step)
                in_catch.append(caller)
                # Untimed: let the last captures of the round drain before the next round.
                unstored += not handle.wait(TIMEOUT)
    return {"plain": plain, "caught": caught, "in_catch": in_catch, "steps": steps,
            "unstored": unstored}


# -- main ------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and rounds")
    parser.add_argument("--width", type=int, default=1024,
                        help="hidden width of the MLP (default 1024)")
    parser.add_argument("--transport", choices=("auto", "tcp", "unix", "shm"),
                        help="THING_TRANSPORT for the client (default: the environment's, "
                             "else auto)")
    args = parser.parse_args()

    batches = 50 if args.quick else 200
    calls = 1000
    bursts = 10 if args.quick else 30
    burst = 7  # timed as a batch, after the first call of the burst, which is timed alone
    rounds = 4 if args.quick else 12
    seconds_per_round = 0.5

    if args.transport:
        os.environ["THING_TRANSPORT"] = args.transport
    server, port = _common.start_thing_server()
    # Captures must be sent, not dropped: a queue far larger than any burst.
    os.environ.update(THING_SERVER=f"127.0.0.1:{port}", THING_QUEUE_BYTES=str(16 << 30),
                      THING_QUEUE_ITEMS="100000")
    try:
        import torch

        import thing

        _common.print_machine("thing overhead benchmark: the caller's thread and a training loop")
        big = torch.randn(64 * MiB // 4)
        small = torch.randn(4 * KiB // 4)
        x = big
        first = thing.catch(x, name="warmup")  # connect before anything is timed
        if not first.wait(TIMEOUT):
            raise SystemExit(f"could not reach the thing server: {first!r}")
        # Which path the default client took; private attributes, read defensively.
        channels = getattr(getattr(thing, "_default_client", None), "_channels", {})
        transport = getattr(next(iter(channels.values()), None), "transport", None) or "?"
        wanted = os.environ.get("THING_TRANSPORT", "") or "auto"
        print(f"A thing server runs in another process (port {port}); captures are really sent "
              f"(THING_TRANSPORT={wanted}: over {transport}).\n")

        rows = []
        timings = [batch_empty(thing, x, calls, time.perf_counter_ns)[0] for _ in range(batches)]
        empty = median_ns(timings, calls)
        rows.append(("empty Python function call: noop(x)", empty, None,
                     f"{batches} batches x {calls} calls"))
        for label, batch in (("throttled away: thing.catch(x, every=1000), 64 MiB",
                              batch_throttled),
                             ("  same with name='throttled'", batch_throttled_named),
                             ("  through Python: thing.catch.__wrapped__(x, every=1000)",
                              batch_throttled_python),
                             ("  through Python, with name=", batch_throttled_named_python)):
            timings = time_throttled(thing, batch, big, batches)
            rows.append((label, median_ns(timings, 999), TARGET_THROTTLED_NS,
                         f"{batches} batches x 999 calls"))
        timings = time_on_demand(thing, big, batches, calls)
        rows.append(("on demand, not requested: thing.catch(x, name=..., on_demand=True)",
                     median_ns(timings, calls), TARGET_THROTTLED_NS,
                     f"{batches} batches x {calls} calls"))
        lost_total = 0
        for size_label, tensor in (("64 MiB", big), ("4 KiB", small)):
            for call, batch in (("thing.catch(x)", batch_enqueued),
                                ("thing.catch(x, name='named')", batch_enqueued_named)):
                firsts, timings, lost = time_enqueued(thing, batch, tensor, bursts, burst, server)
                lost_total += lost
                rows.append((f"enqueued: {call}, {size_label}", median_ns(timings, burst),
                             TARGET_ENQUEUED_NS, f"{bursts} bursts x {burst} calls after the 1st"))
                rows.append(("  1st call of each burst (thread was waiting)",
                             statistics.median(firsts), None, f"{bursts} single calls"))
        cold = statistics.median(time_cold_empty(x, 50 if args.quick else 200, 0.01))
        rows.append(("1st empty call after sleeping 10 ms (machine's cold-call cost)", cold, None,
                     f"{50 if args.quick else 200} single calls"))

        print("Caller-thread cost per call: median over batches of the mean ns per call "
              "(loop included)")
        print(f"  {'':<64} {'ns/call':>9} {'x empty':>8}  {'target':>9}  verdict")
        for label, ns, target, note in rows:
            verdict = "" if target is None else ("meets" if ns <= target else "MISSES")
            target_text = "" if target is None else f"<= {target:,} ns"
            print(f"  {label:<64} {ns:>9.0f} {ns / empty:>8.1f}  {target_text:>9}  {verdict:<6}"
                  f"  {note}")
        if lost_total:
            print(f"  WARNING: {lost_total} enqueued captures were not stored (dropped or failed)")
        else:
            print("  Every enqueued capture was stored by the server (queue never full).")
        print()

        samples, step = (20 if args.quick else 100), 0.005
        delays = sorted(measure_request_delay(thing, server, samples, step))
        middle, worst = statistics.median(delays), delays[max(int(len(delays) * 0.99) - 1, 0)]
        print(f"From thing.request() in the REPL to the first capture it brings, a loop of "
              f"{step * 1e3:g} ms steps catching on demand ({samples} requests):")
        print(f"  median {middle * 1e3:.2f} ms ({middle / step:.2f} steps), p99 "
              f"{worst * 1e3:.2f} ms ({worst / step:.2f} steps); target <= 2 steps: "
              f"{'meets' if worst <= 2 * step else 'MISSES'}")
        print()

        rows, lost = snapshot_rows(thing, torch, server, bursts, burst)
        print("Snapshot at the call (copy=True) vs queued by reference (copy=False): ns per catch,")
        print(f"median over {bursts} bursts of {burst}; the bare copy is timed alone, same run")
        print(f"  {'':<16} {'by reference':>13} {'snapshot':>10} {'difference':>11} "
              f"{'bare copy':>10} {'snapshot / ref':>15}  default")
        for label, by_reference, snapshot, bare, default in rows:
            print(f"  {label:<16} {by_reference:>13.0f} {snapshot:>10.0f} "
                  f"{snapshot - by_reference:>+11.0f} {bare:>10.0f} "
                  f"{snapshot / by_reference:>15.2f}  {default}")
        if lost:
            print(f"  WARNING: {lost} captures were not stored")
        print()

        threads = [torch.get_num_threads()]
        if threads[0] > 1 and not args.quick:
            threads.append(1)  # leaves a core to thing's threads and the server process
        print(f"Training loop: MLP 256-{args.width}-{args.width}-10, batch 128, SGD on random "
              f"data; {rounds} rounds per variant, ABBA order, ~{seconds_per_round:g} s a round.")
        print("  with thing: thing.catch(loss) every step and "
              f"thing.catch(model.fc1.weight, every=10) ({256 * args.width * 4 / MiB:g} MiB)")
        for count in threads:
            torch.set_num_threads(count)
            result = measure_training(thing, torch, rounds, seconds_per_round, args.width)
            plain = statistics.median(result["plain"])
            caught = statistics.median(result["caught"])
            # Round i of each variant ran back to back: their ratio cancels slow drifts in
            # the machine's load, and the median of the ratios ignores a disturbed round.
            slowdown = statistics.median(
                c / p for p, c in zip(result["plain"], result["caught"])) - 1
            target = TARGET_SLOWDOWN_ONE_THREAD if count == 1 else TARGET_SLOWDOWN
            verdict = "meets" if slowdown <= target else "MISSES"
            print(f"  {count} torch thread{'s' if count > 1 else ''}, {result['steps']} steps a "
                  f"round: slowdown {slowdown * 100:+.2f}% (median of the rounds' ratios; "
                  f"{slowdown * plain * 1e6:+.0f} us/step), target <= {target:.0%}: "
                  f"{verdict}")
            for label, values, middle in (("without thing", result["plain"], plain),
                                          ("with thing", result["caught"], caught)):
                print(f"    {label:<14} median {middle * 1e3:7.3f} ms/step; rounds "
                      + " ".join(f"{value * 1e3:.3f}" for value in values))
            caller = statistics.median(result["in_catch"])
            print(f"    time inside the two catch calls: median {caller * 1e6:.1f} us/step "
                  "(the caller's share of the slowdown)")
            if result["unstored"]:
                print(f"    WARNING: the last loss capture of {result['unstored']} rounds was "
                      "not stored")
        print(f"\nLoad average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
              "(other work on the machine inflates every figure above).")
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
