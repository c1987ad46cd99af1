"""catch() in a training loop: throttling, bounded queue, in-place updates, fork, ranks."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import types

import numpy as np
import pytest

import thing
import thing.arrays
import thing.channel
import thing.history_stats
import thing.reports
from thing import wire
from thing._core import recv_buffers, send_buffers
from thing.channel import BATCH
from thing.handles import QUEUE_FULL

from .conftest import expect_line, free_port, poll, run_script, start_script


def test_every_and_first_arithmetic(server: thing.Server) -> None:
    run_script(
        """
        import thing
        sent = {"every": [], "first": [], "both": []}
        for i in range(1, 31):
            if thing.catch(i, name="every", every=10).wait(10):
                sent["every"].append(i)
            if thing.catch(i, name="first", first=3).wait(10):
                sent["first"].append(i)
            if thing.catch(i, name="both", every=4, first=3).wait(10):
                sent["both"].append(i)
        assert sent == {"every": [1, 11, 21], "first": [1, 2, 3], "both": [1, 5, 9]}, sent
        """,
        server.port,
    )
    assert server.get_all("every") == [1, 11, 21]
    assert server.get_all("first") == [1, 2, 3]
    assert server.get_all("both") == [1, 5, 9]


def test_traced_names_arrive(server: thing.Server, tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import numpy as np, thing\n"
        "class Layer:\n"
        "    weight = np.ones(3)\n"
        "class Model:\n"
        "    lm_head = Layer()\n"
        "model = Model()\n"
        "loss = 0.25\n"
        "h = [np.zeros(2)] * 4\n"
        "handles = [thing.catch(loss), thing.catch(model.lm_head.weight), thing.catch(h[3])]\n"
        "def elsewhere(loss):\n"
        "    return thing.catch(loss)\n"
        "handles.append(elsewhere(0.5))\n"
        "assert all(h.wait(10) for h in handles)\n"
    )
    run_script(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", server.port)
    assert set(server.store.names()) == {"loss", "model.lm_head.weight", "h[3]", "loss_1"}
    assert server.get("loss") == 0.25 and server.get("loss_1") == 0.5
    site = server.capture("loss_1").call_site
    assert site.endswith("(elsewhere)") and "train.py:11" in site


def test_catch_never_raises_or_prints(server: thing.Server) -> None:
    result = run_script(
        """
        import sys, thing
        handle = thing.catch(object(), name="bad")
        assert handle.wait(1) is False and "cannot send an object" in handle.error
        assert thing.catch({(1,): "tuple key"}, name="bad2").wait(1) is False
        assert thing.catch(1.5, name="good").wait(10) is True
        """,
        server.port,
        full=True,
    )
    assert result.stdout == "" and result.stderr == ""
    assert server.store.names() == ["good"]


def test_a_catch_from_a_finalizer_or_signal_handler_never_hangs_the_job(
        server: thing.Server) -> None:
    """A finalizer the garbage collector runs on the sender thread while it holds its lock,
    and a signal handler that interrupts a catch (a preemption handler catching the final
    state), both catch on a thread in the middle of thing's own work: the nested call is
    told it was not sent, and neither thread waits for a lock it holds itself. A handler
    that interrupts the making of the default client (the first catch) is told so too."""
    result = run_script(
        """
        import gc, json, signal, sys, numpy as np, thing
        from thing.handles import REENTERED

        class Tracker:
            def __init__(self):
                self.me = self  # a cycle: only the garbage collector ends it, on any thread
            def __del__(self):
                thing.catch(1.0, name="final")

        outcomes = {"in a signal handler": 0, "REENTERED": 0}
        def on_alarm(signum, frame):
            handle = thing.catch(2.0, name="alarm")
            outcomes["in a signal handler"] += 1
            outcomes["REENTERED"] += handle is REENTERED

        gc.set_threshold(50)
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 1e-3, 1e-3)  # many land in the first catch
        handles = []
        for step in range(3000):
            Tracker()
            handles.append(thing.catch(np.float32([step]), name="main", block=True))
        assert thing.catch(0.5, name="last", block=True).wait(20)
        assert all(handle.wait(20) for handle in handles)  # hurry(), interrupted too
        assert thing._default_client.flush(20)
        signal.setitimer(signal.ITIMER_REAL, 0)
        print(json.dumps(outcomes))
        """,
        server.port,
        timeout=90,
        full=True,
    )
    assert result.stderr == ""
    outcomes = json.loads(result.stdout)
    assert outcomes["in a signal handler"] > 0 and outcomes["REENTERED"] > 0
    assert server.get("last") == 0.5 and len(server.store.get_all("main")) == 3000


def test_server_gone_returns_false_at_once() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    out = run_script(
        """
        import time, numpy as np, thing
        x = np.ones(1000)
        results = []
        start = time.perf_counter()
        for i in range(200):
            results.append(thing.catch(x, name="x"))
        elapsed = time.perf_counter() - start
        assert not any(h.wait(2) for h in results)
        assert elapsed < 5.0, elapsed  # about 10 ms; room for a machine under load
        print("ok")
        """,
        free_port,
    )
    assert out.strip() == "ok"


class _StalledServer:
    """A real thing peer that completes the handshake and then never reads.

    Its receive buffer is small, so a send of a few MiB to it never completes, however the
    machine tunes TCP: a capture's room in the client's queue is given back once its bytes
    are sent, and such a capture holds it for good.
    """

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # inherited
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.peers: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            peer, _ = self.listener.accept()
        except OSError:
            return
        self.peers.append(peer)
        prefix = bytearray(wire.HANDSHAKE.size)
        recv_buffers(peer, [prefix])
        _, length = wire.decode_handshake_prefix(bytes(prefix))
        recv_buffers(peer, [bytearray(length)])
        send_buffers(peer, [wire.encode_handshake({"server": "stalled"})])

    def close(self) -> None:
        for sock in [self.listener, *self.peers]:
            sock.close()


# Larger than what a stalled server's small receive buffer and our send buffer hold between
# them, the latter at its largest (net.ipv4.tcp_wmem: 4 MiB by default, 16-32 on tuned hosts).
STUCK = np.ones(64 << 20, dtype=np.uint8)


def test_a_channel_that_cannot_start_its_thread_keeps_no_descriptor(monkeypatch) -> None:
    """Out of threads, each catch tries to open its channel again: none may keep the
    descriptors its sender would have woken on."""
    import os

    started = threading.Thread.start

    def no_sender(thread: threading.Thread) -> None:
        if thread.name.startswith("thing-send"):
            raise RuntimeError("can't start new thread")
        started(thread)

    monkeypatch.setattr(threading.Thread, "start", no_sender)
    client = thing.Client("127.0.0.1", free_port())
    try:
        client.catch(1.0, name="x")  # the first: imports, and whatever it opens for good
        before = len(os.listdir("/proc/self/fd"))
        handles = [client.catch(1.0, name="x") for _ in range(50)]
        assert all("can't start new thread" in handle.error for handle in handles)
        assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        client.close()


def test_a_long_name_of_unprintable_characters_still_arrives(server: thing.Server) -> None:
    """Escaped on the job's side, it would be past what a server takes: it is sent as it
    is, and the server escapes it."""
    client = thing.Client("127.0.0.1", server.port)
    try:
        handle = client.catch(np.ones(2), name="\x01" * 1100)
        assert handle.wait(10), handle.error
    finally:
        client.close()
    assert server.store.names() == [wire.printable("\x01" * 1100)]


def test_full_queue_drops_without_blocking(monkeypatch) -> None:
    monkeypatch.setenv("THING_TRANSPORT", "tcp")  # the stalled server has no Unix socket
    stalled = _StalledServer()
    client = thing.Client("127.0.0.1", stalled.port, max_queue_items=4, max_queue_bytes=1 << 30)
    try:
        first = client.catch(STUCK, name="big")
        deadline = time.monotonic() + 10
        while not client.connected() and time.monotonic() < deadline:
            time.sleep(0.01)
        handles = []
        start = time.perf_counter()
        for _ in range(200):
            handles.append(client.catch(STUCK, name="big"))
        elapsed = time.perf_counter() - start
        assert elapsed < 1.0, f"catch blocked: {elapsed:.3f} s for 200 calls"
        dropped = [h for h in handles if h.done and h.error and "full" in h.error]
        assert len(dropped) >= 190
        assert client.dropped == len(dropped)
        assert not first.done  # still stuck in the stalled socket, not lost
    finally:
        client.close()
        stalled.close()


def test_a_full_queue_copies_nothing_but_a_capture_of_a_few_kib(monkeypatch) -> None:
    # A capture is snapshotted after it got room, so dropping costs no copy; one of a few KiB
    # is snapshotted first, as one lock costs more than its copy (channel.HOLD_FIRST_BYTES).
    monkeypatch.setenv("THING_TRANSPORT", "tcp")
    stalled = _StalledServer()
    client = thing.Client("127.0.0.1", stalled.port, max_queue_items=1)
    copies = []
    snapshot = thing.arrays._snapshot_array
    monkeypatch.setattr(thing.arrays, "_snapshot_array",
                        lambda array: copies.append(array.nbytes) or snapshot(array))
    try:
        first = client.catch(STUCK, name="first")  # read in place; its send never ends
        assert copies == []
        assert client.catch(np.zeros(4096), name="dropped").error == QUEUE_FULL.error
        assert copies == []  # 32 KiB, dropped before any copy
        assert client.catch(np.zeros(16), name="small").error == QUEUE_FULL.error
        assert copies == [128]
        assert client.dropped == 2 and not first.done
    finally:
        client.close()
        stalled.close()


@pytest.mark.parametrize("elements", [16, 4096])  # snapshotted before / after its room
def test_a_catch_waiting_for_room_when_the_client_closes_is_told_so(monkeypatch,
                                                                    elements: int) -> None:
    monkeypatch.setenv("THING_TRANSPORT", "tcp")
    stalled = _StalledServer()
    client = thing.Client("127.0.0.1", stalled.port, max_queue_items=1)
    try:
        client.catch(STUCK, name="first")  # its send never ends: it holds the one place
        waiting: list[thing.CaptureHandle] = []
        catcher = threading.Thread(target=lambda: waiting.append(
            client.catch(np.zeros(elements), name="waits", block=True)))
        catcher.start()
        poll(lambda: client._queue.lock._waiters, what="the catch to wait for room")
        client.close()
        catcher.join(10)
        assert waiting[0].done and waiting[0].error == "not sent: the client is closed"
        assert client._queue.items == 0 and client._queue.bytes == 0  # every place given back
        assert client.undelivered == {"closed": 2}
        # After the close: told so, and counted, as every capture not delivered is.
        late = client.catch(1.0, name="late")
        assert late.error == "not sent: the client is closed"
        assert client.undelivered == {"closed": 3}
    finally:
        client.close()
        stalled.close()


def test_block_true_waits_for_room(server: thing.Server) -> None:
    out = run_script(
        """
        import os, numpy as np, thing
        client = thing.Client("127.0.0.1", int(os.environ["THING_PORT"]), max_queue_items=1)
        arrays = [np.full(1 << 20, i, np.float32) for i in range(20)]
        handles = [client.catch(a, name="w", block=True) for a in arrays]
        print(sum(h.wait(30) for h in handles))
        """,
        server.port,
    )
    assert out.strip() == "20"
    assert [int(v[0]) for v in server.get_all("w")] == list(range(20))


def test_in_place_update_is_flagged_and_copy_is_not(server: thing.Server) -> None:
    run_script(
        """
        import numpy as np, torch, thing
        weight = torch.zeros(16 << 20)
        # A large capture ahead in the queue keeps the sender busy, so the update
        # below surely lands before the weight's bytes are all sent.
        plug = thing.catch(np.ones(16 << 20, np.float32), name="plug")
        torn = thing.catch(weight, name="torn")
        weight.add_(1)  # optimizer.step() while the send is in flight
        snapshot = thing.catch(weight, name="snapshot", copy=True)
        weight.add_(1)
        assert plug.wait(30) and torn.wait(30) and snapshot.wait(30)
        """,
        server.port,
    )
    assert server.capture("torn").consistent is False
    snapshot = server.capture("snapshot")
    assert snapshot.consistent is True
    assert bool((snapshot.value == 1).all())


def test_forked_child_gets_its_own_client(server: thing.Server) -> None:
    out = run_script(
        """
        import os, thing
        assert thing.catch(1, name="parent").wait(10)
        pid = os.fork()
        if pid == 0:
            ok = thing.catch(os.getpid(), name="child").wait(10)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert thing.catch(2, name="parent").wait(10)
        print(pid)
        """,
        server.port,
    )
    child_pid = int(out)
    assert server.get("child") == child_pid
    assert server.capture("child").sender.pid == child_pid
    assert server.get_all("parent") == [1, 2]
    assert server.capture("parent").sender.pid != child_pid


def test_ranks_from_environment(server: thing.Server) -> None:
    code = """
        import os, thing
        rank = int(os.environ["RANK"])
        assert thing.catch(rank * 10, name="loss").wait(10)
        assert thing.catch(rank * 10 + 1, name="loss").wait(10)
    """
    # As torchrun starts them: RANK, WORLD_SIZE and the run id of the launch.
    procs = [start_script(code, server.port, RANK=str(r), WORLD_SIZE="3",
                          TORCHELASTIC_RUN_ID="launch-1") for r in range(3)]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    for rank in range(3):
        assert server.get("loss", rank=rank) == rank * 10 + 1
        assert server.get_all("loss", rank=rank) == [rank * 10, rank * 10 + 1]
        capture = server.capture("loss", rank=rank)
        assert (capture.sender.rank, capture.sender.world_size) == (rank, 3)
    assert len(server.get_all("loss")) == 6


def test_explicit_server_argument(server: thing.Server) -> None:
    with thing.Server(port=0) as other:
        run_script(
            f"""
            import thing
            assert thing.catch("default", name="where").wait(10)
            assert thing.catch("other", name="where", server="127.0.0.1:{other.port}").wait(10)
            """,
            server.port,
        )
        assert server.get_all("where") == ["default"]
        assert other.get_all("where") == ["other"]


def test_queue_bytes_bound(server: thing.Server) -> None:
    client = thing.Client("127.0.0.1", server.port, max_queue_bytes=1 << 20, max_queue_items=100)
    try:
        assert client.catch(np.zeros(10), name="small").wait(10)
        # Larger than the byte bound while others wait: still sent when the queue is empty.
        assert client.catch(np.zeros(1 << 18), name="alone").wait(10)
    finally:
        client.close()
    assert json.dumps(server.store.names()) == '["small", "alone"]'


def test_per_name_and_per_server_bookkeeping_is_bounded(monkeypatch) -> None:
    monkeypatch.setenv("THING_MAX_NAMES", "100")
    monkeypatch.setenv("THING_MAX_SERVERS", "3")
    client = thing.Client("127.0.0.1", free_port())
    try:
        for i in range(1000):  # a job that makes up a new name every step
            client.catch(i, name=f"step-{i}", every=10)
        assert 100 - 100 // 8 <= len(client._throttles) <= 100  # an eighth forgotten at a time
        assert client.catch(0, name="step-999", every=10) is thing.client.SKIPPED  # still counted
        servers = [f"127.0.0.1:{free_port()}" for _ in range(6)]
        for server in servers:
            client.catch(0, name="x", server=server)
        assert len(client._channels) == 3 and list(client._channels) == servers[3:]
    finally:
        client.close()


def test_client_and_server_read_the_variables_catch_and_serve_read(monkeypatch) -> None:
    monkeypatch.setenv("THING_PORT", "0")
    monkeypatch.setenv("THING_HOST", "127.0.0.1")
    with thing.Server() as server:  # THING_PORT=0: a free port
        assert server.host == "127.0.0.1" and server.port > 0
        monkeypatch.setenv("THING_PORT", str(server.port))
        monkeypatch.setenv("THING_SERVER", "127.0.0.1")
        client = thing.Client()
        try:
            assert client.address == ("127.0.0.1", server.port)
            assert client.catch(np.arange(3), name="from_env").wait(10)
        finally:
            client.close()
        assert server.get("from_env").tolist() == [0, 1, 2]
    monkeypatch.setenv("THING_SERVER", "example.org:1234")
    assert thing.Client(server_port=5).address == ("example.org", 5)  # explicit wins
    assert thing.Client("localhost").address == ("localhost", 1234)
    assert thing.Client().address == ("example.org", 1234)
    monkeypatch.setenv("THING_PORT", "4321")
    assert thing.Server().port == 4321 and thing.Server(port=7).port == 7


def test_settings_that_would_spin_or_never_send_are_kept_in_bounds(monkeypatch) -> None:
    """0 as the reconnect interval would dial in a busy loop; 0 servers would open and
    close a connection at every catch; a timeout of 0 would make sockets non-blocking."""
    from thing import config

    for variable in ("THING_RECONNECT_INTERVAL", "THING_MAX_SERVERS", "THING_SEND_TIMEOUT",
                     "THING_CONNECT_TIMEOUT"):
        monkeypatch.setenv(variable, "0")
    assert config.reconnect_interval() == 0.05 and config.max_servers() == 1
    assert config.send_timeout() == config.connect_timeout() == 0.1
    monkeypatch.setenv("THING_RECONNECT_INTERVAL", "-3")
    assert config.reconnect_interval() == 0.05
    # A port out of range (a traceback from bind), a store that refuses every capture.
    for port in ("70000", "-5"):
        monkeypatch.setenv("THING_PORT", port)
        assert config.serve_port() == config.server_address()[1] == config.DEFAULT_PORT
    monkeypatch.setenv("THING_STORE_BYTES", "-1")
    assert config.store_max_bytes() == config._physical_memory() // 2


def test_sizes_are_taken_with_units_as_the_command_line_takes_them(monkeypatch, caplog) -> None:
    """THING_STORE_BYTES=4G was ignored ("not a number") where ``thing record --max-bytes
    4G`` took it; a size that is none is still ignored, saying so."""
    from thing import config

    monkeypatch.setenv("THING_STORE_BYTES", "4G")
    monkeypatch.setenv("THING_SNAPSHOT_BYTES", "16 KiB")
    monkeypatch.setenv("THING_MAX_HEADER_BYTES", "1.5MB")
    monkeypatch.setenv("THING_QUEUE_BYTES", "3e6")
    with thing.Server(port=0) as server:
        assert server.store.max_bytes == 4 << 30
    assert config.snapshot_bytes() == 16 << 10 and config.queue_max_bytes() == 3_000_000
    assert config.max_header_bytes() == 3 << 19
    for junk in ("4 gigs", "G", "inf"):
        monkeypatch.setenv("THING_STORE_BYTES", junk)
        assert config.store_max_bytes() == config._physical_memory() // 2
        assert f"ignoring THING_STORE_BYTES={junk!r}: not a size" in caplog.text
    # What float() reads still reads as before: -1 copies nothing at the call, as 0 does.
    for plain, size in (("-1", -1), ("+5", 5), ("1_000", 1000), ("5.", 5)):
        monkeypatch.setenv("THING_SNAPSHOT_BYTES", plain)
        assert config.snapshot_bytes() == size


def test_a_huge_integer_setting_is_taken_as_the_most_it_can_be(server: thing.Server,
                                                               monkeypatch) -> None:
    """THING_MAX_NAMES=1e19 is past a C integer, which the compiled core keeps it in: every
    catch was "not sent: Python int too large to convert to C ssize_t"."""
    monkeypatch.setenv("THING_MAX_NAMES", "1e19")
    client = thing.Client("127.0.0.1", server.port)
    try:
        assert client.catch(np.arange(3), name="counted", every=2).wait(10)
        assert not client.catch(np.arange(3), name="counted", every=2).wait(10)  # skipped
    finally:
        client.close()
    assert server.get("counted").tolist() == [0, 1, 2]


def test_small_captures_go_once_a_tick_and_at_once_when_waited_for(server: thing.Server,
                                                                    processes) -> None:
    """A training loop's small captures wait for the sender's tick (here a minute, so that
    nothing but the rules below can send them); a handle's wait(), flush(), a full batch and
    a large capture each send at once."""
    job = start_script(
        """
        import sys, numpy as np, thing, thing.channel
        thing.channel.TICK_SECONDS = 60.0
        client = thing.Client()
        assert client.catch(np.float32(0), name="tick").wait(30)  # sent, the tick begins
        handles = [client.catch(np.float32(i), name="tick") for i in range(1, 6)]
        print("queued", flush=True)
        sys.stdin.readline()
        assert handles[-1].wait(30), handles[-1].error
        print("waited", all(handle.done for handle in handles), flush=True)
        sys.stdin.readline()
        for i in range(6, 6 + thing.channel.BATCH):
            client.catch(np.float32(i), name="tick")
        print("batch", flush=True)
        sys.stdin.readline()
        client.catch(np.ones(thing.wire.SMALL_BYTES, np.uint8), name="large")
        print("large", flush=True)
        sys.stdin.readline()
        client.catch(np.float32(-1), name="flushed")
        print("flushed", client.flush(30), flush=True)
        """,
        server.port, stdin=True)
    processes.append(job)

    def go() -> None:
        job.stdin.write("\n")
        job.stdin.flush()

    def count(name: str) -> int:
        return len(server.store.get_all(name)) if name in server.store.names() else 0

    expect_line(job, "queued")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # within the tick nothing sends them
        assert count("tick") == 1
        time.sleep(0.05)
    go()
    assert expect_line(job, "waited").split() == ["waited", "True"]
    assert count("tick") == 6
    go()
    expect_line(job, "batch")
    poll(lambda: count("tick") == 6 + BATCH, what="a full batch, sent at once")
    go()
    expect_line(job, "large")
    poll(lambda: count("large") == 1, what="a large capture, sent at once")
    go()
    assert expect_line(job, "flushed").split() == ["flushed", "True"]
    assert count("flushed") == 1
    values = [float(value) for value in server.get_all("tick")]
    assert values == [float(i) for i in range(6 + BATCH)]  # all, in order
    assert job.wait(30) == 0


def test_a_small_queue_is_sent_before_it_fills_and_wait_never_blocks_on_the_lock(
        server: thing.Server) -> None:
    """With room for 8 captures, small ones go once half of it is taken, not at the tick
    (here a minute): 100 blocking catches finish. wait(timeout) keeps its timeout even
    while the client's lock is held (a signal handler that interrupted a catch)."""
    out = run_script(
        """
        import numpy as np, thing, thing.channel
        thing.channel.TICK_SECONDS = 60.0
        client = thing.Client(max_queue_items=8)
        handles = [client.catch(np.float32(i), name="q", block=True) for i in range(100)]
        print(sum(handle.wait(30) for handle in handles), client.dropped)
        """,
        server.port, timeout=50)
    assert out.split() == ["100", "0"]
    assert [float(value) for value in server.get_all("q")] == [float(i) for i in range(100)]



