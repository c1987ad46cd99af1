"""Socket plumbing shared by client and server: addresses, options, timeouts, Unix sockets."""

from __future__ import annotations

import contextlib
import errno
import functools
import grp
import ipaddress
import os
import pwd
import select
import socket
import stat
import struct
import tempfile
import time
from pathlib import Path

from ._core import recv_buffers
from .errors import ArgumentError

_no_temporary_directory = False


def _temporary_directory() -> Path | None:
    """The temporary directory; None where none is usable (a read-only container), which
    tempfile would find out anew, in tens of milliseconds, at each asking (it keeps only
    the directory it found): asked once."""
    global _no_temporary_directory
    if not _no_temporary_directory:
        try:
            return Path(tempfile.gettempdir())
        except OSError:
            _no_temporary_directory = True
    return None


def home_directory() -> Path | None:
    """This user's home; None where there is none (no HOME, and a uid with no passwd
    entry, as in some containers)."""
    try:
        return Path.home()
    except RuntimeError:
        return None


def mine_alone(info: os.stat_result) -> bool:
    """Whether a file (or directory) of this status is this user's, and no other user may
    write to it: not anyone, nor a group, unless that group is the user's own private one
    (where the umask is 002, as on Ubuntu, every file a user makes is writable by it)."""
    if info.st_uid != os.getuid() or info.st_mode & stat.S_IWOTH:
        return False
    return not info.st_mode & stat.S_IWGRP or _private_group(info.st_gid)


@functools.lru_cache(maxsize=16)
def _private_group(gid: int) -> bool:
    """Whether ``gid`` is this user's primary group, named after them, that no other user
    is in (as a member, or as their own primary group)."""
    try:
        user, group = pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(gid)
    except KeyError:  # a user or group the system cannot name
        return False
    return (gid == os.getgid() and group.gr_name == user and set(group.gr_mem) <= {user}
            and not any(entry.pw_gid == gid and entry.pw_name != user
                        for entry in pwd.getpwall()))


def runtime_directory() -> Path | None:
    """thing's directory under ``$XDG_RUNTIME_DIR``, the user's own by design; None where
    that is not set, or names no directory of this user's that only they may write to.

    Such a one (``/tmp``, as containers and ``su`` may leave it) is as if unset: another
    user could make thing's directory in it first, and no socket or token file would go
    anywhere.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    try:
        info = os.stat(runtime) if runtime else None
    except OSError:
        return None
    if info is None or not stat.S_ISDIR(info.st_mode) or not mine_alone(info):
        return None
    return Path(runtime) / "thing"


# The sender thread must never be the first to take these: a fork (a DataLoader worker,
# say) while it holds tempfile's once-lock or is half-way through importing the idna
# codec that getaddrinfo's host names need leaves the child blocked or failing for good.
_temporary_directory()
"localhost".encode("idna")


def parse_address(text: str, default_port: int) -> tuple[str, int]:
    """Split ``host``, ``host:port``, ``:port`` or ``[v6]:port`` into ``(host, port)``."""
    text = text.strip()
    host, port = text, default_port
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest.startswith(":"):
            port = _port(rest[1:], text)
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = _port(port_text, text)
    return host or "localhost", port


def _port(text: str, whole: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise ArgumentError(f"bad port in server address {whole!r}") from None
    if not 0 <= port < 65536:
        raise ArgumentError(f"port out of range in server address {whole!r}")
    return port


def set_timeouts(sock: socket.socket, send: float | None, receive: float | None) -> None:
    """Make ``sock`` blocking with kernel-level send/receive timeouts (None: wait forever).

    The compiled core calls ``sendmsg``/``recvmsg`` on the raw descriptor with
    the GIL released, so Python-level socket timeouts would not apply there;
    ``SO_SNDTIMEO``/``SO_RCVTIMEO`` apply to both backends alike.
    """
    sock.settimeout(None)
    for option, seconds in ((socket.SO_SNDTIMEO, send), (socket.SO_RCVTIMEO, receive)):
        whole = int(seconds or 0)
        micros = int(((seconds or 0) - whole) * 1_000_000)
        sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, micros))


def tune_stream(sock: socket.socket) -> None:
    """Send small frames at once (no Nagle delay); give Unix sockets room for big ones.

    A Unix socket's default buffers (about 200 KiB) make a large transfer
    wake each side every few hundred KiB; 4 MiB measured 1.5x faster. TCP
    tunes its own buffers better than a fixed size would.
    """
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A peer whose machine vanished without closing is noticed in about 90 s: a job
        # that sends nothing (paused, on demand) then starts its THING_CONTROL_TTL.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, option):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    elif sock.family == socket.AF_UNIX:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):  # capped by the system: still correct
                sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)


def shutdown(sock: socket.socket) -> None:
    """Shut both directions of ``sock``, waking any thread blocked on it; never raises."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def recv_exactly(sock: socket.socket, size: int, deadline: float | None = None) -> bytearray:
    """``size`` bytes from ``sock``, all of them by ``deadline`` (``time.monotonic()``;
    TimeoutError after it) or, with none, as the socket's own timeouts allow.
    ConnectionResetError if the peer closes first."""
    received = bytearray(size)
    if deadline is None:
        recv_buffers(sock, [received])
        return received
    view, got = memoryview(received), 0
    waiting = select.poll()
    waiting.register(sock, select.POLLIN)
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0 or not waiting.poll(left * 1000):
            raise TimeoutError(f"{got} of {size} bytes arrived in the time allowed")
        moved = sock.recv_into(view[got:])
        if not moved:
            raise ConnectionResetError(errno.ECONNRESET, "the peer closed the connection")
        got += moved
    return received


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """Open a tuned TCP connection to ``host:port`` within ``timeout`` seconds."""
    return connect_resolved(resolve(host, port), timeout)


