"""The receive-buffer pool: memory of evicted captures comes back warm, and never deadlocks."""

from __future__ import annotations

import threading

from thing.arrays import LeafSpec
from thing.buffers import POOLED_FROM, ReceiveBuffers

from .conftest import run_script


def spec(nbytes: int) -> LeafSpec:
    return LeafSpec("numpy", "uint8", (nbytes,))


def test_freed_memory_is_reused_up_to_the_cap() -> None:
    pool = ReceiveBuffers(3 * POOLED_FROM)
    first = pool.array(spec(POOLED_FROM))
    address = first.__array_interface__["data"][0]
    del first
    assert pool.spare_bytes == POOLED_FROM
    again = pool.array(spec(POOLED_FROM))
    assert again.__array_interface__["data"][0] == address  # the same, warm memory
    assert pool.spare_bytes == 0
    arrays = [pool.array(spec(2 * POOLED_FROM)) for _ in range(3)]
    del arrays
    assert pool.spare_bytes <= 3 * POOLED_FROM  # the rest went back to the system
    assert pool.array(spec(100)).base is None  # small arrays come from malloc, not the pool


def test_memory_beyond_the_cap_goes_back_to_the_system_as_its_array_dies() -> None:
    """Not at the next large receive: a job that sent large arrays and then only small
    ones, or a REPL that cleared a name of large captures, would hold it till then."""
    pool = ReceiveBuffers(POOLED_FROM)
    arrays = [pool.array(spec(POOLED_FROM)) for _ in range(4)]
    del arrays
    # Filed at once: one kept, three unmapped (nothing holds them any more).
    assert not pool._returned and pool._free_bytes == POOLED_FROM
    # A closed server's pool keeps nothing for a reuse that will not come; reopened, it does.
    kept = pool.array(spec(POOLED_FROM))
    pool.close()
    del kept
    assert pool.spare_bytes == 0
    pool.open()
    again = pool.array(spec(POOLED_FROM))
    del again
    assert pool.spare_bytes == POOLED_FROM


def test_pooled_memory_is_private_not_shared() -> None:
    """Shared anonymous memory is shmem: no huge pages, and several times slower to fault
    in. The mapping behind a pooled array must be private (``p`` in /proc/self/maps)."""
    array = ReceiveBuffers(8 * POOLED_FROM).array(spec(4 * POOLED_FROM))
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, permissions = line.split()[:2]
            start, end = (int(bound, 16) for bound in span.split("-"))
            if start <= address < end:
                assert permissions == "rw-p", line
                return
    raise AssertionError("the array's mapping is not in /proc/self/maps")


def test_an_array_dying_while_the_pool_is_busy_gives_its_memory_back() -> None:
    """What a garbage-collection pass inside the pool does: a pooled array dies on a
    thread that holds the pool's lock (the old pool re-entered its lock and hung)."""
    pool = ReceiveBuffers(64 << 20)
    array = pool.array(spec(POOLED_FROM))
    finished = threading.Event()

    def die_inside() -> None:
        nonlocal array
        with pool._lock:
            del array  # the finalizer runs here, as it would in a collection here
        finished.set()

    thread = threading.Thread(target=die_inside, daemon=True)
    thread.start()
    thread.join(10)
    assert finished.is_set(), "the pool deadlocked"
    assert pool.spare_bytes == POOLED_FROM


def test_garbage_collection_inside_the_pool_cannot_deadlock() -> None:
    """Arrays held in reference cycles are freed by the collector at any allocation,
    including the pool's own, on any thread: their memory must come back without a lock."""
    run_script(
        """
        import gc, threading
        from thing.arrays import LeafSpec
        from thing.buffers import ReceiveBuffers

        pool = ReceiveBuffers(8 << 30)  # mapped, never touched: address space, not memory
        gc.set_threshold(1, 1, 1)  # collect at nearly every allocation

        class Cycle:
            pass

        def churn(seed):
            for i in range(1500):
                size = (1 << 20) + 4096 * (seed * 10_000 + i)  # a new size: new bookkeeping
                holder = Cycle()
                holder.me, holder.array = holder, pool.array(LeafSpec("numpy", "uint8", (size,)))
                del holder  # only the collector frees it, whenever it next runs
                if i % 100 == 0:
                    pool.spare_bytes

        threads = [threading.Thread(target=churn, args=(seed,), daemon=True)
                   for seed in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "the pool deadlocked"
        gc.collect()
        assert pool.spare_bytes <= 8 << 30
        """,
        timeout=90,
    )
