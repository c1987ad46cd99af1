"""The recorder: ``thing record DIR`` and ``thing serve --record DIR``, in real processes.

Every capture a client process sends is in the recording, bit for bit, in
order; a recorder SIGKILLed at random moments (many times, on one directory)
always leaves a recording that loads, holding every segment it reported; a
full disk (a small tmpfs) drops captures, counted, and writing resumes when
space returns; the byte budget deletes the oldest segments.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import thing
from thing import sockets
from thing.captures import Sender
from thing.errors import ThingError
from thing.recorder import DISK_FULL, FALLING_BEHIND, Recorder
from thing.recording import SEGMENT_NAME, segment_path, segments_of
from thing.segments import write_segment, write_unflushed
from thing.store import HistoryStore

from .conftest import ROOT, free_port, poll, run_script, script_env, start_script

# Sends ("step", np.full(SIZE, i)) for i = 0, 1, ... COUNT - 1; with WAIT, waits for each
# to be stored.
STREAM = """
    import os, sys, numpy as np, thing
    count, size = int(os.environ["COUNT"]), int(os.environ["SIZE"])
    for i in range(count):
        handle = thing.catch(np.full(size, i, np.int64), name="step", block=True)
        if os.environ.get("WAIT"):
            assert handle.wait(30), handle.error
"""


def _record(directory: Path, port: int, *options: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "thing", "record", str(directory), "--port", str(port), *options],
        env=script_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_ready(recorder: subprocess.Popen) -> None:
    assert recorder.stdout is not None
    line = recorder.stdout.readline()
    assert line.startswith("thing is recording"), (line, recorder.stderr.read()
                                                  if recorder.poll() is not None else "")


def _steps(directory: Path) -> list[int]:
    """The ``step`` values of a recording, checked bit for bit against their pattern."""
    store = HistoryStore()
    store.load(directory)
    steps = []
    for capture in store.get_all("step") if "step" in store.names() else []:
        value = capture.value
        assert value.dtype == np.int64 and (value == value[0]).all()
        steps.append(int(value[0]))
    return steps


def test_every_capture_a_client_sends_is_recorded_in_order(tmp_path: Path) -> None:
    port = free_port()
    recorder = _record(tmp_path / "rec", port, "--segment-bytes", "100K")
    try:
        _wait_ready(recorder)
        run_script(STREAM, port, COUNT="300", SIZE="1000", WAIT="1")
        recorder.send_signal(signal.SIGTERM)
        out, err = recorder.communicate(timeout=30)
    finally:
        if recorder.poll() is None:
            recorder.kill()
    assert recorder.returncode == 0, err
    assert _steps(tmp_path / "rec") == list(range(300))
    segment_lines = [line for line in out.splitlines() if line.startswith("segment-")]
    assert len(segment_lines) == len(segments_of(tmp_path / "rec")) >= 20  # 8 KB each, 100K
    assert "thing recorded 300 captures" in out


def test_a_change_made_in_the_repl_is_in_the_history_not_in_the_recording(tmp_path: Path
                                                                          ) -> None:
    """`get()` hands out the kept array, the REPL's to change in place; the recorder wrote
    the same array seconds later, so `w *= 100` made the recording say the job sent it."""
    with thing.Server(port=0) as server:
        server.record(tmp_path / "rec")
        run_script(STREAM, server.port, COUNT="3", SIZE="1000", WAIT="1")
        changed = server.get("step")
        changed *= 100
        server.get_all("step")[0][:] = -1
    assert _steps(tmp_path / "rec") == [0, 1, 2]  # bit for bit, as sent
    assert np.array_equal(changed, np.full(1000, 200, np.int64))  # the history's, changed


def test_a_recorder_killed_at_random_moments_always_leaves_a_recording(tmp_path: Path) -> None:
    """SIGKILL 20 times while a client streams; restart on the same directory each time."""
    directory, port = tmp_path / "rec", free_port()
    streamer = start_script(STREAM, port, COUNT="100000000", SIZE="2000")
    reported: list[str] = []  # segment files the recorders said they wrote
    reported_captures = 0  # and the captures they said those hold
    rng = random.Random(1234)
    try:
        for _ in range(20):
            recorder = _record(directory, port, "--segment-bytes", "64K",
                               "--segment-seconds", "0.1")
            _wait_ready(recorder)
            lines: list[str] = []
            reader = threading.Thread(target=lambda r=recorder, out=lines: out.extend(r.stdout))
            reader.start()
            time.sleep(rng.uniform(0.2, 1.2))
            recorder.kill()
            recorder.wait(10)
            reader.join(10)
            written = [line for line in lines if line.startswith("segment-")]
            reported += [line.split(":")[0] for line in written]
            reported_captures += sum(int(line.split()[1]) for line in written)
            # Whatever moment the kill came, the directory loads, whole.
            steps = _steps(directory)
            assert steps == sorted(set(steps)), "captures repeated or out of order"
            names = {path.name for _, path in segments_of(directory)}
            assert set(reported) <= names, "a segment reported written is missing"
            assert len(steps) >= reported_captures
    finally:
        streamer.kill()
        streamer.communicate()
    assert len(reported) >= 20 and len(_steps(directory)) > 100
    # Nothing a killed writer left lies around uncounted: only segments and the lock.
    assert {entry.name for entry in directory.iterdir()
            if not SEGMENT_NAME.fullmatch(entry.name)} <= {".thing-recorder.lock",
                                                            ".thing-staging"}
    with Recorder(HistoryStore(), directory):
        assert not list((directory / ".thing-staging").iterdir())


def test_what_a_crashed_writer_left_is_deleted_by_the_next(tmp_path: Path) -> None:
    """The safetensors package writes a temporary file of its own, named as it likes, before
    the segment's: a SIGKILL then left it (8 MB here) beside the recording, for ever."""
    directory = tmp_path / "rec"
    staging = directory / ".thing-staging"
    staging.mkdir(parents=True)
    for leftover in (".tmpqPTnE4", "segment-000001.safetensors"):
        (staging / leftover).write_bytes(b"\0" * 1000)
    store = HistoryStore()
    store.add("x", np.arange(3), (), 24, Sender("a:1"))
    with Recorder(store, directory):
        assert not list(staging.iterdir())
        store.add("x", np.arange(4), (), 32, Sender("a:1"))
    assert not list(staging.iterdir())
    loaded = HistoryStore()
    loaded.load(directory)
    assert loaded.get("x").value.tolist() == list(range(4))