def connect_resolved(addresses: list[tuple[int, tuple]], timeout: float) -> socket.socket:
    """Open a tuned TCP connection to the first of ``addresses`` (see :func:`resolve`) that
    answers, each given ``timeout`` seconds; the last one's error if none does."""
    error: OSError = OSError(errno.EADDRNOTAVAIL, "no address to connect to")
    for family, address in addresses:
        try:
            return _connected(socket.socket(family, socket.SOCK_STREAM), address, timeout)
        except OSError as exc:
            error = exc
    raise error


def _connected(sock: socket.socket, address: str | tuple | None, timeout: float
               ) -> socket.socket:
    """``sock``, connected to ``address`` if given, tuned and with kernel timeouts."""
    try:
        if address is not None:
            sock.settimeout(timeout)
            sock.connect(address)
        tune_stream(sock)
        set_timeouts(sock, timeout, timeout)
    except BaseException:
        sock.close()
        raise
    return sock


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    """Bind and listen on ``host:port`` (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


# -- the same-host path ---------------------------------------------------------


def private_directory(directory: Path) -> bool:
    """Create ``directory`` (0700) if missing; True if it is a real directory only we can use.

    Not a symlink, owned by this user, no access for group or others: otherwise
    another user could read or replace what is put there.
    """
    try:
        _make_private(directory)
        info = directory.lstat()
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
            and not info.st_mode & 0o077)


def _make_private(directory: Path) -> None:
    """Make ``directory`` and any of its parents missing, each 0700 (``mkdir(parents=True)``
    makes the parents as the umask says: ``~/.thing`` 0755, where the token file may then
    not be written)."""
    if not os.path.lexists(directory.parent):
        _make_private(directory.parent)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)


# Hosts whose server's socket is named after the port alone: what a client on this
# machine reaches as "localhost" (a server bound to loopback or to every interface).
_PLAIN_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1", "0.0.0.0", "::"})


def unix_socket_path(port: int, host: str = "127.0.0.1") -> Path | None:
    """Where the server of TCP ``host:port`` also listens on this host; None if nowhere is safe.

    The directory is ``$XDG_RUNTIME_DIR/thing`` (else ``<tmp>/thing-<uid>``, or
    ``~/.thing/sockets`` where another user made that one first), mode 0700 and
    owned by this user: nobody else can even reach the socket.
    A server bound to loopback or to every interface is ``<port>.sock``; one
    bound to another address (127.0.0.2, a LAN address) is ``<address>-<port>.sock``,
    so two such servers of one user on one port keep apart.
    """
    runtime = runtime_directory()
    if runtime is not None:
        candidates = [runtime]
    else:
        temporary, home = _temporary_directory(), home_directory()
        candidates = [*([] if temporary is None else [temporary / f"thing-{os.getuid()}"]),
                      *([] if home is None else [home / ".thing" / "sockets"])]
    directory = next((path for path in candidates if private_directory(path)), None)
    if directory is None:
        return None
    host = canonical_host(host)
    if host in _PLAIN_HOSTS or (_address(host) is None and is_this_host(host)):
        return directory / f"{port}.sock"
    return directory / f"{host.replace(':', '_').replace('/', '_')}-{port}.sock"


def listen_unix(path: Path, backlog: int = 128) -> tuple[socket.socket, int]:
    """Bind and listen on the Unix socket ``path``; return it and the inode it bound.

    A socket file left by a dead server (nothing accepts on it) is replaced; one
    a live server listens on is not (``EADDRINUSE``).
    """
    if path.is_socket():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink(missing_ok=True)  # stale
            else:
                raise OSError(errno.EADDRINUSE, f"a live server listens on {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        inode = os.stat(path).st_ino
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock, inode


def remove_unix_socket(path: Path, inode: int) -> None:
    """Remove the socket file at ``path`` if it is still the one we bound (``inode``)."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            path.unlink()


def connect_unix(path: Path, timeout: float) -> socket.socket:
    """Open a connection to the Unix socket ``path`` within ``timeout`` seconds."""
    return _connected(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), str(path), timeout)


def peer_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket, where the OS tells."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:  # pragma: no cover - not Linux; the 0700 directory still guards
        return None
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, 12))
    return uid


