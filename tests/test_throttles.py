"""``every=``/``first=``, and the compiled gate that answers the calls they skip.

A throttled call is answered by ``thing/_core/_throttles.pyx`` before any
Python runs; the pure-Python twin has no gate and answers every call in
``Client.catch``. Each test runs a real job process on each core: call for
call, both must give the answers written out here, and the server must store
the same call numbers.
"""

from __future__ import annotations

import gc
import inspect
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import thing
import thing.channel

from .conftest import run_script, script_env

JOB = r"""
import json, os, sys
import numpy as np
import thing
from thing.handles import SKIPPED

def marks(handles):
    return "".join("S" if handle is SKIPPED else "x" for handle in handles)

out = {}
out["named, every=3"] = marks([thing.catch(1.0, name="n", every=3) for _ in range(10)])
out["traced, every=3"] = marks([thing.catch(v, every=3) for v in range(10)])

def step(loss):  # a new frame at every call, as a training step's
    return thing.catch(loss, every=2, step=7)

out["traced in a function"] = marks([step(float(v)) for v in range(7)])
w, both = 0.0, []
for _ in range(4):  # two lines, one name: one count
    both.append(thing.catch(w, every=2))
    both.append(thing.catch(w, every=2))
out["two sites, one name"] = marks(both)
out["first=2"] = marks([thing.catch(1.0, name="f", first=2) for _ in range(5)])
out["every=2, first=2"] = marks([thing.catch(1.0, name="ef", every=2, first=2)
                                 for _ in range(7)])
out["numpy every"] = marks([thing.catch(1.0, name="np", every=np.int64(3)) for _ in range(7)])
out["float every"] = marks([thing.catch(1.0, name="fl", every=2.0) for _ in range(4)])
out["huge every"] = marks([thing.catch(1.0, name="huge", every=10**30) for _ in range(4)])
out["every=0"] = marks([thing.catch(1.0, name="zero", every=0) for _ in range(3)])
out["on_demand=False"] = marks([thing.catch(1.0, name="od", every=2, on_demand=False)
                                for _ in range(4)])
probe = np.zeros(3)
out["on demand, not asked for"] = marks([thing.catch(probe, on_demand=True)
                                         for _ in range(3)])

# A client of its own counts on its own, and forgets beyond THING_MAX_NAMES: a traced
# name it forgot counts from 1 again, though its call site was answered by the gate.
os.environ["THING_MAX_NAMES"] = "8"
client = thing.Client("127.0.0.1", 1)
out["a client's own counts"] = marks([client.catch(1.0, name="n", every=3) for _ in range(4)])

def wrapper(v):  # a job's own helper, which names what its caller passes it
    return client.catch(v, every=2, _depth=2)

out["through a wrapper"] = marks([wrapper(float(v)) for v in range(5)])

def forgetful(v):
    return client.catch(v, every=3)

seq = [forgetful(0), forgetful(1)]
for i in range(20):
    client.catch(0, name=f"other {i}")
seq += [forgetful(2), forgetful(3)]
out["forgotten, then back"] = marks(seq)
client.close()

# A forked child (a DataLoader worker) counts on from its parent's counts.
before = marks([thing.catch(1.0, name="fk", every=3) for _ in range(2)])
read_end, write_end = os.pipe()
child = os.fork()
if child == 0:
    after = marks([thing.catch(1.0, name="fk", every=3) for _ in range(2)])
    thing._default_client.flush(30)
    os.write(write_end, after.encode())
    os._exit(0)
os.close(write_end)
os.waitpid(child, 0)
out["a forked child counts on"] = before + "|" + os.read(read_end, 100).decode()

# Whether throttled calls, from sites seen before, run any Python at all.
def throttled():
    thing.catch(1.0, name="n", every=1000)
    thing.catch(w, every=1000)
    thing.catch(probe, on_demand=True)

throttled()
python_calls = []
sys.setprofile(lambda frame, event, arg: python_calls.append(1) if event == "call" else None)
for _ in range(100):
    throttled()
sys.setprofile(None)
out["python calls"] = len(python_calls)
assert thing._default_client.flush(30)
out["announced"] = sorted(thing._default_client._announced)
print(json.dumps(out))
"""

