"""The REPL functions (thing.get, thing.summary, ...) on a real server fed by client processes."""

from __future__ import annotations

import math
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import thing
import thing.display
import thing.live
import thing.repl
import thing.reports
from thing.arrays import LeafSpec
from thing.captures import Sender
from thing.store import NAME_BYTES, RECORD_BYTES, Announcement, HistoryStore, UnsentNotice

from .conftest import run_script, script_env, start_script


@pytest.fixture
def default(server: thing.Server, monkeypatch: pytest.MonkeyPatch) -> thing.Server:
    """The conftest server, installed as the one thing.serve() would have started."""
    monkeypatch.setattr(thing.repl, "_server", server)
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps tables at 80 columns when not in a terminal
    return server


@pytest.fixture
def no_default(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No default server before the test; whatever it starts is closed after it."""
    monkeypatch.setattr(thing.repl, "_server", None)
    yield
    if thing.repl._server is not None:
        thing.repl._server.close()


def send(port: int, code: str) -> str:
    """Run client ``code`` (thing and numpy imported) in a fresh process; return its stdout."""
    return run_script("import thing\nimport numpy as np\n" + textwrap.dedent(code), port=port)


# -- serve --------------------------------------------------------------------------------


def test_functions_before_serve_say_to_call_serve(no_default: None) -> None:
    for call in (lambda: thing.get("loss"), lambda: thing.get_all("loss"), thing.summary,
                 lambda: thing.describe("loss"), thing.status, thing.ingest_all, thing.clear,
                 lambda: thing.wait("loss", 1)):
        with pytest.raises(thing.NotServing, match=r"call thing\.serve\(\) first"):
            call()


def test_serve_after_the_server_was_closed_keeps_its_history(no_default: None,
                                                             monkeypatch) -> None:
    monkeypatch.setattr(thing.repl, "_loaded", None)
    first = thing.serve(port=0)
    send(first.port, "assert thing.catch(1.5, name='loss').wait(10)")
    first.close()
    assert thing.get("loss") == 1.5  # closed, its history still looked at
    with pytest.raises(thing.NotServing):  # nothing could arrive: not a wait for ever
        thing.wait("loss", 30)
    second = thing.serve(port=0)
    assert second is not first and thing.get("loss") == 1.5  # the session's history goes on
    send(second.port, "assert thing.catch(2.5, name='loss').wait(10)")
    kept = second.store.get_all("loss", run=thing.store.ALL_RUNS)  # two jobs, two runs
    assert [capture.value for capture in kept] == [1.5, 2.5]


def test_serve_starts_once_and_logs_its_port(no_default: None, caplog) -> None:
    caplog.set_level("INFO", logger="thing")
    server = thing.serve(port=0)
    assert server.running and server.port > 0
    assert f"Server started at port {server.port}." in caplog.text
    assert thing.serve() is server
    assert thing.serve(port=0) is server
    assert "already running" in caplog.text
    # The REPL stays usable: serve() returned while the server receives in the background.
    send(server.port, "assert thing.catch(np.arange(3), name='a').wait(10)")
    assert thing.get("a").tolist() == [0, 1, 2]


def test_serve_on_a_busy_port_says_so_in_one_sentence(no_default: None) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(thing.ThingError) as error:
            thing.serve(port=port)
    message = str(error.value)
    assert message.startswith(f"Port {port} is already in use")
    free = int(message.split("try port ")[1].split(":")[0])
    assert f"thing.serve(port={free}) or `thing serve --port {free}`" in message
    assert f"THING_PORT={free} for the jobs" in message
    assert message.count(". ") == 0 and "\n" not in message
    assert error.value.__cause__ is None and error.value.__suppress_context__
    assert thing.repl._server is None


# -- get, get_all, wait, clear ------------------------------------------------------------


def test_get_by_name_index_and_id(default: thing.Server) -> None:
    out = send(default.port, """
        for i in range(3):
            handle = thing.catch(np.arange(4, dtype=np.float32) + i, name="w")
            assert handle.wait(10)
            print(handle.id)
    """)
    ids = [int(line) for line in out.split()]
    newest = thing.get("w")
    assert newest.dtype == np.float32 and newest.tolist() == [2, 3, 4, 5]
    assert thing.get("w", 1).tolist() == [1, 2, 3, 4]
    assert thing.get("w", index=2).tolist() == [0, 1, 2, 3]
    assert thing.get("w", -1).tolist() == [0, 1, 2, 3]
    assert thing.get(ids[1]).tolist() == [1, 2, 3, 4]
    # The very array that was received into, not a copy.
    assert thing.get("w") is thing.get(ids[2]) is default.store.get("w").value
    with pytest.raises(IndexError):
        thing.get("w", 3)


def test_what_get_and_wait_cannot_answer_is_refused_not_guessed(default: thing.Server) -> None:
    """A bool is no position (True as step 1 handed back a capture nobody asked for), an id
    is one capture whatever else is asked, a shorthand for several names is refused by
    wait() as by get() (wait() had waited out its timeout, or for ever), and summary()
    shows at least one name."""
    send(default.port, """
        for step in range(3):
            assert thing.catch(float(step), name="w", step=step).wait(10)
        assert thing.catch(1.0, name="x.y").wait(10)
        assert thing.catch(2.0, name="x[y]").wait(10)
    """)
    for wrong in (dict(index=True), dict(step=True), dict(index=1.0), dict(step="2"),
                  dict(rank=False)):
        with pytest.raises(TypeError, match="is a whole number"):
            thing.get("w", **wrong)
    with pytest.raises(TypeError, match="rank is a whole number"):
        thing.get_all("w", rank=False)
    newest = default.store.get("w").id
    for selector in (dict(index=1), dict(step=0), dict(rank=0), dict(run="other")):
        with pytest.raises(ValueError, match=f"capture {newest} is one capture"):
            thing.get(newest, **selector)
    assert thing.get("w", np.int64(1)) == 1.0 and thing.get("w", step=np.int64(0)) == 0.0
    with pytest.raises(thing.UnknownName, match="'x_y' stands for several names"):
        thing.wait("x_y", 30)
    for wrong in (0, -1):
        with pytest.raises(ValueError, match=r"max_items \(or None: all\) is a whole number "
                                             "from 1, not"):
            thing.summary(wrong)
    for wrong in (True, "5", 2.0):
        with pytest.raises(TypeError, match=r"max_items \(or None: all\) is a whole number, "
                                            "not"):
            thing.summary(wrong)
    thing.summary(np.int64(2))  # as good as an int


def test_get_returns_containers_as_sent(default: thing.Server) -> None:
    send(default.port, """
        value = {"h": [np.arange(2), (1.5, "x")], "n": None, "deep": {"k": [True]}}
        assert thing.catch(value, name="tree").wait(10)
    """)
    value = thing.get("tree")
    assert list(value) == ["h", "n", "deep"]
    assert isinstance(value["h"], list) and isinstance(value["h"][1], tuple)
    assert value["h"][0].tolist() == [0, 1] and value["h"][1] == (1.5, "x")
    assert value["n"] is None and value["deep"] == {"k": [True]}


def test_get_of_an_unknown_name_lists_the_closest(default: thing.Server) -> None:
    send(default.port, """
        for name in ("loss", "lr", "model.lm_head.weight"):
            assert thing.catch(1.0, name=name).wait(10)
    """)
    with pytest.raises(KeyError, match="did you mean 'loss'"):
        thing.get("lss")
    with pytest.raises(KeyError, match="'model.lm_head.weight'"):
        thing.get("lm_head.weight")


def test_get_all_is_oldest_to_newest(default: thing.Server) -> None:
    send(default.port, """
        for i in range(5):
            assert thing.catch(np.full(3, i, np.int16), name="h").wait(10)
    """)
    history = thing.get_all("h")
    assert [int(a[0]) for a in history] == [0, 1, 2, 3, 4]
    assert all(a.dtype == np.int16 for a in history)


def test_wait_returns_the_next_capture(default: thing.Server) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        thing.wait("tick", timeout=0.2)
    assert time.monotonic() - started < 5
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(thing.wait("tick", timeout=30)))
    waiter.start()
    # Keep sending until the waiter has what it waited for: no guess of when it started waiting.
    sender = start_script("""
        import time, thing, numpy as np
        while True:
            thing.catch(np.array([7, 8]), name="tick").wait(10)
            time.sleep(0.05)
    """, port=default.port)
    try:
        waiter.join(timeout=60)
    finally:
        sender.kill()
        sender.communicate()
    assert result and result[0].tolist() == [7, 8]


def test_clear_one_name_or_everything(default: thing.Server) -> None:
    send(default.port, """
        for name in ("a", "a", "b"):
            assert thing.catch(np.arange(2), name=name).wait(10)
    """)
    assert thing.clear("a") == 2
    with pytest.raises(KeyError):
        thing.get("a")
    assert thing.get("b").tolist() == [0, 1]
    assert thing.clear() == 1
    assert len(default.store) == 0


# -- ingest_all -------------------------------------------------------------------------------


NAMES = ("loss", "model.lm_head.weight", "h[3]", "class", "3d", "h.3")


def test_identifier_rule() -> None:
    rule = thing.names.identifier_for
    assert [rule(name) for name in NAMES] == [
        "loss", "model_lm_head_weight", "h_3", "_class", "_3d", "h_3"]
    assert rule("<module>:12") == "module_12"
    assert rule("...") == "_"
    assert rule("ß.x") == "ß_x"
    # As Python reads what is typed (NFKC): names nobody could type become ones they can.
    assert [rule(name) for name in ("x²", "ﬁle", "①a")] == ["x2", "file", "_1a"]


def test_ingest_all_binds_sanitised_names_and_keeps_existing(default: thing.Server) -> None:
    send(default.port, f"""
        for i, name in enumerate({NAMES!r}):
            assert thing.catch(np.array([i]), name=name).wait(10)
    """)
    namespace = {"loss": "mine"}
    bound = thing.ingest_all(namespace=namespace)
    assert bound == {"model_lm_head_weight": "model.lm_head.weight", "h_3": "h[3]",
                     "_class": "class", "_3d": "3d"}
    assert namespace["loss"] == "mine"
    assert namespace["model_lm_head_weight"] is thing.get("model.lm_head.weight")
    assert namespace["h_3"].tolist() == [2]  # h[3] arrived first; h.3 would clash with it
    shown = repr(bound)  # what a REPL echoes: the report, once
    assert "ingest_all: 4 variables" in shown and "_class ('class')" in shown
    assert "kept" in shown and "loss" in shown and "overwrite=True" in shown
    assert "'h.3'" in shown  # the clash is reported, not silently dropped

    bound = thing.ingest_all(overwrite=True, namespace=namespace)
    assert bound["loss"] == "loss" and namespace["loss"].tolist() == [0]


def test_ingest_all_lists_at_most_fifty_names_of_a_kind(default: thing.Server) -> None:
    """Among 20,000 names its echo was 20,000 lines; the dict it returns has them all."""
    store = default.store
    for i in range(120):
        store.add(f"layer{i}.weight", float(i), (), 0, Sender("a:1"))
    namespace = {f"layer{i}_weight": "mine" for i in range(60)}
    bound = thing.ingest_all(namespace=namespace)
    assert len(bound) == 60 and namespace["layer119_weight"] == 119.0
    shown = repr(bound)
    assert "and 10 more (the dict ingest_all returns has them)" in shown
    assert shown.count("layer") == 2 * 2 * 50 and len(shown.splitlines()) < 60  # two lists


def test_ingest_all_never_shadows_builtins_dunders_or_modules(default: thing.Server) -> None:
    names = ("print", "len", "open", "sum", "exec", "__builtins__", "thing", "mine", "fine")
    send(default.port, f"""
        for i, name in enumerate({names!r}):
            assert thing.catch(np.array([i]), name=name).wait(10)
    """)
    namespace = {"__builtins__": __builtins__, "thing": thing, "mine": "kept"}
    for overwrite in (False, True):
        bound = thing.ingest_all(overwrite=overwrite, namespace=namespace)
        # "__builtins__" binds as "builtins": no identifier is a dunder.
        assert set(bound) == {"fine", "builtins"} | ({"mine"} if overwrite else set())
        assert namespace["thing"] is thing and namespace["__builtins__"] is __builtins__
        assert not {"print", "len", "open", "sum", "exec"} & set(namespace)
        shown = repr(bound)
        for skipped in ("'print' (print is a builtin)", "'exec' (exec is a builtin)",
                        "'thing' (thing is a module)", "use thing.get(name)"):
            assert skipped in shown, shown
        assert ("mine" in shown) and (namespace["mine"] == "kept") != overwrite
    assert namespace["mine"].tolist() == [7]
    assert thing.get("print").tolist() == [0]  # still reachable


def test_from_thing_import_star_keeps_the_builtin_help() -> None:
    namespace: dict = {}
    exec("from thing import *", namespace)
    assert "help" not in namespace and "catch" in namespace and "get" in namespace
    import builtins

    assert not [name for name in thing.__all__ if hasattr(builtins, name)]
    assert callable(thing.help)


def test_names_are_reachable_by_their_identifier(default: thing.Server) -> None:
    send(default.port, """
        for name in ("model.lm_head.weight", "h[3]", "a.b", "a_b", "x.y", "x[y]"):
            assert thing.catch(np.arange(2), name=name).wait(10)
    """)
    assert thing.get("model_lm_head_weight") is thing.get("model.lm_head.weight")
    assert thing.get_all("h_3")[0].tolist() == [0, 1]
    assert thing.get("a_b") is not thing.get("a.b")  # a name of its own wins over an alias
    with pytest.raises(KeyError, match=r"'x_y' stands for several names: 'x.y', 'x\[y\]'"):
        thing.get("x_y")
    thing.clear("a_b")
    assert thing.get("a_b") is thing.get("a.b")  # now the alias is unambiguous


def test_a_mistyped_name_ends_in_a_short_traceback(default: thing.Server) -> None:
    import traceback

    default.store.reserve(0)
    default.store.add("loss", 1.0, (), 0, Sender("x:1"))
    try:
        thing.get("los")
    except KeyError:
        lines = traceback.format_exc().strip().splitlines()
    # This test's frame, thing's one frame, and the message with its remedy.
    assert lines[-1] == "thing.errors.UnknownName: no capture named 'los'; did you mean 'loss'?"
    assert len(lines) <= 7, lines


def test_a_wait_that_times_out_ends_in_a_short_traceback(default: thing.Server) -> None:
    """thing.wait() running out of time is an ordinary outcome: four frames of thing's
    own code above the message said nothing to the user."""
    import traceback

    try:
        thing.wait("never", timeout=0.05)
    except TimeoutError:
        lines = traceback.format_exc().strip().splitlines()
    assert lines[-1] == "TimeoutError: no new capture of 'never' within 0.05 s"
    assert len(lines) <= 7, lines


def test_what_thing_refuses_on_purpose_ends_in_a_short_traceback(
        default: thing.Server, tmp_path) -> None:
    """A save to a directory of one's own files, a load of a damaged file: thing's own
    refusals (a ThingError) are told in a few lines, not from deep in the library."""
    import traceback

    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "segment-000001.safetensors").write_bytes(b"\0" * 5)
    told = []
    try:
        thing.save(tmp_path)
    except thing.ThingError:
        told.append(traceback.format_exc().strip().splitlines())
    try:
        thing.load(tmp_path / "rec")
    except thing.ThingError:
        told.append(traceback.format_exc().strip().splitlines())
    assert [lines[-1].split(":")[0] for lines in told] == [
        "thing.errors.ThingError", "thing.errors.BadRecording"]
    assert all(len(lines) <= 7 for lines in told), told


@pytest.mark.parametrize(("call", "error"), [
    (lambda: thing.get("loss", index=5), IndexError),
    (lambda: thing.get("loss", index="0"), TypeError),
    (lambda: thing.get(2.5), TypeError),
    (lambda: thing.get(1, index=1), ValueError),
    (lambda: thing.plot("loss", stat="nope"), ValueError),
    (lambda: thing.every("loss", 0), ValueError),
    (lambda: thing.every(7, 2), TypeError),
    (lambda: thing.summary(max_items=0), ValueError),
    (lambda: thing.serve(port=True), TypeError),  # it served on port 1
    (lambda: thing.serve(port="abc"), TypeError),
    (lambda: thing.serve(port=70000), ValueError),
    (lambda: thing.serve(host=5), TypeError),
    (lambda: thing.load(5), TypeError),
    (lambda: thing.ingest_all(namespace=[1]), TypeError),
    (lambda: thing.request(None), ValueError),
    (lambda: thing.first(None, 3), ValueError),
], ids=["index", "index-type", "name-type", "id-and-index", "stat", "every-0", "every-name",
        "max-items", "port-bool", "port-text", "port-range", "host", "load-path",
        "namespace", "request-no-name", "first-no-name"])
def test_an_argument_a_repl_function_refuses_ends_in_a_short_traceback(
        default: thing.Server, call, error) -> None:
    """An index past the kept versions or a value of the wrong kind: the message says what
    the function takes, in a few lines, and it is still the builtin error code catches."""
    import traceback

    default.store.reserve(0)
    default.store.add("loss", 1.0, (), 0, Sender("x:1"))
    with pytest.raises(error) as raised:
        try:
            call()
        except thing.ThingError:
            lines = traceback.format_exc().strip().splitlines()
            raise
    assert isinstance(raised.value, thing.ThingError)
    frames = [line for line in lines if line.startswith("  File ")]
    assert [frame for frame in frames if "/thing/" in frame] == [
        next(frame for frame in frames if "/thing/repl.py" in frame)], lines
    assert lines[-1].endswith(str(raised.value))


def test_ingest_all_gives_a_name_its_own_variable_and_updates_what_it_bound(
        default: thing.Server) -> None:
    send(default.port, """
        assert thing.catch(np.array([-1.0]), name="-loss").wait(10)  # first: it took "loss"
        assert thing.catch(np.array([1.0]), name="loss").wait(10)
        assert thing.catch(np.array([4.0]), name="4").wait(10)  # _4: IPython's Out[4]
    """)
    namespace: dict = {}
    bound = thing.ingest_all(namespace=namespace)
    assert bound == {"loss": "loss"} and namespace["loss"].tolist() == [1.0]
    shown = repr(bound)
    assert "'-loss' (its variable loss is 'loss')" in shown
    assert "'4' (_4 is the REPL's output history)" in shown and "_4" not in namespace
    namespace["mine"] = "kept"
    send(default.port, """
        assert thing.catch(np.array([2.0]), name="loss").wait(10)
        assert thing.catch(np.array([3.0]), name="mine").wait(10)
        assert thing.catch(0.5, name="lr").wait(10)
    """)
    bound = thing.ingest_all(namespace=namespace)  # a cell run again: what it bound moves on
    assert namespace["loss"].tolist() == [2.0] and namespace["mine"] == "kept"
    assert bound == {"loss": "loss", "lr": "lr"} and "kept" in repr(bound)
    send(default.port, "assert thing.catch(0.25, name='lr').wait(10)")
    thing.ingest_all(namespace=namespace)
    assert namespace["lr"] == 0.25  # a float too
    namespace["lr"] = 1.0  # the user's own now: kept
    send(default.port, "assert thing.catch(0.125, name='lr').wait(10)")
    assert "lr" not in thing.ingest_all(namespace=namespace) and namespace["lr"] == 1.0
    # What it bound and the user deleted is not remembered for ever (per-step names).
    from thing import ingest
    send(default.port, "for i in range(50): assert thing.catch(0.5, name=f's{i}').wait(10)")
    thing.ingest_all(namespace=namespace)
    for i in range(50):
        del namespace[f"s{i}"]
    thing.ingest_all(namespace={})  # another namespace: this one's memory is its own
    assert sum(key[0] == id(namespace) for key in ingest._bound_strongly) == 50
    thing.ingest_all(namespace=namespace)
    assert sum(key[0] == id(namespace) for key in ingest._bound_strongly) == 50  # bound anew
    namespace.clear()
    default.clear()
    thing.ingest_all(namespace=namespace)
    assert not any(key[0] == id(namespace) for key in ingest._bound_strongly)


def test_ingest_all_defaults_to_the_callers_globals(default: thing.Server) -> None:
    send(default.port, "assert thing.catch(np.arange(2), name='zz.ingested').wait(10)")
    try:
        thing.ingest_all()
        assert globals()["zz_ingested"].tolist() == [0, 1]
    finally:
        globals().pop("zz_ingested", None)


# -- summary and describe -------------------------------------------------------------------


def test_summary_shows_each_name_and_the_counts(default: thing.Server, capsys) -> None:
    send(default.port, """
        import torch
        assert thing.catch(np.float32(0.25), name="loss").wait(10)
        assert thing.catch(torch.ones(16, 4, dtype=torch.bfloat16), name="lm.weight").wait(10)
        assert thing.catch({"a": np.arange(3), "b": [torch.zeros(2)]}, name="acts").wait(10)
        assert thing.catch(np.float32(0.125), name="loss").wait(10)
    """)
    default.store.reserve(0)
    default.store.add(None, 1.0, (), 0, Sender("x:1", "elsewhere", 42))
    thing.summary()
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "0.125" in lines["loss"] and "float32" in lines["loss"] and " 2 " in lines["loss"]
    assert "(16, 4)" in lines["lm.weight"] and "bfloat16" in lines["lm.weight"]
    assert "torch" in lines["lm.weight"]
    assert "dict of 2" in lines["acts"]
    assert f"{socket.gethostname()}:" in lines["loss"]
    assert "1 unnamed" in out and "0 evicted" in out and "5 captures kept" in out

    thing.summary(max_items=1)
    out = capsys.readouterr().out
    assert "loss" in out and "lm.weight" not in out and "2 more names" in out


def test_summary_marks_inconsistent_captures(default: thing.Server, capsys) -> None:
    default.store.reserve(4)
    default.store.fill(4)
    default.store.add("torn", np.zeros(1, np.float32), (), 4, Sender("x:1"), consistent=False)
    thing.summary()
    out = capsys.readouterr().out
    assert "torn !" in out and "changed after catch()" in out


def test_summary_of_an_empty_server(default: thing.Server, capsys) -> None:
    thing.summary()
    assert "nothing received yet" in capsys.readouterr().out


def test_eviction_under_a_byte_cap_with_a_real_client(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    # Three captures named "w": data, record, name and call site ("<string>:3 (<module>)"),
    # and the name's own cost.
    store = HistoryStore(max_bytes=3 * (4000 + RECORD_BYTES + 51 + 80) + NAME_BYTES + 100)
    with thing.Server(port=0, store=store) as server:
        monkeypatch.setattr(thing.repl, "_server", server)
        out = send(server.port, """
            for i in range(5):
                assert thing.catch(np.full(1000, i, np.float32), name="w").wait(10)
            too_big = thing.catch(np.zeros(100_000, np.float32), name="huge")
            print(too_big.wait(10), too_big.error)
            assert thing.catch(np.full(1000, 9, np.float32), name="w").wait(10)
        """)
        assert out.startswith("False") and "cap" in out
        assert [int(a[0]) for a in thing.get_all("w")] == [3, 4, 9]
        assert store.evicted == 3 and store.rejected == 1
        assert store.held_bytes <= store.max_bytes
        thing.summary()
        printed = capsys.readouterr().out
        assert "3 evicted" in printed and "1 refused" in printed


def test_describe_a_tensor_with_nan_and_inf(default: thing.Server, capsys) -> None:
    send(default.port, """
        import torch
        x = torch.tensor([1.0, -2.0, 3.5, float("nan"), float("inf"), 0.5], dtype=torch.bfloat16)
        assert thing.catch(x * 2, name="x").wait(10)
        assert thing.catch(x, name="x").wait(10)
    """)
    thing.describe("x")
    out = capsys.readouterr().out
    fields = dict(line.split(None, 1) for line in out.splitlines()[1:]
                  if line.strip() and len(line.split(None, 1)) == 2)
    finite = np.array([1.0, -2.0, 3.5, 0.5])
    assert fields["dtype"].strip() == "bfloat16" and fields["framework"].strip() == "torch"
    assert fields["min"].strip() == "-2" and fields["max"].strip() == "3.5"
    assert fields["mean"].startswith(f"{finite.mean():.6g} (over the 4 finite values)")
    assert fields["std"].startswith(f"{finite.std():.6g}")
    assert fields["NaN"].strip() == "1" and fields["Inf"].strip() == "1"
    assert "L2 norm" in out and f"{np.linalg.norm(finite):.6g}" in out
    assert "2 kept; this is the newest" in out
    assert f"host {socket.gethostname()}, pid " in out
    assert "call site" in out and "consistent" in out


def test_describe_a_container_describes_each_array(default: thing.Server, capsys) -> None:
    send(default.port, """
        acts = {"hidden": np.arange(6, dtype=np.float64).reshape(2, 3), "out": [np.ones(2)]}
        assert thing.catch(acts, name="acts").wait(10)
    """)
    thing.describe("acts")
    out = capsys.readouterr().out
    hidden = next(line for line in out.splitlines() if "['hidden']" in line).split()
    assert hidden[1:4] == ["(2,", "3)", "float64"]
    header = next(line for line in out.splitlines() if line.startswith("path")).split()
    assert header[3:6] == ["min", "max", "mean"] and hidden[4:7] == ["0", "5", "2.5"]
    assert any("['out'][0]" in line for line in out.splitlines())


def test_describe_marks_a_complex_array_in_a_container_as_magnitudes(default: thing.Server,
                                                                     capsys) -> None:
    """Its statistics are of |x| (a mean of 5 where the values' mean is 0): said on its row,
    which keeps its path when the dtype column is left out."""
    send(default.port, """
        assert thing.catch({"z": np.array([3 + 4j, -3 - 4j]), "r": np.array([1.0, 2.0])},
                           name="d").wait(10)
    """)
    thing.describe("d")
    lines = capsys.readouterr().out.splitlines()
    z = next(line for line in lines if "['z']" in line).split()
    assert z[:2] == ["['z']", "|x|"] and z[4:8] == ["5", "5", "5", "0"]
    assert next(line for line in lines if "['r']" in line).split()[:2] == ["['r']", "(2,)"]
    assert "|x|: of a complex array's magnitudes" in lines


def test_describe_by_id_and_of_a_scalar(default: thing.Server, capsys) -> None:
    out = send(default.port, """
        handle = thing.catch(0.5, name="lr")
        assert handle.wait(10)
        print(handle.id)
    """)
    thing.describe(int(out))
    printed = capsys.readouterr().out
    assert "lr" in printed and "0.5" in printed and "python" in printed


# -- array statistics --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "uint8", "bool", "float16"])
def test_array_stats_match_numpy_across_chunks(dtype: str, monkeypatch) -> None:
    monkeypatch.setattr(thing.array_stats, "STATS_CHUNK", 1000)  # several chunks to merge
    rng = np.random.default_rng(1)
    values = (rng.normal(3, 2, 4567) * 10).astype(dtype)
    stats = thing.array_stats.array_stats(values)
    exact = values.astype(np.float64)
    assert stats.count == stats.finite == values.size and stats.nan == stats.inf == 0
    assert stats.min == exact.min() and stats.max == exact.max()
    assert math.isclose(stats.mean, exact.mean(), rel_tol=1e-12)
    assert math.isclose(stats.std, exact.std(), rel_tol=1e-9)
    assert math.isclose(stats.norm, np.linalg.norm(exact), rel_tol=1e-12)


def test_array_stats_of_torch_jax_bfloat16_and_raw_bits() -> None:
    import jax.numpy as jnp
    import ml_dtypes
    import torch

    reference = np.array([1.0, -2.0, 3.5, 0.25])
    for value in (torch.tensor(reference, dtype=torch.bfloat16),
                  torch.tensor(reference).reshape(2, 2),
                  jnp.asarray(reference, dtype=jnp.bfloat16),
                  reference.astype(ml_dtypes.bfloat16),
                  reference.astype(ml_dtypes.bfloat16).view(np.uint16)):
        spec = thing.arrays.LeafSpec("numpy", "bfloat16", (4,))
        stats = thing.array_stats.array_stats(value, spec)
        assert (stats.min, stats.max, stats.mean) == (-2.0, 3.5, reference.mean()), value
    big = np.array([2**62 + 1, -5], np.int64)
    assert thing.array_stats.array_stats(big).max == 2**62 + 1  # exact, not rounded via float64
    complex_stats = thing.array_stats.array_stats(np.array([3 + 4j, 0j]))
    assert complex_stats.magnitude and complex_stats.max == 5.0
    empty = thing.array_stats.array_stats(np.zeros((0, 3)))
    assert empty.count == 0 and empty.min is None
    assert thing.array_stats.array_stats(b"bytes") is None


# -- status -----------------------------------------------------------------------------------


STATUS_SCRIPT = """
    import thing
    server = thing.serve(port=0)
    print("PORT", server.port, flush=True)
    thing.status()
    print("after status: running", server.running, flush=True)
    print("waited for", thing.wait("after", timeout=60).tolist(), flush=True)
"""


class Lines:
    """The stdout of a process, line by line, read on a thread so waiting for one can time out."""

    def __init__(self, process: subprocess.Popen):
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(process.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def until(self, text: str, timeout: float = 30) -> str:
        """The lines up to and including the first that contains ``text``."""
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"{text!r} not seen within {timeout} s:\n{''.join(seen)}")
            seen.append(line)
            if text in line:
                return "".join(seen)


def test_status_shows_arrivals_and_returns_on_ctrl_c(tmp_path) -> None:
    watcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(STATUS_SCRIPT)],
                               env=script_env(COLUMNS="200"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    sender = None
    lines = Lines(watcher)
    try:
        port = int(lines.until("PORT").split()[-1])
        lines.until("press Ctrl+C to stop")
        send(port, "assert thing.catch(np.arange(3), name='during').wait(10)")
        arrival = lines.until("during")
        assert "(3,)" in arrival and "int64" in arrival
        watcher.send_signal(signal.SIGINT)
        lines.until("Stopped watching; the server is still running")
        lines.until("after status: running True")
        # The server still receives after status() returned.
        sender = start_script("""
            import time, thing, numpy as np
            while True:
                thing.catch(np.array([4, 2]), name="after").wait(10)
                time.sleep(0.05)
        """, port=port)
        lines.until("waited for [4, 2]")
        assert watcher.wait(timeout=30) == 0
    finally:
        if sender is not None:
            sender.kill()
            sender.communicate()
        if watcher.poll() is None:
            watcher.kill()
        watcher.wait(timeout=30)
        watcher.stderr.close()


def test_status_stops_when_the_server_is_closed() -> None:
    """It waited forever on a closed server, and then said it was still running."""
    out = run_script("""
        import threading, time, thing
        server = thing.serve(port=0)
        threading.Timer(0.5, server.close).start()
        started = time.monotonic()
        thing.status()
        print("returned after", round(time.monotonic() - started, 1), flush=True)
        """, timeout=60)
    assert "Stopped watching: the server at 127.0.0.1:" in out and "was closed; 0 captures" in out
    assert float(out.split("returned after")[1]) < 10


# pexpect forks to open the terminal; the child execs at once, so jax's threads (if another
# test imported jax) cannot deadlock it.
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_status_live_view_in_a_terminal_returns_on_ctrl_c() -> None:
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-c", textwrap.dedent(STATUS_SCRIPT)],
                          env=script_env(), encoding="utf-8", timeout=30, dimensions=(40, 160))
    try:
        child.expect(r"PORT (\d+)")
        port = int(child.match.group(1))
        child.expect("press Ctrl\\+C to stop")
        child.expect(r"thing at 127\.0\.0\.1:\d+: 0 received")  # the spinner's line
        child.expect("waiting for the first capture")
        child.expect_exact("⠙")  # the spinner turns while nothing arrives
        child.expect_exact("⠹")
        send(port, "assert thing.catch(np.arange(3), name='live_one').wait(10)")
        child.expect("live_one")
        child.sendintr()
        child.expect("Stopped watching; the server is still running at 127.0.0.1")
        child.expect("after status: running True")
    finally:
        child.close(force=True)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_ctrl_c_while_the_live_view_starts_leaves_the_terminal_as_it_was() -> None:
    """A Ctrl+C in the view's first moments (as it draws its first frame) left the cursor
    hidden and stdout taken over for the rest of the session."""
    pexpect = pytest.importorskip("pexpect")
    script = """
        import sys, rich.live, thing
        first_refresh = rich.live.Live.refresh
        def interrupted(self):  # Ctrl+C as the first frame is drawn
            rich.live.Live.refresh = first_refresh
            raise KeyboardInterrupt
        rich.live.Live.refresh = interrupted
        server = thing.serve(port=0)
        thing.status()
        print("stdout is its own:", sys.stdout is sys.__stdout__, flush=True)
        """
    child = pexpect.spawn(sys.executable, ["-c", textwrap.dedent(script)], env=script_env(),
                          encoding="utf-8", timeout=30, dimensions=(40, 160))
    try:
        child.expect("stdout is its own: (True|False)")
        assert child.match.group(1) == "True"
        shown = child.before
        assert shown.rfind("\x1b[?25h") > shown.rfind("\x1b[?25l") >= 0  # the cursor back
    finally:
        child.close(force=True)


def test_log_lines_go_where_stderr_is_when_they_are_logged() -> None:
    """status()'s live view stands in for sys.stderr while it runs, and prints what is
    written there above the view: a warning written to the stderr of before was drawn
    over by the view's next frame."""
    result = run_script("""
        import io, logging, sys, thing
        server = thing.serve(port=0)
        real, sys.stderr = sys.stderr, io.StringIO()
        logging.getLogger("thing").warning("a peer broke the protocol")
        written, sys.stderr = sys.stderr.getvalue(), real
        print(repr(written))
        server.close()
        """, full=True)
    assert "- thing - WARNING  - a peer broke the protocol" in result.stdout
    assert "a peer broke the protocol" not in result.stderr


def test_the_status_view_fits_80_columns(default: thing.Server) -> None:
    for name in LONG_NAMES:
        keep(default.store, name, np.zeros(768, np.float32),
             Sender("10.0.0.7:5000", "gpu-node-17.cluster.example.org", 4242, 1, 8))
    text = thing.live.view(default.store, default.info(), 10, width=80).text(80)
    lines = text.splitlines()
    assert all(len(line) <= 78 for line in lines[:1]) and all(len(line) <= 80 for line in lines)
    assert lines[0].startswith(f"thing at 127.0.0.1:{default.port}: 2 received")
    assert sum(1 for line in lines if "…" in line or "model.transformer" in line) == 2


def test_numbers_shortened_to_fit_keep_their_exponent_and_digits_that_tell_them_apart(
        default: thing.Server, capsys) -> None:
    """Cut from the end to fit 80 columns, a learning rate of 2.99817e-05 read as
    "2.99817…" and -2**63 as "-922337…" (and 10**400, shortened, must not read inf);
    describe() wrote a min of 99999995 and a max
    of 100000005 both as 1e+08 (beside a std of 4), and its table of a dict's arrays a min
    of 0.99995 as 1."""
    send(default.port, """
        caught = {"model.optimizer.param_groups.0.lr": 2.99817e-05,
                  "model.layers.11.attention.scale": -2**63,
                  "model.layers.11.attention.count": 10**400,
                  "offset": np.array([1e8 - 5, 1e8 + 5, 1e8]),
                  "d": {"p": np.array([0.99995, 0.99999, 1.0])}}
        for name, value in caught.items():
            assert thing.catch(value, name=name).wait(10)
    """)
    summary = thing.reports.summary(default.store, default.info()).text(80)
    live = thing.live.view(default.store, default.info(), 10, width=80).text(80)
    for text in (summary, live):
        assert all(len(line) <= 80 for line in text.splitlines())
        assert not any(("2.99817…" in line or "-922337…" in line) for line in text.splitlines())
        lr = next(line for line in text.splitlines() if "param_groups" in line).split()
        assert any(float(token) == pytest.approx(3e-05, rel=0.01) for token in lr
                   if token[0].isdigit()), lr
        count = next(line for line in text.splitlines() if "attention.count" in line)
        assert "e+400" in count and "inf" not in count, count  # float() makes it inf
    thing.describe("offset")
    fields = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines()[1:]
                  if line.strip())
    assert (fields["min"], fields["max"], fields["mean"]) == ("99999995", "100000005",
                                                              "100000000")
    thing.describe("d")
    row = next(line for line in capsys.readouterr().out.splitlines() if "['p']" in line)
    assert row.split()[3:6] == ["0.99995", "1", "0.99998"]


def test_a_sparkline_s_value_is_the_value_caught(default: thing.Server) -> None:
    """status() drew |z| for a complex loss, and showed 5 for -3-4j, without saying so; an
    array of one number shows that number."""
    send(default.port, """
        for z in (-3 - 4j, 1 + 1j):
            assert thing.catch(z, name="z").wait(10)
        for x in (0.5, 0.25):
            assert thing.catch(np.array([x]), name="one").wait(10)
    """)
    lines = thing.live.view(default.store, default.info(), 10, width=80).text(80).splitlines()
    z = next(line for line in lines if line.startswith("z "))
    one = next(line for line in lines if line.startswith("one "))
    assert z.startswith("z |x|") and z.split()[-1] == "1+1j", z
    assert one.split()[-1] == "0.25", one


# -- help ---------------------------------------------------------------------------------


def test_help_lists_every_public_function_and_class(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    thing.help()
    out = capsys.readouterr().out
    for name in thing.__all__:
        obj = getattr(thing, name)
        if callable(obj):
            assert f"thing.{name}" in out, name
    for function in ("catch", "serve", "get", "get_all", "ingest_all", "summary", "status",
                     "describe", "wait", "clear", "help"):
        line = next(line for line in out.splitlines() if line.startswith(f"thing.{function}("))
        assert line.rstrip().endswith(")"), line
    assert "thing.get(name_or_id, index=0, rank=None, *, step=None, run=None)" in out
    assert "The newest capture of a name" in out
    assert out.index("thing.catch(") < out.index("thing.serve(") < out.index("thing.Server(")
    # A sentence that spans lines is shown whole, not cut at its first line's end.
    assert ("Make the next count calls of name in the running jobs send, whatever their "
            "throttles say (rank=: only that rank's).") in out


def test_piped_status_says_the_steering_in_force_and_each_change(default: thing.Server
                                                                ) -> None:
    """status() that cannot redraw (piped, a dumb terminal, no rich) printed arrivals only:
    the settings in force, which only status() shows, were never said."""
    result = run_script("""
        import os, signal, threading, time, numpy as np, thing, thing.live
        server = thing.serve(port=0)
        thing.every("loss", 10)
        said, say = [], thing.live.say
        def watched(text):  # to go on once status() has said it
            say(text)
            said.append(text)
        thing.live.say = watched
        def until_steering_said(times):
            deadline = time.monotonic() + 20
            while sum(line.startswith("steering:") for line in said) < times:
                assert time.monotonic() < deadline, said
                time.sleep(0.01)
        def send_then_stop():
            client = thing.Client("127.0.0.1", server.port)
            try:
                until_steering_said(1)
                assert client.catch(1.0, name="loss").wait(10)
                thing.pause("w")
                until_steering_said(2)
            finally:
                client.close()
                os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=send_then_stop).start()
        thing.status()
    """, full=True, COLUMNS="")
    said = [line for line in result.stdout.splitlines() if line.startswith("steering:")]
    assert len(said) == 2, result.stdout
    assert "every 10" in said[0] and "paused" not in said[0]
    assert "every 10" in said[1] and "paused" in said[1]


def test_piped_reports_fit_80_columns_whatever_the_names(default: thing.Server) -> None:
    """Piped (80 columns): help's signatures, the lines status() prints as captures come,
    and the names ingest_all() bound, wide characters and 170-character names included,
    all fit; each wrapped line counts a wide character as two columns."""
    names = ["重み行列の名前がとても長い重み行列の名前がとても長い", "emoji" + "🔥" * 20,
             "model.transformer.h.11.attn.c_attn.weight.very.long.name." * 3, "loss"]
    result = run_script(f"""
        import os, signal, threading, numpy as np, thing
        server = thing.serve(port=0)
        names = {names!r}
        def send_then_stop():
            client = thing.Client("127.0.0.1", server.port)
            for name in names:
                assert client.catch(np.ones((4, 5)), name=name).wait(10)
            client.close()
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=send_then_stop).start()
        thing.status()
        print(repr(thing.ingest_all(namespace={{}})))
        thing.describe(names[2])
        thing.help()
    """, full=True, COLUMNS="")
    lines = result.stdout.splitlines()
    assert all(thing.display.columns(line) <= 80 for line in lines), "\n".join(
        line for line in lines if thing.display.columns(line) > 80)
    out = result.stdout
    assert "thing.catch(obj, name=None," in out and "Watching arrivals" in out
    assert sum("model.transformer" in line for line in lines) >= 2  # shortened, still there


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(st.sampled_from("ab.[]_重🔥é"), min_size=1, max_size=60), max_size=12),
       st.integers(12, 90))
