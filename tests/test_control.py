"""Steering from the REPL: on-demand names, requests, every/first/pause/resume/reset.

Jobs are real processes that catch when the test tells them to (one command per line on
their stdin), so what they send is known call by call. A control message and the
acknowledgements after it travel on one stream, in order: once a capture the job sent
after a setting is acknowledged, the job has applied the setting (``sync``).
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thing
import thing.repl
from thing import answers, auth, live, reports, wire
from thing.answers import read_server_message
from thing.channel import PAUSED
from thing.errors import ProtocolError
from thing.handles import SKIPPED
from thing.overrides import Overrides
from thing.sockets import connect
from thing.stream import StreamReader

from .conftest import poll, run_script, start_script

JOB = """
import os, sys, numpy as np, thing
print("ready", flush=True)
for line in sys.stdin:
    command, *args = line.split()
    if command == "catch":  # name every calls on_demand
        name, every, calls, on_demand = args[0], int(args[1]), int(args[2]), args[3] == "1"
        for _ in range(calls):
            thing.catch(np.arange(3, dtype=np.float32), name=name, every=every,
                        on_demand=on_demand)
    if command == "fork":  # name calls: a forked child catches on demand, then the parent
        name, calls = args[0], int(args[1])
        child = os.fork()
        for _ in range(calls):
            thing.catch(np.arange(3, dtype=np.float32), name=name, on_demand=True)
        if child == 0:
            thing._default_client.flush(10)
            os._exit(0)
        os.waitpid(child, 0)
    if command == "touch":  # catch once and wait for nothing (a server that never answers)
        thing.catch(0, name="touch")
        print("done", flush=True)
        continue
    if command == "settings":
        overrides = thing._default_client._overrides
        print("settings", sorted(map(str, overrides.settings())), flush=True)
        continue
    # One connection delivers in order: once this is stored, so is all before it, and
    # every control message the server sent before its ack was applied.
    assert thing.catch(0, name="sync").wait(10)
    print("done", flush=True)
