"""How a client reaches a server: the path (a Unix socket, shared memory, or TCP) and the
handshake in which each side proves the token.

A :class:`~thing.channel.Channel` calls :func:`dial` for every connection it
makes; whatever fails here (no server, another user's server, a refused or
unproven handshake) raises, and the channel says why on the handles of what
it could not send.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any, NamedTuple

from . import auth, config, shm, wire
from ._core import send_buffers
from .errors import HandshakeError
from .sockets import (
    NO_OWNER,
    connect,
    connect_resolved,
    connect_unix,
    is_own_address,
    peer_uid,
    resolve,
    set_timeouts,
    tcp_peer_uid,
    trusted_owner,
    unix_socket_path,
)

TRANSPORT_NAMES = {
    "tcp": "TCP",
    "unix": "a Unix socket",
    "shm": "a Unix socket, with shared memory for large arrays",
}


class Dialled(NamedTuple):
    """A connection that passed the handshake, and what its server said it takes."""

    sock: socket.socket
    transport: str  # "tcp", "unix" or "shm"
    mac: auth.SessionMac | None  # signs every frame when a token is in use
    notices: bool  # the server takes notices of captures that could not be sent
    steered: bool  # the server may steer us (and takes announcements of on-demand names)
    replays: bool  # it ends what it tells us of its settings with "replayed" (see Channel)
    steering: str | None  # the instance of its statements (see Steering.instance)


def dial(address: tuple[str, int], token: str | None, this_host: bool,
         control: bool) -> Dialled:
    """Connect to the server at ``address`` and greet it.

    ``token`` is the one given to the client (else ``THING_TOKEN``, else the
    one this user's server on this machine wrote); ``this_host`` whether the
    address is this machine's; ``control`` whether the job lets the REPL steer
    it. Raises HandshakeError for a server that refuses us or that we refuse,
    OSError or ProtocolError for one that is not there or breaks the protocol.
    """
    try:
        configured = auth.configured_token(token)
    except ValueError as exc:
        raise HandshakeError(str(exc)) from None
    token = configured or auth.local_token(address[1])
    sock, transport, here = _open(address, this_host, token)
    try:
        if transport == "tcp" and here and token is None:
            # Nothing can be proven: who listens must at least be this user (or root, whose
            # port forwarders a container's ports are), as on the Unix socket.
            owner = tcp_peer_uid(sock)
            if not trusted_owner(owner):
                whose = ("by no one the system shows" if owner == NO_OWNER
                         else f"by another user (uid {owner})")
                raise HandshakeError(
                    f"the TCP port {address[1]} on this machine is served {whose}: not "
                    "sending to it. To send to another user's server, give both sides a "
                    "token (THING_TOKEN)")
        # TCP to this host counts only if the server proves the token: also when TCP was
        # forced, if this user has one (forced without any, nothing could be proven).
        tcp_here = transport == "tcp" and here and (
            config.transport() != "tcp" or token is not None)
        mac, info = _handshake(sock, address, token, configured is not None or tcp_here,
                               transport == "shm", control)
    except BaseException:
        sock.close()
        raise
    steered = info.get("control") is True
    instance = info.get("steering")
    return Dialled(sock, transport, mac, info.get("notices") is True, steered,
                   control and steered and info.get("replay") is True,
                   instance[:64] if isinstance(instance, str) else None)


def _open(address: tuple[str, int], this_host: bool, token: str | None
          ) -> tuple[socket.socket, str, bool]:
    """Connect by the fastest safe path: shared memory or a Unix socket, else TCP; return
    the socket, the path, and whether the server is on this machine.

    On this host a Unix socket is used when it is there and its server is this
    user's (checked with SO_PEERCRED, as the server checks us). TCP to this host
    is another matter: any local user may be listening on the port before the
    real server is. So without a token a client does not fall back to it
    unless ``THING_TRANSPORT=tcp`` says so; with one, the server must prove it.
    """
    host, port = address
    wanted = config.transport()
    if not this_host:
        # A name only the resolver knows may still be this machine (an alias, its own
        # address on the network): judged on the very addresses the connection will use.
        resolved = resolve(host, port)
        own = next((found[0] for _, found in resolved if is_own_address(found[0])), None)
        if own is None:
            return connect_resolved(resolved, config.connect_timeout()), "tcp", False
        host = own
    if wanted == "tcp":
        return connect(host, port, config.connect_timeout()), "tcp", True
    path = unix_socket_path(port, host)
    why = (f"no thing server of this user listens on this machine's Unix socket {path}"
           if path is not None else "no directory only this user can use for thing's Unix "
           "socket (another user's in its place?)")
    if path is not None:
        try:
            sock = connect_unix(path, config.connect_timeout())
        except FileNotFoundError:
            pass
        except OSError as exc:
            why = f"the Unix socket {path} is unusable ({exc})"
        else:
            owner = peer_uid(sock)
            if trusted_owner(owner):
                return sock, "shm" if wanted == "shm" and shm.AVAILABLE else "unix", True
            sock.close()
            why = f"the Unix socket {path} is served by another user (uid {owner})"
    if token is None:
        raise HandshakeError(
            f"{why}; without a token, thing sends to a server on this machine only through "
            "that socket (another user could be listening on the TCP port). Set "
            "THING_TRANSPORT=tcp to use TCP anyway (an ssh tunnel, a container), or "
            "give both sides a token (THING_TOKEN)"
        )
    return connect(host, port, config.connect_timeout()), "tcp", True


def _handshake(sock: socket.socket, address: tuple[str, int], token: str | None,
               server_must_prove: bool, shared_memory: bool, control: bool
               ) -> tuple[auth.SessionMac | None, dict[str, Any]]:
    """Greet the server; with a token, each side proves it. Returns the session's MAC and
    what the server said of itself."""
    host, port = address
    client_nonce = auth.new_nonce()
    # Who this process is (host, pid, run) is told only to a server known to be ours: one
    # that must prove the token hears it with our own proof, once it has given its own.
    identity = _identity()
    hello = {"nonce": client_nonce, "shared_memory": shared_memory, "control": control,
             "replay": control, **({} if server_must_prove else identity)}
    send_buffers(sock, [wire.encode_handshake(hello)])
    deadline = time.monotonic() + config.connect_timeout()  # the handshake's, all of it
    status, info = _answer(sock, deadline, address)
    mac = None
    if status == wire.HANDSHAKE_CHALLENGE:
        server_nonce = info.get("nonce")
        if not auth.is_nonce(server_nonce):
            raise HandshakeError(f"the server at {host}:{port} sent a malformed challenge")
        if token is not None and not auth.verify(
                auth.server_proof(token, client_nonce, server_nonce), info.get("proof")):
            raise HandshakeError(
                f"the server at {host}:{port} could not prove it knows the token: it is "
                "not the server you meant (or the tokens differ); not sending to it")
        # Without a token, answer anyway, so the server can say why it refuses us.
        proof = "" if token is None else auth.client_proof(token, client_nonce, server_nonce)
        answer = {"proof": proof, **(identity if server_must_prove else {})}
        send_buffers(sock, [wire.encode_handshake(answer)])
        status, info = _answer(sock, deadline, address)
        if token is not None:
            mac = auth.SessionMac(token, client_nonce, server_nonce)
    elif status == wire.HANDSHAKE_OK and server_must_prove:
        raise HandshakeError(
            f"the server at {host}:{port} did not ask for the token, so it cannot prove "
            "it is yours (another user's, listening first?); not sending to it")
    if status != wire.HANDSHAKE_OK:
        error = wire.printable(str(info.get("error", "?"))[: wire.MAX_REFUSAL_TEXT])
        if token is None and "token" in error:
            raise HandshakeError(
                f"the server at {host}:{port} requires a token: set THING_TOKEN "
                "to the value the server printed"
            )
        raise HandshakeError(f"server refused the connection: {error}")
    set_timeouts(sock, config.send_timeout(), None)
    return mac, info


def _answer(sock: socket.socket, deadline: float, address: tuple[str, int]
            ) -> tuple[int, dict[str, Any]]:
    """The server's next handshake message. One that took the connection and then said
    nothing in time is a server that is there but stopped or busy (a REPL suspended with
    Ctrl+Z, or paused in a debugger): its captures say so, not that none listens."""
    try:
        return wire.recv_handshake(sock, deadline)
    except TimeoutError:
        raise HandshakeError(
            f"the server at {address[0]}:{address[1]} took the connection but did not answer "
            f"within {config.connect_timeout():g} s (THING_CONNECT_TIMEOUT): is its process "
            "stopped or busy?") from None


def _identity() -> dict[str, Any]:
    """Who this client is, as its hello tells the server (the REPL shows it)."""
    from . import __version__
    from .run_names import current_run

    return {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "run": current_run(),
        "thing": __version__,
        "python": sys.version.split()[0],
    }