def test_wrapped_text_fits_and_keeps_every_character(words: list[str], width: int) -> None:
    """A name too long for a line is broken, never shortened: it may be typed again (a
    describe() of a long name showed it cut in its middle)."""
    lines = thing.display.wrap(" ".join(words), width, "    ", "> ")
    assert all(thing.display.columns(line) <= width for line in lines), lines
    assert lines[0].startswith("> ") and all(line.startswith("    ") for line in lines[1:])
    kept = "".join(line[2:] if i == 0 else line[4:] for i, line in enumerate(lines))
    assert kept.replace(" ", "") == "".join(words)


def test_a_number_and_its_unit_stay_on_one_line() -> None:
    """The summary's footer broke "2.0 GiB" into "2.0" at a line's end and "GiB" below."""
    text = "12 captures kept; 1.2 KiB held of a 2.0 GiB cap, last 12 s ago (5 %)."
    for width in range(12, len(text) + 1):
        lines = thing.display.wrap(text, width)
        assert " ".join(lines) == text
        assert not any(line.endswith(("1.2", "2.0", "12", "5")) for line in lines), lines
    # Too narrow for both, they part at the space, as other words do: never a unit broken
    # in two, a line begun or ended with a space, or one of a space alone.
    assert thing.display.wrap("a 2.0 GiB cap", 5) == ["a 2.0", "GiB", "cap"]
    assert thing.display.wrap("a 2.0 GiB cap", 3) == ["a", "2.0", "GiB", "cap"]
    assert thing.display.wrap("1 B", 1) == ["1", "B"]


