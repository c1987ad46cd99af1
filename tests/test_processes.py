"""Captures made in child processes arrive: fork, forkserver, spawn and DataLoader workers.

multiprocessing ends its children with ``os._exit``, which skips ``atexit``;
thing flushes from multiprocessing's own finalizers instead. Nothing a parent
thread held at the moment of a fork (a lock, a half-done import) may block
the child.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import thing

from .conftest import run_script, script_env


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


def test_children_forked_right_after_the_first_catch_all_deliver(server: thing.Server) -> None:
    """The parent's sender thread is busy connecting when the children are forked."""
    run_script(
        """
        import multiprocessing as mp, thing

        def work(child):
            assert thing.catch(child, name="child", block=True).wait(30)

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