EXPECTED = {
    "named, every=3": "xSSxSSxSSx",
    "traced, every=3": "xSSxSSxSSx",
    "traced in a function": "xSxSxSx",
    "two sites, one name": "xSxSxSxS",
    "first=2": "xxSSS",
    "every=2, first=2": "xSxSSSS",
    "numpy every": "xSSxSSx",
    "float every": "xSxS",
    "huge every": "xSSS",
    "every=0": "xxx",
    "on_demand=False": "xSxS",
    "on demand, not asked for": "SSS",
    "a client's own counts": "xSSx",
    "through a wrapper": "xSxSx",
    "forgotten, then back": "xSxS",
    "a forked child counts on": "xS|Sx",
}


@pytest.mark.parametrize("pure_python", ["0", "1"], ids=["compiled", "python"])
def test_both_cores_skip_and_number_the_same_calls(server: thing.Server, pure_python: str,
                                                   tmp_path: Path) -> None:
    job = tmp_path / "job.py"  # a file, so that names are traced from its source
    job.write_text(JOB)
    result = subprocess.run([sys.executable, str(job)], capture_output=True, text=True,
                            timeout=60, env=script_env(server.port, THING_PUREPYTHON=pure_python))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    python_calls = out.pop("python calls")
    announced = out.pop("announced")
    assert out == EXPECTED
    if pure_python == "0":  # the gate answered all 300 calls; without it, each runs Python
        assert python_calls == 100  # throttled() itself
    else:
        assert python_calls >= 400

    def calls(name: str) -> list[int]:
        return [capture.call for capture in server.store.get_all(name)]

    assert calls("n") == [1, 4, 7, 10]
    assert calls("loss") == [1, 3, 5, 7]
    assert [c.step for c in server.store.get_all("loss")] == [7] * 4
    assert calls("w") == [1, 3, 5, 7]
    assert calls("ef") == [1, 3]
    assert sorted(calls("fk")) == [1, 4]  # the parent's first call, the child's second
    # On demand, never asked for: told of (throttled()'s is another function's), never sent
    # (the server listed them while the job was connected: tests/test_control.py).
    assert announced == ["probe", "probe_1"]
    assert not {"probe", "probe_1"} & set(server.store.names())


def parameters(function: Any, follow_wrapped: bool = True) -> list[tuple[str, Any, Any]]:
    signature = inspect.signature(function, follow_wrapped=follow_wrapped)
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()
            if p.name != "_depth"]  # Client.catch's, for thing.catch's own call through it


@pytest.mark.skipif(thing.BACKEND != "compiled", reason="the twin has no gate")
def test_the_gate_takes_what_catch_takes_and_shows_its_help() -> None:
    """The gate's own parameters (what a call is checked against) are catch's, and help()
    and inspect show catch's docstring and signature."""
    client = thing.Client("127.0.0.1", 1)
    try:
        for gate, behind in ((thing.catch, thing.catch.__wrapped__),
                             (client.catch, client.catch.__wrapped__)):
            assert parameters(gate, follow_wrapped=False) == parameters(behind)
            assert parameters(gate) == parameters(behind)
            assert gate.__doc__ == behind.__doc__ and gate.__name__ == "catch"
            with pytest.raises(TypeError, match=r"^catch\(\)"):  # a wrong call names catch
                gate()
        assert thing.catch.__doc__.startswith("Send ``obj`` to the thing server")
    finally:
        client.close()


