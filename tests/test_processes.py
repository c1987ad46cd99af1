"""Captures made in child processes arrive: fork, forkserver, spawn and DataLoader workers.

multiprocessing ends its children with ``os._exit``, which skips ``atexit``;
thing flushes from multiprocessing's own finalizers instead. Nothing a parent
thread held at the moment of a fork (a lock, a half-done import) may block
the child.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import thing

from .conftest import expect_line, poll, run_script, script_env, start_script


def run_file(directory: Path, code: str, port: int, timeout: float) -> None:
    """Run ``code`` as a script file: spawn and forkserver children import it by path."""
    script = directory / "job.py"
    script.write_text(textwrap.dedent(code))
    result = subprocess.run([sys.executable, str(script)], env=script_env(port),
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_children_that_catch_and_return_deliver_everything(server: thing.Server, method: str,
                                                           tmp_path: Path) -> None:
    run_file(
        tmp_path,
        f"""
        import multiprocessing as mp, numpy as np, thing

        def work(child):
            for i in range(20):
                thing.catch(np.full(8, i), name=f"child-{{child}}")
            # and return at once: no flush, no wait

        if __name__ == "__main__":
            thing.catch(0, name="parent").wait(10)
            context = mp.get_context({method!r})
            children = [context.Process(target=work, args=(c,)) for c in range(4)]
            for child in children:
                child.start()
            for child in children:
                child.join(60)
                assert child.exitcode == 0
        """,
        server.port,
        timeout=120,
    )
    for child in range(4):
        values = [int(v[0]) for v in server.get_all(f"child-{child}")]
        assert values == list(range(20)), f"child {child} delivered {values}"


def test_dataloader_workers_deliver_every_capture(server: thing.Server) -> None:
    """num_workers=2, fork, not persistent: new workers every epoch, ended by the loader."""
    out = run_script(
        """
        import json, torch, thing
        from torch.utils.data import DataLoader, Dataset

        class Numbers(Dataset):
            def __len__(self):
                return 64
            def __getitem__(self, index):
                info = torch.utils.data.get_worker_info()
                thing.catch(torch.tensor([RUN, EPOCH[0], index]), name=f"w{info.id}")
                return index

        EPOCH = [0]
        expected = 0
        for RUN in range(5):
            for epoch in range(3):
                EPOCH[0] = epoch
                loader = DataLoader(Numbers(), batch_size=4, num_workers=2,
                                    multiprocessing_context="fork")
                assert sorted(int(i) for batch in loader for i in batch) == list(range(64))
                expected += 64
        print(json.dumps(expected))
        """,
        server.port,
        timeout=300,
    )
    caught = [tuple(t.tolist()) for name in ("w0", "w1") for t in server.get_all(name)]
    assert len(caught) == json.loads(out) == 5 * 3 * 64
    assert sorted(caught) == sorted((run, epoch, index) for run in range(5)
                                    for epoch in range(3) for index in range(64))


def test_persistent_dataloader_workers_deliver_when_the_loader_is_deleted_at_the_end(
        server: thing.Server) -> None:
    """Alive at interpreter exit, persistent workers are terminated (SIGTERM) with captures
    still queued: the README's `del loader` at the end of the script ends them properly."""
    run_script(
        """
        import torch, thing
        from torch.utils.data import DataLoader, Dataset

        class Numbers(Dataset):
            def __len__(self):
                return 64
            def __getitem__(self, index):
                thing.catch(torch.tensor(float(index)), name="item")
                return index

        loader = DataLoader(Numbers(), batch_size=8, num_workers=2,
                            multiprocessing_context="fork", persistent_workers=True)
        for epoch in range(2):
            assert sorted(int(i) for batch in loader for i in batch) == list(range(64))
        del loader  # the job ends here
        """,
        server.port,
        timeout=120,
    )
    assert sorted(float(t) for t in server.get_all("item")) == sorted(
        float(i) for i in range(64) for _ in range(2))


