"""Token authentication: a challenge-response in the handshake; the token never crosses the wire.

A server with a token answers a client's hello with a random nonce; the client
proves it knows the token by returning HMAC-SHA256(token, nonce), which the
server checks in constant time. A server that listens beyond loopback without
a configured token makes one up and writes it, readable only by its user, to
``$XDG_RUNTIME_DIR/thing/token-<port>`` (else ``~/.thing/token-<port>``), where
that user's clients on the same machine find it by themselves.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from pathlib import Path

NONCE_BYTES = 32
_CONTEXT = b"thing-auth-v1:"


def new_nonce() -> str:
    """A fresh challenge, hex-encoded."""
    return secrets.token_hex(NONCE_BYTES)


def proof(token: str, nonce: str) -> str:
    """The answer to a challenge: HMAC-SHA256 of the nonce, keyed by the token."""
    return hmac.new(token.encode(), _CONTEXT + nonce.encode(), hashlib.sha256).hexdigest()


def verify(token: str, nonce: str, answer: object) -> bool:
    """True if ``answer`` proves knowledge of ``token``; constant-time."""
    if not isinstance(answer, str):
        return False
    return hmac.compare_digest(proof(token, nonce).encode(), answer.encode("utf-8", "replace"))


def is_loopback(host: str) -> bool:
    """True if binding ``host`` exposes the server to this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_file(port: int) -> Path:
    """Where a server on ``port`` keeps its generated token."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = Path(runtime) / "thing" if runtime and os.path.isdir(runtime) else Path.home() / ".thing"
    return base / f"token-{port}"


def write_token_file(port: int, token: str) -> Path:
    """Write ``token`` where same-user clients look for it; only the user can read it."""
    path = token_file(port)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    os.replace(temporary, path)
    return path


def remove_token_file(port: int, token: str) -> None:
    """Remove the token file of ``port`` if it still holds ``token``."""
    path = token_file(port)
    try:
        if path.read_text() == token:
            path.unlink()
    except OSError:
        pass


def client_token(port: int, explicit: str | None = None) -> str | None:
    """The token a client uses: ``explicit``, else ``THING_TOKEN``, else the local token file."""
    token = explicit or os.environ.get("THING_TOKEN", "")
    if token:
        return token
    try:
        return token_file(port).read_text().strip() or None
    except OSError:
        return None
