"""Every tunable of thing in one place: its default and its environment variable.

Functions read the environment when they are called, not at import, so a test
or a notebook can change a variable and then create a client or a server.
"""

from __future__ import annotations

import math
import os
import re
from typing import TypeVar

from .log import log

DEFAULT_PORT = 2875

T = TypeVar("T")


# What an integer setting may be at most: some are C integers in the compiled core, where
# THING_MAX_NAMES=1e19 made every catch fail ("Python int too large to convert").
_MAX_INT = 1 << 62


def _env_int(name: str, default: int) -> int:
    return _bounded(_env_float(name, default))


def _ignored(name: str, value: object, why: str, default: T) -> T:
    """Say that ``name``'s value is ignored, and why, and return the default to use: a typo
    in a variable must not stop a training job."""
    log.warning("ignoring %s=%r: %s; using %r", name, value, why, default)
    return default


def _bounded(number: float) -> int:
    return int(max(min(number, _MAX_INT), -_MAX_INT))


def _env_bytes(name: str, default: int) -> int:
    """A size in bytes, written as a number or with a unit (``4G``, ``512MiB``)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    size = parse_size(raw)
    if size is None:
        return _ignored(name, raw, "not a size (try 4G, 512M or 4096)", default)
    return _bounded(size)


# A number as float() reads it (a sign, 1_000, 4e9), then a unit: K, KB, KiB, ... T.
_SIZE = re.compile(r"(.*?)\s*([kmgt]?)(?:ib|b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int | None:
    """``20G``, ``512MiB``, ``1.5g``, ``4e9``, ``4096``, ``-1``: bytes (K, M, G and T are
    powers of 1024); None if ``text`` is no size."""
    number, unit = _SIZE.fullmatch(text.strip()).groups()  # type: ignore[union-attr]
    try:
        size = float(number) * _SIZE_UNITS[unit.upper()]
    except ValueError:
        return None
    return int(size) if math.isfinite(size) else None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        return _ignored(name, raw, "not a number", default)
    return value


def server_address() -> tuple[str, int]:
    """Where the default client sends: ``THING_SERVER`` (``host[:port]``), ``THING_PORT``."""
    from .sockets import parse_address

    return parse_address(os.environ.get("THING_SERVER", "") or "localhost", _port())


def serve_host() -> str:
    """Interface the default server binds: ``THING_HOST``, else loopback."""
    return os.environ.get("THING_HOST", "") or "127.0.0.1"


def serve_port() -> int:
    """Port the default server binds: ``THING_PORT``, else 2875."""
    return _port()


def _port() -> int:
    port = _env_int("THING_PORT", DEFAULT_PORT)
    if not 0 <= port <= 65535:  # bind() and connect() would fail with a traceback
        return _ignored("THING_PORT", port, "not a port (0 to 65535)", DEFAULT_PORT)
    return port


# Client side -----------------------------------------------------------------


def queue_max_bytes() -> int:
    """Bytes a client may hold waiting to be sent (``THING_QUEUE_BYTES``, 1 GiB)."""
    return _env_bytes("THING_QUEUE_BYTES", 1 << 30)


def queue_max_items() -> int:
    """Captures a client may hold while they wait to be sent (``THING_QUEUE_ITEMS``, 1024)."""
    return _env_int("THING_QUEUE_ITEMS", 1024)


def snapshot_bytes() -> int:
    """Arrays up to this size are copied at the call (``THING_SNAPSHOT_BYTES``, 64 KiB).

    Measured (benchmarks/README.md): copying 64 KiB costs less than queueing a
    capture, so the capture holds the value at the call for free; larger arrays
    are read in place by the sender thread.
    """
    return _env_bytes("THING_SNAPSHOT_BYTES", 64 << 10)


def max_names() -> int:
    """Names whose ``every=``/``first=`` counts and call sites a client remembers
    (``THING_MAX_NAMES``, 10,000); beyond it the least recently caught are forgotten, an
    eighth at a time (their counting restarts). At least 1."""
    return max(_env_int("THING_MAX_NAMES", 10_000), 1)


def max_servers() -> int:
    """Distinct ``server=`` strings a client keeps connections for (``THING_MAX_SERVERS``, 64).

    Beyond it the least recently opened connection is closed.
    """
    return max(_env_int("THING_MAX_SERVERS", 64), 1)


def flush_timeout() -> float:
    """Seconds the interpreter waits at exit for queued captures (``THING_FLUSH_TIMEOUT``, 5)."""
    return _env_float("THING_FLUSH_TIMEOUT", 5.0)


def send_timeout() -> float:
    """Seconds a send may go without progress before reconnecting (``THING_SEND_TIMEOUT``,
    30): ``SO_SNDTIMEO``, per system call, so a send stalled midway takes up to twice it."""
    return max(_env_float("THING_SEND_TIMEOUT", 30.0), 0.1)  # 0 would be non-blocking


def connect_timeout() -> float:
    """Seconds a connection attempt, handshake included, may take (``THING_CONNECT_TIMEOUT``, 5)."""
    return max(_env_float("THING_CONNECT_TIMEOUT", 5.0), 0.1)


def reconnect_interval() -> float:
    """Longest pause between connection attempts (``THING_RECONNECT_INTERVAL``, 1)."""
    # Not below 50 ms: 0 would have the sender thread dial in a busy loop.
    return max(_env_float("THING_RECONNECT_INTERVAL", 1.0), 0.05)


def control() -> bool:
    """Whether a client follows the REPL's steering (``THING_CONTROL``, 1; 0 refuses all).

    ``0``/``false``/``no``/``off`` refuse it, ``1``/``true``/``yes``/``on`` allow it. Any
    other value refuses it too: the switch that keeps a REPL out of a job fails closed.
    """
    raw = os.environ.get("THING_CONTROL", "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return True
    if raw not in ("0", "false", "no", "off"):
        log.warning("THING_CONTROL=%r is not 0 or 1: refusing the REPL's steering", raw)
    return False


def control_ttl() -> float:
    """Seconds a client keeps the REPL's settings once no server connects
    (``THING_CONTROL_TTL``, 600); then its own every=/first= apply again."""
    return _env_float("THING_CONTROL_TTL", 600.0)


def transport() -> str:
    """How a client reaches a server on this host (``THING_TRANSPORT``): auto, tcp, unix or shm.

    ``auto`` (the default) and ``unix`` use the Unix socket; ``shm`` adds the
    shared-memory hand-off for large arrays. ``auto`` leaves shared memory out
    because, measured (benchmarks/README.md), faulting in fresh shared pages
    costs more than the socket copies it saves. Each falls back to the next
    path (shm, unix, tcp) when unavailable.
    """
    value = os.environ.get("THING_TRANSPORT", "").strip().lower() or "auto"
    if value not in ("auto", "tcp", "unix", "shm"):
        return _ignored("THING_TRANSPORT", value, "use auto, tcp, unix or shm", "auto")
    return value


def max_mappings() -> int:
    """Shared-memory captures a server keeps mapped, for all its clients together
    (``THING_MAX_MAPPINGS``, 1024).

    Each mapping takes one of the process's map entries (``vm.max_map_count``,
    often 65530); beyond this, shared-memory captures are copied into ordinary
    memory as they arrive, as if they had come inline.
    """
    return _env_int("THING_MAX_MAPPINGS", 1024)


def shm_threshold() -> int:
    """Payload bytes from which a capture goes through shared memory (``THING_SHM_THRESHOLD``)."""
    return _env_bytes("THING_SHM_THRESHOLD", 1 << 20)


# Server side -----------------------------------------------------------------


def max_capture_bytes() -> int:
    """Largest capture a server accepts (``THING_MAX_CAPTURE_BYTES``, 64 GiB)."""
    return _env_bytes("THING_MAX_CAPTURE_BYTES", 64 << 30)


def max_header_bytes() -> int:
    """Largest metadata header a server accepts (``THING_MAX_HEADER_BYTES``, 1 MiB).

    A header describes a capture's structure, not its data: a dict of 10,000
    tensors takes about 600 KiB. Parsed, it may hold up to 32 times its size in
    Python objects, which the store is charged for.
    """
    return _env_bytes("THING_MAX_HEADER_BYTES", 1 << 20)


def idle_timeout() -> float:
    """Seconds a peer may stall mid-frame or in the handshake (``THING_IDLE_TIMEOUT``, 60)."""
    return _env_float("THING_IDLE_TIMEOUT", 60.0)


def min_frame_rate() -> float:
    """Bytes per second a frame must average (``THING_MIN_RATE``, 1 MiB/s).

    A frame of N bytes must be complete within ``THING_IDLE_TIMEOUT`` + N / rate
    seconds of its first byte, or it is cut off and whatever it reserved released.
    """
    return max(float(_env_bytes("THING_MIN_RATE", 1 << 20)), 1.0)


def max_connections() -> int:
    """Clients a server serves at once (``THING_MAX_CONNECTIONS``, 256)."""
    return _env_int("THING_MAX_CONNECTIONS", 256)


def store_max_bytes() -> int:
    """Bytes the history store holds before evicting (``THING_STORE_BYTES``, half the RAM)."""
    default = _physical_memory() // 2
    size = _env_bytes("THING_STORE_BYTES", default)
    if size <= 0:  # a store that refuses every capture
        return _ignored("THING_STORE_BYTES", size, "not a positive size", default)
    return size


def stats_share() -> float:
    """The share of one core the server may spend working out each arriving capture's
    statistics in the background (``THING_STATS_SHARE``, 0.25; 0: only when asked for)."""
    return min(max(_env_float("THING_STATS_SHARE", 0.25), 0.0), 1.0)


def store_max_versions() -> int | None:
    """Versions kept per name, or unlimited (``THING_MAX_VERSIONS``, unlimited)."""
    value = _env_int("THING_MAX_VERSIONS", 0)
    return value or None


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30
