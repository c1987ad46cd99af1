"""One client's connection, read on the server: the handshake, then frames, each answered once.

This is the only code that reads a peer's bytes (``wire.py`` decodes what it
reads, through a :class:`~thing.stream.StreamReader`), and the fuzz tests
drive it through real sockets. It owns the socket's deadlines, the headers it
has validated, discarding what it refuses, and the batch of acknowledgements
still to be sent.

Every frame gets exactly one acknowledgement, in frame order: stored with
its id, or refused with its own reason. A frame refused for its size, for a
limit or for what its header (read whole) says is read past and the
connection stays up; one the reader cannot follow (a bad prefix or trailer,
a signature that fails) ends the connection. Either way, and whenever the
connection ends, the acknowledgements of frames already stored are sent
first: a client is never told that a capture the server kept was lost.
"""

from __future__ import annotations

import dataclasses
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import auth, shm, wire
from ._core import send_buffers
from .arrays import LeafSpec
from .buffers import ReceiveBuffers
from .captures import Capture, Sender
from .deadlines import Deadlines, ReadDeadline
from .errors import HandshakeError, InvalidValue, LimitExceeded, ProtocolError
from .frame_charges import FrameCharge, HeaderBudget
from .known_headers import KnownHeader, announcement_of, int_in, notice_of, str_or
from .run_names import MAX_RUN_NAME
from .sockets import set_timeouts
from .store import HistoryStore, UnsentNotice
from .stream import StreamReader
from .value_trees import ReceivedValue, caught_type, check_received

# Acknowledgements sent in one write at most; a client waits for no more than this many.
ACK_BATCH = 64
# Seconds a control message waits for a client to have room for it (then it is not sent).
CONTROL_WAIT = 0.1
# A payload is received (and the store makes room for it) this much at a time; a header
# is read this much at a time, as it arrives.
RECEIVE_CHUNK = 4 << 20
HEADER_CHUNK = 64 << 10
# A connection keeps the headers it validated, up to this many bytes of their parsed cost,
# so a header seen again (every call of one name and layout) is only looked up. Headers
# this long at most; the cache holds parsed-cost bytes of the server's header budget.
HEADER_CACHE_BYTES = 256 << 10
CACHED_HEADER_MAX = 2048


@dataclass
class ReceiveCounts:
    """What a server's connections did, for ``summary()``."""

    received: int = 0  # frames stored
    dropped_transfers: int = 0  # frames begun but never stored: cut, malformed, too slow, refused
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, count in counts.items():
                setattr(self, name, getattr(self, name) + count)


@dataclass(frozen=True)
class ReceiveSettings:
    """What every connection of one server shares."""

    store: HistoryStore
    buffers: ReceiveBuffers
    limits: wire.Limits
    token: str | None
    idle_timeout: float
    min_rate: float  # bytes per second a frame must average, after idle_timeout of grace
    deadlines: Deadlines
    header_budget: HeaderBudget
    mappings: shm.Mappings  # what the captures of every connection keep mapped
    counts: ReceiveCounts
    closing: threading.Event
    warn: Callable[[str, str], None]  # (peer address, message), rate-limited per peer
    steering: str  # the server's steering instance (Steering.instance), told in the welcome