def test_whole_segments_a_killed_writer_left_staged_join_the_recording(tmp_path: Path,
                                                                       caplog) -> None:
    """Written but not yet named when the writer was killed, a segment is whole (a killed
    process's writes all reach the file): the next recorder names it, and says so, where
    it deleted it without a word. One cut short, or whose number is taken, is deleted."""
    directory = tmp_path / "rec"
    directory.mkdir()
    store = HistoryStore()
    for step in range(3):
        store.add("x", np.full(4, step), (), 32, Sender("a:1"), call=step + 1)
    first, second, third = store.get_all("x")
    write_segment(segment_path(directory, 1), [first])
    for number, capture in ((1, second), (2, second), (3, third)):
        temporary, _ = write_unflushed(segment_path(directory, number), [capture])
        if number == 3:
            temporary.write_bytes(temporary.read_bytes()[:-5])  # cut short
    with caplog.at_level("WARNING", logger="thing"), Recorder(store, directory):
        assert not list((directory / ".thing-staging").iterdir())
        store.add("x", np.full(4, 9), (), 32, Sender("a:1"), call=4)
    messages = [record.getMessage() for record in caplog.records]
    assert any("1 whole segment (1 capture)" in message for message in messages)
    assert any("deleted 2 files" in message for message in messages)
    assert [number for number, _ in segments_of(directory)] == [1, 2, 3]
    loaded = HistoryStore()
    assert loaded.load(directory) == 3
    assert [c.value.tolist()[0] for c in loaded.get_all("x")] == [0, 1, 9]
    # Two names for one number (6 digits and 7): the first is named, the other deleted.
    staging = directory / ".thing-staging"
    for name, capture in (("segment-000007.safetensors", first),
                          ("segment-0000007.safetensors", third)):
        temporary, _ = write_unflushed(directory / name, [capture])
        assert temporary == staging / name
    caplog.clear()
    with caplog.at_level("WARNING", logger="thing"), Recorder(store, directory):
        pass
    assert [number for number, _ in segments_of(directory)] == [1, 2, 3, 7]
    assert any("1 whole segment (1 capture)" in r.getMessage() for r in caplog.records)
    assert not list(staging.iterdir())