"""


class Job:
    """A job process steered through its stdin."""

    def __init__(self, port: int, **env: str):
        self.process = start_script(JOB, port, stdin=True, **env)
        self._expect("ready")

    def run(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._expect("settings" if command == "settings" else "done")

    def catch(self, name: str, calls: int, every: int = 1, on_demand: bool = False) -> None:
        self.run(f"catch {name} {every} {calls} {int(on_demand)}")

    def sync(self) -> None:
        self.run("sync")

    def _expect(self, word: str) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith(word):
            self.process.kill()
            raise AssertionError(f"job said {line!r}:\n{self.process.communicate()[1]}")
        return line

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.close()


def calls_of(server: thing.Server, name: str) -> list[int]:
    try:
        return [capture.call for capture in server.store.get_all(name)]
    except KeyError:
        return []


# -- on demand, and requests ----------------------------------------------------------------


def test_an_on_demand_name_sends_nothing_until_requested(server: thing.Server,
                                                         jobs: list[Job]) -> None:
    jobs.append(job := Job(server.port))
    job.catch("attn_probs", 20, on_demand=True)
    assert calls_of(server, "attn_probs") == []
    [announced] = server.available()
    assert (announced.name, announced.shape, announced.dtype) == ("attn_probs", (3,), "float32")
    assert announced.type_name == "numpy.ndarray" and announced.sender.pid == job.process.pid
    summary = reports.summary(server.store, server.info()).text(100)
    assert "on demand" in summary and "attn_probs" in summary

    assert server.request("attn_probs", count=3) == 1
    job.sync()
    job.catch("attn_probs", 10, on_demand=True)
    assert calls_of(server, "attn_probs") == [21, 22, 23]  # exactly 3, the next ones
    assert all(capture.requested for capture in server.store.get_all("attn_probs"))
    described = reports.describe(server.store, "attn_probs").text(100)
    assert "because of a request" in described
    job.catch("attn_probs", 10, on_demand=True)
    assert calls_of(server, "attn_probs") == [21, 22, 23]  # and nothing more


@pytest.mark.parametrize("spelling", ["a\\tb", "a\tb"], ids=["as-shown", "as-caught"])
def test_a_name_the_repl_shows_escaped_is_steered_by_what_it_shows(
        server: thing.Server, spelling: str) -> None:
    """A name with a character that is not printable is kept, listed and shown escaped
    ("a\\tb"); asked for by that name, the job now sends it (it was told of a name it
    did not have, and nothing came). Asked for as the job's code spells it (a real tab),
    the request was told to the job, listed as in force, and did nothing."""
    job = start_script("""
        import sys, numpy as np, thing
        def catch_some(count):
            for _ in range(count):
                thing.catch(np.arange(3, dtype=np.float32), name="a\\tb", on_demand=True)
            assert thing.catch(0, name="sync").wait(10)
        catch_some(2)
        print("ready", flush=True)
        sys.stdin.readline()
        # Acknowledged after the request came: the job has applied it.
        assert thing.catch(0, name="sync").wait(10)
        catch_some(5)
        print("done", flush=True)
        """, server.port, stdin=True)
    try:
        assert job.stdout.readline().strip() == "ready"
        [announced] = server.available()
        assert announced.name == "a\\tb"
        assert server.request(spelling, count=2) == 1
        job.stdin.write("go\n")
        job.stdin.flush()
        assert job.stdout.readline().strip() == "done"
    finally:
        job.kill()
        job.communicate()
    assert calls_of(server, "a\\tb") == [3, 4]


@pytest.mark.parametrize("env", [{}, {"RANK": "3", "WORLD_SIZE": "8"}], ids=["alone", "rank"])
def test_what_a_job_catches_on_demand_is_listed_while_it_is_connected(
        server: thing.Server, jobs: list[Job], env: dict[str, str]) -> None:
    jobs.append(job := Job(server.port, **env))
    job.catch("attn_probs", 2, on_demand=True)
    assert [announced.name for announced in server.available()] == ["attn_probs"]
    job.run("fork attn_probs 2")  # a child tells its own connection, and ends first
    assert [announced.name for announced in server.available()] == ["attn_probs"]
    # The server learns that the child's connection closed on its own thread, a moment
    # after the child ended; from then on the parent's announcement is the one listed.
    poll(lambda: [announced.sender.pid for announced in server.available()]
         == [job.process.pid], what="the child's announcement forgotten, the parent's kept")
    job.close()  # the job ends: nobody is left to ask
    poll(lambda: not server.available(), what="the announcement forgotten")


def test_a_name_is_steered_by_its_identifier_as_it_is_read_by_it(server: thing.Server,
                                                                  jobs: list[Job]) -> None:
    """get("layer_0") finds "layer[0]", and so does every steering function: the job is told
    the name itself. An identifier nothing here has is sent as it is (a job may not have
    caught it yet); one that stands for several names is refused, as get() refuses it."""
    jobs.append(job := Job(server.port))
    job.catch("layer[0]", 2)
    job.catch("probe[1]", 5, on_demand=True)
    assert server.request("probe_1", count=2) == 1
    job.sync()
    job.catch("probe[1]", 5, on_demand=True)
    assert calls_of(server, "probe[1]") == [6, 7]
    server.pause("layer_0")
    job.sync()
    job.catch("layer[0]", 3)
    assert calls_of(server, "layer[0]") == [1, 2]
    assert "layer[0]" in job.run("settings")
    server.reset("layer_0")
    job.sync()
    job.catch("layer[0]", 1)
    assert calls_of(server, "layer[0]") == [1, 2, 6]
    server.every("not_seen_yet", 3)
    job.sync()
    assert "not_seen_yet" in job.run("settings")
    job.catch("layer(0)", 1)  # the same identifier as layer[0]
    with pytest.raises(KeyError, match="stands for several names"):
        server.pause("layer_0")


def test_a_forked_child_keeps_the_settings_but_not_the_requests(server: thing.Server,
                                                                jobs: list[Job]) -> None:
    jobs.append(job := Job(server.port))
    job.sync()
    server.request("probe", 5)
    server.every("w", 1)
    job.sync()
    job.run("fork probe 8")  # what the parent was asked for, the child does not send again
    captures = server.store.get_all("probe")
    assert [c.call for c in captures] == [1, 2, 3, 4, 5]
    assert {c.sender.pid for c in captures} == {job.process.pid}
    [announced] = server.available()  # one job: parent and child are one run, one rank
    assert announced.name == "probe"
    saved = server.store.save(server_dir := Path(tempfile.mkdtemp()) / "rec")
    loaded = thing.HistoryStore()
    loaded.load(server_dir)
    assert saved and all(c.requested for c in loaded.get_all("probe"))  # kept on disk too


def test_a_request_sends_the_next_calls_of_a_throttled_name(server: thing.Server,
                                                            jobs: list[Job]) -> None:
    jobs.append(job := Job(server.port))
    job.catch("w", 5, every=100)
    server.request("w", 2)
    job.sync()
    job.catch("w", 5, every=100)
    assert calls_of(server, "w") == [1, 6, 7]
    assert [c.requested for c in server.store.get_all("w")] == [False, True, True]


def test_the_first_capture_a_request_brings_is_sent_at_once(server: thing.Server,
                                                            processes: list) -> None:
    """Someone at the REPL waits for it: it is not held for the sender's tick (made 30 s
    here), as the rest of a request for many calls are."""
    processes.append(job := start_script("""
        import time, thing, thing.channel
        thing.channel.TICK_SECONDS = 30.0
        assert thing.catch(0.0, name="warm").wait(10)
        print("ready", flush=True)
        for step in range(1, 6000):  # about 30 s of 5 ms steps
            thing.catch(float(step), name="probe", on_demand=True)
            time.sleep(0.005)
    """, server.port))
    assert job.stdout.readline() == "ready\n", job.stderr.read()
    server.request("probe", 3)  # the job is connected: it caught "warm"
    assert server.store.wait("probe", 10).requested  # not 30 s later, with the tick
    assert len(server.store.get_all("probe")) == 1  # the other two go with the tick


def test_settings_for_single_ranks_are_bounded_and_a_new_job_is_told_them_all(
        server: thing.Server) -> None:
    """Ranks run to 2**31: settings for single ranks stop at MAX_RANKED_STATEMENTS, so the
    settings a job is told when it connects never pass the rate at which a job hangs up on
    a flooding server, and a job that connects after many are set still sends."""
    from thing.settings_table import MAX_RANKED_STATEMENTS

    for rank in range(5):
        for index in range(1000):
            if rank * 1000 + index < MAX_RANKED_STATEMENTS:
                server.pause(f"layer{index}", rank=rank)
            else:
                with pytest.raises(ValueError, match="for single ranks"):
                    server.pause(f"layer{index}", rank=rank)
                break
    server.every("layer0", 2)  # for every rank: layer0 is paused for ranks 0 to 3 only
    assert len(server.steering.statements()) == MAX_RANKED_STATEMENTS + 1
    run_script("""
        import thing
        assert thing.catch(0.0, name="layer1").wait(20)  # connected, and told the settings
        handles = [thing.catch(float(i), name="layer0", block=True) for i in range(1, 7)]
        assert [handle.wait(20) for handle in handles] == [True, False] * 3
    """, server.port, RANK="4", WORLD_SIZE="8")
    assert server.get_all("layer0") == [1.0, 3.0, 5.0]


# -- live throttles ------------------------------------------------------------------------


def test_every_overrides_the_job_until_reset(server: thing.Server, jobs: list[Job]) -> None:
    jobs.append(job := Job(server.port))
    job.catch("w", 150, every=100)
    assert calls_of(server, "w") == [1, 101]
    server.every("w", 1)
    job.sync()
    job.catch("w", 5, every=100)
    assert calls_of(server, "w") == [1, 101, 151, 152, 153, 154, 155]
    server.reset("w")
    job.sync()
    job.catch("w", 150, every=100)
    assert calls_of(server, "w") == [1, 101, 151, 152, 153, 154, 155, 201, 301]


def test_first_sends_the_next_captures_then_none(server: thing.Server, jobs: list[Job]) -> None:
    jobs.append(job := Job(server.port))
    job.catch("grad", 3)
    server.first("grad", 2)
    job.sync()
    job.catch("grad", 5, every=2)  # first= keeps the job's every=
    assert calls_of(server, "grad") == [1, 2, 3, 5, 7]
    server.reset()
    job.sync()
    job.catch("grad", 2)
    assert calls_of(server, "grad")[-2:] == [9, 10]


def test_pause_stops_everything_and_resume_restarts(server: thing.Server,
                                                    jobs: list[Job]) -> None:
    jobs.append(job := Job(server.port))
    server.pause()
    server.resume("sync")  # what syncs with the job must still be sent
    job.sync()
    job.catch("a", 3)
    job.catch("b", 3)
    assert calls_of(server, "a") == calls_of(server, "b") == []
    server.resume("a")  # only a, while the rest stays paused
    job.sync()
    job.catch("a", 2)
    job.catch("b", 2)
    assert (calls_of(server, "a"), calls_of(server, "b")) == ([4, 5], [])
    shown = live.view(server.store, server.info(), 5, width=120).text(120)
    assert "steering: all names: paused; 'sync': sent; 'a': sent" in shown
    server.resume()
    job.sync()
    job.catch("b", 1)
    assert calls_of(server, "b") == [6]
    assert server.info().steering == ()


def test_a_setting_can_be_for_one_rank(server: thing.Server, jobs: list[Job]) -> None:
    jobs.extend(ranks := [Job(server.port, RANK=str(rank), WORLD_SIZE="2") for rank in (0, 1)])
    server.every("x", 1, rank=1)
    for job in ranks:
        job.sync()
        job.catch("x", 4, every=3)
    by_rank = {rank: [c.call for c in server.store.get_all("x", rank=rank)] for rank in (0, 1)}
    assert by_rank == {0: [1, 4], 1: [1, 2, 3, 4]}
    server.reset("x", rank=1)
    for job in ranks:
        job.sync()
        job.catch("x", 3, every=3)
    assert [c.call for c in server.store.get_all("x", rank=1)][-1] == 7


def test_a_job_that_connects_later_picks_up_the_settings(server: thing.Server,
                                                         jobs: list[Job]) -> None:
    server.every("w", 1)
    server.pause("quiet")
    server.request("w", 5)  # a request is for the calls of now, not kept for later jobs
    jobs.append(job := Job(server.port))
    job.sync()
    job.catch("w", 3, every=100)
    job.catch("quiet", 3)
    assert calls_of(server, "w") == [1, 2, 3] and calls_of(server, "quiet") == []
    assert not any(c.requested for c in server.store.get_all("w"))


def test_serving_again_after_close_keeps_what_the_repl_set(
        jobs: list[Job], monkeypatch: pytest.MonkeyPatch) -> None:
    """serve() again receives into the session's history; what the REPL set for jobs
    holds on too (a paused tensor flowed again at once)."""
    monkeypatch.setattr(thing.repl, "_server", None)
    first = thing.serve(port=0)
    try:
        thing.pause("quiet")
        first.close()
        second = thing.serve(port=0)
        assert second is not first
        assert [s.operation for s in second.steering.statements()] == ["pause"]
        jobs.append(job := Job(second.port))
        job.catch("quiet", 3)
        job.catch("w", 2)
        assert calls_of(second, "quiet") == [] and calls_of(second, "w") == [1, 2]
    finally:
        thing.repl._server.close()


def test_a_pause_set_before_a_job_starts_holds_back_its_very_first_calls(
        server: thing.Server) -> None:
    """A new job's first calls are queued before its connection is up, so before it has
    heard the settings: it reads them first, and what they pause is skipped, not sent
    (its handle says so, and nothing counts as lost); the rest goes, in order."""
    server.pause("secret")
    script = """
        import json, thing
        secret = [thing.catch(i, name="secret") for i in range(3)]  # before it connects
        # Let through before it heard the settings, queued after: the three before it fill
        # the queue, and it waits for room, which they give back once paused.
        secret.append(thing.catch(3, name="secret", block=True))
        loss = [thing.catch(i, name="loss", block=True) for i in range(4)]
        assert all(handle.wait(10) for handle in loss), [handle.error for handle in loss]
        print(json.dumps({"secret": [handle.error for handle in secret],
                          "undelivered": dict(thing._default_client.undelivered)}))
    """
    said = json.loads(run_script(script, server.port, THING_QUEUE_ITEMS="3"))
    assert said == {"secret": [PAUSED] * 4, "undelivered": {}}, said
    assert calls_of(server, "secret") == []
    assert [capture.value for capture in server.store.get_all("loss")] == [0, 1, 2, 3]


def test_thing_control_0_ignores_the_repl(server: thing.Server, jobs: list[Job],
                                          caplog: pytest.LogCaptureFixture) -> None:
    jobs.append(job := Job(server.port, THING_CONTROL="0"))
    job.sync()
    assert server.steering.clients == 0  # it said so in its hello: nothing is sent to it
    # The REPL says so: it looked as if the setting were in force.
    with caplog.at_level(logging.WARNING, logger="thing"):
        server.every("w", 1)
        server.every("w", 1)  # said once, not at every call
    assert caplog.text.count("1 connected job refuses steering") == 1
    assert "1 connected job refuses steering" in live._steering_line(server.info())
    server.request("w", 3)
    job.sync()
    job.catch("w", 5, every=100)
    assert calls_of(server, "w") == [1]
    job.catch("probe", 5, on_demand=True)
    # Nothing sent, and nothing listed: it could never be asked for.
    assert calls_of(server, "probe") == [] and server.available() == []


def test_settings_outlive_the_repl_for_the_ttl_only(jobs: list[Job]) -> None:
    with thing.Server(port=0) as server:
        port = server.port
        jobs.append(job := Job(port, THING_CONTROL_TTL="1.5", THING_RECONNECT_INTERVAL="0.2"))
        server.every("w", 1)
        job.sync()
        assert job.run("settings") == "settings ['w']\n"
    gone = time.monotonic()
    assert job.run("settings") == "settings ['w']\n"  # the REPL went away: kept a while
    poll(lambda: job.run("settings") == "settings []\n", timeout=10, what="settings to expire")
    assert time.monotonic() - gone >= 1.5


def test_control_under_a_token(jobs: list[Job]) -> None:
    with thing.Server(port=0, token="steer-secret") as server:
        jobs.append(job := Job(server.port, THING_TOKEN="steer-secret"))
        job.sync()
        server.every("w", 1)
        server.request("probe", 1)
        job.sync()
        job.catch("w", 3, every=100)
        job.catch("probe", 2, on_demand=True)
        assert calls_of(server, "w") == [1, 2, 3] and calls_of(server, "probe") == [1]


def test_the_repl_refuses_what_a_client_would(server: thing.Server) -> None:
    with pytest.raises(ValueError, match="count is a whole number from 1 to "):
        server.request("w", 0)
    with pytest.raises(ValueError, match="n is a whole number from 1 to "):
        server.every("w", 2**50)
    with pytest.raises(ValueError, match=r"rank \(or None: every rank\) is a whole number "
                                         "from 0 to 2147483647, not -1"):
        server.pause("w", rank=-1)
    with pytest.raises(TypeError, match="n is a whole number, not 2.0"):
        server.every("w", 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a name is a str"):
        server.every(3, 1)  # type: ignore[arg-type]
    # A name of no characters is the wire's "every name"; one of more than 4096 bytes, a
    # stream the job no longer follows: each would have reached every job as that.
    with pytest.raises(ValueError, match="a name of 0 bytes"):
        server.pause("")
    with pytest.raises(ValueError, match="a name of 5000 bytes"):
        server.every("é" * 2500, 1)
    assert server.info().steering == ()
    # A numpy integer is as good as an int here, as in get(): pause(rank=np.int64(1)) was
    # refused with "rank must be a rank number".
    server.every("w", np.int64(5), rank=np.int64(1))
    [statement] = server.info().steering
    assert (statement.name, statement.rank, statement.value) == ("w", 1, 5)
    assert type(statement.rank) is int and type(statement.value) is int


@pytest.mark.parametrize("value, steered", [
    ("", True), ("1", True), ("true", True), ("On", True), ("yes", True),
    ("0", False), ("false", False), ("OFF", False), ("no", False), ("disabled", False)])
def test_thing_control_takes_words_and_fails_closed(monkeypatch: pytest.MonkeyPatch,
                                                    value: str, steered: bool) -> None:
    """The switch that keeps a REPL out of a job: a value it does not know refuses steering
    rather than allow it (``false`` had read as "not a number: the default, on")."""
    from thing import config

    monkeypatch.setenv("THING_CONTROL", value)
    assert config.control() is steered


def test_a_first_used_up_under_a_repl_since_restarted_counts_anew(jobs: list[Job]) -> None:
    """A job reconnecting to the same REPL keeps what its first= let through; a REPL
    restarted on the same port is another: the same first= said there sends that many."""
    with thing.Server(port=0) as repl:
        port = repl.port
        jobs.append(job := Job(port, THING_RECONNECT_INTERVAL="0.2"))
        repl.every("x", 1)
        repl.first("x", 2)
        job.sync()
        job.catch("x", 4)
        assert calls_of(repl, "x") == [1, 2]
    with thing.Server(port=port) as restarted:
        poll(lambda: restarted.steering.clients == 1, what="the job to reconnect")
        restarted.every("x", 1)
        restarted.first("x", 2)
        job.sync()
        job.catch("x", 3)
        assert calls_of(restarted, "x") == [5, 6]


def test_a_first_said_anew_after_a_reconnection_counts_anew(server: thing.Server,
                                                            jobs: list[Job]) -> None:
    """A reconnection to the same REPL keeps what a first= let through only for the
    statements it replays: a first said again after a reset sends that many."""
    jobs.append(job := Job(server.port, THING_RECONNECT_INTERVAL="0.2"))
    server.first("x", 2)
    job.sync()
    job.catch("x", 3)
    assert calls_of(server, "x") == [1, 2]
    server.max_connections = 0  # the job is cut off, and kept off for now
    with server._lock:
        for sock in list(server._connections):
            sock.shutdown(socket.SHUT_RDWR)
    poll(lambda: server.steering.clients == 0, what="the job to be cut off")
    server.reset("x")  # said while it is away: its replay holds no first for x
    server.max_connections = 256
    poll(lambda: server.steering.clients == 1, what="the job to reconnect")
    server.first("x", 2)
    job.sync()
    job.catch("x", 3)
    assert calls_of(server, "x") == [1, 2, 4, 5]


def _cut_off(server: thing.Server) -> None:
    """Cut every job off and keep them off (until max_connections is set again)."""
    server.max_connections = 0
    with server._lock:
        for sock in list(server._connections):
            sock.shutdown(socket.SHUT_RDWR)
    poll(lambda: server.steering.clients == 0, what="the job to be cut off")


def test_a_first_said_anew_while_the_job_was_away_counts_anew(server: thing.Server,
                                                              jobs: list[Job]) -> None:
    """Said again (after a reset, or over itself) while the job reconnects: the job took it
    for the one it held, used up, and sent nothing (0 captures instead of 2)."""
    jobs.append(job := Job(server.port, THING_RECONNECT_INTERVAL="0.2"))
    server.every("x", 1)
    server.first("x", 2)
    job.sync()
    job.catch("x", 3)
    assert calls_of(server, "x") == [1, 2]
    for said_again in (lambda: (server.reset("x"), server.every("x", 1)), lambda: None):
        _cut_off(server)
        said_again()
        server.first("x", 2)  # said while it is away
        server.max_connections = 256
        poll(lambda: server.steering.clients == 1, what="the job to reconnect")
        job.sync()
        before = len(calls_of(server, "x"))
        job.catch("x", 3)
        assert len(calls_of(server, "x")) == before + 2
    # Told again what it was told before, it keeps its count: none left.
    _cut_off(server)
    server.max_connections = 256
    poll(lambda: server.steering.clients == 1, what="the job to reconnect")
    job.sync()
    before = len(calls_of(server, "x"))
    job.catch("x", 3)
    assert len(calls_of(server, "x")) == before


def test_a_first_used_up_before_the_settings_expired_stays_used_up(jobs: list[Job]) -> None:
    """The job went back to its own settings (THING_CONTROL_TTL) and the same REPL came
    back: its replayed first= let as many through again, though status() said none."""
    with thing.Server(port=0) as server:
        jobs.append(job := Job(server.port, THING_CONTROL_TTL="0.5",
                               THING_RECONNECT_INTERVAL="0.2"))
        server.every("x", 1)
        server.first("x", 2)
        job.sync()
        job.catch("x", 3)
        assert calls_of(server, "x") == [1, 2]
        _cut_off(server)
        poll(lambda: job.run("settings") == "settings []\n", timeout=10,
             what="settings to expire")
        server.max_connections = 256
        poll(lambda: server.steering.clients == 1, what="the job to reconnect")
        job.sync()
        job.catch("x", 3)
        assert calls_of(server, "x") == [1, 2]


def test_a_setting_for_another_rank_changes_nothing_here() -> None:
    """Kept for the rank this process may learn it is, a statement for another rank neither
    makes an on-demand name its own here nor turns the compiled gate off once the rank
    is known."""
    steered = overrides()  # rank 1
    steered.apply(read(message("every", None, None, 1)))
    steered.apply(read(message("pause", "probe", 3)))
    throttle = thing._core.Throttles().of("probe")
    assert steered.admit("probe", throttle, 1, None, True) == (0, False)  # not asked for
    ranked = overrides()
    ranked.apply(read(message("pause", "grad_norm", 3)))
    assert not ranked.active and ranked.settings() == {}
    for name in range(1000):  # the cap on names leaves every-name statements alone
        ranked.apply(read(message("every", f"n{name}", None, 2)))
    ranked.apply(read(message("pause")))
    assert ranked.settings()[None].paused


def test_a_reset_for_another_rank_leaves_this_ranks_requests(server: thing.Server) -> None:
    """``reset(name, rank=0)`` dropped what was requested of the name on every rank."""
    steered = overrides()  # rank 1
    steered.apply(read(message("request", "x", None, 5)))
    steered.apply(read(message("reset", "x", 0)))
    steered.apply(read(message("reset", None, 2)))
    assert steered.requests() == {"x": 5}
    steered.apply(read(message("reset", "x", 1)))
    assert steered.requests() == {}


def test_a_request_ends_with_the_repl_that_made_it(jobs: list[Job]) -> None:
    """A REPL restarted on the same port (another server) could neither see nor pause what
    the last one requested, and received it all the same."""
    with thing.Server(port=0) as repl:
        port = repl.port
        jobs.append(job := Job(port, THING_RECONNECT_INTERVAL="0.2"))
        job.sync()  # connected
        repl.request("x", 1000)
        job.sync()  # the request reached it
        job.catch("x", 2, every=10**6)
        job.sync()
        assert calls_of(repl, "x") == [1, 2]
    with thing.Server(port=port) as restarted:
        poll(lambda: restarted.steering.clients == 1, what="the job to reconnect")
        job.sync()
        job.catch("x", 3, every=10**6)
        job.sync()
        assert calls_of(restarted, "x") == []


def test_a_setting_for_a_rank_applies_once_the_job_learns_its_rank(server: thing.Server
                                                                   ) -> None:
    """Under mp.spawn a job connects, and hears the settings, before torch.distributed
    tells it its rank: a pause for rank 0 said then applies from the moment it is rank 0."""
    pytest.importorskip("torch.distributed")
    server.pause("loss", rank=0)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        rendezvous = free.getsockname()[1]
    script = f"""
        import json, torch.distributed as dist, thing
        assert thing.catch(0, name="sync").wait(10)  # connected: told the settings
        before = thing.catch(1.0, name="loss").wait(10)  # no rank yet: not rank 0's
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{rendezvous}",
                                rank=0, world_size=1)
        after = [thing.catch(2.0, name="loss").error for _ in range(3)]
        dist.destroy_process_group()
        print(json.dumps([before, after]))
    """
    before, after = json.loads(run_script(script, server.port, RANK="", WORLD_SIZE=""))
    assert before and after == [SKIPPED.error] * 3
    assert [capture.rank for capture in server.store.get_all("loss")] == [None]


def test_only_the_calls_sent_to_the_default_server_are_steered(server: thing.Server) -> None:
    """Another server's connection refuses steering, so the default server's settings do not
    decide what goes there, and an on-demand name is listed by neither."""
    server.pause()
    server.resume("sync")
    with thing.Server(port=0) as other:
        script = f"""
            import json, numpy as np, thing
            assert thing.catch(0, name="sync").wait(10)  # told the settings
            there = "127.0.0.1:{other.port}"
            paused = thing.catch(1, name="loss").error
            sent = [thing.catch(i, name="loss", server=there).wait(10) for i in range(3)]
            thing.catch(np.zeros(2), name="probe", server=there, on_demand=True)
            assert thing.catch(0, name="sync", server=there).wait(10)
            print(json.dumps([paused, sent]))
        """
        paused, sent = json.loads(run_script(script, server.port))
        assert paused == SKIPPED.error and sent == [True] * 3
        assert calls_of(server, "loss") == []
        assert [capture.value for capture in other.store.get_all("loss")] == [0, 1, 2]
        assert other.available() == [] and server.available() == []


# -- what a client makes of what a server sends -------------------------------------------


def overrides() -> Overrides:
    return Overrides(True, 600.0, lambda: 1)


def message(operation: str, name: str | None = None, rank: int | None = None,
            value: int = 0) -> bytes:
    return wire.encode_control(operation, name, rank, value)


def read(raw: bytes, mac: Any = None) -> Any:
    """``raw`` through the client's one reader of what a server sends."""
    left, right = socket.socketpair()
    with left, right:
        right.sendall(raw)
        right.shutdown(socket.SHUT_WR)
        return read_server_message(StreamReader(left), mac)