def test_children_forked_right_after_the_first_catch_all_deliver(server: thing.Server) -> None:
    """The parent's sender thread is busy connecting when the children are forked."""
    run_script(
        """
        import multiprocessing as mp, thing

        def work(child):
            handle = thing.catch(child, name="child", block=True)
            assert handle.wait(30), handle.error

        if __name__ == "__main__":
            thing.catch(-1, name="parent")  # starts the sender: connect, getaddrinfo, ...
            context = mp.get_context("fork")
            children = [context.Process(target=work, args=(c,)) for c in range(80)]
            for child in children:
                child.start()
            for child in children:
                child.join(60)
            assert [child.exitcode for child in children] == [0] * 80
        """,
        server.port,
        timeout=180,
    )
    assert sorted(server.get_all("child")) == list(range(80))


FORKED_HOLDING_A_HANDLE = """
import os, time, thing, thing.channel as channel
{before_the_fork}
pid = os.fork()
if pid == 0:
    print(handle.error, flush=True)  # read first: it says so as surely as done does
    print(handle.wait(), handle.done, handle.error, flush=True)  # no timeout: it must end
    os._exit(0)
os.waitpid(pid, 0)
assert handle.wait(10), handle.error
"""


@pytest.mark.parametrize("before_the_fork", [
    # Still queued for the sender's tick.
    'handle = thing.catch(7.0, name="before")',
    # Answered, and being told: the sender took it out of its books, then tells its handle
    # (slowly here; a fork in between is 1 child in a few hundred).
    'tell = channel._resolve\n'
    'channel._resolve = lambda finished: (time.sleep(0.5), tell(finished))\n'
    'handle = thing.catch(7.0, name="before")\n'
    'handle._hurry()  # sent now; its answer read at once, then told slowly\n'
    'time.sleep(0.25)',
], ids=["queued", "being-told"])
def test_a_handle_pending_at_a_fork_ends_in_the_child_and_the_parent_sends_it(
        server: thing.Server, before_the_fork: str) -> None:
    """Every handle ends: the child's copy of one the parent had pending at the fork says
    the parent sends it (it waited for ever), and the parent does, once. Its error, read
    before anything else, said nothing (None) until done was looked at."""
    out = run_script(FORKED_HOLDING_A_HANDLE.format(before_the_fork=before_the_fork),
                     server.port, timeout=60)
    first, second = out.splitlines()[:2]
    assert first.startswith("not sent by this process: caught before it was forked")
    assert second.startswith("False True not sent by this process: caught before it was forked")
    assert server.get_all("before") == [7.0]


def test_a_child_forked_while_another_thread_makes_the_client_catches_at_once(
        server: thing.Server) -> None:
    """A thread's first catch makes the default client (imports and all, under a lock); a
    fork meanwhile left the child that lock held by a thread it does not have."""
    run_script(
        """
        import os, threading, time, thing

        making = threading.Event()
        made = thing.Client.__init__

        def slowly_made(self, *args, **kwargs):  # as a cold import of the sending side
            making.set()
            time.sleep(0.3)
            made(self, *args, **kwargs)

        thing.Client.__init__ = slowly_made
        first = threading.Thread(target=thing.catch, args=(1.0,), kwargs={"name": "thread"})
        first.start()
        assert making.wait(10)
        child = os.fork()
        if child == 0:
            code = 0 if thing.catch(2.0, name="child").wait(30) else 1
            os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        first.join(10)
        """,
        server.port,
        timeout=60,
    )
    assert server.get("child") == 2.0 and server.get("thread") == 1.0


