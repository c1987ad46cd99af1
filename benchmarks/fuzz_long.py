"""Long fuzzing run: the frame decoder for minutes, then a live server for minutes.

    python benchmarks/fuzz_long.py                         # 3 + 2 minutes
    python benchmarks/fuzz_long.py --decoder-minutes 30 --live-minutes 10 --save-dir crashes
    python benchmarks/fuzz_long.py --atheris --decoder-minutes 10   # pip install atheris

The CI suite (``tests/test_fuzz.py``) runs a few thousand cases; this runs
millions, with the same generators: mutations of valid frames (bit flips,
truncation, splices, length fields set to boundary values, repeated and cut
slices), structurally mutated JSON headers, random bytes, mutated handshakes.

Decoder phase: each case is a byte stream as a peer would send it (a
handshake, then frames) decoded the way the server decodes a connection,
receiving into real arrays. The only acceptable failure is ``ProtocolError``
(or a subclass); anything else is a bug: the input is saved under
``--save-dir`` and counted. With ``--atheris`` the decoder phase is
coverage-guided by libFuzzer instead (seeded with ``tests/corpus``), and stops
at the first bug, writing it as ``crash-*``.

Live phase: a ``thing.Server`` in this process gets fresh connections, each
with a fuzzed stream, 8 at a time. At the end the server must still store a
valid capture bit-exactly, hold no bytes once cleared, and be back to its
baseline of threads and descriptors; ERROR records in its log (an unexpected
exception in a connection thread) are counted.
"""

from __future__ import annotations

import argparse
import collections
import logging
import random
import socket
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# _common puts this checkout first on sys.path (thing, and the tests this reuses).
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import print_machine  # noqa: E402

import thing  # noqa: E402
from tests.conftest import open_fds  # noqa: E402
from tests.test_fuzz import (  # noqa: E402
    HELLO,
    SEED_FRAMES,
    fuzzed_frame,
    live_case,
    mutate_bytes,
    nasty_frames,
    read_like_the_server,
)
from tests.test_security import read_to_end, stored_acks  # noqa: E402
from thing import wire  # noqa: E402
from thing.errors import ProtocolError  # noqa: E402


def decode_stream(data: bytes) -> int:
    """Feed ``data`` as a connection's bytes (a handshake, then frames) to the server's reader."""
    return len(read_like_the_server(data, _LIMITS, handshake=True))


_LIMITS = wire.Limits(max_capture_bytes=64 << 20, max_header_bytes=1 << 20)