class Connection:
    """Reads one client's handshake and frames, stores captures, answers every frame."""

    def __init__(self, sock: socket.socket, address: str, settings: ReceiveSettings):
        self.sock = sock
        self.address = address
        self.settings = settings
        self.local = sock.family == socket.AF_UNIX
        self.takes_descriptors = False  # until the handshake says otherwise
        self.sender = Sender(address)
        self.takes_control = False  # until the handshake says otherwise
        self.awaits_replay = False
        self._acks: list[bytes] = []
        # Acks (this connection's thread) and control messages (the REPL's) share the
        # socket and the signatures' count: each is signed as it is sent, under this lock.
        self._send_lock = threading.Lock()
        self._mid_frame = False  # a frame's prefix arrived and it is not answered yet
        self.handshaken = False
        self.since = time.monotonic()  # when it connected, then when its last frame ended
        # With a token: signs the acks and checks the frames (see auth.py).
        self.mac: auth.SessionMac | None = None
        self._trailer_size = wire.FRAME_TRAILER.size
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._writable = select.poll()
        self._writable.register(sock, select.POLLOUT)
        self._deadline = ReadDeadline(settings.deadlines, sock, settings.idle_timeout)
        self._frame_started = 0.0  # when the frame being read began: its pieces' deadlines
        self._stream = StreamReader(sock, before_wait=self._deadline.start)
        self._headers: dict[bytes, KnownHeader] = {}  # raw header -> what it tells
        # Those of them a run may store (see _receive_run): no notice, nothing to check.
        self._runnable: dict[bytes, KnownHeader] = {}
        self._header_costs: dict[bytes, int] = {}  # what each kept one holds of the budget
        self._headers_cost = 0

    @property
    def busy(self) -> bool:
        """True while a frame is being received."""
        return self._mid_frame

    # -- handshake -----------------------------------------------------------------

    def handshake(self, refusal: str | None = None) -> Sender:
        """Greet the peer (and check its token); return who it is. Raises HandshakeError,
        also, once its hello is read, with ``refusal`` told to it, if given."""
        sock, settings = self.sock, self.settings
        set_timeouts(sock, settings.idle_timeout, settings.idle_timeout)
        self._deadline.start()
        info = self._read_handshake()
        if refusal is not None:
            self._refuse(refusal)
            raise HandshakeError(refusal)
        # Only a client that said so may pass descriptors: from any other they are read
        # with no room for them, so the kernel closes any sent anyway, and a shared-memory
        # frame finds none to take and is refused.
        self.takes_descriptors = self.local and info.get("shared_memory") is True
        self.takes_control = info.get("control") is True
        # It holds what it caught before it connected until it hears the settings' end.
        self.awaits_replay = self.takes_control and info.get("replay") is True
        if settings.token is not None:
            # A client that waits for our proof says who it is only with its own.
            info = {**info, **self._authenticate(settings.token, info.get("nonce"))}
        if self.takes_descriptors:  # only once proven: none is kept from a peer turned away
            self._stream.take_descriptors()
        # Proven (or no token asked): from now on it holds a slot like any client.
        self.handshaken, self.since = True, time.monotonic()
        welcome = {"server": "thing", "pid": os.getpid(), "notices": True, "control": True,
                   "replay": True, "steering": settings.steering}
        send_buffers(sock, [wire.encode_handshake(welcome)])
        self._deadline.stop()
        self.sender = Sender(
            address=self.address,
            hostname=wire.printable(str(info.get("hostname", "?"))[:255]),
            pid=int_in(info.get("pid"), range(1 << 31)) or 0,
            run=str_or(info.get("run"), MAX_RUN_NAME),
        )
        return self.sender

    def _authenticate(self, token: str, client_nonce: Any) -> dict[str, Any]:
        """Prove the token to the client, have it prove the token back, start signing.
        Returns the client's answer."""
        if not auth.is_nonce(client_nonce):
            self._refuse("no client nonce: install the same thing version on both sides")
            raise HandshakeError("refused: a hello without a nonce")
        server_nonce = auth.new_nonce()
        challenge = {"nonce": server_nonce,
                     "proof": auth.server_proof(token, client_nonce, server_nonce)}
        send_buffers(self.sock, [wire.encode_handshake(challenge, wire.HANDSHAKE_CHALLENGE)])
        try:
            answer = self._read_handshake()
        except ConnectionError:
            # A client with another token refuses our proof and hangs up: say so in the REPL.
            raise HandshakeError("a client hung up at the token check (its token differs from "
                                 "this server's?)") from None
        if not auth.verify(auth.client_proof(token, client_nonce, server_nonce),
                           answer.get("proof")):
            self._refuse("wrong or missing token (set THING_TOKEN to the server's token)")
            raise HandshakeError("refused: wrong or missing token")
        self.mac = auth.SessionMac(token, client_nonce, server_nonce)
        self._trailer_size = wire.FRAME_TRAILER.size + auth.MAC_BYTES
        return answer

    def _read_handshake(self) -> dict[str, Any]:
        """The peer's next handshake message, its JSON object. A thing peer of another
        version is told why before HandshakeError is raised."""
        prefix = self._stream.read(wire.HANDSHAKE.size)
        try:
            _, length = wire.decode_handshake_prefix(prefix)
        except HandshakeError as exc:
            if prefix[:4] == wire.MAGIC:  # a thing peer of another version: tell it why
                # Read its message first: closing with unread bytes would reset the
                # connection and lose the refusal on the way.
                self._discard(min(wire.HANDSHAKE.unpack(prefix)[3], wire.MAX_HANDSHAKE_JSON))
                self._refuse(str(exc))
            raise
        return wire.decode_handshake_info(self._stream.read(length))

    def _refuse(self, reason: str) -> None:
        send_buffers(self.sock, [wire.encode_handshake({"error": reason}, wire.HANDSHAKE_REFUSED)])

    # -- frames --------------------------------------------------------------------

    def serve(self) -> None:
        """Receive frames until the peer leaves, breaks the protocol, or the server closes.

        Raises what ended the connection (ProtocolError, OSError) after the
        acknowledgements owed were sent, as far as the peer still listens.
        """
        try:
            while self._wait_readable():
                if not self._receive_run() and not self._receive_frame():
                    break
                # Frames that arrived together are answered together: one send, and
                # one wake-up of the client's reader, per batch.
                if len(self._acks) >= ACK_BATCH or not (
                        self._frame_buffered() or self._poller.poll(0)):
                    self._flush_acks()
        except ProtocolError as exc:
            # The stream can no longer be followed: answer the frame, then hang up.
            self._answer(wire.encode_ack(wire.SEQ_OLDEST_UNANSWERED, -1, str(exc)[:1000]))
            raise
        except OSError as exc:
            if self._mid_frame:  # cut off, or too slow: tell the peer, if it still listens
                self._answer(wire.encode_ack(
                    wire.SEQ_OLDEST_UNANSWERED, -1, f"the frame did not arrive whole: {exc}"))
            raise
        finally:
            self._flush_acks_and_close()

    def _wait_readable(self) -> bool:
        """Wait, as long as it takes, for the next frame to begin, and take in what has
        arrived (so that a run stores a batch's first frame too, not only the rest); False
        once closing or when the peer closed between frames."""
        if self._stream.buffered:
            return True
        if self.settings.closing.is_set():
            return False
        # No timeout: closing shuts every connection's reading side, which ends the wait
        # (an idle connection had woken once a second to look).
        self._poller.poll()
        try:
            return self._stream.receive_arrived() > 0
        except ConnectionResetError:  # between frames: as a clean close
            return False

    def _frame_buffered(self) -> bool:
        """Whether the next frame has arrived whole (so reading it waits for nothing)."""
        prefix = self._stream.peek(wire.FRAME_PREFIX.size)
        if prefix is None:
            return False
        _, kind, header_len, payload_len, *_ = wire.FRAME_PREFIX.unpack(prefix)
        in_stream = 0 if kind == wire.KIND_SHARED_MEMORY else payload_len
        return self._stream.buffered >= (
            wire.FRAME_PREFIX.size + header_len + in_stream + self._trailer_size)

    def _receive_run(self) -> int:
        """Store the frames already here whole that ask for nothing but storing, together:
        small, inline, unsigned, with a header this connection validated and kept before,
        that is no notice and has nothing to check (a training loop's every step).
        Returns how many it stored: with the acknowledgements already waiting, at most
        ACK_BATCH (one write's worth). At the first frame that is not one (not whole yet,
        or one the store could refuse) it stops, and :meth:`_receive_frame` reads that one
        with every check and every way it can end.
        """
        stream, store = self._stream, self.settings.store
        if self.mac is not None or stream.descriptors_waiting:
            return 0
        captures: list[Capture] = []
        charges: list[int] = []
        seqs: list[int] = []
        start = 0  # of the next frame in what has arrived
        for end, known, payload, seq, caught_at, call, step, modified in \
                wire.decode_small_frames(stream.peek(stream.buffered), ACK_BATCH - len(self._acks),
                                         wire.SMALL_BYTES, self._runnable):
            charge = len(payload) + known.record_bytes
            if (known.header.nbytes != len(payload) or charge > store.max_bytes // 2
                    or not store.could_reserve(len(payload))):
                break
            header = known.header
            start = end
            if known.undelivered:
                store.note_undelivered(known.sender, known.undelivered)
            captures.append(Capture(
                -1, known.name,
                ReceivedValue(header.tree, header.leaves, _arrays_of(known.layout, payload)),
                header.leaves, len(payload), known.sender, caught_at=caught_at, call=call,
                step=step, call_site=known.call_site, consistent=not modified,
                requested=known.requested))
            charges.append(charge)
            seqs.append(seq)
        stream.take(start)
        if captures:
            store.add_arrived(captures, charges)
            self._acks += [wire.encode_ack(seq, capture.id)
                           for seq, capture in zip(seqs, captures)]
            self.settings.counts.add(received=len(captures))
            self.since = time.monotonic()
        return len(captures)

    def _receive_frame(self) -> bool:
        """Receive one frame and queue its acknowledgement; False if the peer closed cleanly."""
        settings = self.settings
        self._deadline.set(settings.idle_timeout)
        try:
            prefix = self._stream.read(wire.FRAME_PREFIX.size)
        except OSError as exc:
            self._deadline.stop()
            if not self._stream.buffered:  # between frames
                if isinstance(exc, ConnectionResetError):
                    return False  # a clean close
                raise
            # Cut off (or too slow) inside a prefix: a frame that did not arrive whole.
            self._mid_frame = True
            settings.counts.add(dropped_transfers=1)
            raise
        self._mid_frame = True
        fds: list[int] = []
        try:
            self._answer(self._receive_rest(prefix, fds))
            self._mid_frame = False
            self.since = time.monotonic()
        except ProtocolError:
            settings.counts.add(dropped_transfers=1)
            self._mid_frame = False  # answered by serve() with the reason
            raise
        except BaseException:
            settings.counts.add(dropped_transfers=1)  # cut mid-frame, invalid or too slow
            raise
        finally:
            self._deadline.stop()
            for fd in fds:  # a descriptor we did not adopt (the frame was refused)
                os.close(fd)
        return True

    def _receive_rest(self, raw_prefix: bytes, fds: list[int]) -> bytes:
        settings = self.settings
        prefix = wire.decode_prefix(raw_prefix)
        header_len, payload_len, seq = prefix.header_len, prefix.payload_len, prefix.seq
        shared = prefix.kind == wire.KIND_SHARED_MEMORY
        if shared:
            fd = self._stream.take_descriptor()
            if fd is None:
                raise ProtocolError("a shared-memory frame came without its descriptor")
            fds.append(fd)
        payload_in_stream = 0 if shared else payload_len
        # The frame must arrive at a minimum rate, each part by when its bytes are due, so a
        # peer that trickles cannot hold a reservation, the header budget or its connection
        # slot (a discard) for ever: first the header, by its own length alone.
        self._frame_started = time.monotonic()
        self._due_by(header_len)
        # Every frame is numbered and signed, refused ones too: none can be slipped in.
        signature = None if self.mac is None else self.mac.incoming()
        if signature is not None:
            signature.update(raw_prefix)
        try:
            wire.check_frame_size(header_len, payload_len, settings.limits)
            too_large = None
        except LimitExceeded as exc:
            if header_len > settings.limits.max_header_bytes:
                self._discard(header_len, signature, due_from=0)
                return self._skip(payload_in_stream, signature, seq, None, exc, header_len)
            # Its header is read all the same (it is within bounds), so that the REPL lists
            # the capture refused by its name, not as an unnamed one.
            too_large = exc
        with FrameCharge(settings.store, settings.header_budget) as charge:
            try:
                raw_header = self._recv_header(header_len, charge, signature)
            except LimitExceeded as exc:  # the header budget: read past
                return self._skip(payload_in_stream, signature, seq, None, exc, header_len)
            self._due_by(header_len + payload_in_stream + self._trailer_size)
            known = self._headers.get(raw_header)
            try:
                if known is None:
                    known = self._validate_header(raw_header, payload_len, charge,
                                                  too_large is not None)
                else:
                    wire.check_payload_length(known.header, payload_len)
                del raw_header
                if too_large is not None:
                    raise too_large
                charge.reserve(payload_len)
            except ProtocolError as exc:
                # A header refused for what it says (a name that is no str, dict keys that
                # collide, a limit): read whole, so the stream is still in step, and the
                # frames after it, the sender's other captures, must not pay for it.
                charge.release_header()  # not held while its payload is discarded
                return self._skip(payload_in_stream, signature, seq, known, too_large or exc,
                                  header_len)
            try:
                capture = self._receive_payload(prefix, known, fds, signature, charge)
            except (LimitExceeded, InvalidValue) as exc:  # read whole: still in step
                self._warn_refused(known, exc)
                self._note_refused(known, exc)
                return wire.encode_ack(seq, -1, str(exc))
        if capture is None:  # a notice, not a capture
            return wire.encode_ack(seq, -1)
        settings.counts.add(received=1)
        return wire.encode_ack(seq, capture.id)

    def _validate_header(self, raw: bytes, payload_len: int, charge: FrameCharge,
                         refused: bool = False) -> KnownHeader:
        """Parse and check a header not seen before; keep it if it is short and there is room.

        The header of a frame ``refused`` for its size already is checked as if its size
        were allowed, only for its name and type (its payload is read past), and never
        kept: the run of small frames (:meth:`_receive_run`) stores a kept header's frames
        without a look at their size.

        While the frame lasts, its header (the bytes, and what parsing them makes) is
        held against a budget all connections share: bounded, but never at the price
        of the history. A kept header stays charged to that budget (only to its spare
        half, so keeping never starves frames under way) until the connection ends.
        """
        limits = self.settings.limits
        if refused:
            limits = dataclasses.replace(limits, max_capture_bytes=len(raw) + payload_len)
        cost = wire.header_cost(raw, limits)
        charge.hold_header(cost)
        header = KnownHeader.of(wire.decode_header(raw, payload_len, limits), self.sender)
        if not refused and len(raw) <= CACHED_HEADER_MAX and cost <= HEADER_CACHE_BYTES:
            # Full, it forgets its oldest: a header changes with what its sender could not
            # deliver (its counts travel in it), and a connection that once dropped a few
            # would otherwise hold single-use headers and keep no new one for good.
            while self._headers_cost + cost > HEADER_CACHE_BYTES:
                self._forget_header(next(iter(self._headers)))
            if self.settings.header_budget.take_spare(cost):
                self._headers[raw] = header
                self._header_costs[raw] = cost
                self._headers_cost += cost
                if header.notice is None and not header.sparse:
                    self._runnable[raw] = header
        return header

    def _forget_header(self, raw: bytes) -> None:
        del self._headers[raw]
        self._runnable.pop(raw, None)
        cost = self._header_costs.pop(raw)
        self._headers_cost -= cost
        self.settings.header_budget.give_back(cost)

    def _receive_payload(self, prefix: wire.FramePrefix, known: KnownHeader,
                         fds: list[int], signature: Any, charge: FrameCharge) -> Capture | None:
        """Receive a frame's arrays and trailer, charging the store as the bytes arrive.

        Returns the stored capture, or None for a notice of a capture the sender
        could not send (``meta["unsent"]``), which the store records instead.
        """
        settings = self.settings
        header = known.header
        payload_len = prefix.payload_len
        trailer = bytearray(self._trailer_size)
        if fds:  # a shared-memory frame: its bytes are all there already
            charge.fill(payload_len)
            arrays = self._adopt(fds.pop(), header.leaves)
            self._stream.read_into([trailer])
        elif payload_len < wire.SMALL_BYTES and (
                here := self._stream.take(payload_len + self._trailer_size)) is not None:
            # Read ahead with frames before it: copied out, one numpy call per array.
            charge.fill(payload_len)
            arrays = _arrays_of(known.layout, here[:payload_len])
            trailer[:] = here[payload_len:]
        else:
            if payload_len >= wire.SMALL_BYTES:
                self._flush_acks()  # the frames before this one need not wait for its payload
            arrays = [settings.buffers.array(spec) for spec in header.leaves]
            views = [array.reshape(-1).view(np.uint8) for array in arrays if array.nbytes]
            # Evicting only as bytes come: a claim alone costs the history nothing.
            batches = [views] if payload_len <= RECEIVE_CHUNK else _batches(views, RECEIVE_CHUNK)
            due = prefix.header_len
            for number, batch in enumerate(batches, 1):
                size = sum(view.nbytes for view in batch)
                charge.fill(size)
                if len(batches) > 1:
                    # Each piece by when the frame's bytes up to its end are due at the
                    # minimum rate: a peer that claims much and sends a byte now and then
                    # holds the store's room (refusing every other capture) for a piece's
                    # time, not for the whole claim's (hours, for a claim of gigabytes).
                    due += size + (self._trailer_size if number == len(batches) else 0)
                    self._due_by(due)
                self._stream.read_into([*batch, trailer] if number == len(batches) else batch)
        modified = self._check_trailer(trailer, signature)
        if self._stream.descriptors_waiting and not self._stream.buffered:
            # A descriptor comes with its frame's first bytes: with none left to read,
            # one still waiting came with this frame or before it, and no frame takes it.
            raise ProtocolError("a frame came with more descriptors than it carries")
        if known.sparse:
            check_received(header.tree, arrays)
        if known.undelivered:
            settings.store.note_undelivered(known.sender, known.undelivered)
        if known.notice == "unsent":
            settings.store.note_unsent(notice_of(header, known.sender))
            return None
        if known.notice == "on_demand":
            settings.store.note_available(announcement_of(header, known.sender))
            return None
        capture = settings.store.add(
            known.name,
            ReceivedValue(header.tree, header.leaves, arrays),
            header.leaves,
            payload_len,
            known.sender,
            known.record_bytes,
            caught_at=prefix.caught_at,
            call=prefix.call,
            step=prefix.step,
            call_site=known.call_site,
            consistent=not modified,
            requested=known.requested,
        )
        charge.stored(payload_len)
        return capture

    def _adopt(self, fd: int, specs: tuple[LeafSpec, ...]) -> list[np.ndarray]:
        """A shared-memory payload's arrays: mapped, or copied out once the server's
        captures keep as many mappings as it allows (see :class:`shm.Mappings`)."""
        arrays, base = shm.adopt(fd, specs)
        if self.settings.mappings.keep(base):
            return arrays
        copies = [self.settings.buffers.array(spec) for spec in specs]
        for copy, array in zip(copies, arrays):
            np.copyto(copy, array)
        return copies  # the mapping goes with ``base`` and ``arrays``

    def _check_trailer(self, trailer: bytearray, signature: Any) -> bool:
        """Check a received trailer (and its signature); return the not-consistent flag."""
        size = wire.FRAME_TRAILER.size
        if signature is not None:
            signature.update(trailer[:size])
            if not auth.matches(signature, trailer[size:]):
                raise ProtocolError("a frame's signature does not match: it was not sent by "
                                    "the client that proved the token, or was altered")
        return wire.decode_trailer(bytes(trailer[:size]))

    def _skip(self, payload_bytes: int, signature: Any, seq: int, known: KnownHeader | None,
              why: ProtocolError, header_len: int) -> bytes:
        """Read past a refused frame, so the connection and the frames after it go on."""
        self._warn_refused(known, why)
        if payload_bytes >= wire.SMALL_BYTES:
            self._flush_acks()  # the frames before this one need not wait for its discard
        self._discard(payload_bytes, due_from=header_len)
        self._due_by(header_len + payload_bytes + self._trailer_size)
        trailer = bytearray(self._trailer_size)
        self._stream.read_into([trailer])
        self._check_trailer(trailer, signature)
        self._note_refused(known, why)  # signed as its sender's: it may speak of it
        return wire.encode_ack(seq, -1, str(why)[:wire.MAX_REASON])

    def _warn_refused(self, known: KnownHeader | None, why: ProtocolError) -> None:
        name = _refused_name(known, why)
        what = "a capture" if name is None else repr(name)
        self.settings.warn(self.address, f"refused {what} from {self.address}: {why}")

    def _note_refused(self, known: KnownHeader | None, why: ProtocolError) -> None:
        """Count a frame read whole and refused, and tell the REPL, by name where the header
        gave one, why (its sender's handle has the reason too, in the acknowledgement). A
        frame cut short or forged meanwhile is counted where the connection ends."""
        self.settings.counts.add(dropped_transfers=1)
        type_name = "?" if known is None else caught_type(known.header.tree,
                                                               known.header.leaves)
        self.settings.store.note_unsent(UnsentNotice(
            _refused_name(known, why), type_name, str(why)[:wire.MAX_REASON],
            None if known is None else known.call_site,
            self.sender if known is None else known.sender, time.time(), refused=True))

    def _answer(self, ack: bytes) -> None:
        """Queue an acknowledgement (signed when sent)."""
        self._acks.append(ack)

    def _flush_acks(self) -> None:
        if self._acks:
            acks, self._acks = self._acks, []
            self._send(acks)

    def send_control(self, message: bytes) -> bool:
        """Send one control message (``wire.encode_control``), from any thread; False (not
        sent) when the client has not read what it was sent before: a stuck or hostile peer
        must not hold up the REPL that steers the others."""
        if not self._send_lock.acquire(timeout=CONTROL_WAIT):
            return False
        try:
            if not self._writable.poll(CONTROL_WAIT * 1000):
                return False
            self._send_signed([message])
        finally:
            self._send_lock.release()
        return True

    def _send(self, messages: list[bytes]) -> None:
        with self._send_lock:
            self._send_signed(messages)

    def _send_signed(self, messages: list[bytes]) -> None:
        if self.mac is not None:
            messages = [part for message in messages for part in (message, self.mac.sign(message))]
        send_buffers(self.sock, messages)

    def _flush_acks_and_close(self) -> None:
        """Send what is owed, then let the peer see the end of the stream.

        Closing with its unread bytes still queued would reset the connection
        and could lose the answers, so read (and drop) what it still sends,
        for a second at most: a thing client hangs up once it sees the end.
        """
        sock = self.sock
        self._stream.close()
        self.settings.header_budget.give_back(self._headers_cost)
        self._headers.clear()
        self._runnable.clear()
        self._header_costs.clear()
        self._headers_cost = 0
        try:
            set_timeouts(sock, 1.0, 0.2)
            self._flush_acks()
            sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 1.0
            scratch = bytearray(1 << 16)
            while time.monotonic() < deadline and sock.recv_into(scratch):
                pass
        except OSError:
            pass

    # -- reading -------------------------------------------------------------------

    def _recv_header(self, size: int, charge: FrameCharge, signature: Any) -> bytes:
        """A header of ``size`` bytes, read as they arrive and fed to ``signature``: a claim
        allocates nothing, and a long one takes the header budget as its bytes come (a peer
        trickling one holds what it sent, not what it claimed). LimitExceeded once the
        budget would not hold the next piece: the rest of it is read past."""
        if size <= HEADER_CHUNK:
            raw = self._stream.read(size)
        else:
            received = bytearray()
            while len(received) < size:
                piece = min(size - len(received), HEADER_CHUNK)
                try:
                    charge.hold_header(len(received) + piece)
                except LimitExceeded:
                    charge.release_header()
                    if signature is not None:
                        signature.update(received)
                    self._discard(size - len(received), signature, due_from=len(received))
                    raise
                received += self._stream.read(piece)
            raw = bytes(received)
        if signature is not None:
            signature.update(raw)
        return raw

    def _discard(self, size: int, signature: Any = None, due_from: int | None = None) -> None:
        """Read and drop ``size`` bytes (feeding them to ``signature``, if given). Those of
        a frame, from its byte ``due_from`` on, are read a piece at a time, each by when it
        is due: a claim of gigabytes read past a byte now and then holds its slot for a
        piece's time, not for the claim's."""
        update = None if signature is None else signature.update
        if due_from is None:
            self._stream.skip(size, update)
            return
        while size > 0:
            piece = min(size, RECEIVE_CHUNK)
            due_from += piece
            self._due_by(due_from)
            self._stream.skip(piece, update)
            size -= piece

    def _due_by(self, frame_bytes: int) -> None:
        """What is read from now on is due when the frame's first ``frame_bytes`` are, at
        the minimum rate from its start (THING_IDLE_TIMEOUT + bytes / THING_MIN_RATE)."""
        settings = self.settings
        self._deadline.set(self._frame_started - time.monotonic() + settings.idle_timeout
                           + frame_bytes / settings.min_rate)


