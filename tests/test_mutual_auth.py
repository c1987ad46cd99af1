"""The client authenticates the server too: a rogue listener or a relay gets nothing in.

The attacks of a local user who listens first on the job's port, or who sits
between the job and the real server: each is a real listener here, the
squatter run as another Unix user where the tests run as root.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

import thing
from thing import auth, wire

from .conftest import free_port, poll, run_script, script_env
from .test_same_host import AS_NOBODY
from .test_security import frame_bytes

ROGUE = """
import json, socket, sys
from thing import wire
mode = sys.argv[1]
listener = socket.create_server(("127.0.0.1", int(sys.argv[2])))
print("listening", flush=True)
peer, _ = listener.accept()
peer.settimeout(10)
received = b""
prefix = peer.recv(wire.HANDSHAKE.size, socket.MSG_WAITALL)
hello = json.loads(peer.recv(wire.HANDSHAKE.unpack(prefix)[3], socket.MSG_WAITALL))
if mode == "no-challenge":
    peer.sendall(wire.encode_handshake({"server": "thing", "pid": 1}))
elif mode == "bad-proof":
    peer.sendall(wire.encode_handshake({"nonce": "ab" * 32, "proof": "00" * 32},
                                       wire.HANDSHAKE_CHALLENGE))
else:  # refuse, with escape sequences for the victim's terminal
    peer.sendall(wire.encode_handshake({"error": "\\x1b]0;pwned\\x07\\x1b[2J go away"},
                                       wire.HANDSHAKE_REFUSED))
try:
    while chunk := peer.recv(65536):
        received += chunk
except OSError:
    pass
told = sorted(set(hello) & {"hostname", "pid", "run", "thing", "python"})
print(json.dumps({"received": len(received), "told": told}), flush=True)
"""


def start_rogue(mode: str, port: int, as_nobody: bool = True) -> subprocess.Popen:
    """A listener on ``port`` that pretends to be a thing server, as user nobody if we can
    (and ``as_nobody``: a job told TCP sends nothing, not even a hello, to another user's
    port unless it has a token)."""
    prelude = AS_NOBODY if as_nobody and os.geteuid() == 0 else ""
    rogue = subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(ROGUE), mode, str(port)],
        env=script_env(PYTHONDONTWRITEBYTECODE="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert rogue.stdout.readline().strip() == "listening", rogue.stderr.read()
    return rogue


@pytest.mark.parametrize("mode", ["no-challenge", "bad-proof"])
def test_a_client_with_a_token_refuses_a_server_that_cannot_prove_it(
        processes: list, mode: str) -> None:
    port = free_port()
    rogue = start_rogue(mode, port)
    processes.append(rogue)
    out = run_script(
        """
        import numpy as np, thing
        handle = thing.catch(np.arange(1000) * 7, name="secret")
        print(handle.wait(15), handle.error)
        """,
        port, THING_TOKEN="the job's token", THING_TRANSPORT="tcp",
    )
    assert out.startswith("False"), out
    assert ("did not ask for the token" if mode == "no-challenge"
            else "could not prove it knows the token") in out
    rogue.wait(15)
    # Not one byte of a frame, nor who the job is (host, pid, run) before the proof.
    assert json.loads(rogue.stdout.readline()) == {"received": 0, "told": []}


def test_a_client_with_a_token_says_who_it_is_with_its_proof() -> None:
    """Held back from the hello, the job's identity still reaches the server that proved
    the token: the REPL lists the job by host, pid and run."""
    with thing.Server(port=0, token="the real token") as server:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent("""
                import os, sys, thing
                assert thing.catch(1.5, name="loss").wait(15)
                print(os.getpid(), flush=True)
                sys.stdin.read()
            """)],
            env=script_env(server.port, THING_TOKEN="the real token", THING_TRANSPORT="tcp",
                           THING_RUN="proven-run"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            pid = int(proc.stdout.readline())
            [client] = server.clients()
            assert (client.hostname, client.pid, client.run) == (
                socket.gethostname(), pid, "proven-run")
            assert server.store.get("loss").sender.pid == pid
        finally:
            proc.communicate("", timeout=30)


def test_a_token_less_client_does_not_trust_tcp_to_a_squatted_port(processes: list) -> None:
    """No token, no Unix socket of its own user's server: nothing goes to the squatter."""
    port = free_port()
    rogue = start_rogue("no-challenge", port)
    processes.append(rogue)
    out = run_script(
        """
        import numpy as np, thing
        handle = thing.catch(np.arange(1000) * 7, name="secret")
        print(handle.wait(5), handle.error)
        """,
        port,
    )
    assert out.startswith("False") and "THING_TRANSPORT=tcp" in out, out
    rogue.kill()
    assert rogue.communicate()[0] == ""  # it never got a connection