def test_the_latest_statement_that_applies_wins() -> None:
    table = overrides()  # this process is rank 1
    for raw in (message("pause"), message("resume", "a"), message("every", "w", 1, 5),
                message("every", "w", None, 7), message("first", "w", None, 2)):
        table.apply(read(raw))
    assert {name: repr(s) for name, s in table.settings().items()} == {
        None: "Setting(every=None, first=None, paused=True)",
        "a": "Setting(every=None, first=None, paused=False)",
        "w": "Setting(every=7, first=2, paused=True)",
    }
    table.apply(read(message("every", "w", 1, 3)))  # for this rank, and said last
    assert table.settings()["w"].every == 3
    table.apply(read(message("reset", "w", 1)))  # what was said for rank 1 goes
    assert table.settings()["w"].every == 7
    table.apply(read(message("every", "w", 0, 9)))  # for rank 0: not this process
    assert table.settings()["w"].every == 7
    table.apply(read(message("pause")))  # said after resume("a"): a is paused too
    assert "a" not in table.settings() and table.settings()[None].paused
    table.apply(read(message("request", "a", None, 2)))
    table.apply(read(message("forget")))  # a reconnect: settings replayed, requests kept
    assert table.settings() == {} and table.requests() == {"a": 2} and table.active
    table.apply(read(message("reset")))
    assert table.requests() == {} and not table.active


