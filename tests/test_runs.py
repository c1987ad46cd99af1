"""Runs: each training job's captures are a history of their own.

Jobs are real processes: started one after another, as torchrun ranks, as
``multiprocessing`` spawn children, and from an interactive parent. The REPL
functions pick the newest run by default, any run by id, or all of them.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import thing
from thing.errors import UnknownName

from .conftest import free_port, run_script, script_env

JOB = """
    import os, thing
    for step in range(3):
        assert thing.catch(float(os.environ.get("BASE", "0")) + step, name="loss").wait(10)
"""


def test_separate_jobs_and_a_torchrun_launch_are_three_runs(server: thing.Server) -> None:
    run_script(JOB, server.port, BASE="0")
    run_script(JOB, server.port, BASE="10")
    for rank in (0, 1):  # launched together, as torchrun does
        run_script(JOB, server.port, BASE=str(100 + 10 * rank), RANK=str(rank),
                   WORLD_SIZE="2", TORCHELASTIC_RUN_ID="launch-7")
    runs = server.runs()
    assert len(runs) == 3 and runs[-1].id == "launch-7"
    assert [(run.captures, run.ranks) for run in runs] == [(3, ()), (3, ()), (6, (0, 1))]
    assert all(run.start <= run.end for run in runs) and runs[0].end <= runs[1].start
    assert runs[0].names == ("loss",)
    # By default the newest run: a restarted job is a new history, not a continuation.
    assert sorted(server.get_all("loss")) == [100.0, 101.0, 102.0, 110.0, 111.0, 112.0]
    assert server.get_all("loss", rank=1) == [110.0, 111.0, 112.0]
    assert server.get_all("loss", run=runs[0].id) == [0.0, 1.0, 2.0]
    assert server.get("loss", run=runs[1].id) == 12.0
    assert len(server.get_all("loss", run="all")) == 12
    with pytest.raises(UnknownName, match="from run 'nope'.*run='all'"):
        server.get_all("loss", run="nope")


def test_summary_groups_rows_by_run(server: thing.Server,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    run_script(JOB, server.port, THING_RUN="first")
    run_script(JOB, server.port, THING_RUN="second")
    server.summary()
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("name"))
    assert header.split()[:2] == ["name", "run"]
    rows = [line.split() for line in out.splitlines() if line.startswith("loss")]
    assert [row[1] for row in rows] == ["second", "first"]  # the newest run first
    server.clear()  # one run only: no run column
    run_script(JOB, server.port, THING_RUN="only")
    server.summary()
    header = next(line for line in capsys.readouterr().out.splitlines()
                  if line.startswith("name"))
    assert "run" not in header.split()


def test_spawned_children_join_the_run_of_the_script_that_started_them(
        server: thing.Server, tmp_path) -> None:
    script = tmp_path / "spawner.py"
    script.write_text("""
import multiprocessing as mp, thing

def work(rank):
    assert thing.catch(float(rank), name="rank value").wait(10)

if __name__ == "__main__":
    children = [mp.get_context("spawn").Process(target=work, args=(r,)) for r in range(2)]
    for child in children: child.start()
    for child in children: child.join(60); assert child.exitcode == 0
""")
    run_script(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
               server.port, timeout=120)
    (run,) = server.runs()
    assert run.captures == 2
    assert sorted(server.get_all("rank value")) == [0.0, 1.0]


def test_jobs_started_from_a_notebook_or_repl_are_runs_of_their_own(
        server: thing.Server) -> None:
    run_script(f"""
        import subprocess, sys, textwrap
        sys.ps1 = ">>> "  # as in an interactive session
        import thing
        for base in ("0", "10"):
            subprocess.run([sys.executable, "-c", textwrap.dedent({JOB!r})], check=True,
                           env=dict(__import__("os").environ, BASE=base))
    """, server.port)
    assert len(server.runs()) == 2
    assert server.get_all("loss") == [10.0, 11.0, 12.0]


def test_rank_then_run_saving_every_run_and_describe(server: thing.Server, tmp_path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    for rank in (0, 1):
        run_script(JOB, server.port, BASE=str(10 * rank), RANK=str(rank), WORLD_SIZE="2",
                   TORCHELASTIC_RUN_ID="first-launch")
    run_script(JOB, server.port, BASE="100", RANK="0", WORLD_SIZE="1", THING_RUN="second")
    # rank 1 sent only in the first launch: its newest run is that one
    assert server.get_all("loss", rank=1) == [10.0, 11.0, 12.0]
    assert server.get_all("loss") == [100.0, 101.0, 102.0]
    assert server.save(tmp_path / "all", names=["loss"]) == 9  # every run's
    old = server.store.get("loss", index=2, run="first-launch", rank=0)
    server.describe(old.id)
    described = capsys.readouterr().out
    assert "6 kept; this is get('loss', index=5, run='first-launch')" in described
    assert any(line.split() == ["run", "first-launch"] for line in described.splitlines())
    # describe() selects as get() does, run= too.
    server.describe("loss", index=2, rank=0, run="first-launch")  # counted among its rank's
    assert ("3 kept from rank 0; this is get('loss', index=2, rank=0, run='first-launch')"
            in " ".join(capsys.readouterr().out.split()))
    with pytest.raises(UnknownName, match="from run 'nope'"):
        server.describe("loss", run="nope")


SPAWNS_A_WORKER = JOB + """
    import subprocess, sys  # a spawned DataLoader worker, say: the rank is its parent
    subprocess.run([sys.executable, "-c",
                    "import thing; assert thing.catch(5.0, name='worker').wait(10)"], check=True)
