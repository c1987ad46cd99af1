"""thing in a real Jupyter kernel: ipykernel started and driven through jupyter_client.

The :class:`Kernel` helper talks to the kernel the way a notebook front end does: it sends
one ``execute_request`` per cell and reads the kernel's IOPub messages itself. So it also
sees what a cell executor such as nbclient drops: display updates that a thread of the
kernel sends after its cell finished, and output while no cell runs (:meth:`Kernel.drain`).
It can interrupt a running cell as the notebook's stop button does (:meth:`Kernel.interrupt`).

Usage::

    def test_something(kernel):
        kernel.execute("import thing\\nserver = thing.serve(port=0)")
        cell = kernel.execute("server.running")
        assert cell.result == "True"  # the execute_result's text/plain

Every wait is bounded (20 s a cell unless told otherwise) and the kernel is always shut
down. Its own stdout and stderr (ipykernel's warnings) go to ``kernel.log`` in the test's
temporary directory, and into the message of a timed-out wait.
"""

from __future__ import annotations

import base64
import io
import os
import queue
import re
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ipykernel")
jupyter_client = pytest.importorskip("jupyter_client")

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# What the kernel inherits from the test's environment. Everything else (THING_*, COLUMNS,
# FORCE_COLOR, JUPYTER_*, PYTHONSTARTUP...) is left out: tests see what a notebook on a
# plain machine sees. HOME stays, or packages installed with `pip install --user` vanish.
INHERITED = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ",
    "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "XDG_RUNTIME_DIR", "SYSTEMROOT",
)


def kernel_env(ipython_dir: Path, **extra: str) -> dict[str, str]:
    """The whole environment of a kernel that imports this checkout's thing.

    IPython's profile, history and startup files are those of ``ipython_dir`` (a fresh
    one: none of the user's); the kernel waits at most 1 s at exit for captures it still
    holds (``THING_FLUSH_TIMEOUT``). ``extra`` (``THING_PORT=...``...) is added last.
    """
    env = {name: os.environ[name] for name in INHERITED if name in os.environ}
    env.setdefault("HOME", str(ipython_dir))
    env["IPYTHONDIR"] = str(ipython_dir)
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"  # debugpy's frozen-modules warning at start
    env["THING_FLUSH_TIMEOUT"] = "1"
    env.update(extra)
    return env


@dataclass
class Output:
    """One output message from IOPub, as a notebook would render it."""

    kind: str  # stream, display_data, update_display_data, execute_result, error, clear_output
    content: dict[str, Any]
    # msg_id of the execute request in its parent header. A kernel thread's output carries
    # the header of the newest request (so in ipykernel 7.4), not of the cell that started it.
    parent: str | None
    late: bool  # the cell of its parent header had finished (or it is not one of ours)
    at: float = field(default_factory=time.monotonic)

    @property
    def data(self) -> dict[str, Any]:
        """The mime bundle of a display_data / update_display_data / execute_result."""
        return self.content.get("data", {})

    @property
    def display_id(self) -> str | None:
        return self.content.get("transient", {}).get("display_id")

    @property
    def text(self) -> str:
        """Stream text, the bundle's text/plain (as sent), or the error's traceback."""
        if self.kind == "stream":
            return self.content["text"]
        if self.kind == "error":
            return "\n".join(self.content["traceback"])
        return self.data.get("text/plain", "")