operations = st.lists(st.tuples(
    st.sampled_from(["request", "every", "first", "pause", "resume", "reset"]),
    st.sampled_from([None, "w", "x"]), st.sampled_from([None, 0, 1]), st.integers(1, 5)),
    max_size=12)


def valid(steps: Any) -> Iterator[tuple[str, str | None, int | None, int]]:
    """The generated steps a REPL could say: a request or first names a name, and pause,
    resume and reset carry no number."""
    for operation, name, rank, value in steps:
        if operation in ("request", "first") and name is None:
            continue
        yield operation, name, rank, 0 if operation in ("pause", "resume", "reset") else value


def shown(settings: dict[Any, Any]) -> dict[Any, str]:
    return {name: repr(setting) for name, setting in settings.items()}


@settings(max_examples=300, deadline=None)
@given(operations)
def test_a_job_connecting_later_decides_as_one_connected_all_along(steps: Any) -> None:
    from thing.settings_table import SettingsTable

    kept = SettingsTable()  # the server's, as thing/steering.py keeps it
    connected = overrides()
    for operation, name, rank, value in valid(steps):
        connected.apply(read(message(operation, name, rank, value)))
        if operation != "request":
            kept.apply(operation, name, rank, value)
    later = overrides()
    for raw in [message("forget")] + [message(s.operation, s.name, s.rank, s.value)
                                      for s in kept.statements()]:
        later.apply(read(raw))
    assert shown(later.settings()) == shown(connected.settings())