def test_wrapping_narrower_than_its_indent_keeps_going() -> None:
    """A width below the indent, or below a wide character, still gives every character
    once, a line at least for each, and no line of indent alone (it raised IndexError)."""
    wrap = thing.display.wrap
    assert wrap("x", 3, "    ") == ["    x"]
    assert wrap("abc de", 2, "    ") == ["    a", "    b", "    c", "    d", "    e"]
    assert wrap("日本語", 1) == ["日", "本", "語"]
    assert wrap("", 10, "  ", "> ") == ["> "]


def test_reports_load_no_rendering_library() -> None:
    out = run_script("""
        import sys, thing
        thing.serve(port=0)
        thing.summary()
        thing.help()
        print("rich" in sys.modules)
    """)
    assert out.split()[-1] == "False"


def keep(store: HistoryStore, name: str, value: np.ndarray, sender: Sender) -> None:
    """Store ``value`` as if it had arrived from ``sender``."""
    store.reserve(value.nbytes)
    store.fill(value.nbytes)
    store.add(name, value, (LeafSpec("numpy", str(value.dtype), value.shape),), value.nbytes,
              sender)


LONG_NAMES = ("model.transformer.h.0.attn.c_attn.weight", "model.transformer.h.11.mlp.c_proj.b")


def shown_as(token: str, name: str) -> bool:
    """Whether ``token`` is ``name``, or ``name`` shortened in its middle with an ellipsis."""
    head, ellipsis, tail = token.partition("…")
    return token == name or bool(ellipsis and name.startswith(head) and name.endswith(tail)
                                 and len(head) >= 6 and len(tail) >= 6)