# What tcp_peer_uid answers when the socket tables show this end of a connection but not
# the other end, established: it closed at once (the tables show a closing socket as
# root's, whatever its user), or hides. Never let in.
NO_OWNER = -1

# Linux's socket tables, IPv4's and IPv6's (where a socket of either family that carries
# IPv4 is listed, under ::ffff:a.b.c.d): one end of a connection may be in each.
_SOCKET_TABLES = (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6))
_ESTABLISHED = "01"


def trusted_owner(uid: int | None) -> bool:
    """Whether a peer on this machine owned by ``uid`` may be talked to without a token:
    this user, root (which can read anything of ours anyway; a container's port forwarder),
    or one the system does not tell (None). Never :data:`NO_OWNER`."""
    return uid in (None, 0, os.getuid())


def tcp_peer_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of a TCP connection within this machine,
    as Linux's socket tables (``/proc/net/tcp``, ``tcp6``) say; :data:`NO_OWNER` if they
    show this end but not the other, established; None if they show neither (not Linux,
    or tables that list nothing).

    The other end's socket is the one whose local address is our peer's and whose remote
    address is ours. A socket a server accepted belongs to the user of its listener.
    """
    try:
        ours, theirs = sock.getsockname()[:2], sock.getpeername()[:2]
    except OSError:  # closed already
        return NO_OWNER
    seen_ours = False
    for table, version in _SOCKET_TABLES:
        try:
            our_address = _table_address(ours, version)
            their_address = _table_address(theirs, version)
            if our_address is None or their_address is None:
                continue
            with open(table) as rows:
                for row in rows:
                    fields = row.split()
                    if len(fields) < 10:
                        continue
                    if (fields[1], fields[2]) == (our_address, their_address):
                        seen_ours = True
                    elif ((fields[1], fields[2]) == (their_address, our_address)
                          and fields[3] == _ESTABLISHED):  # not yet accepted: the listener's
                        return int(fields[7])
        except (OSError, ValueError):  # no such table (not Linux), or what it cannot hold
            continue
    return NO_OWNER if seen_ours else None


def _table_address(address: tuple[str, int], version: int) -> str | None:
    """An address as Linux's IPv4 or IPv6 socket table writes it (the address's 32-bit
    words in the machine's byte order, in hex, then the port); None if that table cannot
    hold it."""
    host, port = ipaddress.ip_address(address[0].partition("%")[0]), address[1]
    if version == 4:
        if isinstance(host, ipaddress.IPv6Address):
            if host.ipv4_mapped is None:
                return None
            host = host.ipv4_mapped
    elif isinstance(host, ipaddress.IPv4Address):
        host = ipaddress.IPv6Address(f"::ffff:{host}")
    packed = host.packed
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{word:08X}" for word in words) + f":{port:04X}"


def is_this_host(host: str) -> bool:
    """True if ``host`` names this machine: loopback, the unspecified address, an address
    of one of its interfaces, ``localhost``, or this host's own name, however spelled.

    An address is read without the resolver, in any spelling (``127.1``,
    ``::ffff:127.0.0.1``); a host name looks up this host's names once (see
    :func:`own_names`). Any other name is the resolver's to answer: see
    :func:`resolve` and :func:`is_own_address`.
    """
    canonical = canonical_host(host)
    if _address(canonical) is not None:
        return is_own_address(canonical)
    return canonical == "localhost" or canonical in {
        name.lower().rstrip(".") for name in own_names()}


def canonical_host(host: str) -> str:
    """``host`` in one spelling: an address in its standard form (``127.1`` and
    ``::ffff:127.0.0.1`` are ``127.0.0.1``), a name in lower case without a final dot.
    Asks no resolver."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM,
                                   flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError, ValueError):
        return host.lower().rstrip(".")
    address = ipaddress.ip_address(found[0][4][0].partition("%")[0])
    return str(getattr(address, "ipv4_mapped", None) or address)


def is_own_address(address: str) -> bool:
    """Whether a connection to the IP ``address`` reaches this machine: loopback, the
    unspecified address, or one of this machine's own (which only it can bind)."""
    ip = ipaddress.ip_address(canonical_host(address))
    if ip.is_loopback or ip.is_unspecified:
        return True
    try:  # no IPv6 on this machine: no IPv6 address of its own
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET,
                           socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True


def resolve(host: str, port: int) -> list[tuple[int, tuple]]:
    """The ``(family, address)`` pairs a TCP connection to ``host:port`` would try."""
    return [(family, address) for family, _, _, _, address
            in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address, or None for a host name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@functools.lru_cache(maxsize=1)
def own_names() -> tuple[str, str]:
    """This host's name and fully qualified name, looked up once.

    ``getfqdn`` goes through the resolver, which holds locks of the C library
    while it works: a fork (a DataLoader worker) while a sender thread is inside
    it can leave the child's own lookups blocked for good (1 child in 200 here,
    forked while another thread looked up). So a channel asks on the thread that
    opens it, before its sender thread starts, and the sender finds the answer kept.
    """
    return socket.gethostname(), socket.getfqdn()
