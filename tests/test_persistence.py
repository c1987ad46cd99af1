"""Saving and loading history: every value bit for bit, and bad files refused whole.

Captures arrive over real sockets from a client process, are saved, and are
loaded again, here and in fresh interpreters (with and without torch); the
files are read by the ``safetensors`` package and by torch too. Damaged,
foreign and hostile files (truncated at every length, mutated by hypothesis,
symbolic links) are refused with :class:`thing.BadRecording`, and nothing of
them reaches the store.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thing
from thing.captures import Capture, Sender
from thing.errors import BadRecording, ThingError
from thing.recording import segment_path, segments_of
from thing.segments import records_checksum, write_unflushed
from thing.store import HistoryStore

from .conftest import run_script, script_env

# Sent by a client process: every dtype, 0-d and empty arrays, containers, frameworks.
SENDER_CODE = """
    import math, struct, numpy as np, torch, jax.numpy as jnp, thing
    nan = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000001))[0]
    values = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "f64 fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "f16": np.array([1.5, -0.0, np.inf], np.float16),
        "ints": [np.array([-1, 2], dt) for dt in ("int8", "int16", "int32", "int64")],
        "uints": [np.array([1, 2**bits - 1], dt) for dt, bits in
                  (("uint8", 8), ("uint16", 16), ("uint32", 32), ("uint64", 64))],
        "bool": np.array([True, False, True]),
        "c64": np.array([1 + 2j, nan * 1j], np.complex64),
        "c128": np.array([[1 - 1j, 3.5j]], np.complex128),
        "zero-d": np.array(7.25),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.float32(2.5),
        "bf16": torch.randn(4, 5).to(torch.bfloat16),
        "fp8 e4m3": torch.randn(8).to(torch.float8_e4m3fn),
        "fp8 e5m2": torch.randn(8).to(torch.float8_e5m2),
        "torch f32": torch.arange(6.0).reshape(2, 3),
        "torch size": torch.Size([2, 3]),
        "sparse": torch.sparse_coo_tensor([[0, 1], [2, 0]], [3.0, 4.0], (2, 3)).coalesce(),
        "jax": jnp.arange(5, dtype=jnp.float32),
        "nested": {"a": [1, (2.5, "three")], 4: {"b": b"bytes", None: None},
                   "set": {1, 2}, "nan": nan, "c": 1 - 2j,
                   "arrays": [np.ones(2, np.int16), torch.zeros(3, dtype=torch.bfloat16)]},
        "loss": 0.125,
        "text": "h\\u00e9llo",
    }
    handles = [thing.catch(value, name=name) for name, value in values.items()]
    handles.append(thing.catch(np.arange(3), name="f32"))  # a second version of one name
    assert all(handle.wait(30) for handle in handles), [h.error for h in handles]