@pytest.mark.parametrize("width", [60, 80, 200])
def test_summary_fits_the_width_a_name_per_line_a_row_per_rank(
        default: thing.Server, width: int, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", str(width))  # as a terminal of that width, or piped (80)
    for name in LONG_NAMES:
        for rank in (0, 1):
            keep(default.store, name, np.full(768, rank, np.float32),
                 Sender("10.0.0.7:5000", "gpu-node-17.cluster.example.org", 4242 + rank, rank, 2))
    thing.summary()
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    lines = out.splitlines()
    assert all(len(line) <= width for line in lines), out
    for name in LONG_NAMES:
        rows = [line.split() for line in lines if line.split() and shown_as(line.split()[0], name)]
        assert [row[1] for row in rows] == ["0/2", "1/2"], out  # one row per rank, by rank
        assert all("(768,)" in row and "float32" in row for row in rows), out
        if width == 200:
            assert all(row[0] == name for row in rows)
            assert "gpu-node-17.cluster.example.org:4243" in out


@pytest.mark.parametrize("width", [40, 80])
def test_wide_characters_take_two_columns_and_the_columns_stay_aligned(
        default: thing.Server, width: int, monkeypatch, capsys) -> None:
    wcwidth = pytest.importorskip("wcwidth")  # another's measure of a terminal's columns
    monkeypatch.setenv("COLUMNS", str(width))
    names = ["训练损失", "模型.编码器.第三层.注意力.权重矩阵", "café\u0301.poids", "loss"]
    for name in names:
        keep(default.store, name, np.zeros(3, np.float32), Sender("10.0.0.7:5000", "node", 7))
    thing.summary()
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if "(3,)" in line]
    assert len(rows) == 4 and all(wcwidth.wcswidth(line) <= width for line in lines), lines
    # Every row's shape starts in the same terminal column as the header's.
    header = next(line for line in lines if line.startswith("name"))
    column = wcwidth.wcswidth(header[:header.index("shape")])
    assert {wcwidth.wcswidth(row[:row.index("(3,)")]) for row in rows} == {column}, lines