@settings(max_examples=300, deadline=None)
@given(operations)
def test_what_a_statement_changes_is_what_working_everything_out_again_gives(steps: Any
                                                                              ) -> None:
    """A statement for one name works out that name's setting only (a replay of a thousand
    names took a job seconds of CPU when each worked out all): always what all give."""
    from thing.settings_table import SettingsTable

    steered = overrides()  # rank 1
    for operation, name, rank, value in valid(steps):
        steered.apply(read(message(operation, name, rank, value)))
        table = SettingsTable()
        for statement in steered._table.statements():
            table.apply(statement.operation, statement.name, statement.rank, statement.value)
        assert shown(steered.settings()) == shown(table.settings(1))


def test_a_server_that_forgets_again_and_again_and_never_replays_grows_no_job() -> None:
    """A server saying a thousand first= statements, then "forget", again and again, each
    time with other values, and never ending a replay: the counts kept over each forget
    for the replay after it grew by a thousand each time (20 MB a second over the wire).
    They are bounded as the table is."""
    from thing.settings_table import MAX_KEPT_BUDGETS, SettingsTable

    table = SettingsTable()
    for cycle in range(12):
        for i in range(1000):
            assert table.apply("first", f"name{i}", None, cycle + 2)
        table.apply("forget", None, None, 0)
    assert len(table._kept_budgets) <= MAX_KEPT_BUDGETS
    table.apply("first", "name999", None, 13)  # the newest kept: its count carries on
    assert table._kept_budgets.get(("name999", None, 13)) is None