"""


def _same_parts(first: Capture, second: Capture) -> None:
    """Two captures hold the same value, bit for bit, and the same record."""
    a, b = first.parts(), second.parts()
    assert a.tree == b.tree and a.specs == b.specs
    assert [x.tobytes() for x in a.arrays] == [y.tobytes() for y in b.arrays]
    assert [x.dtype for x in a.arrays] == [y.dtype for y in b.arrays]
    assert (first.name, first.sender, first.call_site, first.caught_at, first.received_at,
            first.consistent, first.nbytes) == (
        second.name, second.sender, second.call_site, second.caught_at, second.received_at,
        second.consistent, second.nbytes)


def _received(server: thing.Server, tmp_path: Path) -> Path:
    run_script(SENDER_CODE, server.port, timeout=120)
    path = tmp_path / "saved"
    assert server.save(path) == len(server.store)
    return path


def test_every_value_from_a_client_process_round_trips(server: thing.Server,
                                                       tmp_path: Path) -> None:
    path = _received(server, tmp_path)
    loaded = HistoryStore()
    assert loaded.load(path) == len(server.store) == 22
    originals = server.store.recent(100)[::-1]
    copies = loaded.recent(100)[::-1]
    for original, copy in zip(originals, copies):
        _same_parts(original, copy)
        assert type(copy.value) is type(original.value)
    assert loaded.names() == server.store.names()
    assert loaded.versions("f32") == 2
    import torch

    assert loaded.get("bf16").value.dtype == torch.bfloat16
    assert torch.equal(loaded.get("bf16").value, server.store.get("bf16").value)
    assert loaded.get("sparse").value.is_sparse
    assert loaded.get("torch size").value == torch.Size([2, 3])
    assert loaded.get("nested").value["set"] == {1, 2}
    assert type(loaded.get("jax").value).__module__.startswith("jax")
    assert loaded.get("scalar").value == np.float32(2.5)
    assert all(c.call_site and "<string>" in c.call_site for c in copies)


def test_a_fresh_interpreter_loads_it_without_a_server_and_without_torch(
        server: thing.Server, tmp_path: Path) -> None:
    path = _received(server, tmp_path)
    expected = server.store.get("bf16").parts().arrays[0].tobytes().hex()
    out = run_script(f"""
        import thing, torch
        assert thing.load({str(path)!r}) == 22
        print(thing.get("bf16").dtype, thing.get("bf16").view(torch.int16).numpy().tobytes().hex())
        print(thing.get("f32", index=1).tolist(), thing.get_all("f32")[-1].tolist())
        thing.summary(max_items=None)
    """)
    assert f"torch.bfloat16 {expected}" in out
    assert "[[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]] [0, 1, 2]" in out
    assert "bf16" in out and "fp8 e4m3" in out  # the summary's rows
    # With torch unavailable, torch's arrays arrive as numpy, in their carrier dtype.
    out = run_script(f"""
        import sys
        sys.modules["torch"] = None
        import thing
        thing.load({str(path)!r})
        value = thing.get("torch f32")
        print(type(value).__name__, value.dtype, value.tolist())
    """)
    assert "ndarray float32 [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]" in out


def test_the_safetensors_package_and_torch_read_the_files(server: thing.Server,
                                                          tmp_path: Path) -> None:
    import safetensors.numpy
    import safetensors.torch
    import torch

    path = _received(server, tmp_path)
    ((_, segment),) = segments_of(path)
    as_torch = safetensors.torch.load_file(segment)
    order = [c.name for c in server.store.recent(100)[::-1]]
    bf16 = server.store.get("bf16").value
    assert as_torch[f"{order.index('bf16')}.0"].dtype == torch.bfloat16
    assert torch.equal(as_torch[f"{order.index('bf16')}.0"], bf16)
    assert as_torch[f"{order.index('fp8 e5m2')}.0"].dtype == torch.float8_e5m2
    # The package's numpy reader knows no dtype numpy lacks: a file without them.
    numpy_names = [name for name in server.store.names()
                   if name not in ("bf16", "fp8 e4m3", "fp8 e5m2", "nested")]
    server.save(tmp_path / "numpy", numpy_names)
    as_numpy = safetensors.numpy.load_file(segment_path(tmp_path / "numpy", 1))
    order = [c.name for c in server.store.recent(100)[::-1] if c.name in numpy_names]
    f32 = as_numpy[f"{order.index('f32')}.0"]
    assert f32.dtype == np.float32 and f32.tolist() == server.store.get("f32", 1).value.tolist()
    c128 = as_numpy[f"{order.index('c128')}.0"]  # float64 pairs: safetensors has no complex128
    assert c128.shape == (1, 2, 2) and c128.view(np.complex128)[..., 0].tolist() == [[1 - 1j,
                                                                                       3.5j]]


def test_a_loaded_capture_that_changed_while_sent_is_warned_of_as_a_received_one(
        tmp_path: Path) -> None:
    """The warning get() gives for a capture marked inconsistent shows in a session that
    only loaded a recording (thing.load, thing open), not only in one that served."""
    store = HistoryStore()
    store.add("w", np.ones(2, np.float32), (), 8, Sender("a:1"), consistent=False)
    store.add("fine", np.ones(2, np.float32), (), 8, Sender("a:1"))
    store.save(tmp_path / "rec")
    result = run_script(f"""
        import thing
        assert thing.load({str(tmp_path / "rec")!r}) == 2
        thing.get("fine")
        print("fine read", flush=True)
        print(thing.get("w").tolist())
        """, full=True)
    assert result.stdout.splitlines() == ["fine read", "[1.0, 1.0]"]
    assert "of 'w' changed between catch() and the end of its send" in result.stderr
    assert "'fine'" not in result.stderr


def test_a_file_another_user_may_change_is_read_not_mapped(tmp_path: Path) -> None:
    """A private mapping shows the file's later changes on pages not yet read: a file that
    others may write (or that is theirs) could change what was checked, or be cut short
    under the REPL (SIGBUS). What was loaded stays what was read."""
    store = HistoryStore()
    big = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: past what is copied anyway
    store.add("big", big, (), big.nbytes, Sender("a:1"))
    store.save(tmp_path / "rec")
    [(_, segment)] = segments_of(tmp_path / "rec")
    os.chmod(segment, 0o666)  # writable by others, as a shared directory's files may be
    loaded = HistoryStore()
    assert loaded.load(tmp_path / "rec") == 1
    with open(segment, "r+b") as file:  # another user rewrites the data, then cuts it short
        file.seek(-4096, os.SEEK_END)
        file.write(b"\xff" * 4096)
        file.truncate(4096)
    assert np.array_equal(loaded.get("big").value, big)


def test_a_file_another_user_may_change_is_read_only_as_far_as_its_header_allows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read, not mapped, it must not cost what its size claims before its header is
    checked (a sparse file of a terabyte was a MemoryError, of 2 GiB 2 GB and 10 s), nor
    more than the history may hold."""
    store = HistoryStore()
    big = np.arange(1 << 19, dtype=np.float32)
    store.add("big", big, (), big.nbytes, Sender("a:1"))
    store.save(tmp_path / "rec")
    [(_, segment)] = segments_of(tmp_path / "rec")
    os.chmod(segment, 0o666)
    monkeypatch.setenv("THING_STORE_BYTES", str(1 << 20))
    with pytest.raises(BadRecording, match=r"copy the recording \(cp -r\)"):
        HistoryStore().load(tmp_path / "rec")
    monkeypatch.delenv("THING_STORE_BYTES")
    with open(segment, "r+b") as file:  # a header that says nothing, a terabyte claimed
        file.write(b"\x08" + b"\x00" * 7 + b"not json")
        file.truncate(1 << 40)
    with pytest.raises(BadRecording, match="safetensors header"):
        HistoryStore().load(tmp_path / "rec")