def test_a_subclass_catch_sees_every_call() -> None:
    """The gate stands only in front of Client.catch itself: a subclass's own catch may
    count calls, or treat every= otherwise, and gets every call."""

    class SendsEverything(thing.Client):
        seen = 0

        def catch(self, obj: Any, name: Any = None, server: Any = None, every: int = 1,
                  first: Any = None, **options: Any) -> Any:
            SendsEverything.seen += 1
            return super().catch(obj, name, server, 1, first, _depth=2, **options)

    client = SendsEverything("127.0.0.1", 1)
    try:
        handles = [client.catch(1.0, name="n", every=3) for _ in range(6)]
        assert SendsEverything.seen == 6
        assert not any(handle is thing.client.SKIPPED for handle in handles)
    finally:
        client.close()


class Cell:
    """One line of code, ``client.catch(v, every=3)``, run again and again as a module of
    any name: one call site whose traced name depends on the module (its source is
    unknown, so the names are ``<module>:1``, ``<module>:1_1``, ...)."""

    def __init__(self, client: thing.Client):
        self.client = client
        self.code = compile("handle = client.catch(v, every=3)", "<cell>", "exec")

    def run(self, module: str) -> str:
        # A list: not of the kind the compiled gate queues itself (its Catcher), so every
        # sent call runs Client.catch, and its tracing, which these tests steer.
        scope = {"client": self.client, "v": [0.0], "__name__": module}
        exec(self.code, scope)
        return "S" if scope["handle"] is thing.client.SKIPPED else "x"


def test_a_site_the_name_tracer_forgets_is_forgotten_by_the_gate(monkeypatch) -> None:
    """Traced again, a call site may get another name (here: the same code run as another
    module): the gate must not answer from the old name's counts."""
    monkeypatch.setenv("THING_MAX_NAMES", "2")
    client = thing.Client("127.0.0.1", 1)
    run = Cell(client).run
    try:
        marks = run("a") + run("a")
        client.catch(1, every=1)  # two more sites: the tracer (2 sites) forgets the first
        client.catch(1, every=1)
        marks += run("b")  # the same instruction, traced again: module b's name, call 1
        assert marks == "xSx"
    finally:
        client.close()


def test_a_site_forgotten_by_another_thread_s_tracing_is_not_remembered(monkeypatch) -> None:
    """Another thread's tracing may make the tracer forget a site between this call's
    name_for and the gate's remembering it (forced here: that thread's work runs inside
    name_for): the gate must not keep it under the name the tracer forgot."""
    monkeypatch.setenv("THING_MAX_NAMES", "2")
    client = thing.Client("127.0.0.1", 1)
    run = Cell(client).run
    name_for = client._names.name_for
    other_thread = []

    def name_for_then_another_thread(frame: Any) -> Any:
        named = name_for(frame)
        while other_thread:
            thread = threading.Thread(target=other_thread.pop())
            thread.start()
            thread.join(10)
        return named

    def two_more_sites() -> None:
        client.catch(1, every=1)
        client.catch(1, every=1)

    monkeypatch.setattr(client._names, "name_for", name_for_then_another_thread)
    try:
        marks = run("a") + run("a") + run("a")
        other_thread.append(two_more_sites)
        marks += run("a")  # call 4 is sent: the Python path, and the other thread meanwhile
        marks += "|" + run("b") + run("b") + run("b")  # module b: a name of its own
        assert marks == "xSSx|xSS"
    finally:
        client.close()


@pytest.mark.skipif(thing.BACKEND != "compiled", reason="the twin has no gate")
def test_a_hot_site_stays_answered_while_the_tracer_forgets_others(monkeypatch) -> None:
    """The tracer forgetting a site makes the gate forget that site's code only: a hot
    throttled line keeps being answered without Python while new code is traced (a
    notebook's cells run again and again)."""
    monkeypatch.setenv("THING_MAX_NAMES", "50")
    client = thing.Client("127.0.0.1", 1)
    w = 0.0

    def hot() -> Any:
        return client.catch(w, every=10**9)

    through_python: list[int] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if (event == "call" and frame.f_code is thing.Client.catch.__code__
                and frame.f_back.f_code is hot.__code__):
            through_python.append(1)

    cells = []  # kept alive, as a notebook keeps its cells' code
    try:
        hot()
        sys.setprofile(profile)
        try:
            for i in range(200):
                cells.append(compile("client.catch(v)", f"<cell {i}>", "exec"))
                exec(cells[-1], {"client": client, "v": 1.0})
                hot()
        finally:
            sys.setprofile(None)
        # Its own site is forgotten once per 50 new sites (the tracer's oldest goes first).
        assert len(through_python) <= 200 // 50 + 1, len(through_python)
    finally:
        client.close()