def test_room_comes_back_once_a_capture_is_sent(server: thing.Server) -> None:
    """A capture's room in the client's queue comes back once its bytes are sent, not with
    its answer, which the sender leaves for its tick (here a minute) unless someone waits:
    a small queue with ``block=True`` keeps moving, and nothing is dropped."""
    out = run_script(
        """
        import time, numpy as np, thing, thing.channel
        thing.channel.TICK_SECONDS = 60.0
        client = thing.Client(max_queue_items=10)
        started = time.monotonic()
        handles = [client.catch(np.float32(i), name="room", block=True) for i in range(200)]
        caught = time.monotonic()
        flushed = client.flush(60)  # woken by the last answer, not by its timeout
        print(caught - started < 30, client.dropped, flushed, time.monotonic() - caught < 30,
              sum(handle.id is not None for handle in handles))
        """,
        server.port, timeout=150)
    assert out.split() == ["True", "0", "True", "True", "200"]
    assert [float(value) for value in server.get_all("room")] == list(range(200))


def test_a_capture_larger_than_the_queue_is_not_dropped_for_answers_not_yet_read(
        server: thing.Server) -> None:
    """One larger than ``THING_QUEUE_BYTES`` goes only into an empty queue; captures already
    sent no longer count there, though the sender reads their answers only at its tick."""
    out = run_script(
        """
        import time, numpy as np, thing, thing.channel
        thing.channel.TICK_SECONDS = 60.0
        client = thing.Client(max_queue_bytes=1 << 20)
        sent = [client.catch(np.float32(1), name="small"),
                client.catch(np.ones(1 << 14), name="medium")]  # 128 KiB: sent at once
        deadline = time.monotonic() + 20
        while client._queue.items and time.monotonic() < deadline:
            time.sleep(0.01)
        big = client.catch(np.ones(1 << 18), name="big")  # 2 MiB
        print(big.wait(20), big.error, all(handle.wait(20) for handle in sent), client.dropped)
        """,
        server.port, timeout=80)
    assert out.split() == ["True", "None", "True", "0"]
    assert server.get("big").nbytes == 2 << 20