def test_ranks_flags_names_and_save_of_some_names(tmp_path: Path) -> None:
    store = HistoryStore()
    store.add("w", np.ones(2, np.float32), (), 8, Sender("a:1", "h1", 11, 0, 2),
              consistent=False, call_site="train.py:9 (step)", caught_at=5.0)
    store.add("w", np.zeros(2, np.float32), (), 8, Sender("a:2", "h2", 12, 1, 2))
    store.add("other", "text", (), 0, Sender("a:1"))
    store.add(None, [1, 2], (), 0, Sender("a:1"))
    assert store.save(tmp_path / "w", names=["w"]) == 2
    loaded = HistoryStore()
    loaded.load(tmp_path / "w")
    assert loaded.names() == ["w"] and len(loaded) == 2
    for original, copy in zip(store.get_all("w"), loaded.get_all("w")):
        _same_parts(original, copy)
    assert loaded.get("w", rank=1).value.tolist() == [0, 0]
    assert not loaded.get("w", rank=0).consistent and loaded.overview().inconsistent == 1
    everything = tmp_path / "all"
    store.save(everything)
    assert HistoryStore().load(everything) == 4
    with pytest.raises(ThingError, match="is not an empty directory"):
        store.save(everything)
    assert HistoryStore().load(everything) == 4  # the first save, untouched


def test_a_name_and_its_identifier_save_each_capture_once(tmp_path: Path) -> None:
    """names=["h[3]", "h_3"] is one history named twice: each capture is written once, and
    a recording holding one twice (a hostile file) loads it once."""
    store = HistoryStore()
    for step in range(3):
        store.add("h[3]", float(step), (), 0, Sender("job:1", "host", 7), call=step + 1)
    assert store.save(tmp_path / "rec", names=["h[3]", "h_3"]) == 3
    loaded = HistoryStore()
    assert loaded.load(tmp_path / "rec") == 3
    assert [c.value for c in loaded.get_all("h[3]")] == [0.0, 1.0, 2.0]
    twice = store.kept() * 2
    assert HistoryStore().restore(twice, [0] * len(twice)) == 3


def mappings_of(directory: Path) -> int:
    """How many of this process's memory mappings are of files in ``directory``."""
    with open("/proc/self/maps") as maps:
        return sum(str(directory) in line for line in maps)


def test_small_segments_are_copied_out_and_large_ones_mapped(tmp_path: Path) -> None:
    """Each mapping takes one of the process's map entries (often 65,530): a recording of a
    slow job, a segment of one small capture every 10 s, did not load after a week."""
    from thing.recording import segment_path
    from thing.segments import write_segment

    directory = tmp_path / "rec"
    directory.mkdir()
    for number in range(1, 301):
        store = HistoryStore()
        store.add("loss", float(number), (), 0, Sender("job:1", "host", 7), call=number)
        write_segment(segment_path(directory, number), store.kept())
    big = HistoryStore()
    big.add("weight", np.arange(1 << 19, dtype=np.float32), (), 1 << 21, Sender("job:1"))
    write_segment(segment_path(directory, 301), big.kept())
    loaded = HistoryStore()
    assert loaded.load(directory) == 301
    assert mappings_of(directory) == 1  # the large segment's alone
    assert [c.value for c in loaded.get_all("loss")] == list(range(1, 301))
    assert np.array_equal(loaded.get("weight").value, np.arange(1 << 19, dtype=np.float32))
    senders = {id(capture.sender) for capture in loaded.get_all("loss")}
    assert len(senders) == 1  # one sender, however many headers name it


def _segments_of_one_array(directory: Path, count: int, elements: int) -> None:
    """A recording of ``count`` segments, each one capture "w" of ``elements`` float32."""
    from thing.segments import write_segment

    directory.mkdir()
    for number in range(1, count + 1):
        store = HistoryStore()
        store.add("w", np.full(elements, number, np.float32), (), 4 * elements,
                  Sender("job:1"), call=number)
        write_segment(segment_path(directory, number), store.kept())


def test_arrays_copied_out_of_a_recording_count_against_the_cap(tmp_path: Path) -> None:
    """A loaded capture was charged its record alone (about 3 KB), its arrays being the
    file's; but a small segment's (and another user's file's) are copied into memory: a
    crafted recording of many small files grew the REPL to ten times its cap."""
    _segments_of_one_array(tmp_path / "rec", 40, 1 << 16)  # 256 KiB each: copied out
    loaded = HistoryStore(max_bytes=2 << 20)
    added = loaded.load(tmp_path / "rec")
    assert 4 <= added <= 8  # the newest that fit 2 MiB
    assert loaded.held_bytes <= loaded.max_bytes
    history = loaded.get_all("w")
    assert [capture.call for capture in history] == list(range(41 - len(history), 41))
    assert all(np.array_equal(c.value, np.full(1 << 16, c.call, np.float32)) for c in history)