def test_a_job_that_dies_is_seen_to_leave_though_its_forked_child_lives_on(
        server: thing.Server) -> None:
    """A child kept copies of its parent's connection: the REPL listed a job killed an hour
    ago as connected for as long as its DataLoader worker ran."""
    job = start_script(
        """
        import os, sys, thing
        assert thing.catch(1.0, name="parent").wait(30)
        child = os.fork()
        if child == 0:
            sys.stdin.readline()  # until the test is done
            os._exit(0)
        print("child", child, flush=True)
        sys.stdin.readline()
        """, server.port, stdin=True)
    child = int(expect_line(job, "child").split()[1])
    try:
        assert [sender.pid for sender in server.clients()] == [job.pid]
        job.kill()
        job.wait(10)
        poll(lambda: not server.clients(), 10, "the killed job's connection to end")
        os.kill(child, 0)  # still running
    finally:
        job.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_a_parents_handle_waited_on_in_a_child_writes_to_no_socket_of_the_child(
        server: thing.Server) -> None:
    """The child closed its copies of the parent's sockets: their numbers are free for the
    child's own, which a wake-up meant for the parent's sender must never write into."""
    run_script(
        """
        import os, select, socket, thing, thing.channel
        thing.channel.TICK_SECONDS = 60.0  # the capture waits in the queue, its sender asleep
        client = thing.Client()
        assert client.catch(0.0, name="warm").wait(10)
        pending = client.catch(1.0, name="queued")
        child = os.fork()
        if child == 0:
            mine = [socket.socketpair() for _ in range(3)]  # the freed numbers, reused
            pending.wait(0.2)  # hurries the parent's channel, which is not this process's
            ends = [end for pair in mine for end in pair]
            os._exit(3 if select.select(ends, [], [], 0.2)[0] else 0)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "a byte landed in the child's socket"
        assert pending.wait(10)
        """,
        server.port,
        timeout=60,
    )
    assert server.get("queued") == 1.0


def test_a_forked_child_leaves_the_captures_the_parent_had_queued_alone(
        server: thing.Server) -> None:
    """Only the parent sends them. Freeing the child's copies would run their finalizers in
    the child (a CUDA capture's pinned memory records CUDA events, which a forked child
    cannot) and write to the pages it shares with the parent."""
    out = run_script(
        """
        import gc, os, numpy as np, thing, thing.channel
        thing.channel.TICK_SECONDS = 60.0  # the capture waits in the queue, its sender asleep

        class Noted(np.ndarray):
            def __del__(self):
                print("freed in", "the parent" if os.getpid() == parent else "a child",
                      flush=True)

        parent = os.getpid()
        client = thing.Client()
        assert client.catch(0.0, name="warm").wait(10)
        pending = client.catch(np.arange(1000.0).view(Noted), name="queued", copy=False)
        child = os.fork()
        if child == 0:
            del pending
            gc.collect()
            os._exit(0)
        os.waitpid(child, 0)
        assert pending.wait(10)
        """,
        server.port,
        timeout=60,
    )
    assert out.splitlines() == ["freed in the parent"]
    np.testing.assert_array_equal(server.get("queued"), np.arange(1000.0))


def test_mp_spawn_ranks_are_read_at_the_call(server: thing.Server, tmp_path: Path) -> None:
    """Captures made just before destroy_process_group() still carry their rank."""
    run_file(
        tmp_path,
        f"""
        import torch.distributed as dist, torch.multiprocessing as mp, thing

        def work(rank, world_size):
            dist.init_process_group("gloo", init_method={(tmp_path / "init").as_uri()!r},
                                    rank=rank, world_size=world_size)
            for step in range(100):
                thing.catch(float(step), name="loss")
            dist.destroy_process_group()  # at once: most captures are still queued

        if __name__ == "__main__":
            mp.spawn(work, args=(2,), nprocs=2)
        """,
        server.port,
        timeout=180,
    )
    for rank in (0, 1):
        captures = server.store.get_all("loss", rank=rank)
        assert [c.value for c in captures] == [float(step) for step in range(100)]
        assert {c.sender.world_size for c in captures} == {2}
    assert len(server.store.get_all("loss")) == 200


def test_dataloader_workers_carry_their_jobs_rank(server: thing.Server) -> None:
    run_script(
        """
        import torch, thing
        from torch.utils.data import DataLoader, Dataset

        class Numbers(Dataset):
            def __len__(self):
                return 16
            def __getitem__(self, index):
                thing.catch(index, name="item")
                return index

        thing.catch(-1, name="main").wait(10)
        loader = DataLoader(Numbers(), batch_size=4, num_workers=2,
                            multiprocessing_context="fork")
        assert sorted(int(i) for batch in loader for i in batch) == list(range(16))
        """,
        server.port,
        timeout=120,
        RANK="3",
        WORLD_SIZE="4",
    )
    captures = server.store.get_all("item")
    assert sorted(c.value for c in captures) == list(range(16))
    assert {(c.sender.rank, c.sender.world_size) for c in captures} == {(3, 4)}
    assert server.store.get("main").sender.rank == 3