def test_a_capture_sent_in_shared_memory_holds_its_room_until_answered(monkeypatch) -> None:
    """Its pages live in a memfd until the server takes it, so the room it takes in the
    job's memory comes back with its answer, not once the descriptor is sent."""
    monkeypatch.setenv("THING_TRANSPORT", "shm")
    server = thing.Server(port=0).start()
    arrived, answering = threading.Event(), threading.Event()
    add = server.store.add

    def add_once_answering(*args: object, **kwargs: object) -> object:
        arrived.set()
        answering.wait(30)
        return add(*args, **kwargs)

    monkeypatch.setattr(server.store, "add", add_once_answering)
    client = thing.Client("127.0.0.1", server.port, max_queue_bytes=3 << 20)
    try:
        first = client.catch(np.ones(2 << 20, np.uint8), name="first")
        assert arrived.wait(10)  # the memfd was sent, and taken; its answer waits
        assert client.transport() == "shm"
        assert client.catch(np.ones(2 << 20, np.uint8), name="second") is QUEUE_FULL
        answering.set()
        assert first.wait(10), first.error
        third = client.catch(np.ones(2 << 20, np.uint8), name="third")
        assert third.wait(10), third.error
        assert client._queue.items == 0 and client._queue.bytes == 0
    finally:
        answering.set()
        client.close()
        server.close()