def test_an_on_demand_name_forgotten_during_the_gate_s_lookup_goes_to_catch() -> None:
    """The set of told names may run Python while the gate looks a name up (a name's
    __eq__): if that forgets the throttle the gate holds, catch decides, not the gate."""
    throttles = thing._core.Throttles(max_names=4)
    throttles.announced = set()
    through_python: list[Any] = []

    def catch(obj: Any, name: Any = None, *args: Any, **options: Any) -> str:
        through_python.append(name)
        return "python"

    gate = thing._core.gated(catch, throttles, thing.client.SKIPPED)

    class Collides:
        armed = False

        def __hash__(self) -> int:
            return hash("od")

        def __eq__(self, other: object) -> bool:
            if Collides.armed:
                Collides.armed = False
                for i in range(10):  # "od" is the least recently caught: forgotten
                    throttles.of(f"other {i}")
            return False

    throttles.of("od")
    throttles.announced.update((Collides(), "od"))
    assert gate(1.0, name="od", on_demand=True) is thing.client.SKIPPED
    Collides.armed = True
    answer = gate(1.0, name="od", on_demand=True)
    if Collides.armed:  # the set found "od" before it compared with Collides
        pytest.skip("this set's order did not run __eq__ during the lookup")
    assert answer == "python" and through_python == ["od"]


# -- the sent calls the compiled gate queues itself (Catcher, in _core/_gate.pyx) -------

# Values of the common kind: the gate snapshots and queues them without running
# Client.catch. Arrays up to HOLD_FIRST_BYTES (4 KiB), their bytes in order in memory.
def _common_values() -> list[Any]:
    import torch

    storage = torch.arange(10, dtype=torch.float64)
    loss = (torch.ones(3, requires_grad=True) * 2).sum()
    return [0.25, -0.0, float("inf"), 7, 2**70, True, None,
            np.arange(4, dtype=np.float32), np.ones((2, 3), np.float16),
            np.array([True, False]), np.array([1 + 2j], np.complex64), np.array(5),
            np.zeros((0, 3)), np.arange(4096, dtype=np.uint8),
            torch.zeros(3), torch.nn.Parameter(torch.ones(2, 2)), storage[3:6],
            torch.arange(4, dtype=torch.bfloat16), torch.tensor([-1, 2], dtype=torch.int8),
            loss, torch.zeros(0, 2)]


# And of every other kind, left to Client.catch: a NaN (its bits travel), a numpy scalar,
# arrays swapped, strided, or over 4 KiB, tensors strided or conjugate, containers, text.
def _other_values() -> list[Any]:
    import torch

    return [float("nan"), np.float32(1.5), np.arange(3, dtype=">f4"),
            np.asfortranarray(np.ones((2, 3))), np.arange(4097, dtype=np.uint8),
            torch.ones(2, 3).t(), torch.tensor([1 + 1j]).conj(), [1.0], "text"]


def _bits(value: Any) -> Any:
    """An array's dtype, shape and bytes, whatever its framework; anything else itself."""
    if isinstance(value, np.ndarray):
        return value.dtype, value.shape, value.tobytes()
    if hasattr(value, "untyped_storage"):  # torch, bfloat16 too
        return value.dtype, value.shape, value.reshape(-1).view(torch.uint8).numpy().tobytes()
    return repr(value)


def _bits(value: Any) -> Any:
    """An array's bytes, whatever its framework (bfloat16 too); anything else's repr."""
    if isinstance(value, np.ndarray):  # in C order and the wire's byte order
        return value.astype(value.dtype.newbyteorder("<")).tobytes()
    if isinstance(value, torch.Tensor):  # its value's bytes: a conjugate view's resolved
        return value.detach().resolve_conj().reshape(-1).view(torch.uint8).numpy().tobytes()
    return repr(value)