"""


def test_a_torchrun_launch_with_the_default_rendezvous_id_is_one_run(
        server: thing.Server) -> None:
    """Named after its master and its agent (the ranks' parent), it reaches what a rank
    spawns too, whose parent is the rank: each rank's worker was a run of its own."""
    run_script(f"""
        import os, subprocess, sys, textwrap
        ranks = [subprocess.Popen([sys.executable, "-c", textwrap.dedent({SPAWNS_A_WORKER!r})],
                                  env=dict(os.environ, RANK=str(rank), WORLD_SIZE="2",
                                           BASE=str(10 * rank), TORCHELASTIC_RUN_ID="none",
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"))
                 for rank in (0, 1)]
        assert all(rank.wait(60) == 0 for rank in ranks)
    """, server.port, timeout=120)
    (run,) = server.runs()
    assert run.ranks == (0, 1) and run.id.startswith("torchrun-127.0.0.1:29500-")
    assert run.captures == 8  # three losses and a worker's capture from each rank


@pytest.mark.parametrize("wrapped", [False, True], ids=["ranks", "ranks-in-a-wrapper"])
def test_a_real_torchrun_launch_is_one_run(server: thing.Server, tmp_path: Path,
                                            wrapped: bool) -> None:
    """torchrun with its default rendezvous id, each rank started directly or through a
    wrapper script (nsys, numactl, a shell that sets the environment): one run. Wrapped,
    each rank was a run of its own (named after its parent, the wrapper), and get_all()
    showed one rank's captures."""
    pytest.importorskip("torch")
    job = tmp_path / "job.py"
    job.write_text("import os, thing\n"
                   "for step in range(3):\n"
                   "    assert thing.catch(float(step), name='loss').wait(30)\n")
    entry = (["--no-python", "sh", "-c", f"{shlex.quote(sys.executable)} {shlex.quote(str(job))}"
              "; true"] if wrapped else [str(job)])
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    "--master_port", str(free_port()), *entry],
                   env=script_env(server.port), check=True, capture_output=True, timeout=120)
    (run,) = server.runs()
    assert run.ranks == (0, 1) and run.captures == 6
    assert run.id.startswith("torchrun-127.0.0.1:") or run.id.startswith("torchrun-localhost")


def test_ranks_torchrun_started_again_after_a_failure_are_a_run_of_their_own(
        server: thing.Server) -> None:
    """``--max-restarts``: the new attempt's steps start from 1 again; one run with the
    failed attempt's had two captures at each step (get(step=5) found only the later)."""
    for restart in ("0", "1"):
        run_script(JOB, server.port, BASE=str(100 * int(restart)), RANK="0", WORLD_SIZE="1",
                   TORCHELASTIC_RUN_ID="launch-9", TORCHELASTIC_RESTART_COUNT=restart)
    # With the default rendezvous id, both attempts have the same agent: their parent.
    run_script(f"""
        import os, subprocess, sys, textwrap
        for restart in ("0", "1"):
            subprocess.run([sys.executable, "-c", textwrap.dedent({JOB!r})], check=True,
                           env=dict(os.environ, RANK="0", WORLD_SIZE="1",
                                    TORCHELASTIC_RUN_ID="none", MASTER_ADDR="127.0.0.1",
                                    MASTER_PORT="29501", TORCHELASTIC_RESTART_COUNT=restart))
    """, server.port, timeout=120)
    # Across nodes each agent counts its own failures (a node restarted for another's counts
    # none): one launch's ranks stay one run there, not split by their counts.
    for restart in ("1", "0"):
        run_script(JOB, server.port, BASE="1000", RANK="0", WORLD_SIZE="1", GROUP_WORLD_SIZE="2",
                   TORCHELASTIC_RUN_ID="nodes-2", TORCHELASTIC_RESTART_COUNT=restart)
    ids = [run.id for run in server.runs()]
    assert ids[4:] == ["nodes-2"]
    assert ids[:2] == ["launch-9", "launch-9-restart1"]
    assert ids[2].startswith("torchrun-127.0.0.1:29501-") and ids[3] == f"{ids[2]}-restart1"
    assert server.get_all("loss", run="launch-9") == [0.0, 1.0, 2.0]
    assert server.get("loss", step=2, run="launch-9-restart1") == 101.0


def test_forks_of_an_interactive_session_share_its_run(server: thing.Server) -> None:
    run_script("""
        import os, sys
        sys.ps1 = ">>> "  # a notebook or REPL: it names no run for what it spawns
        import thing
        child = os.fork()
        if child == 0:
            thing.catch(1.0, name="from child").wait(10)
            os._exit(0)
        os.waitpid(child, 0)
        assert thing.catch(2.0, name="from parent").wait(10)
        assert "THING_RUN_ID" not in os.environ
    """, server.port)
    (run,) = server.runs()
    assert run.captures == 2