def test_a_catch_at_interpreter_teardown_after_the_client_closed_says_closed(
        server: thing.Server) -> None:
    """A module global's finalizer catches as the interpreter tears down, after thing's own
    exit handler closed the client: told the client is closed, quietly (it was an
    ImportError of the import machinery, logged as a warning, without its name)."""
    result = run_script(
        """
        import logging, sys, thing
        logging.basicConfig(level=logging.WARNING)
        out = sys.__stdout__

        class Tracker:
            def __del__(self):
                out.write(repr(thing.catch(42.0, name="from_del")) + "\\n")

        assert thing.catch(0, name="warm").wait(10)
        tracker = Tracker()  # freed at teardown, after the exit handlers ran
        """,
        server.port,
        full=True,
    )
    assert result.stdout == "<CaptureHandle None not sent: the client is closed>\n", result
    assert result.stderr == ""


def test_a_signal_handler_that_interrupts_a_catch_may_flush_close_or_wait_without_hanging(
        server: thing.Server) -> None:
    """A SIGTERM handler that flushes (or closes, waits, counts) and exits: landing while a
    catch holds the send queue's lock, flush(2) hung the job for good, and wait(5) always
    ran out, the sender needing that same lock. Each now returns at once; the process's end
    still delivers what is queued."""
    result = run_script(
        """
        import json, signal, time, numpy as np, thing
        from thing import send_queue

        client = thing.Client()
        assert client.catch(0.0, name="warm").wait(10)
        earlier = client.catch(1.0, name="earlier")  # queued for the tick
        took = {}
        def on_term(signum, frame):
            for what, call in (("flush", lambda: client.flush(2.0)),
                               ("wait", lambda: earlier.wait(5.0)),
                               ("undelivered", lambda: client.undelivered),
                               ("close", lambda: client.close(2.0))):
                started = time.monotonic()
                call()
                took[what] = time.monotonic() - started
        signal.signal(signal.SIGTERM, on_term)

        take = send_queue.SendQueue.take
        def take_then_signal(self, *args, **kwargs):  # where a real signal may land
            room = take(self, *args, **kwargs)
            send_queue.SendQueue.take = take
            signal.raise_signal(signal.SIGTERM)  # the handler runs with the lock held
            return room
        send_queue.SendQueue.take = take_then_signal
        interrupted = client.catch(2.0, name="interrupted")
        assert earlier.wait(10) and interrupted.wait(10)  # the client is not closed
        assert client.flush(10)
        print(json.dumps(took))
        """,
        server.port,
        timeout=60,
    )
    took = json.loads(result)
    assert set(took) == {"flush", "wait", "undelivered", "close"}
    assert all(seconds < 1 for seconds in took.values()), took
    assert [server.get(name) for name in ("earlier", "interrupted")] == [1.0, 2.0]