def test_a_staging_folder_that_is_a_link_is_refused_and_its_target_untouched(
        tmp_path: Path) -> None:
    """A recording unpacked from someone's archive may hold a link in place of its staging
    folder: clearing it would delete the files it points at, and segments would be
    written there."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "model.pt").write_bytes(b"weights")
    directory = tmp_path / "rec"
    directory.mkdir()
    (directory / ".thing-staging").symlink_to(victim)
    with pytest.raises(OSError, match="not a directory of this user's own"):
        Recorder(HistoryStore(), directory).start()
    assert [p.name for p in victim.iterdir()] == ["model.pt"]
    (directory / ".thing-staging").unlink()  # once removed, the directory records (unlocked)
    with Recorder(HistoryStore(), directory):
        pass


def test_a_directory_others_may_write_to_is_not_recorded_or_saved_into(tmp_path: Path) -> None:
    """Another user could put segments of their own among the recording's (a later load
    takes them for its captures), or take its own away."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # made by someone else for everyone, as /tmp/run may be
    with pytest.raises(ThingError, match="others may write to it"):
        Recorder(HistoryStore(), shared).start()
    store = HistoryStore()
    store.add("x", 1.0, (), 0, Sender("a:1"))
    with pytest.raises(ThingError, match="others may write to it"):
        store.save(shared)
    assert list(shared.iterdir()) == []
    # What thing makes itself, a group may not write to, whatever the umask: under 002 a
    # user whose group is not their own private one had their new directory refused.
    umask = os.umask(0o002)
    try:
        with Recorder(HistoryStore(), tmp_path / "fresh"):
            pass
        store.save(tmp_path / "saved")
    finally:
        os.umask(umask)
    for made in ("fresh", "saved"):
        assert stat.S_IMODE((tmp_path / made).stat().st_mode) == 0o755
    # Writable by this user's own private group (umask 002, as on Ubuntu): theirs alone.
    own = tmp_path / "own"
    own.mkdir()
    own.chmod(0o775)
    if sockets._private_group(os.getgid()):
        with Recorder(HistoryStore(), own):
            pass
    if os.geteuid() == 0:
        # Another user's, made for us (0755): theirs all the same.
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ThingError, match="another user's"):
            Recorder(HistoryStore(), theirs).start()
        # Ours, writable by a group of others (a setgid project directory): they too could.
        os.chown(own, 0, 65534)
        with pytest.raises(ThingError, match="others may write to it"):
            Recorder(HistoryStore(), own).start()
        with pytest.raises(ThingError, match="others may write to it"):
            store.save(own)