def test_a_recording_keeps_no_more_files_mapped_than_its_share_of_map_entries(
        tmp_path: Path) -> None:
    """Each mapped segment takes one of the process's map entries (often 65,530): a crafted
    recording of many 1 MiB files (sparse, a few KB on disk) took them all, and the REPL's
    own mappings (a thread's stack, a large array) then failed. Past a quarter of them the
    segments are copied out, charged to the cap; those only checked, not kept (older than
    the cap holds), are neither copied nor counted."""
    _segments_of_one_array(tmp_path / "rec", 6, 1 << 19)  # 2 MiB each: mapped
    out = run_script(f"""
        import numpy as np
        from pathlib import Path
        from thing import segments
        from thing.store import HistoryStore
        from tests.test_persistence import mappings_of
        segments.MAPPED_SEGMENTS.most = 3  # a quarter of 12 map entries, say
        loaded = HistoryStore()
        print(loaded.load({str(tmp_path / "rec")!r}), mappings_of(Path({str(tmp_path)!r})))
        assert all(np.array_equal(c.value, np.full(1 << 19, c.call, np.float32))
                   for c in loaded.get_all("w"))
        # Gone with their captures, the mappings count no more: the next load maps again.
        loaded.clear()
        # Three mapped (their records charged), then one copied (2 MiB): full; the two older
        # are checked through mappings that go with them.
        small = HistoryStore(max_bytes=1 << 20)
        print(small.load({str(tmp_path / "rec")!r}), mappings_of(Path({str(tmp_path)!r})),
              segments.MAPPED_SEGMENTS.held)
    """)
    assert out.split() == ["6", "3", "4", "3", "3"]


@pytest.mark.parametrize("pad", [1, 200_001])  # a small segment (copied), a large (mapped)
def test_a_loaded_complex128_tensor_is_aligned_as_torch_needs(tmp_path: Path, pad: int) -> None:
    """A recording aligns an array to 8 bytes at most; torch takes complex128 elements to
    lie at multiples of 16, and a loaded one after an odd number of float64 crashed the
    REPL (SIGSEGV) at its first clone()."""
    pytest.importorskip("torch")
    run_script(f"""
        import numpy as np, torch, thing
        server = thing.Server(port=0).start()
        client = thing.Client("127.0.0.1", server.port)
        z = torch.tensor([1 + 2j, 3 - 4j, -0.0 + 5e-324j], dtype=torch.complex128)
        assert client.catch(np.zeros({pad}, np.float64), name="pad").wait(30)
        assert client.catch(z, name="z").wait(30)
        client.close()
        server.save({str(tmp_path / "rec")!r})
        server.close()
        loaded = thing.HistoryStore()
        loaded.load({str(tmp_path / "rec")!r})
        back = loaded.get("z").value
        assert back.data_ptr() % 16 == 0
        assert torch.equal(back.clone().view(torch.float64), z.view(torch.float64))
        assert torch.equal((back * 1).view(torch.float64), z.view(torch.float64))
    """)


def test_a_save_is_whole_or_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    """One name given as a string is that name; a save that fails (an unknown name, a
    full disk mid-way, a directory with files of its own) leaves no file behind and
    touches none there."""
    store = HistoryStore()
    store.add("loss", 1.5, (), 0, Sender("a:1"))
    store.add("big", np.arange(1000, dtype=np.float32), (), 4000, Sender("a:1"))
    assert store.save(tmp_path / "one", names="loss") == 1
    assert HistoryStore().load(tmp_path / "one") == 1

    with pytest.raises(thing.UnknownName):
        store.save(tmp_path / "typo", names=["loss", "losss"])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ThingError, match="is not an empty directory"):
        store.save(mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    monkeypatch.setattr("thing.recording.SAVE_SEGMENT_BYTES", 0)  # one segment a capture
    written = []

    def full_disk_at_the_second(path: Path, captures: Any) -> int:
        if written:  # meanwhile, someone else's file where the save stages its own
            (path.parent / ".thing-staging" / "theirs").write_text("theirs")
            raise OSError(28, "No space left on device")
        written.append(path)
        return real_write(path, captures)

    from thing import recording
    real_write = recording.write_segment
    monkeypatch.setattr(recording, "write_segment", full_disk_at_the_second)
    with pytest.raises(OSError, match="No space"):
        store.save(tmp_path / "full")
    assert written  # the first segment was written, then taken away with the rest
    empty = tmp_path / "empty"  # a mount point, say: written inside, not renamed onto
    empty.mkdir()
    written.clear()
    with pytest.raises(OSError, match="No space"):
        store.save(empty)
    assert written and [p.name for p in empty.rglob("*")] == [".thing-staging", "theirs"]
    (empty / ".thing-staging" / "theirs").unlink()  # only what the save wrote went
    (empty / ".thing-staging").rmdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "mine", "one"]
    monkeypatch.setattr(recording, "write_segment", real_write)
    (tmp_path / "link").symlink_to(empty)
    assert store.save(tmp_path / "link") == 2  # an empty directory, through a link too
    with pytest.raises(ThingError, match="is not an empty directory"):
        store.save(empty)
    loaded = HistoryStore()
    assert loaded.load(empty) == 2 and sorted(loaded.names()) == ["big", "loss"]