@pytest.mark.parametrize("width", [60, 80])
def test_summary_fits_the_width_with_every_column_it_can_have(
        default: thing.Server, width: int, monkeypatch, capsys) -> None:
    """Two runs, ranks of a big job, a 5-d weight and a scalar: the shape and the dtype give
    way too (a shape keeps both its ends), then the count of versions and the value go."""
    monkeypatch.setenv("COLUMNS", str(width))
    for run in ("first-run", "second-run"):
        sender = Sender("10.0.0.7:5000", "node", 4242, 10, 128, run)
        keep(default.store, "encoder.conv3d_1.weight", np.zeros((64, 64, 3, 3, 3), np.float16),
             sender)
        default.store.add("loss", 0.25, (), 0, sender)
    thing.summary()
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= width for line in lines), "\n".join(lines)
    assert any("10/128" in line and "(64" in line and "3)" in line for line in lines)


def test_summary_shows_max_items_of_the_on_demand_names_and_the_notices_too(
        default: thing.Server, capsys) -> None:
    # A job (or a peer) with hundreds of them would bury the names under them at every call.
    sender = Sender("10.0.0.7:5000", "node", 4242)
    for i in range(12):
        default.store.note_available(Announcement(f"asked{i}", "torch.Tensor", (3,), "float32",
                                                  None, sender, time.time()))
        default.store.note_unsent(UnsentNotice(f"failed{i}", "Widget", "unsupported type",
                                               None, sender, time.time()))
    thing.summary(max_items=5)
    out = capsys.readouterr().out
    for kind, what in (("asked", "names"), ("failed", "notices")):
        assert [i for i in range(12) if f"{kind}{i} " in out] == [7, 8, 9, 10, 11], out
        assert f"7 more {what} (summary(max_items=None) shows all)" in out
    thing.summary(max_items=None)
    out = capsys.readouterr().out
    assert "more" not in out
    assert all(f"asked{i} " in out and f"failed{i} " in out for i in range(12))