@dataclass
class Cell:
    """A cell sent to the kernel, with what came back for it so far."""

    code: str
    msg_id: str
    outputs: list[Output] = field(default_factory=list)  # in order, until the cell finished
    late: list[Output] = field(default_factory=list)  # with its parent header, after that
    reply: dict[str, Any] | None = None  # the execute_reply's content
    done: bool = False  # the kernel went idle after it

    @property
    def status(self) -> str | None:
        """``ok``, ``error``, or ``aborted`` (queued behind a failed cell); None while running."""
        return None if self.reply is None else self.reply["status"]

    @property
    def stdout(self) -> str:
        return "".join(o.text for o in self.outputs
                       if o.kind == "stream" and o.content["name"] == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(o.text for o in self.outputs
                       if o.kind == "stream" and o.content["name"] == "stderr")

    @property
    def result(self) -> str | None:
        """The text/plain of the cell's value (its execute_result); None without one."""
        found = [o for o in self.outputs if o.kind == "execute_result"]
        return found[-1].text if found else None

    @property
    def error(self) -> Output | None:
        found = [o for o in self.outputs if o.kind == "error"]
        return found[-1] if found else None

    @property
    def displays(self) -> list[Output]:
        return [o for o in self.outputs if o.kind in ("display_data", "update_display_data")]

    def describe(self) -> str:
        lines = [f"cell {self.code!r}: status {self.status}, done {self.done}"]
        lines += [f"  {o.kind}: {ANSI.sub('', o.text) or o.data!r}"[:3000]
                  for o in self.outputs + self.late]
        return "\n".join(lines)


class Kernel:
    """One ipykernel process driven through jupyter_client's blocking client.

    ``env`` is the kernel's whole environment (see :func:`kernel_env`); ``workdir`` is its
    working directory and holds its connection file and ``kernel.log``.
    """

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        # The kernelspec "python3" of the ipykernel this interpreter imports, found without
        # any kernelspec directory: nothing installed by `ipython kernel install` (nor a
        # ~/.local/share/jupyter/kernels/python3 of another Python) is looked at, and the
        # kernel runs on sys.executable.
        self.manager = jupyter_client.KernelManager(
            kernel_name="python3",
            kernel_spec_manager=jupyter_client.kernelspec.KernelSpecManager(kernel_dirs=[]),
            connection_file=str(workdir / "connection.json"),
        )
        self.manager.shutdown_wait_time = 3.0  # then SIGTERM, then SIGKILL
        self.client: Any = None
        self.cells: dict[str, Cell] = {}
        self.log: list[Output] = []  # every output, in the order it arrived
        self.started_in: float | None = None  # seconds from launch to ready
        self._replies: dict[str, dict[str, Any]] = {}
        self._log_file: Any = None

    # -- life -----------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> Kernel:
        started = time.monotonic()
        self._log_file = open(self.workdir / "kernel.log", "wb")  # noqa: SIM115 - see shutdown
        self.manager.start_kernel(env=self.env, cwd=str(self.workdir),
                                  stdout=self._log_file, stderr=self._log_file)
        self.client = self.manager.client()
        self.client.start_channels(stdin=False)  # so input() raises instead of waiting forever
        try:
            self.client.wait_for_ready(timeout=timeout)  # also empties IOPub of the start
        except RuntimeError as exc:
            raise AssertionError(f"the kernel did not start: {exc}\n{self.kernel_log()}") from exc
        self.started_in = time.monotonic() - started
        return self

    def shutdown(self) -> None:
        """Stop the kernel: a shutdown request, then signals; within a few seconds."""
        try:
            if self.client is not None:
                self.client.stop_channels()
        finally:
            try:
                if self.manager.has_kernel:
                    self.manager.shutdown_kernel(now=False)
            except Exception:
                self.manager.shutdown_kernel(now=True)
            finally:
                if self._log_file is not None:
                    self._log_file.close()

    def __enter__(self) -> Kernel:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def kernel_log(self) -> str:
        """What the kernel process wrote to its own stdout and stderr (not to the notebook)."""
        path = self.workdir / "kernel.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- cells ----------------------------------------------------------------------------

    def submit(self, code: str, stop_on_error: bool = True) -> Cell:
        """Send a cell (dedented) and return at once. ``stop_on_error`` as a notebook sends
        it: if the cell fails, the cells already queued behind it are aborted."""
        code = textwrap.dedent(code).strip("\n")
        msg_id = self.client.execute(code, stop_on_error=stop_on_error)
        cell = self.cells[msg_id] = Cell(code, msg_id)
        return cell

    def wait(self, cell: Cell, timeout: float = 20,
             until: Callable[[Cell], bool] | None = None) -> Cell:
        """Read IOPub until the cell finished, or until ``until(cell)``; fail after ``timeout``.

        Output of other cells that arrives meanwhile is kept too (in :attr:`log` and in its
        cell), so nothing is lost by waiting for one cell.
        """
        done = until or (lambda c: c.done)
        deadline = time.monotonic() + timeout
        while not done(cell):
            if not self._pump(deadline):
                raise AssertionError(f"timed out after {timeout} s:\n{cell.describe()}\n"
                                     f"kernel log:\n{self.kernel_log()[-3000:]}")
        if cell.done and cell.reply is None:
            cell.reply = self._reply(cell.msg_id, deadline)
        return cell

    def wait_for_text(self, cell: Cell, text: str, timeout: float = 20) -> Cell:
        """Wait until ``text`` is in the cell's stdout (the cell may go on running)."""
        self.wait(cell, timeout, until=lambda c: text in c.stdout or c.done)
        assert text in cell.stdout, f"the cell ended without printing {text!r}:\n{cell.describe()}"
        return cell

    def execute(self, code: str, timeout: float = 20, allow_error: bool = False) -> Cell:
        """Run one cell to its end; fail the test if it raised (unless ``allow_error``)."""
        cell = self.wait(self.submit(code), timeout)
        if cell.status != "ok" and not allow_error:
            raise AssertionError(f"cell failed:\n{cell.describe()}")
        return cell

    def run(self, *codes: str, timeout: float = 20) -> list[Cell]:
        """Run cells one after the other, each to its end and each within ``timeout``."""
        return [self.execute(code, timeout) for code in codes]

    def interrupt(self) -> None:
        """The notebook's stop button: SIGINT to the kernel's process group (subprocesses a
        cell started get it too). A kernel between cells ignores it: wait until the cell
        runs (:meth:`wait_for_text`) before interrupting it."""
        self.manager.interrupt_kernel()

    def drain(self, seconds: float, until: Callable[[Output], bool] | None = None
              ) -> list[Output]:
        """Outputs that arrive within ``seconds`` (idle or not), whichever cell they belong
        to; returns early once ``until`` holds for one of them."""
        deadline = time.monotonic() + seconds
        first = len(self.log)
        while self._pump(deadline):
            if until is not None and any(until(o) for o in self.log[first:]):
                break
        return self.log[first:]

    def shown(self, display_id: str) -> Output | None:
        """What a notebook shows for a display now: its last display_data or update."""
        found = [o for o in self.log if o.display_id == display_id
                 and o.kind in ("display_data", "update_display_data")]
        return found[-1] if found else None

    # -- messages -------------------------------------------------------------------------

    def _pump(self, deadline: float) -> bool:
        """Handle one IOPub message; False if none came before ``deadline``."""
        try:
            msg = self.client.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Empty:
            return False
        kind = msg["msg_type"]
        parent = msg["parent_header"].get("msg_id")
        cell = self.cells.get(parent)
        if kind == "status":
            if cell is not None and msg["content"]["execution_state"] == "idle":
                cell.done = True
        elif kind in ("stream", "display_data", "update_display_data", "execute_result",
                      "error", "clear_output"):
            output = Output(kind, msg["content"], parent, late=cell is None or cell.done)
            self.log.append(output)
            if cell is not None:
                (cell.late if output.late else cell.outputs).append(output)
        return True

    def _reply(self, msg_id: str, deadline: float) -> dict[str, Any]:
        """The execute_reply (shell channel) of a cell whose idle status was seen."""
        while msg_id not in self._replies:
            try:
                msg = self.client.get_shell_msg(timeout=max(deadline - time.monotonic(), 1))
            except queue.Empty:
                raise AssertionError(f"no execute_reply for {self.cells[msg_id].code!r}") from None
            self._replies[msg["parent_header"].get("msg_id")] = msg["content"]
        return self._replies.pop(msg_id)


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    """A fresh kernel for the test (about 1 s to start), always shut down after it."""
    started = Kernel(tmp_path, kernel_env(tmp_path / "ipython"))
    try:
        yield started.start()
    finally:
        started.shutdown()


# -- the harness itself ---------------------------------------------------------------------


def test_the_kernel_runs_this_checkouts_thing_on_this_python(kernel: Kernel) -> None:
    cell = kernel.execute("import sys, thing\nprint(thing.__file__)\nsys.executable")
    assert cell.stdout.strip() == str(ROOT / "thing" / "__init__.py")
    assert cell.result == repr(sys.executable)
    assert kernel.started_in is not None and kernel.started_in < 20


def test_display_updates_after_the_cell_finished_are_seen(kernel: Kernel) -> None:
    cell = kernel.execute("""
        import threading, time
        from IPython.display import display
        handle = display("step 0", display_id=True)
        go = threading.Event()
        def count():
            go.wait(30)
            for step in range(1, 6):
                time.sleep(0.2)
                handle.update(f"step {step}")
        threading.Thread(target=count, daemon=True).start()
    """)
    assert [o.text for o in cell.displays] == ["'step 0'"]
    display_id = cell.displays[0].display_id
    assert display_id
    kernel.execute("go.set()")  # the updates start after their cell finished...
    kernel.drain(10, until=lambda o: o.text == "'step 5'")  # ...and go on while idle
    seen = [o for o in kernel.log if o.kind == "update_display_data"]
    assert [o.text for o in seen] == [f"'step {step}'" for step in range(1, 6)]
    assert {o.display_id for o in seen} == {display_id}
    assert seen[-1].late  # it came while no cell ran
    assert kernel.shown(display_id) is seen[-1]


# -- thing in a notebook --------------------------------------------------------------------


def test_serve_then_get_in_later_cells(kernel: Kernel) -> None:
    kernel.run(
        "import numpy as np, thing\nserver = thing.serve(port=0)",
        "client = thing.Client('127.0.0.1', server.port)",
        "assert client.catch(np.arange(5, dtype=np.int16) * 3, name='w').wait(10)",
    )
    cell = kernel.execute("thing.get('w')")
    assert cell.result == "array([ 0,  3,  6,  9, 12], dtype=int16)"
    cell = kernel.execute("thing.get('w').tolist(), str(thing.get('w').dtype)")
    assert cell.result == "([0, 3, 6, 9, 12], 'int16')"


def test_a_training_job_in_another_process_sends_to_the_notebook(kernel: Kernel) -> None:
    kernel.execute("import os, subprocess, sys, thing\nserver = thing.serve(port=0)")
    # The job is a file, as a training script is: its source names the capture "loss".
    (kernel.workdir / "train.py").write_text(
        "import thing\nloss = 0.25\nassert thing.catch(loss).wait(10)\n")
    kernel.execute("""
        job = subprocess.run([sys.executable, "train.py"], capture_output=True, text=True,
                             env={**os.environ, "THING_PORT": str(server.port)}, timeout=15)
        assert job.returncode == 0, job.stderr
    """)
    assert kernel.execute("thing.get('loss')").result == "0.25"


def test_interrupting_a_cell_leaves_the_kernel_and_the_server_running(kernel: Kernel) -> None:
    kernel.execute("import time, numpy as np, thing\nserver = thing.serve(port=0)")
    sleeping = kernel.submit("print('sleeping', flush=True)\ntime.sleep(60)")
    kernel.wait_for_text(sleeping, "sleeping", timeout=10)
    assert not sleeping.done
    interrupted_at = time.monotonic()
    kernel.interrupt()
    kernel.wait(sleeping, timeout=10)
    assert time.monotonic() - interrupted_at < 5
    assert sleeping.status == "error" and sleeping.error is not None
    assert sleeping.error.content["ename"] == "KeyboardInterrupt"
    assert kernel.execute("server.running, thing.serve() is server").result == "(True, True)"
    cell = kernel.execute("""
        thing.Client('127.0.0.1', server.port).catch(np.arange(2), name='after').wait(10)
    """)
    assert cell.result == "True"
    assert kernel.execute("thing.get('after').tolist()").result == "[0, 1]"


def test_status_returns_at_once_and_its_display_updates_itself(kernel: Kernel) -> None:
    import numpy as np

    import thing

    port = int(kernel.execute("import thing\nserver = thing.serve(port=0)\nserver.port").result)
    watching = kernel.execute("thing.status()", timeout=5)  # the cell ends: the kernel is free
    assert watching.status == "ok" and "Ctrl+C" not in watching.stdout + watching.stderr
    display_id = next(o.display_id for o in watching.displays if o.display_id)
    assert "waiting for the first capture" in kernel.shown(display_id).text
    client = thing.Client("127.0.0.1", port)  # the training job: this test's process
    try:
        assert client.catch(np.arange(4), name="loss").wait(10)
        kernel.drain(10, until=lambda o: o.kind == "update_display_data"
                     and o.display_id == display_id and "loss" in o.text)
        shown = kernel.shown(display_id)
        assert "\x1b[" not in shown.text and "<table" in shown.data["text/html"]
        assert "1 received" in shown.text

        # The stop button interrupts a cell; the view and the server carry on.
        sleeper = kernel.submit("import time\nprint('sleeping', flush=True)\ntime.sleep(60)")
        kernel.wait_for_text(sleeper, "sleeping")
        kernel.interrupt()
        kernel.wait(sleeper, 10)
        assert sleeper.status == "error"
        assert client.catch(np.arange(2), name="after_interrupt").wait(10)
        kernel.drain(10, until=lambda o: o.kind == "update_display_data"
                     and o.display_id == display_id and "after_interrupt" in o.text)

        # status(False) stops it; running status() again replaces it.
        kernel.execute("thing.status()\nthing.status()", timeout=5)
        threads = "import threading\nsum(t.name == 'thing-status' for t in threading.enumerate())"
        assert kernel.execute(threads).result == "1"
        kernel.execute("thing.status(False)", timeout=5)
        assert kernel.execute(threads).result == "0"
        assert client.catch(np.arange(2), name="unwatched").wait(10)
        late = kernel.drain(1.5, until=lambda o: "unwatched" in o.text)
        assert not any("unwatched" in o.text for o in late)
    finally:
        client.close()
    assert kernel.execute("server.running").result == "True"
    # With no client left, nothing arrives: a pause said now shows all the same (the view
    # waited for a capture to redraw).
    watching = kernel.execute("thing.status()", timeout=5)
    display_id = next(o.display_id for o in watching.displays if o.display_id)
    kernel.execute("thing.pause('loss')", timeout=5)
    kernel.drain(10, until=lambda o: o.kind == "update_display_data"
                 and o.display_id == display_id and "paused" in o.text)
    assert "paused" in kernel.shown(display_id).text
    # With the server closed, status(False) still stops the view (no NotServing).
    kernel.execute("thing.status()\nserver.close()\nthing.status(False)", timeout=5)
    assert kernel.execute(threads).result == "0"


def test_reports_in_a_notebook_are_html_with_plain_text(kernel: Kernel) -> None:
    kernel.run(
        "import numpy as np, thing\nserver = thing.serve(port=0)",
        "client = thing.Client('127.0.0.1', server.port)\n"
        "assert client.catch(np.ones(3), name='<b>w</b>').wait(10)\n"
        "assert client.catch(np.ones(2), name='model.transformer.h.0.attn.c_attn.weight').wait(10)",
    )
    for code in ("thing.summary()", "thing.describe('<b>w</b>')",
                 "server.capture('<b>w</b>')", "thing.ingest_all()"):
        cell = kernel.execute(code)
        bundles = [o.data for o in cell.outputs if o.data]
        assert len(bundles) == 1, (code, cell.describe())  # shown once
        plain, page = bundles[0]["text/plain"], bundles[0]["text/html"]
        assert "\x1b[" not in plain and "<table" in page, code
        if "ingest_all" not in code:
            assert "&lt;b&gt;w&lt;/b&gt;" in page and "<b>w</b>" not in page, code
    summary = kernel.execute("thing.summary()").outputs[0].data
    assert "model.transformer.h.0.attn.c_attn.weight" in summary["text/html"]


def test_a_cell_run_again_keeps_its_names(kernel: Kernel) -> None:
    kernel.run("import numpy as np, thing\nserver = thing.serve(port=0)\nx = np.arange(3)",
               "client = thing.Client('127.0.0.1', server.port)")
    again = "handle = client.catch(x)\nassert handle.wait(10)\nhandle.name"
    in_function = ("def step(x):\n    return client.catch(x)\n"
                   "handle = step(x)\nassert handle.wait(10)\nhandle.name")
    names = [kernel.execute(again).result, kernel.execute(again).result,
             kernel.execute("handle = client.catch(x)  # another cell\n"
                            "assert handle.wait(10)\nhandle.name").result,
             kernel.execute(in_function).result, kernel.execute(in_function).result]
    assert names == ["'x'", "'x'", "'x'", "'x_1'", "'x_1'"]
    assert kernel.execute("len(thing.get_all('x')), len(thing.get_all('x_1'))").result == "(3, 2)"


# -- plots ------------------------------------------------------------------------------------


PLOTTING_JOB = """
import numpy as np, thing
w = np.zeros((8, 4), np.float32)
for step in range(1, 31):
    handle = thing.catch(np.float32(1.0 / step), name="loss", step=step)
    w += np.float32(0.1) * step
    thing.catch(w, name="w", every=10, copy=True, step=step)
assert handle.wait(20)
"""


def test_plots_are_images_in_a_notebook_run_by_nbclient(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    (tmp_path / "train.py").write_text(PLOTTING_JOB)
    cells = [
        "import os, subprocess, sys, thing\nserver = thing.serve(port=0)",
        "job = subprocess.run([sys.executable, 'train.py'], capture_output=True, text=True,\n"
        "                     env={**os.environ, 'THING_PORT': str(server.port)}, timeout=60)\n"
        "assert job.returncode == 0, job.stderr",
        "thing.plot('loss')",
        "thing.plot(['loss', 'w'])",
        "thing.hist('w', bins=20)",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    manager = jupyter_client.KernelManager(
        kernel_name="python3",
        kernel_spec_manager=jupyter_client.kernelspec.KernelSpecManager(kernel_dirs=[]))
    client = nbclient.NotebookClient(notebook, km=manager, timeout=90,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=kernel_env(tmp_path / "ipython"))
    nbformat.validate(notebook)
    for cell in notebook.cells[2:]:
        [output] = cell.outputs  # shown once: no second figure from an inline backend
        assert output.output_type == "display_data", cell.source
        png = base64.b64decode(output.data["image/png"])
        pixels = imread(io.BytesIO(png))
        assert pixels.shape[1] >= 600 and (pixels[..., :3] < 0.9).any(axis=2).mean() > 0.01
        assert "\x1b[" not in output.data["text/plain"]
    assert "loss" in notebook.cells[2].outputs[0].data["text/plain"].splitlines()[0]


def test_a_live_plot_redraws_while_a_job_sends(kernel: Kernel) -> None:
    import numpy as np

    import thing

    port = int(kernel.execute("import thing\nserver = thing.serve(port=0)\nserver.port").result)
    client = thing.Client("127.0.0.1", port)  # the training job: this test's process
    try:
        assert client.catch(np.float32(1.0), name="loss", step=1).wait(10)
        cell = kernel.execute("view = thing.plot('loss', live=True)\nview", timeout=20)
        assert cell.status == "ok"  # the cell ends: the kernel stays free
        display_id = next(o.display_id for o in cell.displays if o.display_id)
        pictures = [kernel.shown(display_id).data["image/png"]]
        assert "updating as captures arrive; .stop() stops it" in (cell.result or "")
        for step in (2, 3, 4):
            assert client.catch(np.float32(1.0 / step), name="loss", step=step).wait(10)
            kernel.drain(10, until=lambda o: o.kind == "update_display_data"
                         and o.display_id == display_id
                         and o.data["image/png"] not in pictures)
            pictures.append(kernel.shown(display_id).data["image/png"])
        assert len(set(pictures)) == 4  # redrawn after each capture, each time a new picture

        # A burst of 50 captures is drawn at most twice a second, not 50 times.
        started = time.monotonic()
        for step in range(5, 55):
            client.catch(np.float32(1.0 / step), name="loss", step=step)
        assert client.catch(np.float32(0.0), name="loss", step=55).wait(10)
        seen = kernel.drain(3)
        updates = [o for o in seen if o.kind == "update_display_data"
                   and o.display_id == display_id]
        assert 1 <= len(updates) <= 2 * (time.monotonic() - started) + 1

        # Running the same plot again replaces it; stop() ends it.
        kernel.execute("again = thing.plot('loss', live=True)", timeout=20)
        threads = "import threading\nsum(t.name == 'thing-plot' for t in threading.enumerate())"
        assert kernel.execute(threads).result == "1"
        assert kernel.execute("view.running, again.running").result == "(False, True)"
        kernel.execute("again.stop()")
        assert kernel.execute(threads).result == "0"
    finally:
        client.close()