def test_a_requested_catch_never_waits_for_the_table_the_sender_is_working_out() -> None:
    """Applying a replay (or a flood) holds the table's lock for milliseconds: a catch of
    a requested name took its request under that lock, and waited (124 ms seen)."""
    steered = overrides()
    steered.apply(read(message("request", "loss", None, 3)))
    throttle = thing._core.Throttles().of("loss")
    with steered._write:  # the sender, in the middle of applying statements
        answered = []
        caller = threading.Thread(target=lambda: answered.append(
            (steered.admit("loss", throttle, 1, None, False), steered.first_answer("loss"))))
        caller.start()
        caller.join(5)
        assert answered == [((1, True), True)]
    assert steered.requests() == {"loss": 2}


def test_a_forked_worker_keeps_the_settings_no_longer_than_its_parent() -> None:
    """A child forked while its parent had no REPL keeps the parent's deadline, not a new
    one; and the settings end at a call once it passes, even in a worker whose every call
    is paused (it opens no connection, whose retries would end them)."""
    from thing.overrides import Overrides

    steered = Overrides(True, 0.5, lambda: None)
    steered.connected(1, "repl")
    steered.apply(read(message("pause")))
    steered.disconnected(1)
    deadline = steered._expires_at
    assert deadline is not None
    steered.after_fork()
    assert steered._expires_at == deadline
    throttle = thing._core.Throttles().of("w")
    assert steered.admit("w", throttle, 1, None, False) == (0, False)  # paused, for now
    poll(lambda: time.monotonic() > deadline, what="the deadline")
    assert steered.admit("w", throttle, 1, None, False) != (0, False)
    assert steered.settings() == {} and not steered.active