def test_a_name_never_sent_is_found_by_its_identifier_too(default: thing.Server,
                                                          capsys) -> None:
    """The identifier works wherever a name does: for a name only a notice tells of too
    (it was said "no capture named 'model_bad_thing'; did you mean 'model.good.thing'")."""
    sender = Sender("10.0.0.7:5000", "node", 4242)
    default.store.add("model.good.thing", 1.0, (), 0, sender)
    default.store.note_unsent(UnsentNotice("model.bad.thing", "Widget", "unsupported type",
                                           None, sender, time.time()))
    thing.describe("model_bad_thing")
    assert "unsupported type" in capsys.readouterr().out
    with pytest.raises(KeyError, match="nothing named 'model.bad.thing' arrived: its sender "
                                       "could not send it"):
        thing.get("model_bad_thing")
    # A name that is itself what another's identifier would be is found as itself first.
    default.store.note_unsent(UnsentNotice("model_bad_thing", "Gadget", "its own reason",
                                           None, sender, time.time() - 1))
    default.store.note_unsent(UnsentNotice("model.bad.thing", "Widget", "unsupported type",
                                           None, sender, time.time()))
    assert [n.name for n in default.store.unsent("model_bad_thing")] == ["model_bad_thing"]
    with pytest.raises(KeyError, match="'model_bad_thing' arrived: .*its own reason"):
        thing.get("model_bad_thing")


