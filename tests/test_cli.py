"""The ``thing`` command: ``thing serve`` driven through a pseudo-terminal, ``thing demo``."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import thing
import thing.display

from .conftest import run_script, script_env

pexpect = pytest.importorskip("pexpect")

# pexpect forks to open the terminal and the child execs at once, so the threads of this
# process (jax's, if a test imported it) cannot deadlock it.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")


def spawn_serve(tmp_path, *args: str):
    """``python -m thing serve ARGS`` in a pseudo-terminal; returns it and the port it serves.

    ``THING_PORT=0`` makes it pick a free port, which its log line then names.
    """
    env = script_env(THING_PORT="0", IPYTHONDIR=str(tmp_path / "ipython"), COLUMNS="160")
    child = pexpect.spawn(sys.executable, ["-m", "thing", "serve", *args], env=env,
                          cwd=str(tmp_path), encoding="utf-8", timeout=30, dimensions=(40, 160))
    child.expect(r"Server started at port (\d+)\.")
    return child, int(child.match.group(1))


def catch_from_another_process(port: int) -> None:
    run_script("""
        import thing, numpy as np
        assert thing.catch(np.arange(3), name="model.w").wait(10)
    """, port=port)


@pytest.mark.parametrize("shell", ["ipython", "plain"])
def test_serve_opens_a_session_that_receives(tmp_path, shell: str) -> None:
    if shell == "ipython":
        pytest.importorskip("IPython")
    child, port = spawn_serve(tmp_path, *(["--plain"] if shell == "plain" else []))
    try:
        child.expect_exact(f"thing is receiving at 127.0.0.1:{port}")
        for command in ("thing.summary()", "thing.get('loss')", "thing.ingest_all()"):
            child.expect_exact(command)
        prompt = r"In \[|>>> "
        child.expect(prompt)
        child.sendline("thing.serve()")  # echoes one informative line
        child.expect(rf"<thing.Server at 127.0.0.1:{port} \(TCP")
        child.expect(prompt)
        catch_from_another_process(port)
        child.sendline("print('got', thing.get('model.w').tolist())")
        child.expect_exact("got [0, 1, 2]")
        child.sendline("thing.ingest_all()")
        child.expect_exact("model_w ('model.w')")
        child.expect(prompt)
        assert "model_w ('model.w')" not in child.before  # shown once, not printed and echoed
        child.sendline("print('sum', int(model_w.sum()))")
        child.expect_exact("sum 3")
        child.sendline("thing.get('model.x')")
        child.expect_exact("did you mean 'model.w'")
        child.sendline("exit()")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_serve_on_a_busy_port_exits_with_one_clear_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "thing", "serve", "--port", str(port)],
                                env=script_env(), capture_output=True, text=True, timeout=60,
                                stdin=subprocess.DEVNULL)
    assert result.returncode == 1
    assert f"thing: Port {port} is already in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_with_numpy_shows_what_arrived_and_records_it(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "thing", "demo", "--numpy", "--steps", "30",
                             "--record", str(tmp_path / "rec")],
                            env=script_env(COLUMNS="160"), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "training a small numpy model" in out
    assert ">>> thing.summary()" in out and ">>> thing.describe('model.hidden.weight')" in out
    summary = out.partition(">>> thing.summary()")[2].partition(">>> thing.describe")[0]
    rows = {line.split()[0]: line.split() for line in summary.splitlines() if line.strip()}
    assert rows["loss"][1:4] == ["()", "float32", "numpy"]
    assert rows["loss"][5] == "30"  # every step
    assert rows["model.hidden.weight"][1:5] == ["(16,", "4)", "float32", "numpy"]
    assert rows["model.hidden.weight"][5] == "3"  # every 10 steps
    assert rows["activations"][1:3] == ["dict", "of"]
    assert "['hidden']" in out and "['prediction']" in out and "L2 norm" in out
    # It ends by drawing the loss over the steps, in the terminal's text.
    drawn = out.partition(">>> thing.plot('loss')")[2].partition("Recorded")[0].splitlines()
    assert drawn[1].strip() == "loss" and drawn[2].startswith("┌") and "x: step" in drawn
    assert all(len(line) <= 160 for line in drawn)
    assert f"Recorded 36 captures into {tmp_path / 'rec'}" in out
    recorded = thing.HistoryStore()
    assert recorded.load(tmp_path / "rec") == 36
    assert len(recorded.get_all("loss")) == 30


def test_demo_with_torch_when_installed() -> None:
    pytest.importorskip("torch")
    out = run_script("""
        import sys
        from thing.cli import main
        sys.exit(main(["demo", "--steps", "20"]))
    """, timeout=120, COLUMNS="80")
    assert "training a small torch model" in out
    # Piped at 80 columns, every line fits, the demo's own sentences too.
    assert all(thing.display.columns(line) <= 80 for line in out.splitlines()), out
    summary = out.partition(">>> thing.summary()")[2].partition(">>> thing.describe")[0]
    rows = {line.split()[0]: line.split() for line in summary.splitlines() if line.strip()}
    assert rows["loss"][1:4] == ["()", "float32", "torch"]
    assert rows["model.hidden.weight"][1:5] == ["(16,", "4)", "float32", "torch"]
    assert "activations" in rows


def test_thing_without_a_command_prints_usage() -> None:
    result = subprocess.run([sys.executable, "-m", "thing"], env=script_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "serve" in result.stdout and "demo" in result.stdout


@pytest.mark.skipif(shutil.which("thing") is None, reason="the console script is not installed")
def test_the_console_script_is_the_same_command() -> None:
    result = subprocess.run(["thing", "serve", "--help"], env=script_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0
    assert "--port" in result.stdout and "--host" in result.stdout


@pytest.mark.parametrize("size", ["inf", "nan", "1e400", "0", "lots"])
def test_a_size_that_is_no_size_is_refused_with_one_line(tmp_path: Path, size: str) -> None:
    result = subprocess.run([sys.executable, "-m", "thing", "record", str(tmp_path / "rec"),
                             "--max-bytes", size], env=script_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{size!r}" in result.stderr.splitlines()[-1]


@pytest.mark.parametrize("arguments", [
    ["record", "REC", "--segment-seconds", "inf"],  # lost every capture, and said 0 recorded
    ["record", "REC", "--segment-seconds", "nan"],
    ["record", "REC", "--segment-seconds", "-1"],
    ["record", "REC", "--port", "99999"],  # a traceback from bind()
    ["serve", "--port", "-5"],
    ["demo", "--steps", "0"],  # a traceback from get()
], ids=lambda arguments: " ".join(arguments[-2:]))
def test_a_number_out_of_range_is_refused_with_one_line(tmp_path: Path,
                                                         arguments: list[str]) -> None:
    arguments = [str(tmp_path / "rec") if a == "REC" else a for a in arguments]
    result = subprocess.run([sys.executable, "-m", "thing", *arguments], env=script_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{arguments[-1]!r}" in result.stderr.splitlines()[-1]
    assert not (tmp_path / "rec").exists()


def test_main_returns_an_exit_status_in_process() -> None:
    out = run_script(textwrap.dedent("""
        from thing.cli import main
        try:
            main(["--help"])
        except SystemExit as exit:
            print("exit", exit.code)
    """))
    assert "usage: thing" in out and "exit 0" in out


def _send(port: int, count: int, size: int) -> None:
    run_script(f"""
        import thing, numpy as np
        client = thing.Client("127.0.0.1", {port})
        for i in range({count}):
            client.catch(np.full({size}, i, np.float32), name="x", block=True)
        assert client.flush(30)
    """)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_record_stopped_by_ctrl_c_twice_still_writes_what_was_waiting(tmp_path: Path) -> None:
    """A second Ctrl+C while the recording was being closed aborted the process ("FATAL:
    exception not rethrown"), its last segment unwritten."""
    port = _free_port()
    recording = subprocess.Popen(
        [sys.executable, "-m", "thing", "record", str(tmp_path / "rec"), "--port", str(port),
         "--segment-seconds", "600"], env=script_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    assert recording.stdout is not None
    recording.stdout.readline()  # "thing is recording ...": listening
    _send(port, 40, 1 << 20)
    for _ in range(10):  # Ctrl+C again and again, as the first is handled and after
        recording.send_signal(signal.SIGINT)
        time.sleep(0.02)
    out, err = recording.communicate(timeout=60)
    assert recording.returncode == 0 and "Traceback" not in err, err
    assert "thing recorded 40 captures" in out
    assert thing.HistoryStore().load(tmp_path / "rec") == 40


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_serve_recording_stopped_by_a_signal_writes_what_was_waiting(tmp_path: Path,
                                                                     signum: int) -> None:
    """SIGTERM (or an ssh session closing: SIGHUP) to `thing serve --record` lost every
    capture not yet written."""
    port = _free_port()
    serving = subprocess.Popen(
        [sys.executable, "-m", "thing", "serve", "--plain", "--port", str(port), "--record",
         str(tmp_path / "rec")], env=script_env(), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert serving.stderr is not None
    assert "Server started" in serving.stderr.readline()
    _send(port, 30, 1000)
    serving.send_signal(signum)
    serving.communicate(timeout=60)
    assert serving.returncode == 128 + signum
    assert thing.HistoryStore().load(tmp_path / "rec") == 30


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["open", "."]])
def test_a_session_with_its_input_closed_is_refused_at_once(command: list[str]) -> None:
    """`thing serve <&-` (nohup, a service) started the server, then ended in a traceback
    at the session's first prompt ("input(): lost sys.stdin", IPython's crash report)."""
    result = subprocess.run([sys.executable, "-m", "thing", *command], env=script_env(),
                            preexec_fn=lambda: os.close(0), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "has no input to read one from" in result.stderr
    assert "Server started" not in result.stderr


def test_serve_recording_stopped_by_a_signal_during_a_close_typed_at_it(tmp_path: Path
                                                                          ) -> None:
    """SIGTERM while the session's own `close()` wrote the recording: the signal's handler
    closed the server in the middle of that close, waiting for good for the lock it held
    (the stop signals ignored from then on)."""
    port = _free_port()
    serving = subprocess.Popen(
        [sys.executable, "-m", "thing", "serve", "--plain", "--port", str(port), "--record",
         str(tmp_path / "rec")], env=script_env(), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert serving.stdin is not None and serving.stdout is not None
    assert serving.stderr is not None
    assert "Server started" in serving.stderr.readline()
    _send(port, 40, 1 << 20)  # 160 MiB for the close to write
    serving.stdin.write('server = thing.serve(); print("closing", flush=True); '
                        'server.close()\n')
    serving.stdin.flush()
    while "closing" not in serving.stdout.readline():
        pass
    serving.send_signal(signal.SIGTERM)
    try:
        serving.communicate(timeout=60)
    finally:
        serving.kill()
    assert serving.returncode == 128 + signal.SIGTERM
    assert thing.HistoryStore().load(tmp_path / "rec") == 40


def test_demo_ended_by_a_signal_ends_its_training_process() -> None:
    """SIGTERM left the demo's training process training, with no server; Ctrl+C printed
    two tracebacks."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        demo = subprocess.Popen([sys.executable, "-m", "thing", "demo", "--numpy", "--steps",
                                 "100000000"], env=script_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert demo.stdout is not None
        while "[training process]" not in demo.stdout.readline():  # until it trains
            pass
        # Ctrl+C reaches the terminal's whole foreground group; SIGTERM the command only.
        os.killpg(demo.pid, signum) if signum == signal.SIGINT else demo.send_signal(signum)
        _, err = demo.communicate(timeout=60)
        assert demo.returncode == 128 + signum and "Traceback" not in err, err
        left = subprocess.run(["pgrep", "-s", str(demo.pid)], capture_output=True, text=True)
        assert left.stdout.split() == [], "the training process outlived the demo"


def test_output_to_a_closed_pipe_or_an_ascii_terminal_is_no_traceback() -> None:
    """`thing demo | head -1` ended in a BrokenPipeError traceback (and the training process
    printed a logging error a line); an output that cannot encode ─ or braille, a
    UnicodeEncodeError."""
    demo = subprocess.Popen([sys.executable, "-m", "thing", "demo", "--numpy", "--steps", "30"],
                            env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert demo.stdout is not None and demo.stderr is not None
    demo.stdout.readline()
    demo.stdout.close()  # as head does, after its first line
    err = demo.stderr.read().decode()
    demo.wait(60)
    assert "Traceback" not in err and "Logging error" not in err, err
    ascii_out = subprocess.run([sys.executable, "-m", "thing", "demo", "--numpy", "--steps", "30"],
                               env=script_env(PYTHONIOENCODING="ascii"), capture_output=True,
                               timeout=120)
    assert ascii_out.returncode == 0, ascii_out.stderr
    assert b">>> thing.plot('loss')" in ascii_out.stdout


def test_recording_options_without_a_recording_are_refused() -> None:
    result = subprocess.run([sys.executable, "-m", "thing", "serve", "--max-bytes", "1M"],
                            env=script_env(), capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and "need --record DIR" in result.stderr.splitlines()[-1]


def test_open_of_what_is_no_recording_says_so(tmp_path: Path) -> None:
    """`thing open` of an empty or unrelated directory opened a session on "0 captures"; of
    a path that does not exist it said "is not a directory"."""
    (tmp_path / "empty").mkdir()
    for directory, said in ((tmp_path / "empty", "holds no segments"),
                            (tmp_path / "nosuch", "does not exist")):
        result = subprocess.run([sys.executable, "-m", "thing", "open", "--plain",
                                 str(directory)], env=script_env(), capture_output=True,
                                text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert result.returncode == 1 and said in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
