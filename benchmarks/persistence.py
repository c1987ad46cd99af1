"""Saving, loading and recording history: thing against torch.save/torch.load, raw safetensors
and dd, on the same history in the same run.

The history is what issue 12 names: 1,000 small captures (4 float32 each) and
10 captures of 256 MiB, in one store. Every writer is timed to the end of an
fsync of what it wrote (thing.save does that itself; the baselines get an
explicit one), so each figure is bytes on disk, not bytes in the page cache.

- save: ``thing.save`` (``HistoryStore.save``) against ``safetensors.numpy.save_file``
  of the same arrays and against ``torch.save`` of the same arrays as tensors
  (``torch.from_numpy``: no copy), each into a fresh directory.
- load: ``HistoryStore.load`` (maps the files) against ``torch.load`` and
  ``torch.load(mmap=True)`` and ``safetensors.numpy.load_file``, with the files in
  the page cache (just written) and, when this process may drop the page cache
  (root), cold. ``load + read all`` also reads every byte of every array, which
  is what a user who looks at all of it pays.
- recorder: a client process sends 16 MiB captures to a ``thing record`` process
  (64 MiB segments, its default; written at most 1 s after their first capture, not
  10 s, so that a trial's last one is not held back), ``--recorded`` of them a
  trial; MB/s from
  the trial's first send to its last segment on disk (the line the recorder
  prints for it), against ``dd bs=64M conv=fdatasync`` of the same number of
  bytes. One recorder runs through every trial, as it would for hours; its
  first trial, with memory and disk cold, is shown apart.

Medians of ``--trials`` (default 3) with the best beside them.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _common import REPO, child_env, median, print_machine

from thing.captures import Sender
from thing.store import HistoryStore

SMALL, LARGE, LARGE_BYTES = 1000, 10, 256 << 20


def history(large: int, large_bytes: int) -> HistoryStore:
    store = HistoryStore()
    sender = Sender("bench:1", "bench", 1)
    for index in range(SMALL):
        value = np.full(4, index, np.float32)
        store.add("small", value, (), value.nbytes, sender)
    rng = np.random.default_rng(0)
    for index in range(large):
        value = rng.standard_normal(large_bytes // 4, dtype=np.float32)
        store.add(f"large{index}", value, (), value.nbytes, sender)
    return store


def arrays_of(store: HistoryStore) -> dict[str, np.ndarray]:
    """The store's arrays, keyed as a user saving them by hand would."""
    return {f"{capture.name}.{capture.id}": capture.value for capture in store.recent(len(store))}


def fsync_tree(path: Path) -> None:
    for file in ([path] if path.is_file() else sorted(path.iterdir())):
        descriptor = os.open(file, os.O_RDONLY)
        os.fsync(descriptor)
        os.close(descriptor)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(action: Callable[[], Any]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def read_all(values: Any) -> None:
    """Touch every byte, as computing a statistic of every array would."""
    items = values.values() if isinstance(values, dict) else values
    for value in items:
        array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
        np.bitwise_xor.reduce(array.reshape(-1).view(np.uint8)[::4096])  # one byte a page
        array.sum()


def row(label: str, nbytes: int, seconds: list[float], baseline: float | None = None,
        target: str = "") -> None:
    rate = nbytes / median(seconds) / 1e6
    best = nbytes / min(seconds) / 1e6
    ratio = "" if baseline is None else f"{rate / baseline:6.2f}x"
    print(f"  {label:<44} {rate:9.0f} MB/s (best {best:7.0f})  {median(seconds) * 1e3:9.1f} ms"
          f"  {ratio} {target}", flush=True)


def bench_save_and_load(store: HistoryStore, work: Path, trials: int) -> None:
    import safetensors.numpy
    import torch

    arrays = arrays_of(store)
    nbytes = sum(array.nbytes for array in arrays.values())
    print(f"\nSave ({len(store)} captures, {nbytes / 1e9:.2f} GB), to the end of an fsync:")
    results: dict[str, list[float]] = {"thing": [], "safetensors": [], "torch": []}
    for trial in range(trials):
        for what in results:
            target = work / f"{what}-{trial}"
            if what == "thing":
                seconds = timed(lambda target=target: store.save(target))
            elif what == "safetensors":
                def save_raw(target: Path = target) -> None:
                    safetensors.numpy.save_file(arrays, target)
                    fsync_tree(target)
                seconds = timed(save_raw)
            else:
                def save_torch(target: Path = target) -> None:
                    torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, target)
                    fsync_tree(target)
                seconds = timed(save_torch)
            results[what].append(seconds)
            if trial < trials - 1:
                shutil.rmtree(target) if target.is_dir() else target.unlink()
    raw = nbytes / median(results["safetensors"]) / 1e6
    row("raw safetensors (save_file + fsync)", nbytes, results["safetensors"])
    row("torch.save (+ fsync)", nbytes, results["torch"], raw)
    row("thing.save", nbytes, results["thing"], raw, "(target >= 0.8x raw safetensors)")

    last = trials - 1
    loaders: dict[str, Callable[[], Any]] = {
        "torch.load": lambda: torch.load(work / f"torch-{last}", weights_only=True),
        "torch.load(mmap=True)": lambda: torch.load(work / f"torch-{last}", mmap=True,
                                                    weights_only=True),
        "safetensors.numpy.load_file": lambda: safetensors.numpy.load_file(
            work / f"safetensors-{last}"),
        "thing.load": lambda: [c.value for c in _loaded(work / f"thing-{last}")],
    }
    for cache in ("warm", "cold"):
        if cache == "cold" and not drop_page_cache():
            print("\nLoad, cold: skipped (dropping the page cache needs root)")
            continue
        print(f"\nLoad, page cache {cache} (MB/s of the history's bytes; higher is better):")
        for touch in (False, True):
            seconds: dict[str, list[float]] = {name: [] for name in loaders}
            for _ in range(trials):
                for name, load in loaders.items():
                    if cache == "cold":
                        drop_page_cache()
                    action = (lambda load=load: read_all(load())) if touch else load
                    seconds[name].append(timed(action))
            baseline = nbytes / median(seconds["torch.load"]) / 1e6
            for name in loaders:
                label = name + (" + read all" if touch else "")
                target = "(target >= 10x torch.load)" if name == "thing.load" and not touch else ""
                row(label, nbytes, seconds[name], None if name == "torch.load" else baseline,
                    target)