def _arrays_of(layout: tuple[tuple[np.dtype, int, tuple[int, ...]], ...],
               payload: bytearray | memoryview) -> tuple[np.ndarray, ...]:
    """The arrays of ``layout`` in a small frame's ``payload``: one numpy call per array, not
    three (view, reshape, copy), which had been a fifth of a connection thread's time in a
    flood.

    A single array owns a ``bytearray`` payload (one the core copied out of the
    read-ahead buffer). Anything else is copied, each array into its own
    ``bytearray``, so each starts where an allocation does (aligned) and frees
    its memory alone.
    """
    if len(layout) == 1 and type(payload) is bytearray:
        dtype, _, shape = layout[0]
        return (np.ndarray(shape, dtype, payload),)
    arrays, offset, data = [], 0, memoryview(payload)
    for dtype, count, shape in layout:
        end = offset + count * dtype.itemsize
        arrays.append(np.ndarray(shape, dtype, bytearray(data[offset:end])))
        offset = end
    return tuple(arrays)


def _batches(views: list[np.ndarray], limit: int) -> list[list[np.ndarray]]:
    """``views`` cut into batches of at most ``limit`` bytes each (at least one batch)."""
    batches: list[list[np.ndarray]] = [[]]
    room = limit
    for view in views:
        while view.nbytes:
            if not room:
                batches.append([])
                room = limit
            batches[-1].append(view[:room])
            room -= batches[-1][-1].nbytes
            view = view[batches[-1][-1].nbytes:]
    return batches


def _refused_name(known: KnownHeader | None, why: ProtocolError) -> str | None:
    """The name of a refused capture: its header's, or as much of one as was valid."""
    if known is not None:
        return known.name
    return None if why.capture_name is None else wire.printable(why.capture_name)