def test_capture_and_reports_show_as_html_in_notebooks(default: thing.Server) -> None:
    keep(default.store, "<script>alert(1)</script>", np.zeros(2, np.float32), Sender("x:1"))
    capture = default.store.get("<script>alert(1)</script>")
    page = capture._repr_html_()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>" not in page
    report = thing.reports.summary(default.store, default.info())
    assert "<table" in report._repr_html_() and "<script>" not in report._repr_html_()
    assert "&lt;script&gt;" in report._repr_html_()



def test_a_sparse_tensor_arrives_sparse_and_is_reported(default: thing.Server, capsys) -> None:
    torch = pytest.importorskip("torch")
    send(default.port, """
        import torch
        dense = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])
        assert thing.catch(dense.to_sparse(), name="coo").wait(10)
        assert thing.catch(dense.to_sparse_csr(), name="csr").wait(10)
    """)
    dense = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])
    coo, csr = thing.get("coo"), thing.get("csr")
    assert coo.layout == torch.sparse_coo and csr.layout == torch.sparse_csr
    assert torch.equal(coo.to_dense(), dense) and torch.equal(csr.to_dense(), dense)
    thing.summary()
    thing.describe("csr")
    out = capsys.readouterr().out
    assert "torch sparse_coo" in out and "torch sparse_csr" in out and "(2, 3)" in out