def test_wait_keeps_its_timeout_while_the_client_lock_is_held(server: thing.Server,
                                                              monkeypatch) -> None:
    """wait(timeout) asks the sender to hurry without waiting for the client's lock: a
    signal handler may wait on a handle while the catch it interrupted holds it."""
    monkeypatch.setattr(thing.channel, "TICK_SECONDS", 60.0)
    client = thing.Client("127.0.0.1", server.port)
    try:
        assert client.catch(np.float32(1), name="locked").wait(10)  # sent: the tick begins
        handle = client.catch(np.float32(2), name="locked")  # waits for the tick
        with client._queue.mutex:  # what the interrupted catch holds
            started = time.monotonic()
            assert not handle.wait(0.2)
            assert time.monotonic() - started < 5
        assert handle.wait(10), handle.error  # the lock is free: sent at once
        assert [float(value) for value in server.get_all("locked")] == [1.0, 2.0]
    finally:
        client.close()


def test_a_large_capture_wakes_an_idle_sender_even_after_a_hurry_that_found_the_lock_taken(
        server: thing.Server) -> None:
    """A hurry that could not take the client's lock leaves a flag and no wake-up; the
    next capture that must go at once still wakes the sender, asleep with nothing queued."""
    client = thing.Client("127.0.0.1", server.port)
    try:
        assert client.catch(np.float32(1), name="first").wait(10)
        channel = client._channels[None]
        poll(lambda: channel._idle, what="the sender asleep after a quiet tick")
        with client._queue.mutex:  # a catch interrupted by a signal handler holds it
            channel.hurry()  # from that handler: it cannot take the lock
        client.catch(np.ones(wire.SMALL_BYTES, np.uint8), name="big")  # sent at once; no wait
        poll(lambda: "big" in server.store.names(), timeout=10, what="the large capture")
    finally:
        client.close()