def _loaded(path: Path) -> list[Any]:
    store = HistoryStore()
    store.load(path)
    return store.recent(len(store))


def bench_recorder(work: Path, captures: int, trials: int) -> None:
    """One ``thing record`` process and one sender for every trial, as a recorder runs for
    hours: the first trial (memory and disk cold) is reported apart from the others."""
    nbytes = captures * (16 << 20)
    segments_per_trial = nbytes // (64 << 20)  # its default segment: 4 captures
    print(f"\nRecording {captures} x 16 MiB captures sent by a client process "
          f"({nbytes / 1e9:.2f} GB a trial), to the trial's last segment on disk:")
    port = free_port()
    recorder = subprocess.Popen([sys.executable, "-m", "thing", "record", str(work / "rec"),
                                 "--port", str(port), "--segment-seconds", "1"],
                                env=child_env(), cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
    assert recorder.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in recorder.stdout],
                     daemon=True).start()
    # The sender once the recorder listens: a capture with no server listening is dropped.
    assert lines.get(timeout=60).startswith("thing is recording")
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(port), str(captures)],
                              env=child_env(), cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert sender.stdout is not None and sender.stdin is not None
    dd, recorded = [], []
    try:
        assert sender.stdout.readline().strip() == "ready"
        for trial in range(trials + 1):
            target = work / f"dd-{trial}"
            start = time.perf_counter()
            subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=64M",
                            f"count={segments_per_trial}", "conv=fdatasync"],
                           check=True, capture_output=True)
            dd.append(time.perf_counter() - start)
            target.unlink()
            start = time.perf_counter()
            sender.stdin.write("go\n")
            sender.stdin.flush()
            written = 0
            while written < captures + (trial == 0):  # the warm-up capture is in the first
                line = lines.get(timeout=300)
                if line.startswith("segment-"):  # else the rest of the opening line, wrapped
                    written += int(line.split()[1])
            recorded.append(time.perf_counter() - start)
            assert sender.stdout.readline().strip() == "sent"
    finally:
        sender.kill()
        recorder.send_signal(signal.SIGTERM)
        recorder.wait(60)
    baseline = nbytes / median(dd[1:]) / 1e6
    row("dd bs=64M conv=fdatasync", nbytes, dd[1:])
    row("thing record, sustained (trials 2 on)", nbytes, recorded[1:], baseline,
        "(target >= 0.8x dd)")
    row("dd, first trial", nbytes, dd[:1])
    row("thing record, first trial (memory cold)", nbytes, recorded[:1], nbytes / dd[0] / 1e6)


# The client: 16 MiB captures under new names, each trial's waited for at its end.
SENDER = """
import sys, numpy as np, thing
port, count = int(sys.argv[1]), int(sys.argv[2])
client = thing.Client(f"127.0.0.1:{port}")
value = np.random.default_rng(1).standard_normal(4 << 20, dtype=np.float32)
assert client.catch(np.zeros(1), name="warm").wait(30)  # 8 bytes: segments stay 4 captures
print("ready", flush=True)
trial = 0
while sys.stdin.readline():
    handles = [client.catch(value, name=f"x{trial}.{i}", block=True) for i in range(count)]
    assert all(handle.wait(60) for handle in handles)
    print("sent", flush=True)
    trial += 1
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="10 x 64 MiB instead of 10 x 256 MiB, 2 trials")
    parser.add_argument("--recorded", type=int, default=64,
                        help="16 MiB captures the recorder receives per trial (default 64)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--parts", default="save,record",
                        help="which to run: save (save and load), record (default: both)")
    args = parser.parse_args()
    large_bytes = 64 << 20 if args.quick else LARGE_BYTES
    trials = 2 if args.quick else args.trials
    print_machine("persistence: save, load and record, against torch, safetensors and dd")
    work = Path(tempfile.mkdtemp(prefix="thing-persistence-", dir=args.dir))
    try:
        parts = args.parts.split(",")
        if "save" in parts:
            store = history(LARGE, large_bytes)
            bench_save_and_load(store, work, trials)
            del store
        if "record" in parts:
            bench_recorder(work, 16 if args.quick else args.recorded, trials)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