control_parts = st.tuples(st.integers(0, 2**16 - 1), st.binary(max_size=64),
                          st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(control_parts)
def test_a_malformed_control_message_never_raises_nor_changes_anything(parts: Any) -> None:
    code, raw_name, rank, value = parts
    raw = wire.CONTROL.pack(wire.CONTROL_TAG, code, len(raw_name), rank, value) + raw_name
    table = overrides()
    table.apply(read(message("every", "kept", None, 3)))
    before = {name: repr(s) for name, s in table.settings().items()}, table.requests()
    try:
        decoded = read(raw)
    except wire.BadControl:  # read whole and ignored: the connection stays
        assert ({name: repr(s) for name, s in table.settings().items()},
                table.requests()) == before
        return
    table.apply(decoded)  # a valid one, by chance: applies without raising
    assert decoded.operation in wire.CONTROL_OPERATIONS.values()


def test_what_breaks_the_stream_or_its_signature_is_refused() -> None:
    too_long = wire.CONTROL.pack(wire.CONTROL_TAG, 2, wire.MAX_CONTROL_NAME + 1, 0, 1)
    with pytest.raises(ProtocolError, match="a name of 4097 bytes"):
        read(too_long + b"x" * 10)
    mac = auth.SessionMac("token", "c" * 32, "s" * 32)
    raw = message("every", "w", None, 1)
    forged = auth.SessionMac("another", "c" * 32, "s" * 32).sign(raw)
    with pytest.raises(ProtocolError, match="signature does not match"):
        read(raw + forged, mac)
    genuine = auth.SessionMac("token", "c" * 32, "s" * 32)
    fresh = auth.SessionMac("token", "c" * 32, "s" * 32)  # the forged one used message 0
    assert read(raw + genuine.sign(raw), fresh) == wire.ControlMessage("every", "w", None, 1)


@pytest.mark.parametrize("replay", [True, False], ids=["asks-for-the-end", "older-client"])
def test_the_end_of_the_settings_is_said_only_to_a_client_that_asks(
        server: thing.Server, replay: bool) -> None:
    """A client whose hello says "replay" is told where the settings a new connection gets
    end; an older one, which would log an operation it does not know, is not."""
    server.pause("secret")
    with connect("127.0.0.1", server.port, 10) as peer:
        hello = {"hostname": "raw", "pid": 1, "control": True}
        peer.sendall(wire.encode_handshake({**hello, "replay": True} if replay else hello))
        status, welcome = wire.recv_handshake(peer)
        assert status == wire.HANDSHAKE_OK and welcome["replay"] is True
        stream = StreamReader(peer)
        told = [read_server_message(stream, None) for _ in range(2)]
        poll(lambda: server.steering.clients == 1, what="the connection steered")
        server.resume("secret")  # the next message there is
        told += [read_server_message(stream, None) for _ in range(1 + replay)]
    expected = ["forget", "pause", *["replayed"] * replay, "resume"]
    assert [message.operation for message in told] == expected


def test_a_server_that_never_ends_its_settings_is_sent_to_after_the_connect_timeout(
        jobs: list[Job]) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    received = []

    def serve() -> None:  # says it ends its settings, never does, and reads what comes
        with listener:
            connection, _ = listener.accept()
            with connection:
                wire.recv_handshake(connection)
                connection.sendall(wire.encode_handshake(
                    {"server": "thing", "notices": True, "control": True, "replay": True}))
                connection.settimeout(10)
                received.append(connection.recv(wire.FRAME_PREFIX.size))

    fake = threading.Thread(target=serve, daemon=True)
    fake.start()
    job = Job(listener.getsockname()[1], THING_TRANSPORT="tcp", THING_CONNECT_TIMEOUT="0.5")
    jobs.append(job)
    job.run("touch")
    fake.join(10)
    assert received and received[0][:2] == wire.FRAME_TAG  # its capture came


def test_a_hostile_server_cannot_upset_a_job(jobs: list[Job]) -> None:
    """A server that floods garbage control messages: the job keeps catching, never raises,
    and ends up with no setting it did not validate."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    junk = [wire.CONTROL.pack(wire.CONTROL_TAG, 99, 0, 0, 0),  # no such operation
            wire.CONTROL.pack(wire.CONTROL_TAG, 2, 0, 0, -5),  # every -5
            wire.CONTROL.pack(wire.CONTROL_TAG, 1, 2, 0, 3) + b"\xff\xfe",  # not UTF-8
            message("every", "w", None, 1)]  # one valid message among them

    def serve() -> None:
        with listener:
            connection, _ = listener.accept()
            with connection:
                wire.recv_handshake(connection)
                connection.sendall(wire.encode_handshake(
                    {"server": "thing", "notices": True, "control": True}))
                for raw in junk * 50:
                    connection.sendall(raw)
                time.sleep(1)

    fake = threading.Thread(target=serve, daemon=True)
    fake.start()
    job = Job(port, THING_TRANSPORT="tcp")
    jobs.append(job)
    job.run("touch")  # connects
    fake.join(10)
    assert job.run("settings") == "settings ['w']\n"  # the valid one, applied 50 times
    job.run("touch")
    assert job.process.poll() is None


def test_on_demand_costs_a_throttled_call_until_requested() -> None:
    """Not a timing (benchmarks/overhead.py measures it): an on-demand call touches no data
    and queues nothing, even with no server at all."""
    client = thing.Client("127.0.0.1", 1, control=True)
    try:
        class Untouchable:
            shape = (2, 2)
            dtype = "float32"

            def __array__(self, *args: Any) -> np.ndarray:
                raise AssertionError("data touched")

        handles = [client.catch(Untouchable(), name="probe", on_demand=True)
                   for _ in range(3)]
        assert not any(handle.wait(0) for handle in handles) and client.undelivered == {}
    finally:
        client.close()



def fake_server(speak: Any) -> tuple[int, list[int]]:
    """A server of our own on TCP that gives each connection to ``speak`` on a thread of its
    own; returns its port and how many connections it accepted so far (in a list). It stops
    listening 15 s after the last connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(15)
    accepted = [0]

    def talk(connection: socket.socket) -> None:
        with connection:
            try:
                speak(connection)
            except OSError:
                pass

    def serve() -> None:
        with listener:
            while True:
                try:
                    connection, _ = listener.accept()
                except OSError:
                    return
                accepted[0] += 1
                threading.Thread(target=talk, args=(connection,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], accepted


def welcome(connection: socket.socket) -> None:
    wire.recv_handshake(connection)
    connection.sendall(wire.encode_handshake(
        {"server": "thing", "notices": True, "control": True}))


def read_until_hung_up(connection: socket.socket) -> None:
    """Read what the job sends until it hangs up (10 s at most between reads)."""
    connection.settimeout(10)
    while connection.recv(1 << 16):
        pass


def handshake_reply(status: int, body: bytes) -> bytes:
    """A server's handshake message of ``status`` with ``body``, built by hand."""
    return wire.HANDSHAKE.pack(wire.MAGIC, wire.VERSION, status, len(body)) + body


def error_of_one_catch(port: int, **env: str) -> str:
    """What the handle of one catch says, in a job of its own that sends to ``port`` by TCP."""
    return run_script("""
        import thing
        handle = thing.catch(1.0, name="x")
        assert not handle.wait(10)
        print(handle.error)
    """, port, THING_TRANSPORT="tcp", **env).strip()


def test_a_flood_of_control_messages_is_hung_up_on(jobs: list[Job]) -> None:
    """A REPL's replay is a few thousand messages; a server sending far more a second would
    keep the job's sender reading, in Python, under the training loop's GIL."""
    flood = message("every", "w", None, 1) * (answers.MAX_CONTROL_PER_SECOND + 1000)

    def speak(connection: socket.socket) -> None:
        welcome(connection)
        connection.sendall(flood)
        read_until_hung_up(connection)

    port, accepted = fake_server(speak)
    jobs.append(job := Job(port, THING_TRANSPORT="tcp", THING_RECONNECT_INTERVAL="0.2"))
    job.run("touch")
    poll(lambda: accepted[0] >= 2, what="the job to hang up and come back")


def test_a_flood_of_costly_statements_is_hung_up_on_below_the_count(jobs: list[Job]) -> None:
    """With the table full, a statement for every name costs the sender 100 times one for a
    name: 2,000 a second, a fifth of the count allowed, took a job's sender most of the
    GIL for as long as they came. What steering takes of its time is bounded too."""
    from thing.settings_table import MAX_RANKED_STATEMENTS, MAX_STEERED_NAMES

    full = b"".join(message(kind, f"n{i}", None, 2) for i in range(MAX_STEERED_NAMES)
                    for kind in ("every", "first"))
    full += b"".join(message("every", f"n{r % MAX_STEERED_NAMES}", r + 1, 3)
                     for r in range(MAX_RANKED_STATEMENTS))
    costly = message("resume") * 200

    def speak(connection: socket.socket) -> None:
        welcome(connection)
        connection.sendall(full)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the job hangs up
            connection.sendall(costly)
            time.sleep(0.1)

    port, accepted = fake_server(speak)
    jobs.append(job := Job(port, THING_TRANSPORT="tcp", THING_RECONNECT_INTERVAL="0.2"))
    job.run("touch")
    poll(lambda: accepted[0] >= 2, 20, "the job to hang up and come back")


def test_a_refusal_of_any_length_reaches_its_handle_short_and_escaped() -> None:
    """Made readable outside the lock catch() takes, and cut: a hostile server's 64 KiB of
    control characters had held each catch() for half a second."""
    def speak(connection: socket.socket) -> None:
        welcome(connection)
        StreamReader(connection).read(wire.FRAME_PREFIX.size)  # a frame begins: answer it
        connection.sendall(wire.encode_ack(wire.SEQ_OLDEST_UNANSWERED, -1, "\x01" * 65_000))
        read_until_hung_up(connection)

    port, _ = fake_server(speak)
    error = error_of_one_catch(port)
    assert error.startswith("refused by the server: \\x01\\x01")
    assert len(error) <= len("refused by the server: ") + 4 * wire.MAX_REFUSAL_TEXT


def test_a_server_refusing_every_other_handshake_at_length_is_logged_rarely_and_short() -> None:
    """A server that takes one connection and refuses the next, with 64 KiB of reason, had
    the job log 160,000 characters at every refusal: 330 MB an hour."""
    turns = itertools.count()

    def speak(connection: socket.socket) -> None:
        wire.recv_handshake(connection)
        if next(turns) % 2:
            body = json.dumps({"error": "go away " + "\U000e0001" * 16_000},  # 64 KB
                              ensure_ascii=False).encode()
            connection.sendall(handshake_reply(wire.HANDSHAKE_REFUSED, body))
        else:
            connection.sendall(wire.encode_handshake({"server": "thing"}))

    port, accepted = fake_server(speak)
    result = run_script("""
        import logging, time, thing
        logging.basicConfig(level=logging.WARNING)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            handle = thing.catch(1.0, name="x")
            time.sleep(0.02)
        print(len(handle.error or ""))
    """, port, full=True, THING_TRANSPORT="tcp", THING_RECONNECT_INTERVAL="0.05")
    assert accepted[0] >= 6  # refused three times at least
    refusals = [line for line in result.stderr.splitlines() if "cannot use the thing" in line]
    assert len(refusals) == 1, result.stderr[:2000]
    # Cut, then escaped: 4,000 characters of ten each (160,000 uncut).
    assert len(refusals[0]) < 11 * wire.MAX_REFUSAL_TEXT
    assert int(result.stdout) < 11 * wire.MAX_REFUSAL_TEXT


def test_a_challenge_with_a_malformed_nonce_is_refused_by_the_job() -> None:
    """A server's nonce of unpaired surrogates reached the job's MAC encoding."""
    def speak(connection: socket.socket) -> None:
        wire.recv_handshake(connection)
        body = json.dumps({"nonce": "\ud800" * 40, "proof": "00"}).encode()
        connection.sendall(handshake_reply(wire.HANDSHAKE_CHALLENGE, body))
        read_until_hung_up(connection)

    port, _ = fake_server(speak)
    error = error_of_one_catch(port, THING_TOKEN="ours")
    assert error.endswith("sent a malformed challenge"), error


def test_a_handshake_dripped_a_byte_at_a_time_ends_at_the_connect_timeout(
        jobs: list[Job]) -> None:
    """A socket's timeout restarts with every byte: the handshake has a deadline of its own,
    or a server dripping its welcome would hold the job's captures for days."""
    def speak(connection: socket.socket) -> None:
        wire.recv_handshake(connection)
        for byte in wire.encode_handshake({"server": "thing", "pad": "x" * 100}):
            connection.sendall(bytes([byte]))
            time.sleep(0.2)

    port, accepted = fake_server(speak)
    jobs.append(job := Job(port, THING_TRANSPORT="tcp", THING_CONNECT_TIMEOUT="1",
                           THING_RECONNECT_INTERVAL="0.2"))
    job.run("touch")  # dials
    poll(lambda: accepted[0] >= 2, what="the job to give up on the first and dial again")


def test_a_handshake_that_breaks_the_protocol_is_said_to_each_handle() -> None:
    """A peer that answers, but not as a thing server may, is a server there: the handles
    say what it did, not that nobody listens."""
    def speak(connection: socket.socket) -> None:
        wire.recv_handshake(connection)
        connection.sendall(wire.HANDSHAKE.pack(wire.MAGIC, wire.VERSION, wire.HANDSHAKE_OK,
                                               wire.MAX_HANDSHAKE_JSON + 1))

    port, _ = fake_server(speak)
    error = error_of_one_catch(port)
    assert error.startswith("not sent: handshake of 65537 bytes exceeds"), error