def test_serve_and_close_from_several_threads_at_once_start_and_stop_one_server(
        no_default: None) -> None:
    """Threads calling serve() together get one server (each had started its own, or
    been told the port was in use by it); threads closing it together close it once."""
    import threading

    started: list[thing.Server] = []
    failed: list[BaseException] = []
    together = threading.Barrier(4)

    def call(action: Callable[[], Any]) -> None:
        together.wait(10)
        try:
            result = action()
        except BaseException as exc:  # noqa: BLE001 (collected for the assert)
            failed.append(exc)
        else:
            if result is not None:
                started.append(result)

    for action in (lambda: thing.serve(port=0), lambda: thing.repl._server.close()):
        threads = [threading.Thread(target=call, args=(action,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not failed, failed
    assert len(started) == 4 and len({id(server) for server in started}) == 1
    assert not started[0].running


def test_summary_shows_a_few_rows_of_a_name_sent_by_many_runs_and_ranks() -> None:
    """A sweep of 120 runs, or a job of 64 ranks, made summary() a row per run and rank of
    every name it shows (365 lines): at most max_items rows a name, the newest run's
    lowest ranks first, and a note of how many more."""
    from thing.reports import summary

    store = HistoryStore()
    for run in range(120):
        store.add("loss", float(run), (), 0, Sender("h:1", "h", run, None, None, f"trial{run}"))
    for rank in range(64):
        store.add("act", float(rank), (), 0, Sender("h:1", "h", 1000 + rank, rank, 64, "job"))
    rows = store.overview(5).names
    assert [(c.name, c.sender.run, c.rank) for c, _ in rows] == [
        ("act", "job", rank) for rank in range(5)] + [
        ("loss", f"trial{run}", None) for run in (119, 118, 117, 116, 115)]
    assert store.overview(5).hidden_rows == 59 + 115
    assert len(store.overview(None).names) == 184
    text = str(summary(store, None, 5))
    assert "174 more rows of runs and ranks (summary(max_items=None) shows all)" in text


def test_ctrl_c_while_the_repl_imports_a_framework_leaves_the_import_whole(tmp_path) -> None:
    """thing.status()'s first frame may build the first torch value, and so import torch,
    where Ctrl+C is invited: stopped halfway, torch's import left it broken for the
    session ("Only a single TORCH_LIBRARY can be used..."). The import runs on a thread of
    its own: Ctrl+C ends the wait, and the module is imported once, whole."""
    (tmp_path / "side_effects.py").write_text("imported = 0\n")
    (tmp_path / "slow_framework.py").write_text(
        "import time, side_effects\nside_effects.imported += 1\ntime.sleep(1.0)\n"
        "WHOLE = True\n")
    out = run_script(f"""
        import signal, sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        from thing import arrays

        def ctrl_c(*_):
            raise KeyboardInterrupt

        signal.signal(signal.SIGALRM, ctrl_c)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            arrays._optional("slow_framework")
        except KeyboardInterrupt:
            print("interrupted")
        module = arrays._optional("slow_framework")
        import side_effects
        print(module.WHOLE, side_effects.imported)
    """)
    assert out.split() == ["interrupted", "True", "1"]


def test_describe_of_one_rank_counts_that_ranks_versions() -> None:
    """describe(name, rank=0, index=3) said "15 kept; this is get('loss', index=9)": every
    rank's count, and an index among them all. It now counts that rank's."""
    from thing.reports import describe

    store = HistoryStore()
    for step in range(5):
        for rank in range(3):
            store.add("loss", float(step), (), 0, Sender("h:1", "h", 10 + rank, rank, 3, "job"),
                      step=step)
    assert "5 kept from rank 0; this is get('loss', index=3, rank=0)" in str(
        describe(store, "loss", 3, rank=0))
    assert "5 kept from rank 2; this is the newest from rank 2" in str(
        describe(store, "loss", rank=2))
    assert "15 kept; this is the newest" in str(describe(store, "loss"))
