"""What cannot be sent is said where the user looks: the handle, and the REPL.

The training job stays silent (a log line at most); the client sends the
server one small notice per name and reason, with no data, and the REPL's
summary(), describe() and get() tell the user what went missing and why.
"""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

import thing
import thing.reports
from thing.handles import SKIPPED
from thing.store import HistoryStore

from .conftest import run_script

UNSENDABLE = """
import json, thing

class Opaque:
    pass

things = {"opaque": Opaque(), "a_range": range(3), "generator": (i for i in range(2)),
          "nan_key": {float("nan"): 1.0}, "nested": {"ok": 1, "bad": [Opaque()]}}
errors = {}
for name, value in things.items():
    for _ in range(5):  # told once per name and reason
        handle = thing.catch(value, name=name)
    errors[name] = handle.error
def traced():
    obj = Opaque()
    return thing.catch(obj).error
errors["traced"] = traced()  # python -c has no source: named "traced:<line>"
assert thing.catch(1.5, name="fine").wait(10)
print(json.dumps(errors))
"""


def test_what_cannot_be_sent_is_told_to_the_repl_once_per_name_and_reason(
        server: thing.Server, monkeypatch, capsys) -> None:
    errors = json.loads(run_script(UNSENDABLE, server.port))
    for name, error in errors.items():
        assert error.startswith("not sent: ") and "thing' log" not in error, (name, error)
    assert "Opaque" in errors["opaque"] and "range" in errors["a_range"]
    assert "generator" in errors["generator"] and "Opaque" in errors["nested"]

    notices = {notice.name.partition(":")[0]: notice for notice in server.store.unsent()}
    assert set(notices) == {"opaque", "a_range", "generator", "nan_key", "nested", "traced"}
    for name, notice in notices.items():
        assert f"not sent: {notice.reason}" == errors[name]
        assert notice.call_site and notice.call_site.startswith("<string>:")
    assert notices["opaque"].type_name == "__main__.Opaque"
    assert notices["a_range"].type_name == "range"
    assert "(traced)" in notices["traced"].call_site
    assert server.get("fine") == 1.5  # the connection went on
    assert server.store.received == 1  # notices are not captures

    with pytest.raises(KeyError, match=r"nothing named 'opaque' arrived: its sender could not "
                                       r"send it \(cannot send an object of type"):
        server.get("opaque")
    monkeypatch.setenv("COLUMNS", "200")
    server.summary(max_items=None)  # all six notices
    out = capsys.readouterr().out
    assert "not sent, or refused" in out
    row = next(line for line in out.splitlines() if line.startswith("opaque "))
    assert "__main__.Opaque" in row and "cannot send an object of type" in row
    server.describe("a_range")
    out = capsys.readouterr().out
    assert "could not send 'a_range'" in out and notices["a_range"].reason in out
    assert "call site" in out and "<string>:" in out


def test_the_job_stays_quiet_and_counts_what_it_could_not_send(server: thing.Server) -> None:
    result = run_script(UNSENDABLE + "print(thing._default_client.undelivered)", server.port,
                        full=True)
    assert result.stderr == ""
    assert "'failed': 26" in result.stdout.splitlines()[-1]  # 5 names 5 times, and one
    overview = server.store.overview()
    assert overview.undelivered == {"failed": 26}
    assert len(overview.unsent) == 6


def test_describe_shows_the_call_site_of_named_captures(server: thing.Server,
                                                        capsys, monkeypatch) -> None:
    run_script("""
        import thing
        def step():
            return thing.catch(0.5, name="lr").wait(10)
        assert step()
    """, server.port)
    capture = server.store.get("lr")
    assert capture.call_site == "<string>:4 (step)"
    monkeypatch.setenv("COLUMNS", "120")
    server.describe("lr")
    assert "<string>:4 (step)" in capsys.readouterr().out


def test_a_failed_capture_is_counted_once_with_no_server_to_tell() -> None:
    out = run_script("""
        import thing
        client = thing.Client("127.0.0.1", 1)  # nothing listens on port 1
        print(client.catch(object(), name="bad").error)
        client.flush(2)
        print(client.undelivered)
    """)
    error, counts = out.strip().splitlines()
    assert error.startswith("not sent: cannot send an object of type object")
    assert counts == "{'failed': 1}"


