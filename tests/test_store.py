"""Tests of the history store on its own: ordering, ids, the byte cap, eviction, threads."""

from __future__ import annotations

import copy
import difflib
import pickle
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import thing
from thing.arrays import LeafSpec
from thing.captures import Sender
from thing.errors import LimitExceeded
from thing.store import NAME_BYTES, RECORD_BYTES, Announcement, HistoryStore

SENDER = Sender("127.0.0.1:1", "host", 1)


def put(store: HistoryStore, name: str | None, nbytes: int = 8, fill: int = 0, **details):
    """Receive one uint8 array of ``nbytes`` into ``store`` the way the server does."""
    store.reserve(nbytes)
    store.fill(nbytes)
    value = np.full(nbytes, fill, np.uint8)
    spec = LeafSpec("numpy", "uint8", (nbytes,))
    return store.add(name, value, (spec,), nbytes, SENDER, **details)


def cost(nbytes: int, name: str = "x") -> int:
    """What one ``put`` of ``nbytes`` under a name of ``name``'s length holds against the cap."""
    return nbytes + RECORD_BYTES + sys.getsizeof(name)  # the name is held too


def test_get_by_name_index_and_id() -> None:
    store = HistoryStore(max_bytes=1 << 20)
    first, second, third = (put(store, "w", fill=i) for i in range(3))
    assert store.get("w") is third
    assert store.get("w", 1) is second
    assert store.get("w", 2) is first
    assert store.get("w", -1) is first  # negative: counted from the oldest
    assert store.get("w", -3) is third
    assert store.get(second.id) is second
    assert store.get(np.int64(second.id)) is second
    with pytest.raises(IndexError, match="3 kept versions"):
        store.get("w", 3)
    with pytest.raises(KeyError, match="no capture with id 99"):
        store.get(99)
    with pytest.raises(TypeError):
        store.get(1.5)


def test_get_returns_the_stored_array_itself() -> None:
    store = HistoryStore(max_bytes=1 << 20)
    capture = put(store, "w")
    assert store.get("w").value is capture.value
    assert store.get_all("w")[0].value is capture.value


def test_get_all_is_oldest_to_newest_and_filters_by_rank() -> None:
    store = HistoryStore(max_bytes=1 << 20)
    ids = []
    for i in range(4):
        store.reserve(0)
        sender = Sender("a", "h", 1, rank=i % 2, world_size=2)
        ids.append(store.add("x", float(i), (), 0, sender).id)
    assert [c.id for c in store.get_all("x")] == ids
    assert [c.value for c in store.get_all("x", rank=1)] == [1.0, 3.0]
    assert store.get("x", rank=0).value == 2.0
    with pytest.raises(KeyError, match="it came from ranks 0, 1"):
        store.get_all("x", rank=5)
    put(store, "unranked")  # it said "it came from rank(s) None"
    with pytest.raises(KeyError, match="it came from no rank: it was caught outside"):
        store.get("unranked", rank=3)


def test_unknown_name_lists_the_closest_names() -> None:
    store = HistoryStore(max_bytes=1 << 20)
    with pytest.raises(KeyError, match="nothing is kept"):
        store.get("loss")
    for name in ("loss", "lm_head.weight", "model.lm_head.weight", "acc"):
        put(store, name)
    with pytest.raises(KeyError, match="did you mean 'loss'"):
        store.get("lss")
    with pytest.raises(KeyError) as error:
        store.get("weight")
    assert "'lm_head.weight'" in str(error.value) and "'model.lm_head.weight'" in str(error.value)
    with pytest.raises(KeyError, match="known names: 'loss'"):
        store.get("zzzzzz")


def test_the_closest_names_are_looked_for_outside_the_stores_lock(monkeypatch) -> None:
    """Among 100,000 names a typo's suggestions took seconds, all under the lock every
    arriving capture needs: every job's captures waited."""
    store = HistoryStore(max_bytes=1 << 20)
    put(store, "loss")
    looked = []

    def close_matches(*args: Any, **kwargs: Any) -> list[str]:
        def try_the_lock() -> None:  # as a receiving thread would (the lock is reentrant)
            free = store._lock.acquire(blocking=False)
            if free:
                store._lock.release()
            looked.append(free)

        other = threading.Thread(target=try_the_lock)
        other.start()
        other.join(10)
        return ["loss"]

    monkeypatch.setattr(difflib, "get_close_matches", close_matches)
    with pytest.raises(thing.UnknownName) as error:
        store.get("lss")
    assert "did you mean 'loss'" in str(error.value) and looked == [True]
    assert repr(error.value) == "UnknownName(\"no capture named 'lss'; did you mean 'loss'?\")"