def test_a_handle_wakes_every_waiter_once_and_keeps_no_waiter_after() -> None:
    """Handles have no lock of their own: the first wait makes one, shared by every thread
    waiting on that handle, and the outcome releases it. A timed-out wait leaves the
    handle pending; a look (wait(0)) never asks the sender to hurry."""
    from thing import handles

    hurried: list[int] = []
    handle = handles.CaptureHandle("x", None, lambda: hurried.append(1))
    assert not handle.done and handle.wait(0) is False and hurried == []
    assert handle.wait(0.05) is False and not handle.done and hurried == [1]
    results: list[bool] = []
    waiters = [threading.Thread(target=lambda: results.append(handle.wait(10)))
               for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    poll(lambda: len(hurried) == 5, 10)  # every waiter is waiting (or about to)
    handle.resolve(7)
    handle.resolve(None, "too late: only the first outcome counts")
    for waiter in waiters:
        waiter.join(10)
    assert results == [True] * 4 and (handle.id, handle.error) == (7, None)
    assert handle.wait() is True and handle not in handles._waiters

    refused = handles.CaptureHandle("y")
    threading.Timer(0.05, refused.resolve, (None, "refused by the server: no")).start()
    assert refused.wait(10) is False and refused.done and refused.error.endswith("no")
    assert refused not in handles._waiters


def test_a_handle_resolved_while_its_first_waiter_arrives_is_not_waited_for(monkeypatch
                                                                           ) -> None:
    """The outcome lands between a wait() putting its waiter in place and looking again:
    the wait returns at once, with the outcome, and leaves no waiter behind."""
    from thing import handles

    handle = handles.CaptureHandle("x")

    class ResolvedMeanwhile(dict):
        def setdefault(self, key, default=None):
            placed = super().setdefault(key, default)
            if key is handle:
                handle.resolve(None, "refused by the server: meanwhile")
            return placed

    monkeypatch.setattr(handles, "_waiters", ResolvedMeanwhile())
    started = time.monotonic()
    assert handle.wait(10) is False and handle.error.endswith("meanwhile")
    assert time.monotonic() - started < 5 and handle not in handles._waiters


def test_a_signal_handler_may_wait_on_a_handle_while_the_main_thread_waits_on_another(
) -> None:
    """No lock shared by handles is held while waiting: a handler that waits on a capture
    (a checkpoint on SIGTERM) interrupting a wait on another finishes, and so do both."""
    import signal

    from thing.handles import CaptureHandle

    outer, inner = CaptureHandle("outer"), CaptureHandle("inner")
    seen: list[bool] = []

    def on_signal(signum, frame) -> None:
        threading.Timer(0.05, inner.resolve, (2,)).start()
        seen.append(inner.wait(10))
        outer.resolve(1)

    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        threading.Timer(0.05, signal.pthread_kill,
                        (threading.main_thread().ident, signal.SIGUSR1)).start()
        assert outer.wait(10) is True and seen == [True]
        assert (outer.id, inner.id) == (1, 2)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_framework_another_thread_is_importing_changes_nothing(server: thing.Server) -> None:
    """While another thread imports torch (or jax), it sits in sys.modules half made, its
    types not defined yet: a float, a list or a numpy array caught meanwhile is still
    sent and stored (they were "not sent: partially initialized module 'torch' has no
    attribute 'Tensor'"), and the REPL's statistics of what arrived still work."""
    run_script("""
        import sys, types
        import numpy as np
        import thing
        for module in ("torch", "jax"):  # as an import in another thread leaves them, partway
            sys.modules[module] = types.ModuleType(module)
        handles = [thing.catch(0.5, name="f"), thing.catch([1, 2.0], name="l"),
                   thing.catch(np.arange(3.0), name="a"), thing.catch(np.float32(2), name="s")]
        assert all(h.wait(10) for h in handles), [h.error for h in handles]
    """, server.port)
    assert [server.store.get(name).value for name in "fl"] == [0.5, [1, 2.0]]
    assert server.store.get("a").value.tolist() == [0.0, 1.0, 2.0]
    half = sys.modules.get("torch")
    sys.modules["torch"] = types.ModuleType("torch")
    try:
        assert thing.history_stats.capture_stats(server.store.get("a")).values.max == 2.0
        assert "float64" in str(thing.reports.describe(server.store, "a"))
    finally:
        if half is None:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = half


def test_a_client_dropped_without_close_delivers_what_it_queued_then_ends(
        server: thing.Server) -> None:
    """`thing.Client(...).catch(x)` in one line, the client collected at once: the capture
    is still delivered (in a loop of them, and at the process's end), and each such
    client's sender thread and socket end once it is delivered; a closed client whose
    handle is kept is collected (its handle held it, through the sender).

    Not asserted: the thread ends within a second or two of the collection (within
    IDLE_RECHECK_SECONDS where the collector ran inside thing's own work)."""
    result = run_script(f"""
        import gc, threading, time, weakref
        import numpy as np
        import thing
        before = threading.active_count()
        handles = [thing.Client("127.0.0.1", {server.port}).catch(np.full(4, k), name="one")
                   for k in range(20)]
        assert all(h.wait(10) for h in handles), [h.error for h in handles]
        gc.collect()  # a client is collected by the cyclic collector (its gate holds it)
        deadline = time.monotonic() + 10
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert threading.active_count() == before, threading.enumerate()

        closed = thing.Client("127.0.0.1", {server.port})
        kept = closed.catch(1.0, name="kept")
        assert kept.wait(10)
        closed.close()
        gone = weakref.ref(closed)
        del closed
        gc.collect()
        assert gone() is None, gc.get_referrers(gone())
        thing.Client("127.0.0.1", {server.port}).catch(np.arange(3.0), name="at_exit")
    """, full=True)
    assert result.stderr == "", result.stderr
    assert sorted(c.value.tolist() for c in server.store.get_all("one", run="all")) == [
        [k] * 4 for k in range(20)]  # twenty connections: in whatever order they came
    assert server.store.get("at_exit").value.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.skipif(thing._core.BACKEND != "compiled", reason="the twin cannot untrack")
def test_queued_captures_are_not_walked_by_the_garbage_collector(server: thing.Server) -> None:
    """A job's full collections walk every object it tracks (torch's alone are 170,000): a
    capture waiting behind others to be sent (a flood) is none of them, so the collector
    does not walk them over and over; each still arrives as it was caught."""
    out = run_script(
        """
        import gc, numpy as np, thing, thing.channel
        thing.channel.TICK_SECONDS = 60.0
        client = thing.Client(max_queue_items=10**4)
        assert client.catch(0.0, name="warm").wait(10)
        thing.channel.MAX_IN_FLIGHT = 0  # none sent: the queue grows, as behind a busy sender
        gc.collect()
        before = len(gc.get_objects())
        handles = [client.catch(np.float32([i, -i]), name="s") for i in range(2000)]
        print(len(client._channels[None]._queue), (len(gc.get_objects()) - before) / 2000)
        thing.channel.MAX_IN_FLIGHT = 128
        assert handles[-1].wait(30), handles[-1].error
        """,
        server.port,
    )
    queued, per_capture = out.split()
    assert int(queued) == 2000
    # The first BATCH are tracked (they go with the next send), and the list of handles.
    assert float(per_capture) < 0.3, per_capture
    kept = server.get_all("s")
    assert [value.tobytes() for value in kept] == [
        np.float32([i, -i]).tobytes() for i in range(2000)]


def test_a_slow_lookup_of_another_server_does_not_hold_up_other_threads(
        server: thing.Server) -> None:
    """The first catch to a new server= string looked this host's names up (getfqdn, seconds
    where DNS is unreachable) holding the lock every catch takes: the training thread's
    catches to its own server waited as long."""
    out = run_script(
        """
        import socket, threading, time, numpy as np, thing, thing.sockets
        real = socket.getfqdn
        def unreachable_dns(*args):
            time.sleep(2.0)
            return real(*args)
        socket.getfqdn = unreachable_dns
        thing.sockets.own_names.cache_clear()
        assert thing.catch(0, name="warm").wait(10)
        worst, stop = [0.0], threading.Event()
        def training():
            while not stop.is_set():
                start = time.perf_counter()
                thing.catch(np.zeros(4), name="loss")
                worst[0] = max(worst[0], time.perf_counter() - start)
                time.sleep(0.001)
        thread = threading.Thread(target=training)
        thread.start()
        time.sleep(0.1)
        start = time.perf_counter()
        thing.catch(1, name="other", server=socket.gethostname() + "-metrics:9")
        looked_up = time.perf_counter() - start
        stop.set()
        thread.join()
        assert looked_up > 1.5 and worst[0] < 1.0, (looked_up, worst[0])
        print("ok")
        """,
        server.port,
    )
    assert out.strip() == "ok"


def test_a_slow_log_handler_does_not_hold_up_other_threads(server: thing.Server) -> None:
    """The full queue's warning was logged holding the lock every catch takes: the
    application's handler (a log shipper on a slow network) held up every thread's catch."""
    out = run_script(
        """
        import logging, threading, time, numpy as np, thing
        logged_by = []
        class SlowShipper(logging.Handler):
            def emit(self, record):
                if "send queue full" in record.getMessage():
                    logged_by.append(threading.current_thread().name)
                    time.sleep(2.0)
        logging.getLogger("thing").addHandler(SlowShipper())
        assert thing.catch(0, name="warm").wait(10)
        worst, stop = {}, threading.Event()
        def catching(name, value, pause):
            mine = threading.current_thread().name
            worst[mine] = 0.0
            while not stop.is_set():
                start = time.perf_counter()
                thing.catch(value, name=name)
                worst[mine] = max(worst[mine], time.perf_counter() - start)
                time.sleep(pause)
        threads = [threading.Thread(target=catching, args=args, name=args[0]) for args in
                   (("loss", np.zeros(4), 0.001), ("flood", np.zeros(1 << 20), 0.0))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while not logged_by and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(2.5)
        stop.set()
        for thread in threads:
            thread.join()
        (logger,) = logged_by
        other = "loss" if logger == "flood" else "flood"
        assert worst[other] < 1.0, (logger, worst)
        print("ok")
        """,
        server.port, THING_QUEUE_ITEMS="4",
    )
    assert out.strip() == "ok"


def test_flush_returns_once_every_handle_knows_its_outcome(server: thing.Server) -> None:
    """flush() returned once the answers were counted, before the sender had told the
    handles: a handle read right after it could still say nothing (here the telling is
    slowed down to show it)."""
    out = run_script(
        """
        import time, numpy as np, thing, thing.channel
        tell = thing.channel._resolve
        def slowly(finished):
            time.sleep(0.3)
            tell(finished)
        thing.channel._resolve = slowly
        client = thing.Client()
        handles = [client.catch(np.arange(i + 1), name="x") for i in range(3)]
        assert client.flush(10)
        print([handle.wait(0) for handle in handles])
        """,
        server.port,
    )
    assert out.strip() == "[True, True, True]"
