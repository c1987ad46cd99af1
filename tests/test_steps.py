"""The step axis: every capture carries the call number of its name, or the step it was given.

Real client processes send to a server in this process; ``get(name, step=)``
finds a capture by step, ``describe`` shows it, a recording keeps it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import thing
from thing.errors import UnknownName
from thing.store import HistoryStore

from .conftest import run_script


def test_throttled_calls_are_counted_and_steps_given_are_kept(server: thing.Server) -> None:
    run_script("""
        import numpy as np, thing
        handles = []
        for i in range(1000):
            handles.append(thing.catch(np.float32(i), name="loss", every=50))
            handles.append(thing.catch(float(i), name="lr", step=10_000 + 2 * i, first=3))
        handles.append(thing.catch(1.0, name="big step", step=np.int64(2**62)))
        sent = [h for h in handles if not (h.error or "").startswith("skipped")]
        assert len(sent) == 24 and all(h.wait(30) for h in sent)
        assert thing.catch(1.0, name="bad step", step=2**63).error.startswith("not sent")
        assert thing.catch(1.0, name="bad step", step=1.5).error.startswith("not sent")
    """, server.port)
    losses = server.store.get_all("loss")
    assert [c.step for c in losses] == list(range(1, 1001, 50))
    assert [float(c.value) for c in losses] == [float(i) for i in range(0, 1000, 50)]
    assert all(c.call == c.step and c.given_step is None for c in losses)
    rates = server.store.get_all("lr")
    assert [(c.call, c.step) for c in rates] == [(1, 10_000), (2, 10_002), (3, 10_004)]
    assert server.get("loss", step=51) == 50.0
    assert server.get("lr", step=10_002) == 1.0
    assert server.store.get("big step").step == 2**62
    with pytest.raises(UnknownName, match="at step 52.*1 to 951.*nearest 1, 51, 101"):
        server.get("loss", step=52)
    assert "bad step" not in server.store.names()


def test_describe_shows_the_step_and_a_recording_keeps_it(server: thing.Server,
                                                           tmp_path: Path) -> None:
    run_script("""
        import thing
        assert thing.catch(3.5, name="acc", step=700).wait(30)
        assert thing.catch(4.5, name="acc").wait(30)
    """, server.port)
    server.save(tmp_path / "saved")
    out = run_script(f"""
        import thing
        thing.load({str(tmp_path / "saved")!r})
        thing.describe("acc", step=700)
        thing.describe("acc")
        print(thing.get("acc", step=700), thing.get("acc", step=2))
    """)
    assert "700 (given; call 1 of its name)" in out
    assert "2 (the call number of its name)" in out
    assert out.strip().endswith("3.5 4.5")
    loaded = HistoryStore()
    loaded.load(tmp_path / "saved")
    assert [(c.call, c.given_step, c.step) for c in loaded.get_all("acc")] == [
        (1, 700, 700), (2, None, 2)]


def test_the_least_recently_caught_name_is_forgotten_first(server: thing.Server) -> None:
    run_script("""
        import thing
        for i in range(5):
            assert thing.catch(float(i), name="loss").wait(10)
            assert thing.catch(float(i), name=f"once {i}").wait(10)  # a new name every step
    """, server.port, THING_MAX_NAMES="2")
    assert [c.step for c in server.store.get_all("loss")] == [1, 2, 3, 4, 5]