def test_eviction_drops_the_oldest_first_and_counts() -> None:
    store = HistoryStore(max_bytes=3 * (cost(1000) + NAME_BYTES) + 100)
    captures = [put(store, name, 1000) for name in ("a", "b", "a", "c", "b")]
    assert store.evicted == 2
    assert [c.id for c in store.recent(10)] == [c.id for c in reversed(captures[2:])]
    assert [c.id for c in store.get_all("a")] == [captures[2].id]
    assert store.held_bytes == 3 * (cost(1000) + NAME_BYTES)  # three names, a capture each
    with pytest.raises(KeyError):
        store.get(captures[0].id)
    overview = store.overview()
    assert (overview.evicted, overview.captures, overview.received) == (2, 3, 5)


def test_a_name_whose_versions_were_all_evicted_disappears() -> None:
    store = HistoryStore(max_bytes=2 * cost(1000) + 100)
    put(store, "old", 1000)
    put(store, "new", 1000)
    put(store, "new", 1000)
    assert store.names() == ["new"]
    with pytest.raises(KeyError, match="did you mean 'new'|known names"):
        store.get("old")


def test_max_versions_keeps_the_newest_of_each_name() -> None:
    store = HistoryStore(max_bytes=1 << 20, max_versions=2)
    for i in range(5):
        put(store, "w", fill=i)
        put(store, "other", fill=i)
    assert [int(c.value[0]) for c in store.get_all("w")] == [3, 4]
    assert [int(c.value[0]) for c in store.get_all("other")] == [3, 4]
    assert store.evicted == 6
    assert store.held_bytes == 2 * cost(8, "w") + 2 * cost(8, "other") + 2 * NAME_BYTES
    with pytest.raises(ValueError):
        HistoryStore(max_versions=0)


def test_a_capture_larger_than_the_cap_is_refused_and_evicts_nothing() -> None:
    store = HistoryStore(max_bytes=cost(1000) * 2)
    kept = put(store, "small", 1000)
    with pytest.raises(LimitExceeded, match="larger than the store's cap"):
        store.reserve(cost(1000) * 2)
    assert store.rejected == 1
    assert store.get("small") is kept
    assert store.held_bytes == cost(1000, "small") + NAME_BYTES


def test_reservations_are_accounted_and_released() -> None:
    store = HistoryStore(max_bytes=10_000)
    store.reserve(4000)
    store.reserve(4000)
    assert store.held_bytes == 0  # a claim holds nothing until its bytes arrive
    store.fill(4000)
    store.fill(1000)
    assert store.held_bytes == 5000
    # Captures still being received cannot be evicted: no room for a third.
    with pytest.raises(LimitExceeded, match="still being received"):
        store.reserve(4000)
    store.release(4000, 4000)
    store.release(4000, 1000)
    assert store.held_bytes == 0
    put(store, "x", 4000)
    assert store.held_bytes == cost(4000) + NAME_BYTES
    assert store.clear() == 1
    assert store.held_bytes == 0


def test_tiny_header_only_captures_are_bounded_too() -> None:
    store = HistoryStore(max_bytes=100 * RECORD_BYTES)
    for i in range(1000):
        store.reserve(0)
        store.add("note", "x" * 100 + str(i), (), 0, SENDER)
    assert store.held_bytes <= store.max_bytes
    assert 10 < len(store) < 100
    assert store.evicted == 1000 - len(store)
    assert store.get("note").value.endswith("999")


@pytest.mark.parametrize("character", ["x", "\u4e2d", "\U0001F600"])
def test_text_is_charged_what_it_holds_in_memory(character: str) -> None:
    """Python holds text at 1, 2 or 4 bytes a character: a job catching CJK or emoji text
    filled a store charged by the character to three times its cap."""
    store = HistoryStore(max_bytes=1 << 20)
    for i in range(40):
        store.add("text", character * 20_000 + str(i), (), 0, SENDER)
    held = sum(sys.getsizeof(capture.value) for capture in store.get_all("text"))
    assert held <= store.held_bytes <= store.max_bytes