def test_a_capture_refused_for_its_header_costs_the_captures_after_it_nothing(
        server: thing.Server) -> None:
    """A header the server refuses for what it says (a name that is no str, or too long;
    dict keys that collide) ends its own capture with the reason; the captures sent with it
    are stored, on the same connection, and nothing is counted lost."""
    out = run_script("""
        import json, numpy as np, thing
        client = thing.Client()
        colliding = {i * ((1 << 61) - 1): 0 for i in range(9)}
        handles = []
        for index, (name, value) in enumerate([("a", np.float32([0])), (7, np.zeros(2)),
                                               ("b", np.float32([1])), ("x" * 5000, 1.0),
                                               ("c", np.float32([2])), ("d", colliding),
                                               ("e", np.float32([3]))]):
            handles.append(client.catch(value, name=name))
        print(json.dumps([[handle.wait(10), handle.error] for handle in handles]))
        print(json.dumps(client.undelivered))
    """, server.port)
    outcomes, undelivered = (json.loads(line) for line in out.splitlines())
    for stored, error in outcomes[1::2]:
        assert not stored and error.startswith("refused by the server: ")
    assert "name is not a string" in outcomes[1][1] and "share one hash" in outcomes[5][1]
    assert [stored for stored, _ in outcomes[0::2]] == [True] * 4
    assert undelivered == {"refused": 3}
    assert server.store.overview().undelivered == {}  # the server counted them itself
    for index, name in enumerate("abce"):
        assert server.store.get(name).value.tobytes() == np.float32([index]).tobytes()
    assert server.info().dropped_transfers == 3
    # The REPL says why: by name where the header gave a valid one (once per name and
    # reason, as for a sender's notices: both bad names have the same reason).
    refused = {notice.name: notice for notice in server.store.unsent()}
    assert set(refused) == {None, "d"} and all(n.refused for n in refused.values())
    assert "name is not a string" in refused[None].reason
    with pytest.raises(KeyError, match=r"nothing named 'd' was kept: this server refused it "
                                       r"\(.*share one hash"):
        server.get("d")


def test_what_this_server_refuses_is_said_by_name_in_the_repl(capsys, monkeypatch) -> None:
    """A capture the server refuses on arrival (over its store's cap; an empty tensor of a
    shape numpy cannot make) is not only the sender's handle's business: summary(),
    describe() and get() say, by name, that it was refused and why. An older version of
    the name stays what get() returns."""
    with thing.Server(port=0, store=HistoryStore(max_bytes=1 << 20)) as server:
        out = run_script("""
            import json, numpy as np, torch, thing
            assert thing.catch(np.ones(4), name="big").wait(10)
            handles = {"big": thing.catch(np.zeros(2 << 20, np.uint8), name="big"),
                       "hollow": thing.catch(torch.empty(0, 1 << 62), name="hollow")}
            assert thing.catch(1.5, name="fine").wait(10)
            print(json.dumps({name: [handle.wait(10), handle.error]
                              for name, handle in handles.items()}))
        """, server.port)
        outcomes = json.loads(out)
        assert outcomes["big"][0] is False and "larger than the store" in outcomes["big"][1]
        assert outcomes["hollow"][0] is False
        assert "beyond what numpy can make" in outcomes["hollow"][1]
        notices = {notice.name: notice for notice in server.store.unsent()}
        assert set(notices) == {"big", "hollow"}
        assert all(notice.refused for notice in notices.values())
        assert notices["big"].type_name == "numpy.ndarray"
        assert notices["big"].call_site.startswith("<string>:")
        for name, (_, error) in outcomes.items():
            assert error == f"refused by the server: {notices[name].reason}"

        assert np.array_equal(server.get("big"), np.ones(4))  # the older version stays
        with pytest.raises(KeyError, match=r"nothing named 'hollow' was kept: this server "
                                           r"refused it \(empty leaf of shape"):
            server.get("hollow")
        monkeypatch.setenv("COLUMNS", "200")
        server.summary()
        out = capsys.readouterr().out
        assert "not sent, or refused" in out
        row = next(line for line in out.splitlines() if "refused by this server" in line
                   and line.startswith("big "))
        assert "numpy.ndarray" in row and "capture of 2097152 bytes is larger" in row
        server.describe("hollow")
        assert "this server refused 'hollow'" in capsys.readouterr().out
        with pytest.raises(KeyError):  # of another run: nothing to say
            server.describe("hollow", run="another")