def test_another_users_link_is_not_recorded_or_saved_through(tmp_path: Path) -> None:
    """A neighbour's link where a job records or saves (/tmp/run1 -> the victim's own
    directory, where the kernel follows links in shared directories) had the recorder
    write there, and its byte budget delete the victim's segments."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a link another user owns")
    victim = tmp_path / "important"
    store = HistoryStore()
    store.add("old", 1.0, (), 0, Sender("a:1"))
    store.save(victim)
    before = sorted(path.name for path in victim.iterdir())
    link = tmp_path / "run1"
    link.symlink_to(victim)
    os.lchown(link, 65534, 65534)
    with pytest.raises(ThingError, match="a symbolic link another user made"):
        Recorder(HistoryStore(), link, max_bytes=1).start()
    with pytest.raises(ThingError, match="a symbolic link another user made"):
        store.save(link)
    assert sorted(path.name for path in victim.iterdir()) == before
    os.lchown(link, os.getuid(), os.getgid())  # one's own link is followed, as before
    with Recorder(HistoryStore(), link):
        pass


@pytest.mark.parametrize("seconds", [float("inf"), 1e300, float("nan"), 0.0, -1.0])
def test_a_segment_time_that_is_no_time_is_refused(tmp_path: Path, seconds: float) -> None:
    # inf overflowed the writer's wait: every capture was lost, and 0 reported recorded.
    with pytest.raises(ValueError, match="segment_seconds must be more than 0"):
        Recorder(HistoryStore(), tmp_path / "rec", segment_seconds=seconds)
    assert not (tmp_path / "rec").exists()


def test_a_full_disk_drops_counted_captures_and_writing_resumes(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with thing.Server(port=0) as server:
            recorder = server.record(mount / "rec", segment_bytes=256 << 10,
                                     segment_seconds=0.05)
            ballast = mount / "ballast"
            ballast.write_bytes(b"\0" * ((4 << 20) - (128 << 10)))  # leaves 128 KiB
            run_script(STREAM, server.port, COUNT="40", SIZE="16384", WAIT="1")  # 128 KiB each
            # Every one of them dropped before there is room again: the last may still be
            # in the segment being written (a room made meanwhile would take it).
            poll(lambda: recorder.dropped.get(DISK_FULL) == 40, what="every capture dropped")
            assert recorder.written == 0 and len(server.store) >= 1  # still receiving
            ballast.unlink()
            run_script(STREAM.replace("range(count)", "range(1000, 1000 + count)"),
                       server.port, COUNT="5", SIZE="16384", WAIT="1")
            poll(lambda: recorder.written == 5, what="writing to resume")
            dropped = recorder.dropped[DISK_FULL]
        assert dropped >= 30
        store = HistoryStore()
        store.load(mount / "rec")
        assert [int(v.value[0]) for v in store.get_all("step")] == list(range(1000, 1005))
        assert store.overview().undelivered == {DISK_FULL: dropped}
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_the_byte_budget_deletes_the_oldest_segments(tmp_path: Path) -> None:
    written = []
    with thing.Server(port=0) as server:
        recorder = server.record(tmp_path / "rec", max_bytes=300_000, segment_bytes=64 << 10,
                                 on_segment=written.append)
        run_script(STREAM, server.port, COUNT="200", SIZE="4000", WAIT="1")  # 32 KB each
    assert recorder.written == 200  # the last segment written as the server closed
    kept = segments_of(tmp_path / "rec")
    assert sum(path.stat().st_size for _, path in kept) <= 300_000
    assert written[-1].kept_bytes <= 300_000 and len(written) > len(kept)
    steps = _steps(tmp_path / "rec")
    assert steps == list(range(200 - len(steps), 200))  # the newest, none missing


def test_a_recorder_refuses_to_number_a_segment_no_reader_would_see(tmp_path: Path) -> None:
    """After a segment numbered 10**18 - 1 (a crafted directory), the next one's name would
    not be a segment's: unseen by load, never deleted by the byte budget."""
    from thing.recording import segment_path
    from thing.segments import write_segment

    directory = tmp_path / "rec"
    directory.mkdir()
    write_segment(segment_path(directory, 10**18 - 1), [])
    with pytest.raises(ThingError, match="cannot number one after it"):
        Recorder(HistoryStore(), directory).start()
    segment_path(directory, 10**18 - 1).unlink()
    with Recorder(HistoryStore(), directory):  # the lock was let go: the next may take it
        pass


def test_dropped_counts_of_several_recordings_add_up_and_stay_few(tmp_path: Path) -> None:
    """Loading a second recording adds its dropped counts (it replaced the first's); the
    same one loaded again adds nothing; a file claiming thousands of reasons is kept to a
    few (its counts all there) rather than held, and printed, for ever."""
    from thing.recording import MAX_DROPPED_REASONS, segment_path
    from thing.segments import write_segment

    for name, counts in (("a", {DISK_FULL: 5}), ("b", {FALLING_BEHIND: 3})):
        (tmp_path / name).mkdir()
        write_segment(segment_path(tmp_path / name, 1), [], counts)
    store = HistoryStore()
    for name in ("a", "b", "a"):
        store.load(tmp_path / name)
    assert store.overview().undelivered == {DISK_FULL: 5, FALLING_BEHIND: 3}

    (tmp_path / "many").mkdir()
    for number in range(1, 4):
        write_segment(segment_path(tmp_path / "many", number), [],
                      {f"reason {number}-{i}": 1 for i in range(1000)})
    loaded = HistoryStore()
    loaded.load(tmp_path / "many")
    undelivered = loaded.overview().undelivered
    assert len(undelivered) == MAX_DROPPED_REASONS + 1 and sum(undelivered.values()) == 3000


def test_a_sender_faster_than_the_writer_is_slowed_not_dropped(tmp_path: Path) -> None:
    """Past max_pending_bytes a receiving thread waits for the writer (the sender's frames
    wait in its queue); past max_wait it gives up, and the capture is counted as dropped."""
    options = {"segment_bytes": 1 << 20, "segment_seconds": 0.3, "max_pending_bytes": 200_000}
    with thing.Server(port=0) as server:
        patient = server.record(tmp_path / "patient", **options)
        run_script(STREAM, server.port, COUNT="20", SIZE="8192", WAIT="1")  # 64 KiB each
    assert patient.dropped == {} and patient.written == 20
    assert _steps(tmp_path / "patient") == list(range(20))
    with thing.Server(port=0) as server:
        hasty = server.record(tmp_path / "hasty", max_wait=0.05, **options)
        run_script(STREAM, server.port, COUNT="20", SIZE="8192", WAIT="1")
    assert hasty.dropped.get(FALLING_BEHIND, 0) > 0
    assert hasty.written + hasty.dropped[FALLING_BEHIND] == 20
    recorded = HistoryStore()
    recorded.load(tmp_path / "hasty")
    assert recorded.overview().undelivered == {FALLING_BEHIND: hasty.dropped[FALLING_BEHIND]}