def test_large_ints_are_charged_their_digits() -> None:
    """An int of 4,000 digits holds 1.8 KB: charged 32 bytes, a flood of them filled
    memory 40 times the cap before anything was evicted."""
    store = HistoryStore(max_bytes=1 << 20)
    for i in range(40):
        store.add("big", [10**4000 + i + k for k in range(50)], (), 0, SENDER)
    held = sum(sys.getsizeof(number) for capture in store.get_all("big")
               for number in capture.value)
    assert held <= store.held_bytes <= store.max_bytes


def test_a_received_bytes_capture_is_charged_the_copy_its_value_is() -> None:
    """A bytes object is made by copying the received array, which the capture keeps (what
    save() writes): built, 100 MiB of bytes held 200 MiB, charged 100."""
    with thing.Server(port=0) as server:
        client = thing.Client("127.0.0.1", server.port)
        try:
            handle = client.catch(b"\x07" * 1_000_000, name="blob")
            assert handle.wait(10), handle.error
        finally:
            client.close()
        capture = server.capture(handle.id)
        assert capture.value == b"\x07" * 1_000_000
        assert server.store.charge(capture) >= 2_000_000
        assert server.store.held_bytes >= 2_000_000


def test_clear_one_name_or_everything() -> None:
    store = HistoryStore(max_bytes=1 << 20)
    put(store, "a")
    put(store, "a")
    put(store, "b")
    put(store, None)
    assert store.clear("a") == 2
    assert store.names() == ["b"]
    with pytest.raises(KeyError):
        store.clear("a")
    assert store.clear() == 2
    assert len(store) == 0 and store.held_bytes == 0
    assert store.evicted == 0  # cleared on purpose is not evicted
    assert store.overview().received == 4


def test_overview_lists_the_most_recently_updated_names_first() -> None:
    store = HistoryStore(max_bytes=1 << 20)
    for name in ("a", "b", "c", "a"):
        put(store, name)
    put(store, None)
    put(store, "b", consistent=False)
    overview = store.overview(2)
    assert [(c.name, n) for c, n in overview.names] == [("b", 2), ("a", 2)]
    assert overview.name_count == 3
    assert overview.unnamed == 1
    assert overview.inconsistent == 1
    assert [c.name for c, _ in store.overview().names] == ["b", "a", "c"]


def test_wait_returns_the_next_capture_or_times_out() -> None:
    store = HistoryStore(max_bytes=1 << 20)
    put(store, "x")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="'x' within 0.2 s"):
        store.wait("x", timeout=0.2)
    assert time.monotonic() - started < 5
    before = store.received - 1
    writer = threading.Thread(target=lambda: put(store, "x", fill=7))
    writer.start()
    assert int(store.wait("x", timeout=30, after=before).value[0]) == 7
    writer.join()
    assert store.wait_for_arrival(store.received - 1, 0.01)
    assert not store.wait_for_arrival(store.received, 0.01)


def test_concurrent_receivers_and_readers_keep_the_books_straight() -> None:
    writers, per_writer = 4, 300
    store = HistoryStore(max_bytes=50 * cost(1000, "w0") + writers * NAME_BYTES)
    errors: list[BaseException] = []
    stop = threading.Event()

    def write(index: int) -> None:
        try:
            for i in range(per_writer):
                put(store, f"w{index}", 1000, fill=i % 256)
        except BaseException as exc:
            errors.append(exc)

    def read() -> None:
        try:
            while not stop.is_set():
                for name in store.names():
                    try:
                        history = store.get_all(name)
                        store.get(name, 0)
                    except KeyError:  # evicted meanwhile
                        continue
                    ids = [c.id for c in history]
                    assert ids == sorted(ids)
                store.overview(3)
                store.recent(5)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in readers + threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    stop.set()
    for thread in readers:
        thread.join(timeout=60)
    assert errors == []
    total = writers * per_writer
    assert store.received == total
    assert len(store) + store.evicted == total
    # 50 captures, and one more for each writer's name left with none (its cost given back).
    assert 50 <= len(store) <= 50 + writers - len(store.names())
    assert store.held_bytes == len(store) * cost(1000, "w0") + len(store.names()) * NAME_BYTES
    assert store.held_bytes <= store.max_bytes
    # Every kept capture's bytes are the ones written for it.
    for name in store.names():
        for capture in store.get_all(name):
            assert capture.value.nbytes == 1000
            assert np.all(capture.value == capture.value[0])