def random_case(rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.05:
        return rng.randbytes(rng.randrange(1, 300))
    if roll < 0.10:
        return mutate_bytes(HELLO, rng, [HELLO]) + rng.choice(SEED_FRAMES)
    if roll < 0.15:
        return HELLO + rng.choice(SEED_FRAMES) + fuzzed_frame(rng)
    return HELLO + fuzzed_frame(rng)


def decoder_phase(seconds: float, seed: int, save_dir: Path | None) -> bool:
    rng = random.Random(seed)
    outcomes: collections.Counter[str] = collections.Counter()
    bugs = 0
    started = time.monotonic()
    next_report = started + 30
    while time.monotonic() - started < seconds:
        for _ in range(200):
            data = random_case(rng)
            try:
                outcomes[f"accepted ({decode_stream(data)} frames)"] += 1
            except (ProtocolError, OSError) as exc:
                outcomes[type(exc).__name__] += 1
            except Exception as exc:  # a bug: keep the input
                bugs += 1
                outcomes[f"BUG {type(exc).__name__}"] += 1
                if bugs <= 5:
                    print(f"BUG: {type(exc).__name__}: {exc}")
                    traceback.print_exc(limit=3)
                if save_dir is not None:
                    save_dir.mkdir(parents=True, exist_ok=True)
                    (save_dir / f"bug-{type(exc).__name__}-{bugs}.bin").write_bytes(data)
        if time.monotonic() >= next_report:
            next_report += 30
            total = sum(outcomes.values())
            print(f"  {time.monotonic() - started:5.0f} s: {total} cases, {bugs} bugs", flush=True)
    total = sum(outcomes.values())
    elapsed = time.monotonic() - started
    print(f"decoder: {total} cases in {elapsed:.0f} s ({total / elapsed:.0f}/s), seed {seed}")
    for outcome, count in outcomes.most_common():
        print(f"  {outcome:<28} {count:>10}  {count / total:6.1%}")
    return bugs == 0


def atheris_phase(seconds: float) -> None:
    """Coverage-guided fuzzing of decode_stream with libFuzzer; exits the process when done."""
    import atheris

    atheris.instrument_all()
    corpus = Path(tempfile.mkdtemp(prefix="thing-fuzz-corpus-"))
    for name, data in nasty_frames().items():
        (corpus / name).write_bytes(data)
    for i, frame in enumerate(SEED_FRAMES):
        (corpus / f"seed-{i}").write_bytes(HELLO + frame)

    def one_input(data: bytes) -> None:
        try:
            decode_stream(data)
        except (ProtocolError, OSError):
            pass

    print(f"atheris: {seconds:.0f} s, corpus in {corpus}", flush=True)
    atheris.Setup([sys.argv[0], f"-max_total_time={int(seconds)}", "-rss_limit_mb=4096",
                   "-print_final_stats=1", str(corpus)], one_input)
    atheris.Fuzz()


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        detail = "" if record.exc_info is None else f": {record.exc_info[1]!r}"
        self.messages[(record.getMessage().split(" serving ")[0] + detail)[:160]] += 1


def _fuzz_one(port: int, data: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as peer:
        try:
            peer.sendall(data)
            peer.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        return stored_acks(read_to_end(peer, 30))


def live_phase(seconds: float, seed: int) -> bool:
    rng = random.Random(seed)
    errors = _Errors()
    logging.getLogger("thing").addHandler(errors)
    server = thing.Server(port=0)
    server.idle_timeout = 2.0
    server.start()
    fds, threads = open_fds(), threading.active_count()
    connections = acked = 0
    ok = True
    started = time.monotonic()
    next_report = started + 30
    try:
        with ThreadPoolExecutor(8) as pool:
            while time.monotonic() - started < seconds:
                batch = [live_case(rng) for _ in range(500)]
                acked += sum(pool.map(lambda data: _fuzz_one(server.port, data), batch))
                connections += len(batch)
                server.store.clear()  # keep memory flat over a long run
                if time.monotonic() >= next_report:
                    next_report += 30
                    print(f"  {time.monotonic() - started:5.0f} s: {connections} connections",
                          flush=True)
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 15
        while server.clients() and time.monotonic() < deadline:
            time.sleep(0.05)
        server.store.clear()
        held = server.store.held_bytes
        client = thing.Client("127.0.0.1", server.port)
        value = np.random.default_rng(seed).standard_normal((257, 31)).astype(np.float32)
        stored = client.catch(value, name="after-fuzzing").wait(30)
        exact = stored and server.get("after-fuzzing").tobytes() == value.tobytes()
        client.close()
        deadline = time.monotonic() + 15
        while (threading.active_count() > threads or open_fds() > fds) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"live: {connections} connections in {elapsed:.0f} s "
              f"({connections / elapsed:.0f}/s), seed {seed}")
        print(f"  stored (valid frames among the mutations)  {server.store.received - 1}")
        print(f"  stored acknowledgements seen by peers     {acked}")
        print(f"  held bytes after clear                     {held}")
        print(f"  valid capture afterwards, bit-exact        {exact}")
        print(f"  threads now / before                       {threading.active_count()} / "
              f"{threads}")
        print(f"  descriptors now / before                   {open_fds()} / {fds}")
        print(f"  ERROR records in the server's log          {sum(errors.messages.values())}")
        for message, count in errors.messages.most_common(10):
            print(f"    {count:>6} x {message}")
        ok = (held == 0 and exact and threading.active_count() <= threads
              and open_fds() <= fds and not errors.messages)
    finally:
        server.close()
        logging.getLogger("thing").removeHandler(errors)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decoder-minutes", type=float, default=3.0)
    parser.add_argument("--live-minutes", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--save-dir", type=Path, default=None,
                        help="where inputs that raise anything but ProtocolError are written")
    parser.add_argument("--atheris", action="store_true",
                        help="coverage-guided decoder phase (runs last; needs atheris)")
    args = parser.parse_args()
    print_machine("thing long fuzzing run")
    ok = True
    if not args.atheris and args.decoder_minutes > 0:
        ok = decoder_phase(args.decoder_minutes * 60, args.seed, args.save_dir) and ok
    if args.live_minutes > 0:
        ok = live_phase(args.live_minutes * 60, args.seed) and ok
    if args.atheris and args.decoder_minutes > 0:
        sys.stdout.flush()
        atheris_phase(args.decoder_minutes * 60)  # does not return
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