def test_text_waiting_to_be_written_counts_toward_the_bound(tmp_path: Path) -> None:
    """Captures of text (or long lists of numbers) weigh what the store charges them: they
    weighed nothing, so a flood of them piled up in the recorder without bound."""
    store = HistoryStore()
    with Recorder(store, tmp_path / "rec", segment_seconds=0.5, max_pending_bytes=200_000,
                  max_wait=0.05) as recorder:
        for i in range(20):
            store.add("note", f"{i:04d}" + "x" * 65_536, (), 0, Sender("a:1"))
        assert recorder.dropped.get(FALLING_BEHIND, 0) > 0
    assert recorder.written + recorder.dropped[FALLING_BEHIND] == 20


def test_one_writer_per_directory(tmp_path: Path) -> None:
    store = HistoryStore()
    with Recorder(store, tmp_path / "rec") as recorder:
        with pytest.raises(ThingError, match=r"a recorder \(or a save\) is writing to"):
            Recorder(HistoryStore(), tmp_path / "rec").start()
        # Before its first segment: the recorder would have written it over the saved one.
        store.add("saved", 1.0, (), 0, Sender("a:1"))
        with pytest.raises(ThingError, match=r"a recorder \(or a save\) is writing to"):
            store.save(tmp_path / "rec")
        store.add("recorded", 2.0, (), 0, Sender("a:1"))
        # `thing record` into it says why not before any server starts (nor says it did).
        refused = subprocess.run([sys.executable, "-m", "thing", "record", str(tmp_path / "rec"),
                                  "--port", "0"], env=script_env(), capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode == 1 and "is writing to" in refused.stderr
        assert "Server started" not in refused.stderr + refused.stdout
    # One whose port is taken leaves no directory it made behind.
    with socket.create_server(("127.0.0.1", 0)) as taken:
        refused = subprocess.run([sys.executable, "-m", "thing", "record", str(tmp_path / "new"),
                                  "--port", str(taken.getsockname()[1])], env=script_env(),
                                 capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "already in use" in refused.stderr
    # What to try names the command that was run (it said `thing serve`, a session).
    assert f"`thing record {tmp_path / 'new'} --port " in refused.stderr
    assert "`thing serve" not in refused.stderr and "thing.serve(" not in refused.stderr
    assert not (tmp_path / "new").exists()
    assert recorder.written >= 1
    loaded = HistoryStore()
    loaded.load(tmp_path / "rec")
    assert loaded.get("recorded").value == 2.0


def test_serve_with_record_then_open_it(tmp_path: Path) -> None:
    port = free_port()
    directory = tmp_path / "rec"
    session = subprocess.Popen(
        [sys.executable, "-m", "thing", "serve", "--plain", "--port", str(port),
         "--record", str(directory)],
        env=script_env(), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        poll(lambda: _listening(port), what="the session's server")
        run_script(STREAM, port, COUNT="3", SIZE="10", WAIT="1")
        out, err = session.communicate("print('live', thing.get('step').tolist())\n", timeout=60)
    finally:
        if session.poll() is None:
            session.kill()
    assert "live [2, 2, 2" in out, err
    assert _steps(directory) == [0, 1, 2]
    opened = subprocess.run(
        [sys.executable, "-m", "thing", "open", "--plain", str(directory)],
        env=script_env(), cwd=ROOT, input="print(thing.get_all('step')[0].tolist())\n"
                                          "thing.summary()\n",
        capture_output=True, text=True, timeout=60)
    assert opened.returncode == 0, opened.stderr
    assert "3 captures, no server running" in opened.stderr + opened.stdout
    assert "[0, 0, 0, 0, 0, 0, 0, 0, 0, 0]" in opened.stdout and "step" in opened.stdout
    refused = subprocess.run([sys.executable, "-m", "thing", "open", str(tmp_path / "none")],
                             env=script_env(), cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 1 and "does not exist" in refused.stderr


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0