def test_a_claim_evicts_nothing_only_arriving_bytes_do() -> None:
    each = cost(1000, "n0") + NAME_BYTES  # a name each
    store = HistoryStore(max_bytes=10 * each)
    kept = [put(store, f"n{i}", 1000) for i in range(9)]
    store.reserve(8 * each)  # a near-cap claim, its bytes not yet sent
    assert len(store) == 9 and store.evicted == 0
    store.fill(2 * each)  # as they arrive, the oldest make room, no more
    assert store.evicted == 1 and store.get("n1") is kept[1]
    store.release(8 * each, 2 * each)  # the frame is dropped: the rest stays
    assert len(store) == 8 and store.held_bytes == 8 * each


def test_a_long_history_is_not_walked_by_the_garbage_collector(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every full collection in the REPL walks every object it tracks: with the compiled core
    a stored capture and its statistics are none of them (the twin keeps about one object
    per capture, its arrays in a tuple the collector stops tracking, and its statistics);
    its value is still built whole, from the same memory, when asked for, and its memory
    still goes back the moment it is evicted, without a collection."""
    import gc
    import weakref

    import thing
    from thing.history_stats import capture_stats

    from .conftest import run_script

    count = 2000
    monkeypatch.setenv("THING_STATS_SHARE", "0")  # worked out below, for all of them
    with thing.Server(port=0) as server:
        gc.collect()
        before = len(gc.get_objects())
        run_script(
            f"""
            import numpy as np, thing
            for i in range({count}):
                value = (np.float32([i, -i]) if i % 2 else
                         {{"w": np.arange(i % 7, dtype=np.int16), "n": np.float64(i)}})
                handle = thing.catch(value, name="s", block=True)
            assert handle.wait(30), handle.error
            """,
            server.port,
        )
        for capture in server.store.get_all("s"):  # what thing.stats() keeps on each
            capture_stats(capture)
        del capture
        gc.collect()
        per_capture = (len(gc.get_objects()) - before) / count
        kept = server.store.get_all("s")
        assert len(kept) == count and capture_stats(kept[1]).values.max == 1.0
        if thing._core.BACKEND == "compiled":
            assert per_capture < 0.2, per_capture  # the server's own few objects
        else:
            assert 0.9 < per_capture < 3.2, per_capture
        for i in (0, 1, count - 2, count - 1):
            value = kept[i].value
            if i % 2:
                assert value.tobytes() == np.float32([i, -i]).tobytes()
            else:
                assert value["w"].tobytes() == np.arange(i % 7, dtype=np.int16).tobytes()
                assert value["n"] == np.float64(i)
        parts = kept[1].parts()
        assert np.shares_memory(parts.arrays[0], kept[1].value)
        for copied in (copy.deepcopy(kept[3]), pickle.loads(pickle.dumps(kept[3]))):
            assert copied.value.tobytes() == np.float32([3, -3]).tobytes()
        memory = weakref.ref(parts.arrays[0])
        del value, parts, copied, kept
        gc.disable()  # freed by its reference count alone
        try:
            server.clear("s")
            assert memory() is None
        finally:
            gc.enable()


def test_names_that_never_repeat_are_held_to_the_cap_too() -> None:
    """Each name costs the store its own history and index entries, charged while it has a
    capture: a job catching f"step{i}/loss" is bounded by the cap as one name is."""
    store = HistoryStore(max_bytes=1 << 20)
    for i in range(5000):
        store.add(f"step{i}/loss", float(i), (), 0, Sender("job:1"))
    assert len(store) <= (1 << 20) // (RECORD_BYTES + NAME_BYTES) + 1
    assert store.held_bytes <= store.max_bytes and store.names()[-1] == "step4999/loss"
    store.clear()
    assert store.held_bytes == 0


def test_a_run_and_an_announcement_each_show_in_a_line_of_80_columns() -> None:
    """thing.runs() and thing.available() echo in the REPL: their dataclasses' own reprs
    were 375 and 700 columns, with raw epoch floats."""
    store = HistoryStore()
    job = Sender("127.0.0.1:5", "gpu-node-17.cluster.example.org", 4242, 0, 8,
                 run="20261203-070224-692e3c")
    for name in ("loss", "model.transformer.h.11.attn.c_proj.weight", "lr"):
        store.add(name, 1.0, (), 0, job)
    store.note_available(Announcement("attn_probs", "torch.Tensor", (1024, 1024),
                                      "bfloat16", "train.py:142 (step)", job, time.time()))
    [run] = store.runs()
    [announced] = store.available()
    assert repr(run).startswith("Run('20261203-070224-692e3c': 3 captures, rank 0, ")
    assert repr(announced) == ("Announcement('attn_probs': torch.Tensor (1024, 1024) "
                               "bfloat16, pid 4242 rank 0)")
    assert max(len(repr(run)), len(repr(announced))) <= 80


# -- a long, mixed history against first principles ----------------------------------------


def _reference_history(store: HistoryStore, name: str) -> list:
    """A name's captures, oldest first, found the slow way: in the store's order of arrival."""
    return [capture for capture in store.kept() if capture.name == name]


def _reference_select(store: HistoryStore, name: str, rank, run) -> list:
    history = _reference_history(store, name)
    if rank is not None:
        history = [c for c in history if c.rank == rank]
    if history and run != "all":
        wanted = history[-1].sender.run if run is None else run
        history = [c for c in history if c.sender.run == wanted]
    return history


def _reference_rows(store: HistoryStore, name: str) -> list:
    """summary()'s rows of a name: the newest of each run and rank, the newest run first."""
    newest, counts = {}, {}
    for capture in reversed(_reference_history(store, name)):
        key = (capture.sender.run, capture.rank)
        newest.setdefault(key, capture)
        counts[key] = counts.get(key, 0) + 1
    runs = list(dict.fromkeys(run for run, _ in newest))
    keys = sorted(newest, key=lambda key: (runs.index(key[0]), key[1] is None, key[1] or 0))
    return [(newest[key], counts[key]) for key in keys]


@pytest.mark.parametrize("seed", range(12))
def test_every_question_answers_as_a_walk_of_the_whole_history_would(seed: int) -> None:
    """The store answers get(), get_all(), summary()'s rows, runs() and recent_of() from each
    name's history split by run and rank, kept up to date as captures arrive, are evicted,
    cleared and loaded among them (older, newer, interleaved, twice): the answers must be
    those of a walk of everything kept, in order of arrival."""
    import random

    chance = random.Random(seed)
    names, runs, ranks = ["loss", "w", "h[3]", None], ["a", "b", "c"], [None, 0, 1, 2]
    store = HistoryStore(max_bytes=chance.choice([60, 200, 10_000]) * (RECORD_BYTES + 64),
                         max_versions=chance.choice([None, None, 7]))
    clock, calls = [1000.0], {}

    def capture(at: float | None = None) -> thing.captures.Capture:
        name, run, rank = chance.choice(names), chance.choice(runs), chance.choice(ranks)
        if at is None:
            clock[0] += chance.choice([0.0, 0.5, 1.0])  # several in one arrival, sometimes
            at = clock[0]
        calls[name] = calls.get(name, 0) + 1
        return thing.captures.Capture(0, name, float(calls[name]), (), 0,
                                      Sender("job:1", "host", 7, rank, 3, run),
                                      received_at=at, call=calls[name])

    for _ in range(300):
        action = chance.random()
        if action < 0.7:
            batch = [capture() for _ in range(chance.randint(1, 6))]
            store.add_arrived(batch, [RECORD_BYTES] * len(batch))
        elif action < 0.75 and store.names():
            store.clear(chance.choice(store.names()))
        else:
            kept = store.kept()
            where = chance.choice(["older", "newer", "among"])
            low, high = {"older": (0, 999), "newer": (clock[0] + 1, clock[0] + 50),
                         "among": (990, clock[0] + 5)}[where]
            loaded = sorted((capture(chance.uniform(low, high))  # a recording: in order
                             for _ in range(chance.randint(1, 8))), key=lambda c: c.received_at)
            again = chance.sample(kept, min(len(kept), chance.randint(0, 3)))  # here already
            copies = [thing.captures.Capture(0, c.name, c.value, (), 0, c.sender,
                                             received_at=c.received_at, call=c.call)
                      for c in again]
            store.restore(loaded + copies, [RECORD_BYTES] * (len(loaded) + len(copies)))
            if where == "newer":
                clock[0] = max(clock[0], max(c.received_at for c in loaded))

        kept = store.kept()
        assert [c.received_at for c in kept] == sorted(c.received_at for c in kept)
        assert len({id(c) for c in kept}) == len(kept) == len(store)
        for name in store.names():
            history = _reference_history(store, name)
            assert store.get_all(name, run="all") == history
            assert store.versions(name) == len(history)
            for rank in (None, *ranks[1:]):
                for run in (None, "all", *runs):
                    expected = _reference_select(store, name, rank, run)
                    if not expected:
                        with pytest.raises(KeyError):
                            store.get_all(name, rank, run)
                        continue
                    assert store.get_all(name, rank, run) == expected
                    for index in {0, 1, len(expected) - 1, -1, -2, -len(expected)}:
                        if -len(expected) <= index < len(expected):
                            oldest_first = -1 - index if index >= 0 else -index - 1
                            assert store.get(name, index, rank, None, run) is expected[oldest_first]
                    with pytest.raises(IndexError):
                        store.get(name, len(expected), rank, None, run)
                    step = expected[len(expected) // 2].step
                    assert store.get(name, rank=rank, step=step, run=run) is next(
                        c for c in reversed(expected) if c.step == step)
            newest = history[-1]
            assert store.recent_of(name, 4) == [
                c for c in history if (c.sender.run, c.rank) == (newest.sender.run, newest.rank)
            ][-4:]
        rows = store.overview().names
        shown = list(dict.fromkeys(capture.name for capture, _ in rows))
        assert sorted(shown) == sorted(store.names())
        newest = [_reference_history(store, name)[-1].received_at for name in shown]
        assert newest == sorted(newest, reverse=True)  # the most recently updated first
        assert rows == [row for name in shown for row in _reference_rows(store, name)]
        expected_runs = {}
        for c in kept:
            expected_runs.setdefault(c.sender.run, []).append(c)
        assert {run.id: (run.start, run.end, run.captures, run.ranks, run.names)
                for run in store.runs()} == {
            run: (min(c.received_at for c in cs), max(c.received_at for c in cs), len(cs),
                  tuple(sorted({c.rank for c in cs if c.rank is not None})),
                  tuple(dict.fromkeys(c.name for c in cs if c.name is not None)))
            for run, cs in expected_runs.items()}


def test_what_a_capture_is_charged_covers_its_record_and_statistics() -> None:
    """The cap counts what the REPL's memory holds: a capture's record, and the statistics
    the background worker keeps on it (they once went uncharged: 50,000 scalars held 44 %
    more than a 32 MiB cap)."""
    import tracemalloc

    from thing.history_stats import capture_stats

    store = HistoryStore(max_bytes=1 << 40)
    sender = Sender("unix", "host", 7, 0, 1, "run")
    tracemalloc.start()
    try:
        before, charged = tracemalloc.get_traced_memory()[0], store.held_bytes
        for step in range(2_000):
            store.add("loss", step + 0.5, (), 0, sender, call=step, call_site="train.py:12")
            put(store, "w", 16)
        for capture in store.kept():
            capture_stats(capture)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert all(capture.stats is not None for capture in store.kept())
    assert held <= store.held_bytes - charged, (held, store.held_bytes - charged)


def test_the_newest_is_the_last_stored_when_a_recording_came_from_a_clock_ahead() -> None:
    """A recording made where the clock runs a minute ahead, loaded, then a capture arrives
    here: get() said the live one was the newest, get(rank=0) and summary() the loaded one
    (one went by place, the others by time). The live one is placed after it: every
    question says it is the newest, whatever the clocks said."""
    store = HistoryStore()
    ahead = thing.captures.Capture(0, "x", "recorded", (), 0, Sender("b", "other", 2, 0, 1, "R"),
                                   received_at=time.time() + 60, call=1)
    store.restore([ahead], [RECORD_BYTES])
    live = thing.captures.Capture(0, "x", "live", (), 0, Sender("a", "h", 1, 0, 1, "A"), call=1)
    store.add_arrived([live], [RECORD_BYTES])
    assert store.get("x") is live and store.get("x", rank=0) is live
    assert [c for c, _ in store.overview().names] == [live, ahead]
    assert store.kept() == [ahead, live] and store.get_all("x", run="all") == [ahead, live]
    assert live.received_at < ahead.received_at  # what it shows stays what the clock said


def test_a_capture_cleared_while_a_load_checks_is_loaded_again() -> None:
    """load() found a loaded capture here already, outside the lock; a clear() then took
    that one away before the loaded ones went in, and the loaded copy was dropped as a
    duplicate of what was gone: it is loaded after all."""
    sender = Sender("job:1", "host", 7)

    class Clearing(HistoryStore):
        def _captures_named(self, name):
            here = list(super()._captures_named(name))
            self.clear()  # another thread, as the check runs
            return here

    store = Clearing()
    store.add("x", 1.0, (), 0, sender, call=1, received_at=2.0)
    copies = [thing.captures.Capture(0, "x", value, (), 0, sender, received_at=at, call=call)
              for value, at, call in ((0.0, 1.0, 0), (1.0, 2.0, 1))]
    assert store.restore(copies, [RECORD_BYTES] * 2) == 2
    assert [c.value for c in store.get_all("x")] == [0.0, 1.0]


@pytest.mark.parametrize("spread", ["names", "ranks"])
def test_a_flood_of_new_names_or_ranks_is_charged_what_it_holds(spread: str) -> None:
    """Every frame under a name of its own, or a rank of its own (a peer picks both): each
    name and each source of one (a run and rank) holds tables the cap must count, or the
    store went 25-40 % over it."""
    import dataclasses
    import tracemalloc

    store = HistoryStore(max_bytes=8 << 20)
    base = Sender("1.2.3.4:5", "h", 7, 0, 1 << 31, "r")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(30_000):
            sender = dataclasses.replace(base, rank=i) if spread == "ranks" else base
            name = f"n{i:06d}" if spread == "names" else "same"
            capture = thing.captures.Capture(0, name, 1.0, (), 0, sender, call=i)
            store.add_arrived([capture], [store.record_bytes(name, 1.0, None)])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.evicted > 0 and store.held_bytes <= store.max_bytes
    assert held <= store.max_bytes, (held, store.max_bytes)


def test_a_history_placed_against_the_clock_saves_and_loads_in_its_order(tmp_path) -> None:
    """A capture received after one loaded from a clock ahead is placed after it; saved and
    loaded again, the history keeps that order (it was sorted by the times the clocks
    said, and the newest changed); the same arrival twice in a recording is loaded once
    even when its twin here went while the load looked."""
    store = HistoryStore()
    ahead = thing.captures.Capture(0, "x", "recorded", (), 0, Sender("b", "o", 2, 0, 1, "B"),
                                   received_at=time.time() + 60, call=1)
    store.restore([ahead], [RECORD_BYTES])
    store.add_arrived([thing.captures.Capture(0, "x", "live", (), 0,
                                              Sender("a", "h", 1, 0, 1, "R"), call=1)],
                      [RECORD_BYTES])
    store.save(tmp_path / "rec")
    store.save(tmp_path / "named", names=["x"])
    for path in ("rec", "named"):
        loaded = HistoryStore()
        loaded.load(tmp_path / path)
        assert [c.value for c in loaded.get_all("x", run="all")] == ["recorded", "live"]
        assert loaded.get("x").value == "live"

    class Clearing(HistoryStore):
        def _captures_named(self, name):
            here = list(super()._captures_named(name))
            self.clear()
            return here

    sender = Sender("job:1", "host", 7)
    racing = Clearing()
    racing.add("x", 1.0, (), 0, sender, call=1, received_at=2.0)
    twice = [thing.captures.Capture(0, "x", 1.0, (), 0, sender, received_at=2.0, call=1)
             for _ in range(2)]
    assert racing.restore(twice, [RECORD_BYTES] * 2) == 1