def test_the_rank_follows_a_process_group_torch_keeps_elsewhere(server: thing.Server) -> None:
    """torch's threaded process group (its own tests', DTensor's) replaces the record of
    the default group that the rank is read from: read again each time, not kept."""
    run_script("""
        import torch, torch.distributed as dist, thing
        from torch.testing._internal.distributed import multi_threaded_pg
        assert thing.catch(0, name="before").wait(10)
        multi_threaded_pg._install_threaded_pg()
        dist.init_process_group("threaded", rank=0, world_size=1, store=dist.HashStore())
        assert thing.catch(1, name="during").wait(10)
    """, server.port, timeout=120)
    assert (server.store.get("before").sender.rank, server.store.get("during").sender.rank,
            server.store.get("during").sender.world_size) == (None, 0, 1)


def test_the_rank_follows_the_process_group_as_it_comes_and_goes(server: thing.Server,
                                                                 tmp_path: Path) -> None:
    run_script(f"""
        import torch.distributed as dist, thing
        assert thing.catch(1, name="before").wait(10)
        dist.init_process_group("gloo", init_method={(tmp_path / "init").as_uri()!r},
                                rank=0, world_size=1)
        assert thing.catch(2, name="during").wait(10)
        dist.destroy_process_group()
        assert thing.catch(3, name="after").wait(10)
    """, server.port, timeout=120, RANK="5")
    ranks = {name: (server.store.get(name).sender.rank, server.store.get(name).sender.world_size)
             for name in ("before", "during", "after")}
    assert ranks == {"before": (5, None), "during": (0, 1), "after": (5, None)}


def test_catches_in_a_torch_compiled_function_arrive_under_their_names(
        server: thing.Server, tmp_path: Path) -> None:
    """A catch is a graph break: torch runs it as it is, then the rest of the function in a
    function it makes. thing's own functions are not compiled as they run (a shape that
    changed made captures "not sent", and torch printed warnings), and what follows a
    graph break is still the user's function (names were split: loss, loss_1)."""
    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, thing

        def step(x, w):
            h = x @ w
            thing.catch(h)
            loss = (h * h).sum()
            thing.catch(loss)
            g = loss * 2
            thing.catch(g, every=2)
            return loss

        class Net(torch.nn.Module):  # a method: its resume functions are Net.torch_dynamo_...
            def forward(self, x):
                out = x.relu()
                thing.catch(x.sum(), name="first")  # a graph break before the catch below
                thing.catch(out)
                return out

        compiled, net = torch.compile(step, backend="eager"), torch.compile(Net(), backend="eager")
        for i in range(4):  # a new shape each step: torch compiles the step again, once
            compiled(torch.ones(i + 1, 3), torch.full((3, 4), float(i)))
            net(torch.full((2,), float(i) - 1))
        assert thing._default_client.flush(30)
        assert not thing._default_client.undelivered, thing._default_client.undelivered
    """))
    result = subprocess.run([sys.executable, str(script)], env=script_env(server.port),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # catch never prints, nor makes torch print
    import torch

    expected: dict[str, list[tuple[int, torch.Tensor]]] = {"h": [], "loss": [], "g": []}
    for i in range(4):
        h = torch.ones(i + 1, 3) @ torch.full((3, 4), float(i))
        loss = (h * h).sum()
        expected["h"].append((i + 1, h))
        expected["loss"].append((i + 1, loss))
        if i % 2 == 0:
            expected["g"].append((i + 1, loss * 2))
    assert sorted(server.store.names()) == ["first", "g", "h", "loss", "out"]
    for name, captures in expected.items():
        stored = server.store.get_all(name)
        assert [c.call for c in stored] == [call for call, _ in captures]
        for capture, (_, value) in zip(stored, captures):
            assert capture.value.shape == value.shape and torch.equal(capture.value, value)
            assert capture.call_site.endswith("(step)")
    outs = server.store.get_all("out")
    assert [c.value.tolist() for c in outs] == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    assert {c.call_site.rpartition(" ")[2] for c in outs} == {"(Net.forward)"}
