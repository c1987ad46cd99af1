"""Token authentication: both sides prove the token, and every frame after that is signed.

With a token, the handshake is a mutual challenge-response over two fresh
nonces, one from each side: the server proves it knows the token first (a
client with a token refuses a server that cannot), then the client does. The
token itself never crosses the wire. Both sides then derive a session key
from the token and both nonces, and sign every frame and acknowledgement of
the connection with it, numbered: a relay that passes the handshake through
still cannot inject, replay or reorder a capture, nor forge an answer.

A server that listens beyond loopback without a configured token makes one up
and writes it, readable only by its user, to ``$XDG_RUNTIME_DIR/thing/token-<port>``
(else ``~/.thing/token-<port>``), where that user's clients on the same
machine find it by themselves.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
import string
from pathlib import Path

from .errors import ArgumentError, ThingError
from .sockets import home_directory, private_directory, runtime_directory

NONCE_BYTES = 32
MAC_BYTES = 32
_CONTEXT = b"thing-auth-v2:"


class TokenFileError(ThingError):
    """The token file cannot be written safely (its directory is not private)."""


def new_nonce() -> str:
    """A fresh challenge, hex-encoded."""
    return secrets.token_hex(NONCE_BYTES)


def is_nonce(value: object) -> bool:
    """Whether a peer's ``value`` is a nonce as thing makes them: 32 to 128 hex digits
    (anything else, unpaired surrogates say, must not reach the MAC's encoding)."""
    return (isinstance(value, str) and 32 <= len(value) <= 128 and value.isascii()
            and all(c in string.hexdigits for c in value))


def _hmac(token: str, role: bytes, client_nonce: str, server_nonce: str) -> hmac.HMAC:
    message = b"%s%s:%s:%s" % (_CONTEXT, role, client_nonce.encode(), server_nonce.encode())
    return hmac.new(token.encode(), message, hashlib.sha256)


def server_proof(token: str, client_nonce: str, server_nonce: str) -> str:
    """What the server answers to prove the token, over both nonces."""
    return _hmac(token, b"server", client_nonce, server_nonce).hexdigest()


def client_proof(token: str, client_nonce: str, server_nonce: str) -> str:
    """What the client answers to prove the token, over both nonces."""
    return _hmac(token, b"client", client_nonce, server_nonce).hexdigest()


def verify(expected: str, answer: object) -> bool:
    """True if ``answer`` is the ``expected`` proof; constant-time."""
    if not isinstance(answer, str):
        return False
    return hmac.compare_digest(expected.encode(), answer.encode("utf-8", "replace"))


class SessionMac:
    """Signs and checks the numbered messages of one authenticated connection.

    Each direction counts its own messages; a message's MAC covers its number,
    so none can be dropped, replayed or moved without the next check failing.
    Each counter is used by one thread only (the sender, or the reader).
    """

    def __init__(self, token: str, client_nonce: str, server_nonce: str):
        self._key = _hmac(token, b"session", client_nonce, server_nonce).digest()
        self._sent = 0
        self._received = 0

    def sign(self, *parts: bytes) -> bytes:
        """The MAC of the next message sent, made of ``parts``."""
        signature = self._numbered(self._sent)
        self._sent += 1
        for part in parts:
            signature.update(part)
        return signature.digest()

    def incoming(self) -> hmac.HMAC:
        """The MAC under way of the next message received: update it with its parts as they
        arrive, then compare with :func:`matches`."""
        signature = self._numbered(self._received)
        self._received += 1
        return signature

    def check(self, received: bytes, *parts: bytes) -> bool:
        """Whether ``received`` is the MAC of the next message received, made of ``parts``."""
        signature = self.incoming()
        for part in parts:
            signature.update(part)
        return matches(signature, received)

    def _numbered(self, number: int) -> hmac.HMAC:
        return hmac.new(self._key, number.to_bytes(8, "little"), hashlib.sha256)


def matches(signature: hmac.HMAC, received: bytes) -> bool:
    """Whether a message's ``received`` MAC is the one computed; constant-time."""
    return hmac.compare_digest(signature.digest(), bytes(received))


def is_loopback(host: str) -> bool:
    """True if binding ``host`` exposes the server to this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_file(port: int) -> Path:
    """Where a server on ``port`` keeps its generated token; :class:`TokenFileError` where
    there is nowhere (no runtime directory, and no home)."""
    runtime = runtime_directory()
    if runtime is not None:
        return runtime / f"token-{port}"
    home = home_directory()
    if home is None:
        raise TokenFileError("no home directory to keep a token file in (set HOME)")
    return home / ".thing" / f"token-{port}"


def write_token_file(port: int, token: str) -> Path:
    """Write ``token`` where same-user clients look for it; only the user can read it.

    The file is created new (``O_EXCL | O_NOFOLLOW``) under a random name in a
    private directory, then renamed into place. Raises :class:`TokenFileError`
    rather than write anywhere else.
    """
    path = token_file(port)
    if not private_directory(path.parent):
        raise TokenFileError(
            f"{path.parent} is not a private directory of this user (it must be a real "
            "directory, owned by you, mode 0700): the token is not written there"
        )
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(temporary, flags, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(token)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def remove_token_file(port: int, token: str) -> None:
    """Remove the token file of ``port`` if it still holds ``token``."""
    try:
        path = token_file(port)
        if read_token_file(path) == token:
            path.unlink()
    except (OSError, TokenFileError):
        pass


def read_token_file(path: Path) -> str | None:
    """The token in ``path``, if it is a regular file of this user's that others cannot read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd) as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None
        return handle.read().strip() or None


def configured_token(explicit: str | None = None) -> str | None:
    """The token given by the user: ``explicit``, else ``THING_TOKEN``.

    ``THING_TOKEN=""`` is an error, not "no token": a variable set to nothing is
    more likely a mistake (an unset shell variable) than a wish for no security.
    """
    if explicit is not None:
        if not explicit:
            raise ArgumentError("token='' is not a token; pass None for no token")
        return explicit
    value = os.environ.get("THING_TOKEN")
    if value is not None and not value.strip():
        raise ArgumentError("THING_TOKEN is set but empty; unset it for no token, or set the token")
    return value.strip() if value else None


def local_token(port: int) -> str | None:
    """The token this user's server on ``port`` wrote, for a client with none configured;
    None if there is none it may use."""
    try:
        return read_token_file(token_file(port))
    except (OSError, TokenFileError):
        return None