def test_a_notice_that_finds_the_queue_full_is_not_counted_as_a_lost_capture() -> None:
    """A notice carries no data: a capture that could not travel is counted once ("failed"),
    and an on-demand name told of is no capture at all, even when the queue is full."""
    with socket.create_server(("127.0.0.1", 0)) as listener:  # never answers the handshake
        out = run_script(f"""
            import numpy as np, thing
            client = thing.Client("127.0.0.1", {listener.getsockname()[1]}, max_queue_items=2)
            for name in "ab":
                client.catch(np.zeros(4), name=name)
            print(client.catch(object(), name="bad").error)
            print(client.undelivered)
            client.catch(np.zeros(3), name="asked", on_demand=True)
            print(client.undelivered)
            client.close(0)
        """, THING_TRANSPORT="tcp")
    error, counts, after = out.splitlines()
    assert error.startswith("not sent: cannot send an object of type object")
    assert counts == after == "{'failed': 1}"


def test_first_counts_what_it_let_through_even_when_no_server_listens() -> None:
    """first=n is about the job's first calls: those it let through count though no server
    took them, and each is counted where the user looks."""
    out = run_script("""
        import thing
        client = thing.Client("127.0.0.1", 1)  # nothing listens on port 1
        handles = [client.catch(1.5, name="w", first=2) for _ in range(3)]
        print([handle.wait(10) for handle in handles], handles[2].error)
        print(client.undelivered)
    """)
    outcomes, counts = out.strip().splitlines()
    assert outcomes == f"[False, False, False] {SKIPPED.error}"
    assert counts == "{'no server': 2}"


@pytest.mark.parametrize("variable", [{"THING_SERVER": "localhost:28750x"},
                                      {"THING_SERVER": "localhost:99999"}])
def test_a_server_address_that_is_no_address_never_stops_the_job(variable: dict) -> None:
    """thing.catch never raises: a typo in THING_SERVER is said once, in the log and in
    every handle, and the job goes on."""
    result = run_script("""
        import logging, thing
        logging.basicConfig()  # where the job's log goes
        handles = [thing.catch(1.5, name="loss") for _ in range(3)]
        print(handles[-1].error)
    """, full=True, **variable)
    assert result.stdout.startswith("not sent: ") and "port" in result.stdout
    assert result.stderr.count("thing.catch cannot send anything") == 1


def test_a_number_that_is_no_finite_number_is_ignored_with_a_warning(server: thing.Server
                                                                     ) -> None:
    result = run_script("""
        import logging, thing
        logging.basicConfig()  # where the job's log goes
        print(thing.catch(1.5, name="loss").wait(10))
    """, server.port, full=True, THING_QUEUE_ITEMS="inf", THING_QUEUE_BYTES="nan")
    assert result.stdout == "True\n"
    assert "ignoring THING_QUEUE_ITEMS='inf'" in result.stderr
    assert "ignoring THING_QUEUE_BYTES='nan'" in result.stderr


def test_a_capture_that_fails_on_the_sender_thread_is_told_to_the_repl_too(
        server: thing.Server) -> None:
    """An int too long for the header's JSON fails only when the sender encodes it: its
    handle says why, and the REPL hears of it as of one that failed at the call."""
    out = run_script("""
        import numpy as np, thing
        huge = thing.catch(10 ** 5000, name="huge")
        print(huge.wait(10), huge.error)
        print(thing.catch({"w": np.float32([1.5]), "n": 10 ** 5000}, name="nested").wait(10))
        assert thing.catch(1.5, name="fine").wait(10)
    """, server.port)
    waited, error = out.splitlines()[0].split(" ", 1)
    assert waited == "False" and error.startswith("not sent: could not read the data: ")
    assert out.splitlines()[1] == "False"
    notices = {notice.name: notice for notice in server.store.unsent()}
    assert (notices["huge"].type_name, notices["nested"].type_name) == ("int", "dict")
    assert f"not sent: {notices['huge'].reason}" == error
    assert notices["huge"].call_site.startswith("<string>:")
    with pytest.raises(KeyError, match=r"nothing named 'huge' arrived: its sender could not"):
        server.get("huge")
    assert server.get("fine") == 1.5