def _same_capture(fast: Any, slow: Any) -> None:
    """Two captures of one value say the same, bit for bit, but for their call numbers."""
    assert type(fast.value) is type(slow.value) and _bits(fast.value) == _bits(slow.value)
    assert (fast.leaves, fast.nbytes, fast.given_step, fast.consistent, fast.call_site,
            fast.sender.rank) == (slow.leaves, slow.nbytes, slow.given_step, slow.consistent,
                                  slow.call_site, slow.sender.rank)


def _count_python_queueing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the captures Client.catch queues (the gate queues its own directly)."""
    queued: list[str] = []
    enqueue = thing.channel.Channel.enqueue

    def counted(channel: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        queued.append(name)
        return enqueue(channel, name, *args, **kwargs)

    monkeypatch.setattr(thing.channel.Channel, "enqueue", counted)
    return queued


@pytest.mark.skipif(thing.BACKEND != "compiled", reason="the twin has no gate")
def test_the_gate_queues_a_common_sent_call_as_catch_would(server: thing.Server,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The second call of a name from a call site (the first is Client.catch's, which
    learns both) is queued by the gate when its value is of the common kind, and by
    Client.catch otherwise; either way the server stores the same capture."""
    queued = _count_python_queueing(monkeypatch)
    client = thing.Client("127.0.0.1", server.port)
    common, other = _common_values(), _other_values()

    def traced(value: Any) -> Any:
        return client.catch(value, step=9)

    try:
        assert client.catch(0, name="connected").wait(30)
        handles = [client.catch(value, name=f"v{i}", step=i)
                   for i, value in enumerate(common + other) for _ in range(2)]
        handles += [traced(value) for value in common + other]
        assert all(handle.wait(30) for handle in handles), [h.error for h in handles]
    finally:
        client.close()
    python_once = [f"v{i}" for i in range(len(common))]
    python_twice = [f"v{i}" for i in range(len(common), len(common + other)) for _ in "12"]
    assert queued == ["connected", *python_once, *python_twice, "value",
                      *["value"] * len(other)]
    for i, sent in enumerate(common + other):
        first, second = server.store.get_all(f"v{i}")
        assert (first.call, second.call) == (1, 2)
        _same_capture(second, first)
        assert _bits(first.value) == _bits(sent) or isinstance(sent, float), i  # NaN: below
    by_trace = server.store.get_all("value")
    assert [_bits(capture.value) for capture in by_trace] == [
        _bits(first.value) for first in
        (server.store.get_all(f"v{i}")[0] for i in range(len(common + other)))]
    assert [capture.call for capture in by_trace] == list(range(1, len(by_trace) + 1))