def test_loading_into_a_store_that_holds_captures_keeps_arrival_order(tmp_path: Path) -> None:
    old = HistoryStore()
    for at in (1.0, 3.0, 5.0):
        old.add("loss", at, (), 0, Sender("old:1"), received_at=at)
    old.save(tmp_path / "old")
    live = HistoryStore()
    for at in (2.0, 4.0):
        live.add("loss", at, (), 0, Sender("live:1"), received_at=at)
    live.add("acc", 0.5, (), 0, Sender("live:1"), received_at=6.0)
    assert live.load(tmp_path / "old") == 3
    assert [c.value for c in live.get_all("loss")] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert live.get("loss").value == 5.0  # the newest by arrival
    assert len({c.id for c in live.recent(10)}) == 6  # new ids, none reused
    assert [c.name for c in live.latest()] == ["loss", "acc"]
    assert live.overview().names[0][0].name == "acc"  # the most recently updated first
    live.add("loss", 7.0, (), 0, Sender("live:1"))
    assert live.get("loss").value == 7.0


def test_a_capture_already_here_is_not_loaded_twice(tmp_path: Path, caplog) -> None:
    """The same recording loaded twice, or a save loaded back into the history it came
    from, adds nothing: every history and statistic would count those captures twice."""
    store = HistoryStore()
    for step in range(3):
        store.add("loss", float(step), (), 0, Sender("job:1", "host", 7), call=step + 1)
    store.add("loss", 9.0, (), 0, Sender("job:1", "host", 8), call=1)  # another process
    store.save(tmp_path / "rec")
    assert store.load(tmp_path / "rec") == 0
    assert [c.value for c in store.get_all("loss")] == [0.0, 1.0, 2.0, 9.0]
    assert "4 of the captures" in caplog.text and "not added twice" in caplog.text

    fresh = HistoryStore()
    fresh.add("loss", 5.0, (), 0, Sender("job:1", "host", 7), call=1)  # same call, not same
    assert fresh.load(tmp_path / "rec") == 4
    assert fresh.load(tmp_path / "rec") == 0
    assert sorted(c.value for c in fresh.get_all("loss")) == [0.0, 1.0, 2.0, 5.0, 9.0]
    assert len(fresh) == 5


def test_a_capture_that_arrives_while_a_load_checks_is_not_added_twice(tmp_path: Path) -> None:
    """load() looks for captures here already outside the store's lock (a long history takes
    a while); one that arrives meanwhile, the same as one loaded, is looked for too."""
    sender = Sender("job:1", "host", 7)
    recorded = HistoryStore()
    recorded.add("loss", 1.5, (), 0, sender, call=1, received_at=100.0)
    recorded.save(tmp_path / "rec")

    class Arriving(HistoryStore):
        def _captures_named(self, name):
            here = list(super()._captures_named(name))
            self.add("loss", 1.5, (), 0, sender, call=1, received_at=100.0)  # as it is looked at
            return here

    store = Arriving()
    assert store.load(tmp_path / "rec") == 0
    assert [c.value for c in store.get_all("loss")] == [1.5]


def test_save_writes_what_is_kept_at_one_moment_while_captures_arrive(tmp_path: Path) -> None:
    """A capture stored while save() looks at the store (a job streams on) neither pushes
    the oldest kept ones out of the file nor is half in it: save() took the count, then
    the newest that many, and a capture arriving between the two left out the oldest."""

    class Streaming(HistoryStore):
        def __len__(self) -> int:  # as a connection thread storing a capture right after
            count = super().__len__()
            self.add("loss", -1.0, (), 0, Sender("job:1"))
            return count

    store = Streaming()
    for step in range(5):
        store.add("loss", float(step), (), 0, Sender("job:1"))
    assert store.save(tmp_path / "rec") == 5
    saved = HistoryStore()
    saved.load(tmp_path / "rec")
    assert [c.value for c in saved.get_all("loss")] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_loaded_arrays_are_mapped_not_read(tmp_path: Path) -> None:
    store = HistoryStore()
    big = np.arange(16 << 20, dtype=np.uint8)
    store.add("big", big, (), big.nbytes, Sender("a:1"))
    store.save(tmp_path / "big")
    loaded = HistoryStore()
    loaded.load(tmp_path / "big")
    array = loaded.get("big").value
    assert np.array_equal(array, big)
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    # The file mapped (the compiled core's mapping, or the twin's mmap), not read.
    assert isinstance(base, memoryview) and type(base.obj).__name__ in ("PrivateMapping", "mmap")
    assert loaded.held_bytes < 1 << 20  # its record only: the bytes stay in the file
    array[0] = 99  # copy-on-write: this process's copy, not the file
    reloaded = HistoryStore()
    reloaded.load(tmp_path / "big")
    assert reloaded.get("big").value[0] == 0