def test_a_refusal_from_a_peer_cannot_drive_the_jobs_terminal(processes: list) -> None:
    port = free_port()
    rogue = start_rogue("refuse", port, as_nobody=False)  # this user's: its reason is read
    processes.append(rogue)
    result = run_script(
        """
        import logging, numpy as np, thing
        logging.basicConfig(level=logging.WARNING)
        handle = thing.catch(np.arange(3), name="x")
        handle.wait(15)
        print(handle.error)
        thing._default_client.close()
        """,
        port, full=True, THING_TRANSPORT="tcp",
    )
    assert "go away" in result.stdout and "go away" in result.stderr
    assert "\x1b" not in result.stdout + result.stderr and "\x07" not in result.stderr
    assert "\\x1b]0;pwned" in result.stderr


class InjectingRelay:
    """Passes a real client's connection through to the real server, handshake and all,
    then slips a forged frame in front of the client's first frame."""

    def __init__(self, server_port: int, forged: bytes):
        self.forged = forged
        self.server_port = server_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.handshake_done = threading.Event()
        self.injected = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.server_port))
        threading.Thread(target=self._down, args=(server, client), daemon=True).start()
        try:
            while chunk := client.recv(65536):
                if self.handshake_done.is_set() and not self.injected:
                    server.sendall(self.forged)
                    self.injected = True
                server.sendall(chunk)
        except OSError:
            pass

    def _down(self, server: socket.socket, client: socket.socket) -> None:
        seen = b""
        try:
            while chunk := server.recv(65536):
                seen += chunk
                # The challenge, then the server's OK: the client's next bytes are frames.
                if seen.count(wire.MAGIC) >= 2:
                    self.handshake_done.set()
                client.sendall(chunk)
        except OSError:
            pass
        finally:
            client.close()


def test_a_relay_that_passes_the_handshake_through_cannot_inject_a_frame(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("THING_TOKEN", raising=False)
    # What the relay would like the REPL to see, signed as well as it can without the token.
    forged = frame_bytes(123456.0, "loss") + bytes(auth.MAC_BYTES)
    with thing.Server(port=0, token="the real token") as server:
        relay = InjectingRelay(server.port, forged)
        out = run_script(
            """
            import thing
            handle = thing.catch(0.25, name="loss")
            print(handle.wait(15), handle.error)
            """,
            relay.port, THING_TOKEN="the real token", THING_TRANSPORT="tcp",
        )
        assert relay.injected
        poll(lambda: any("signature" in m for m in caplog.messages), 10,
             f"the forged frame refused in the server's log, got {caplog.messages}")
        assert all(c.value != 123456.0 for c in server.store.recent(len(server.store)))
        if out.startswith("True"):  # the client's own capture may get through on a retry
            assert server.get("loss") == 0.25


def test_proofs_are_bound_to_both_nonces_and_to_their_role() -> None:
    """A proof made for one connection (one pair of nonces) is worth nothing on another,
    and a server's proof is no client's."""
    token, a, b, c = "t", auth.new_nonce(), auth.new_nonce(), auth.new_nonce()
    proof = auth.client_proof(token, a, b)
    assert auth.verify(auth.client_proof(token, a, b), proof)
    assert not auth.verify(auth.client_proof(token, a, c), proof)
    assert not auth.verify(auth.client_proof(token, c, b), proof)
    assert not auth.verify(auth.server_proof(token, a, b), proof)


def test_an_empty_token_is_an_error_not_the_absence_of_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THING_TOKEN", "")
    with pytest.raises(ValueError, match="THING_TOKEN is set but empty"):
        thing.Server(port=0).start()
    with pytest.raises(ValueError, match="not a token"):
        thing.Server(port=0, token="").start()
    out = run_script(
        """
        import thing
        handle = thing.catch(1.0, name="x")  # catch() still never raises
        print(handle.wait(10), handle.error)
        """,
        free_port(), THING_TOKEN="",
    )
    assert out.startswith("False") and "THING_TOKEN is set but empty" in out, out