@pytest.mark.skipif(thing.BACKEND != "compiled", reason="the twin has no gate")
def test_a_call_the_gate_queues_that_fails_is_counted_and_told_as_catch_does(
        server: thing.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """What fails once the call is counted (here: reading the rank) fails the capture with
    its reason, counted under "failed", as in Client.catch; nothing is raised."""
    queued = _count_python_queueing(monkeypatch)
    client = thing.Client("127.0.0.1", server.port)
    try:
        value = np.arange(3.0)
        assert client.catch(value, name="r").wait(30)

        def broken() -> Any:
            raise RuntimeError("no rank today")

        monkeypatch.setattr(client._rank, "read", broken)
        by_gate = client.catch(value, name="r")
        by_catch = thing.Client.catch(client, value, name="r")
        assert queued == ["r"]  # the first call; the gate's own did not go through enqueue
        for handle in (by_gate, by_catch):
            assert not handle.wait(0)
            assert handle.error == "not sent: RuntimeError: no rank today"
        assert client.undelivered["failed"] == 2
        assert [capture.call for capture in server.store.get_all("r")] == [1]
    finally:
        client.close()


@pytest.mark.skipif(thing.BACKEND != "compiled", reason="the twin has no gate")
@pytest.mark.parametrize("block", [True, False])
def test_the_gate_takes_and_gives_back_room_as_catch_does(server: thing.Server,
                                                           block: bool) -> None:
    """In a queue of four, the gate queues where there is room and leaves the rest to
    Client.catch (which waits for room, or drops and counts): every capture is stored in
    order or counted as dropped, and the room is all given back."""
    client = thing.Client("127.0.0.1", server.port, max_queue_items=4)
    try:
        handles = [client.catch(np.full(4, i, np.float32), name="r", block=block)
                   for i in range(2000)]
        assert client.flush(60)
        stored = [i for i, handle in enumerate(handles) if handle.wait(30)]
        dropped = client.undelivered.get("queue full", 0)
        room = client._queue
        assert (room.items, room.bytes) == (0, 0)
    finally:
        client.close()
    assert len(stored) + dropped == 2000 and (dropped == 0 if block else dropped > 0)
    assert [value.tobytes() for value in server.get_all("r")] == [
        np.full(4, i, np.float32).tobytes() for i in stored]


@pytest.mark.skipif(thing.BACKEND != "compiled", reason="the twin has no gate")
def test_a_finalizer_s_catch_inside_the_gate_s_is_refused_as_inside_catch(
        server: thing.Server) -> None:
    """The collector may run while the gate snapshots and queues a capture: a finalizer's
    catch then is refused (REENTERED), as it is inside Client.catch, never sent."""
    client = thing.Client("127.0.0.1", server.port)
    inside = [False]
    seen: list[tuple[bool, Any]] = []

    class Garbage:
        def __init__(self) -> None:
            self.me = self  # a cycle: freed by the collector, at any allocation

        def __del__(self) -> None:
            seen.append((inside[0], client.catch(1.0, name="finalizer")))

    value = torch.arange(3.0)
    for _ in range(2):  # the first call is Client.catch's (which a collection may precede)
        client.catch(value, name="loop")
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        for _ in range(2000):
            Garbage()
            inside[0] = True
            client.catch(value, name="loop")
            inside[0] = False
    finally:
        gc.set_threshold(*thresholds)
        client.close()
    during = [handle for was_inside, handle in seen if was_inside]
    assert during, "no finalizer ran inside a catch: the test proved nothing"
    assert all(handle is thing.handles.REENTERED for handle in during), len(during)


def test_thing_catch_calls_a_catch_patched_onto_the_class(server: thing.Server) -> None:
    """thing.catch calls Client.catch as the class has it at each call: a patch made once
    the gate knows the call site (a mock in a test) sees every call after it."""
    run_script(
        """
        import numpy as np, thing
        from thing.client import SKIPPED

        def step():
            return thing.catch(np.arange(3.0), name="loss")

        assert step().wait(30) and step().wait(30)
        seen = []
        thing.Client.catch = lambda self, obj, name=None, *a, **k: (seen.append(name), SKIPPED)[1]
        assert [step() for _ in range(3)] == [SKIPPED] * 3 and seen == ["loss"] * 3, seen
        """,
        server.port,
    )
    assert len(server.get_all("loss")) == 2


def test_a_header_limit_below_a_scalar_refuses_scalars_at_every_call(
        server: thing.Server) -> None:
    """THING_MAX_HEADER_BYTES=1 leaves no room for a value outside an array: the client is
    made, every call of a scalar is refused with the reason, and arrays still go."""
    run_script(
        """
        import numpy as np, thing
        client = thing.Client()
        for _ in range(3):
            handle = client.catch(1.0, name="scalar")
            assert not handle.wait(30), handle
            assert "a structure of over 1 bytes" in handle.error, handle.error
        assert all(client.catch(np.arange(2.0), name="array").wait(30) for _ in range(3))
        client.close()
        """,
        server.port, THING_MAX_HEADER_BYTES="1",
    )
    assert len(server.get_all("array")) == 3