def test_a_recording_of_more_segments_than_open_files_allowed_loads(tmp_path: Path) -> None:
    """A mapping kept a duplicate of its file's descriptor: a few hours of a recorder's
    segments (one every 10 s) passed the usual limit of 1,024 and no longer loaded."""
    store = HistoryStore()
    for number in range(1, 301):
        store.add("w", np.arange(4, dtype=np.float32), (), 16, Sender("a:1"), call=number)
        written, _ = write_unflushed(segment_path(tmp_path, number), [store.get("w")])
        os.replace(written, segment_path(tmp_path, number))
    run_script(f"""
        import resource, numpy as np
        from thing.store import HistoryStore
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))
        loaded = HistoryStore()
        assert loaded.load({str(tmp_path)!r}) == 300
        assert [c.call for c in loaded.get_all("w")] == list(range(1, 301))
        assert all((c.value == np.arange(4, dtype=np.float32)).all()
                   for c in loaded.get_all("w"))
    """, None)


def test_captures_with_large_headers_are_spread_over_segments(tmp_path: Path) -> None:
    """Header-borne values (long lists) count towards a segment's size, not only arrays:
    every segment written stays one a reader takes."""
    store = HistoryStore()
    for index in range(4_000):
        store.add("list", [index] * 600, (), 0, Sender("a:1"))
    assert store.save(tmp_path / "lists") == 4_000
    assert len(segments_of(tmp_path / "lists")) > 1
    loaded = HistoryStore()
    assert loaded.load(tmp_path / "lists") == 4_000
    assert loaded.get("list", index=0).value == [3_999] * 600


