"""Socket plumbing shared by client and server: addresses, options, timeouts."""

from __future__ import annotations

import socket
import struct


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
        raise ValueError(f"bad port in server address {whole!r}") from None
    if not 0 <= port < 65536:
        raise ValueError(f"port out of range in server address {whole!r}")
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
    """Send small frames (a loss scalar, an acknowledgement) at once, not after Nagle's delay."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """Open a tuned TCP connection to ``host:port`` within ``timeout`` seconds."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
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