def test_a_load_keeps_the_newest_that_fit_the_cap(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Older segments than the cap holds are checked, not kept: memory follows the cap."""
    recording = tmp_path / "three"
    recording.mkdir()
    for number in (1, 2, 3):
        store = HistoryStore()
        for index in range(10):
            store.add("note", f"{number}:{index}:" + "x" * 10_000, (), 0, Sender("a:1"),
                      received_at=number * 100.0 + index)
        store.save(tmp_path / f"part{number}")
        os.rename(segment_path(tmp_path / f"part{number}", 1), segment_path(recording, number))
    one_segment = sum(HistoryStore.record_bytes("note", "x" * 10_010, None) for _ in range(10))
    small = HistoryStore(max_bytes=one_segment * 3 // 2)
    assert small.load(recording) == 20  # the newest two segments read; the store keeps less
    notes = [c.value.split(":")[:2] for c in small.get_all("note")]
    assert notes[-1] == ["3", "9"] and all(number != "1" for number, _ in notes)
    assert small.held_bytes <= small.max_bytes
    assert "10 older ones do not fit" in caplog.text
    segment_path(recording, 1).write_bytes(b"damaged")  # left out, but still checked
    with pytest.raises(BadRecording):
        HistoryStore(max_bytes=one_segment).load(recording)


# -- bad files ----------------------------------------------------------------------


def _small_recording(tmp_path: Path) -> Path:
    store = HistoryStore()
    store.add("w", np.arange(6, dtype=np.float32), (), 24, Sender("a:1"), call_site="x.py:1")
    store.add("n", {"k": [1, np.int16(3)]}, (), 2, Sender("a:1"))
    path = tmp_path / "small"
    store.save(path)
    return path


def _refused(path: Path, match: str | None = None) -> None:
    """Loading ``path`` raises BadRecording (matching ``match``) and adds nothing."""
    store = HistoryStore()
    store.add("kept", 1.0, (), 0, Sender("a:1"))
    with pytest.raises(BadRecording, match=match):
        store.load(path)
    assert len(store) == 1 and store.names() == ["kept"]


def _rewrite_header(segment: Path, change: Any) -> None:
    data = segment.read_bytes()
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + length])
    change(header)
    metadata = header.get("__metadata__", {})
    if "checksum" in metadata:  # as a hostile writer would: what is checked is the rest
        metadata["checksum"] = records_checksum(metadata)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    segment.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


def test_a_file_truncated_at_any_length_is_refused(tmp_path: Path) -> None:
    path = _small_recording(tmp_path)
    segment = segment_path(path, 1)
    whole = segment.read_bytes()
    for length in range(len(whole)):
        segment.write_bytes(whole[:length])
        _refused(path)
    segment.write_bytes(whole + b"\0")
    _refused(path, "extra bytes")


def test_hostile_and_foreign_files_are_refused_with_a_reason(tmp_path: Path) -> None:
    path = _small_recording(tmp_path)
    segment = segment_path(path, 1)
    whole = segment.read_bytes()

    segment.write_bytes(struct.pack("<Q", 1 << 40) + whole[8:])
    _refused(path, "claims 1099511627776 bytes")

    segment.write_bytes(whole)
    _rewrite_header(segment, lambda h: h.pop("__metadata__"))
    _refused(path, "not one of thing's recordings")

    segment.write_bytes(whole)
    _rewrite_header(segment, lambda h: h["__metadata__"].update(version="99"))
    _refused(path, "version '99'")

    segment.write_bytes(whole)
    _rewrite_header(segment, lambda h: h["0.0"].update(dtype="F64", shape=[3]))
    _refused(path, "tensor 0.0 is F64")

    segment.write_bytes(whole)
    _rewrite_header(segment, lambda h: h["0.0"].update(data_offsets=[0, 1 << 30]))
    _refused(path, "claims bytes")

    def lie_about_the_header(header: dict[str, Any]) -> None:
        records = json.loads(header["__metadata__"]["captures"])
        records[0]["header"] = records[0]["header"].replace('"float32"', '"int32"')
        header["__metadata__"]["captures"] = json.dumps(records)

    segment.write_bytes(whole)
    _rewrite_header(segment, lie_about_the_header)
    _refused(path, "its header says int32")

    def drop_a_capture(header: dict[str, Any]) -> None:
        records = json.loads(header["__metadata__"]["captures"])
        header["__metadata__"]["captures"] = json.dumps(records[:1])

    segment.write_bytes(whole)
    _rewrite_header(segment, drop_a_capture)
    _refused(path, "tensors that no capture uses")

    segment.write_bytes(whole)
    segment_path(path, 2).write_bytes(b"not a safetensors file at all")
    _refused(path)  # a second, bad segment: the good first one is not loaded either


def test_symbolic_links_and_non_directories_are_refused(tmp_path: Path) -> None:
    path = _small_recording(tmp_path)
    outside = tmp_path / "outside.safetensors"
    os.replace(segment_path(path, 1), outside)
    segment_path(path, 1).symlink_to(outside)
    _refused(path, "symbolic link")
    segment_path(path, 1).unlink()
    os.mkfifo(segment_path(path, 1))
    _refused(path, "not a regular file")
    _refused(outside, "not a directory")


@pytest.fixture(scope="module")
def sample_segment(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    store = HistoryStore()
    store.add("w", np.arange(6, dtype=np.float32), (), 24, Sender("a:1"), call_site="x.py:1")
    store.add("n", {"k": [1, np.int16(3)], "s": {2}}, (), 2, Sender("a:1", "h", 3, 0, 1))
    path = tmp_path_factory.mktemp("sample") / "r"
    store.save(path)
    return segment_path(path, 1).read_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_files_load_whole_or_are_refused(sample_segment: bytes, data: st.DataObject,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    mutated = bytearray(sample_segment)
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(mutated) - 1))
        action = data.draw(st.sampled_from(["flip", "byte", "cut", "insert"]))
        if action == "flip":
            mutated[position] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "byte":
            mutated[position] = data.draw(st.sampled_from(b'{}[]",:0123456789 \x00\xff'))
        elif action == "cut":
            del mutated[position:position + data.draw(st.integers(1, 16))]
        else:
            mutated[position:position] = data.draw(st.binary(min_size=1, max_size=8))
    path = tmp_path_factory.mktemp("fuzz")
    segment_path(path, 1).write_bytes(bytes(mutated))
    store = HistoryStore()
    try:
        count = store.load(path)
    except BadRecording:
        assert len(store) == 0
        return
    # What loads is whole: every value builds (array bytes carry no checksum, as in any
    # safetensors file, so a changed value in an array is still a value).
    assert count == len(store)
    for capture in store.recent(count):
        capture.value  # noqa: B018 - building it is the check


def test_a_recording_directory_and_the_repl_functions(tmp_path: Path) -> None:
    path = _small_recording(tmp_path)
    assert thing.load.__doc__ and thing.save.__doc__
    out = run_script(f"""
        import thing
        print(thing.load({str(path)!r}))
        print(thing.get("w").tolist())
        thing.describe("w")
        thing.save({str(tmp_path / "again")!r}, names=["n"])
        print("cleared", thing.clear("w"), "kept", len(thing.get_all("n")))  # with no server
        thing.serve(port=0)
        print(thing.get("n"))
    """)
    assert "cleared 1 kept 1" in out.splitlines()
    assert out.splitlines()[:2] == ["2", "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]"]
    assert "x.py:1" in out and "{'k': [1, np.int16(3)]}" in out
    assert HistoryStore().load(tmp_path / "again") == 1


def test_a_bfloat16_or_float8_number_reads_as_itself_without_torch_or_ml_dtypes(
        tmp_path: Path) -> None:
    """Kept as its raw bits where neither is installed (``thing open`` on a laptop), it was
    shown as those bits (1.5 as 16320) by summary(), status() and describe()."""
    import torch

    store = HistoryStore()
    store.add("loss", torch.tensor(1.5, dtype=torch.bfloat16), (), 2, Sender("a:1"))
    store.add("f8", torch.tensor(-2.0, dtype=torch.float8_e4m3fn), (), 1, Sender("a:1"))
    store.save(tmp_path / "rec")
    out = run_script(f"""
        import sys
        sys.modules["torch"] = sys.modules["ml_dtypes"] = None
        import thing
        thing.load({str(tmp_path / "rec")!r})
        print(thing.get("loss").dtype, thing.get("f8").dtype)
        thing.summary()
        thing.describe("loss")
        thing.describe("f8")
    """, COLUMNS="100")
    lines = out.splitlines()
    assert lines[0] == "uint16 uint8"  # as the bits, which the reports read
    assert next(line for line in lines if line.startswith("loss ")).split()[1:5] == [
        "()", "bfloat16", "torch", "1.5"]
    assert next(line for line in lines if line.startswith("f8 ")).split()[4] == "-2"
    assert [line.split()[1] for line in lines if line.startswith("value ")] == ["1.5", "-2.0"]


def _three_segments(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setattr("thing.recording.SAVE_SEGMENT_BYTES", 0)  # one segment a capture
    store = HistoryStore()
    for step in range(3):
        store.add("loss", 0.5 + step, (), 0, Sender("a:1"), call=step + 1)
    path = tmp_path / "three"
    store.save(path)
    assert len(segments_of(path)) == 3
    return path


def test_a_damaged_segment_refuses_the_recording_unless_asked_to_skip_it(
        tmp_path: Path, monkeypatch, caplog) -> None:
    """Refused whole, the message says how to load the rest; with skip_damaged=True (``thing
    open --skip-damaged``) the others load and the one left out is logged."""
    path = _three_segments(tmp_path, monkeypatch)
    damaged = segment_path(path, 2)
    damaged.write_bytes(damaged.read_bytes()[:-3])
    _refused(path, r"segment-000002.*nothing was loaded; load\(..., skip_damaged=True\) "
                   r"\(thing open --skip-damaged\) loads the other 2 segments without it")
    store = HistoryStore()
    with caplog.at_level("WARNING", logger="thing"):
        assert store.load(path, skip_damaged=True) == 2
    assert [capture.value for capture in store.get_all("loss")] == [0.5, 2.5]
    [warning] = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert "segment-000002" in warning
    out = run_script(f"""
        import subprocess, sys
        for flags in ([], ["--skip-damaged"]):
            opened = subprocess.run([sys.executable, "-m", "thing", "open", *flags, "--plain",
                                     {str(path)!r}], input="print(thing.get_all('loss'))",
                                    capture_output=True, text=True, timeout=60)
            print(opened.returncode, "[0.5, 2.5]" in opened.stdout)
    """)
    assert out.splitlines() == ["1 False", "0 True"]


def test_a_changed_number_in_a_record_is_refused_by_its_checksum(tmp_path: Path) -> None:
    """A value carried in the records (a loss, a step, a name) changed by one digit loaded
    as the other value; the records carry a CRC now (array bytes do not: docs/FORMAT.md)."""
    store = HistoryStore()
    store.add("loss", 1.25, (), 0, Sender("a:1"))
    store.save(tmp_path / "rec")
    segment = segment_path(tmp_path / "rec", 1)
    whole = segment.read_bytes()
    at = whole.index(b"1.25")
    segment.write_bytes(whole[:at] + b"7" + whole[at + 1:])
    _refused(tmp_path / "rec", "do not match their checksum")
    # One written without a checksum (by an earlier thing) is read unchecked.
    segment.write_bytes(whole)
    _rewrite_header(segment, lambda header: header["__metadata__"].pop("checksum"))
    loaded = HistoryStore()
    assert loaded.load(tmp_path / "rec") == 1 and loaded.get("loss").value == 1.25


def test_a_save_killed_midway_is_said_to_be_cut_short(tmp_path: Path, caplog) -> None:
    """Into an existing directory, segments appear one by one: a save killed between them
    left what loaded as a whole history."""
    directory = tmp_path / "mount"
    directory.mkdir()
    code = textwrap.dedent(f"""
        import os, signal, numpy as np, thing.recording as recording
        from thing.captures import Sender
        from thing.store import HistoryStore
        store = HistoryStore()
        for step in range(4):
            store.add("x", np.full(8, step), (), 64, Sender("a:1"))
        recording.SAVE_SEGMENT_BYTES = 0
        write = recording.write_segment
        def killed_at_the_third(path, captures):
            if path.name == "segment-000003.safetensors":
                os.kill(os.getpid(), signal.SIGKILL)
            return write(path, captures)
        recording.write_segment = killed_at_the_third
        store.save({str(directory)!r})
    """)
    killed = subprocess.run([sys.executable, "-c", code], env=script_env(), timeout=60)
    assert killed.returncode == -signal.SIGKILL
    store = HistoryStore()
    with caplog.at_level("WARNING", logger="thing"):
        assert store.load(directory) == 2
    assert any("holds a save() that did not end" in r.getMessage() for r in caplog.records)
    whole = tmp_path / "whole"  # one that ended says nothing
    whole.mkdir()
    (whole / ".thing-saving").touch()  # nor does one into where a save died before writing
    caplog.clear()
    store.save(whole)
    assert HistoryStore().load(whole) == 2 and not caplog.records
    assert not (whole / ".thing-saving").exists()


def test_a_file_system_that_cannot_flush_a_directory_still_saves(tmp_path: Path, monkeypatch,
                                                                  caplog) -> None:
    """Some refuse it (EINVAL): the files are whole and named, so it is a warning; a save
    into an existing directory took back everything it wrote instead."""
    real_fsync = os.fsync

    def fsync(descriptor: int) -> None:
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    store = HistoryStore()
    store.add("x", 1.0, (), 0, Sender("a:1"))
    (tmp_path / "mount").mkdir()
    with caplog.at_level("WARNING", logger="thing"):
        for directory in (tmp_path / "mount", tmp_path / "new"):
            assert store.save(directory) == 1
            assert HistoryStore().load(directory) == 1
    assert any("could not flush the directory" in r.getMessage() for r in caplog.records)
