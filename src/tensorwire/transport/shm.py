"""Shared-memory channel: one single-writer byte ring per direction between two local processes.

The ring holds a stream of [64-byte header][payload padded to 64 bytes]. Only the sender writes
`head`, only the receiver writes `tail`, each on its own cache line, so no lock is needed: the
sender publishes bytes by storing `head` after copying them, and on x86-64 (total store order)
the receiver that sees the new `head` also sees the bytes. Receives read straight out of the
ring, reducing in place when the receive asks for it, so a reduction costs no extra copy.
The segment is unlinked as soon as both sides mapped it: a crash leaves nothing in /dev/shm.
"""

from __future__ import annotations

import itertools
import struct
import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..buffers import address, byte_view
from . import cma, pages
from .channel import Channel, ChannelOwner, PeerClosed
from .remote import CMA_DESCRIPTOR, DEVICE_ID, DEVICE_UNITS, CmaPayload, DevicePayload, read_failed
from .requests import SendRequest, Sink
from .shm_segments import CTRL_BYTES, Ring
from .wire import HEADER_SIZE, P2P_FINGERPRINT, SEQ_AT, Header, Kind, Mode, pack_header, with_mode

if TYPE_CHECKING:
    from .tcp import SocketStream

_HEAD, _TAIL = 0, 8  # a ring's control page: head at word 0, tail at word 8 (separate cache lines)
PIPELINE_BYTES = 512 << 10
"""Ring writers publish, and readers release, every this many bytes: the reader copies one piece
out while the writer copies the next in, instead of starting after the whole message."""
_P2P_HEADERS = 256  # parsed point-to-point headers kept per channel (cleared when full)
REMOTE_BYTES = 512 << 10
"""Point-to-point messages from this size whose payload lies mostly in huge pages travel as a
descriptor where the receiver can read the sender's memory (cross-memory attach): it copies
the payload once, straight from the sender's buffer into its own, where the ring copies it
twice, and then tells the sender (Mode.ACK), whose send completes only then (MPI's
rendezvous). The kernel pins a source's pages one by one, so out of 4 KiB pages the read is
slower than the ring's two pipelined copies: the sender looks (pages.py); below this size the
ring is faster out of huge pages too (docs/design/memory.md).
Collectives' messages keep the ring: their receives may fold as they arrive, and the tuner's
prices are measured through it."""
_EMPTY = np.empty(0, dtype=np.uint8)
_UNACKNOWLEDGED: list[object] = []
"""Payloads of REMOTE sends that were never acknowledged when their channel closed (destroy()
with a send nobody waited for): a receive posted later may still read them, so their memory
stays this process's until it exits rather than going back to the allocator."""
_EX_TAKEN, _EX_ACKED, _EX_DONE = 2, 4, 8  # ring_exchange_read's flags (_native.c's EX_*)


def _acknowledging(rid: int) -> bytes:
    """The packed header of the acknowledgement of REMOTE message `rid`."""
    return pack_header(Kind.ACK, 0, rid, 0, 0, P2P_FINGERPRINT, Mode.ACK)


_ACK = _acknowledging(0)  # what ring_exchange_read writes its message's id into, at SEQ_AT
assert SEQ_AT == 8  # as _native.c's SEQ_AT
PARK_BYTES = 256 << 10
"""A message of at least this size whose receive is not posted yet stays in the ring (the
sender waits) instead of being staged in a fresh buffer and copied twice: ranks that run ahead
into the next call (the leaves of back-to-back reduces) would make the receiver stage
megabytes per call (docs/design/memory.md)."""


def _pad(n: int) -> int:
    return (n + 63) & ~63


class RingSource(Protocol):
    """Where a channel gets another ring for its direction (transport/wiring.py: named for the
    pair, within this rank's share of /dev/shm)."""

    def make(self, capacity: int) -> Ring | None:
        """A new ring of at most `capacity` bytes, reserved; None where none fits."""

    def release(self, capacity: int) -> None:
        """A ring of `capacity` bytes this rank wrote is no longer its."""


def _record(n: int) -> int:
    """Ring bytes a message of an n-byte payload takes: its header and the padded payload."""
    return HEADER_SIZE + _pad(n)


_RECORDS_AFTER: dict[int, int] = {Mode.REMOTE: 1, Mode.ACK: 0, Mode.MOVE: 1, Mode.DEVICE: DEVICE_UNITS,
                                  Mode.COPIED: 1}
"""Records that follow the header of each mode but INLINE (its descriptor, a ring's name, an event)."""


def _span(header: Header) -> int:
    """Ring bytes the record that starts with `header` takes."""
    if header.mode == Mode.INLINE:
        return _record(header.nbytes)
    return HEADER_SIZE * (1 + _RECORDS_AFTER.get(header.mode, 1))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


class ShmChannel(Channel):
    """Data through rings, control and liveness through the peer's socket.

    Rings start small and grow with the traffic: a message (with its header) of more than half
    the ring makes its writer move to one that holds two such messages (up to `target`,
    TENSORWIRE_SHM_RING, within this rank's share of /dev/shm), announced in the old ring by a
    MOVE record that the reader follows. So a pair that only ever exchanges small messages (setup, barriers,
    small collectives) holds two small rings, and /dev/shm grows with the traffic, not with
    the number of pairs."""

    kind = "shm"
    direct = True
    sends_now = True
    takes_now = True

    def __init__(self, stream: SocketStream, out_ring: Ring, in_ring: Ring, engine: ChannelOwner,
                 peer_pid: int = 0, peer_reads: bool = False, source: RingSource | None = None,
                 target: int = 0) -> None:
        self.stream = stream
        self.streams = (stream,)
        self.sockets = [stream.sock]
        self.peer = stream.peer
        self.engine = engine
        self.out = out_ring
        self.inn = in_ring
        self.source = source
        self.target = target if source is not None else 0  # the capacity the out ring may grow to
        self.sendq: list[SendRequest] = []
        self._hdr_written = False
        self._sink: Sink | None = None
        self._padded_left = 0
        self.parked: Header | None = None  # the message at the ring's tail, waiting for its receive
        self.release = False  # stage the parked message now (Engine.release_parked)
        self._p2p_headers: dict[bytes, Header] = {}
        self.peer_pid = peer_pid  # non-zero where this process can read the peer's memory
        self.peer_reads = peer_reads  # the peer can read this process's: large sends go REMOTE
        self.native = engine.native  # the compiled ring loops of put_now and take_now, or None
        self.reader = cma.Reader(self.native)
        self.read_bytes = REMOTE_BYTES if peer_pid and self.native is not None else 0
        self.awaiting: dict[int, SendRequest] = {}  # REMOTE sends by id, until acknowledged
        self._remote_ids = itertools.count(1)

    def _outgrown(self, n: int) -> bool:
        """Would a message of `n` bytes leave the ring unable to hold two of them (one written
        while the other is read) where it may still grow? Counted with its header: a payload
        of exactly half the ring (a power of two, as most are) must grow it too."""
        return 2 * _record(n) > self.out.capacity and self.out.capacity < self.target

    def post(self, req: SendRequest) -> None:
        n = req.payload.nbytes
        if req.device_body is not None:
            self._offer_device(req)
        elif self.peer_reads and req.header.kind == Kind.P2P and n >= REMOTE_BYTES:
            self._offer(req)
        if req.descriptor is None and self._outgrown(n):  # (a descriptor's payload stays here)
            self._grow(n)
        if self.sendq or not self._put_whole(req):
            self.sendq.append(req)

    def _grow(self, nbytes: int) -> None:
        """Move to a ring that holds two messages of `nbytes` (at least twice the current one:
        one is written while the other is read), once what is queued before has been written:
        a MOVE record in sendq."""
        if not self._move(min(self.target, max(2 * self.out.capacity, _pow2(2 * _record(nbytes))))):
            self.target = self.out.capacity  # nothing larger fits: stay (and stop asking)

    def shrink(self, capacity: int) -> None:
        """Give back the /dev/shm of an out ring grown beyond `capacity`: move to one of that
        size (a burst of large messages, such as calibration's, need not hold it for the rest of
        the job; it grows again with the traffic)."""
        if self.source is not None and self.out.capacity > capacity and not any(
                req.header.mode == Mode.MOVE for req in self.sendq) and self._move(capacity):
            self._push()

    def _move(self, capacity: int) -> bool:
        """Write into a new ring of `capacity` bytes once what is queued before has been written
        (a MOVE record in sendq); False where none could be made."""
        assert self.source is not None
        ring = self.source.make(capacity)
        if ring is None:
            return False
        move = SendRequest(self.peer, Header(Kind.ACK, 0, ring.nonce, ring.capacity, 0, P2P_FINGERPRINT,
                                             Mode.MOVE), _EMPTY, "ring move")
        move.descriptor = ring.name.encode().ljust(HEADER_SIZE, b"\0")
        move.ring = ring  # type: ignore[attr-defined]
        self.sendq.append(move)
        return True

    def _offer(self, req: SendRequest) -> None:
        """Send `req` as a descriptor of its payload where that lies in huge pages (REMOTE_BYTES)."""
        rid = self._describe(req)
        if rid:
            self.awaiting[rid] = req

    def _describe(self, req: SendRequest) -> int:
        """Make `req` a REMOTE message, its payload's address and a new id in its descriptor,
        where the payload lies in huge pages; its id, or 0 where it stays inline."""
        where = address(req.payload)
        eighths = pages.scanner().eighths([(where, req.payload.nbytes)])
        if eighths == pages.UNKNOWN or eighths < 4:
            return 0
        rid = next(self._remote_ids)
        req.wire_header = with_mode(req.wire_header, Mode.REMOTE)
        req.descriptor = CMA_DESCRIPTOR.pack(where, rid).ljust(HEADER_SIZE, b"\0")
        return rid

    def _offer_device(self, req: SendRequest) -> None:
        """Send a CUDA buffer as its descriptor (Engine.isend_device): the receiver copies it
        device to device, and acknowledges."""
        rid = next(self._remote_ids)
        self.awaiting[rid] = req
        req.wire_header = req.header._replace(mode=Mode.DEVICE).pack()
        body = req.device_body or b""
        req.descriptor = (DEVICE_ID.pack(rid) + body).ljust(DEVICE_UNITS * HEADER_SIZE, b"\0")

    def acknowledge(self, rid: int, copied: bytes | None = None) -> None:
        """Tell the peer its REMOTE or DEVICE message `rid` was read (`copied`: the handle of the
        event after a device copy, which its sender's stream waits for): its send completes."""
        mode = Mode.ACK if copied is None else Mode.COPIED
        ack = SendRequest(self.peer, Header(Kind.ACK, 0, rid, 0, 0, P2P_FINGERPRINT, mode), _EMPTY,
                          "acknowledgement")
        if copied is not None:
            ack.descriptor = copied.ljust(HEADER_SIZE, b"\0")
        self.post(ack)
        if self.sendq:  # behind other sends: push now, the peer may wait for nothing else
            self._push()
            self.engine.watch_in_background(ack)  # and later, should this rank stop calling

    def _acked(self, rid: int, copied: bytes | None = None) -> None:
        req = self.awaiting.pop(rid, None)
        if req is not None:
            req.copied = copied
            if copied is not None and req.holds is not None:
                try:
                    req.holds.copied(copied, self.peer)
                except Exception as exc:  # a CUDA error: the send fails with it, progress goes on
                    req.fail(exc)
            req.done = True  # no-op effect where it already failed (done, with its error)

    def _put_whole(self, req: SendRequest) -> bool:
        """Write a message that fits the ring's free space in one record (its payload may wrap
        past the ring's end), and finish its request; False leaves it to `_push`. Most small
        sends end here, with no queueing and no piece-by-piece bookkeeping."""
        if not self._put(req.wire_header, req.payload, req.descriptor):
            return False
        req.done = req.descriptor is None or req.header.kind == Kind.ACK  # else once the peer acknowledges
        req.sent = req.payload.nbytes
        return True

    def put_now(self, wire_header: bytes, payload: np.ndarray) -> bool:
        """Write a small point-to-point message (`payload`: a C-contiguous array) whole, with
        no request at all, where nothing is queued before it, the ring needs not grow and the
        payload goes through the ring; False leaves it to `post` (Engine.send_now)."""
        n = payload.nbytes
        out = self.out
        if self.sendq or n >= REMOTE_BYTES or (n > (out.capacity >> 1) - 127 and self._outgrown(n)):
            return False  # (below that bound no record outgrows the ring)
        if self.native is not None:  # _put's record, written in C
            return self.native.ring_put(out.bytes, CTRL_BYTES, out.capacity, wire_header, payload)
        return self._put(wire_header, byte_view(payload), None)

    def exchange_now(self, out_header: bytes, payload: np.ndarray, inn: ShmChannel, in_header: bytes,
                     dst: np.ndarray, spin_s: float) -> tuple[bool, bool] | None:
        """put_now here, then inn.take_now waiting up to spin_s (none where a send to inn's
        peer waits to be pushed, which that peer may need first), in one compiled call: a small
        MPI_Sendrecv (Engine.sendrecv_now). (sent, taken); False, False also for buffers the
        general path must name (not C-contiguous, a read-only dst). None: no compiled loops, or
        the message needs more than that call checks; the engine then sends and receives."""
        n = payload.nbytes
        out = self.out
        if self.native is None or self.sendq or n >= REMOTE_BYTES or n > (out.capacity >> 1) - 127 \
                or inn._sink is not None:
            return None
        ring = inn.inn
        done = self.native.ring_sendrecv(out.bytes, CTRL_BYTES, out.capacity, out_header, payload, ring.bytes,
                                         CTRL_BYTES, ring.capacity, in_header, dst,
                                         0 if inn.queued() else int(spin_s * 1e9))
        if done == 2:
            inn.parked = None
            inn.release = False
        return done > 0, done == 2

    def exchange_read(self, req: SendRequest, inn: ShmChannel, in_header: bytes, in_what: str,
                      dst: np.ndarray, spin_s: float) -> tuple[bool, bool]:
        """A large MPI_Sendrecv where each side reads the other's buffer (Engine.sendrecv_read),
        in one compiled call (ring_exchange_read): the REMOTE exchange that `post`,
        `_take_remote` and `acknowledge` make on the general path, where nothing else is in
        the way. (whether `req` went, done or in `awaiting` until acknowledged; whether the
        receive is done). False, False: nothing done (no compiled loops, a payload not in
        huge pages, traffic to handle first, or a reader that must bounce)."""
        native = self.native
        if native is None or not self.peer_reads or not inn.peer_pid or self.sendq or inn.sendq \
                or self._sink is not None or inn._sink is not None or cma.aliasing_is_slow():
            return False, False
        rid = self._describe(req)
        if not rid:
            return False, False
        out, source, back, mine = self.out, inn.inn, inn.out, self.inn
        flags, peer_rid, err = native.ring_exchange_read(
            out.bytes, CTRL_BYTES, out.capacity, req.wire_header, req.descriptor,
            source.bytes, CTRL_BYTES, source.capacity, with_mode(in_header, Mode.REMOTE), dst,
            back.bytes, CTRL_BYTES, back.capacity, _ACK, inn.peer_pid,
            mine.bytes, CTRL_BYTES, mine.capacity, _acknowledging(rid), int(spin_s * 1e9))
        if not flags:
            return False, False
        req.sent = req.payload.nbytes
        if flags & _EX_DONE:
            req.done = True
        else:
            self.awaiting[rid] = req
        if flags & _EX_TAKEN:
            inn._read(flags, peer_rid, err, in_what)
        return True, bool(flags & _EX_TAKEN)

    def take_read(self, wire_header: bytes, dst: np.ndarray, what: str, spin_s: float) -> bool | None:
        """A receive (labelled `what`) of a message its sender left in its memory (REMOTE), taken,
        read into `dst` (writable, C-contiguous) and acknowledged in one compiled call where
        its descriptor is the ring's next record (ring_take_read), waiting up to `spin_s`:
        take_now's answers. A read that fails raises as the general path's does."""
        native = self.native
        if native is None or self._sink is not None or self.sendq or cma.aliasing_is_slow():
            return False  # (sendq: the acknowledgement would pass what waits to be written)
        ring, out = self.inn, self.out
        taken, rid, err = native.ring_take_read(
            ring.bytes, CTRL_BYTES, ring.capacity, with_mode(wire_header, Mode.REMOTE), dst, self.peer_pid,
            out.bytes, CTRL_BYTES, out.capacity, _ACK, int(spin_s * 1e9))
        if taken <= 0:
            return None if taken < 0 else False
        self._read(taken, rid, err, what)
        return True

    def _read(self, flags: int, rid: int, err: int, what: str) -> None:
        """After a compiled call took and read this ring's REMOTE message `rid` (for the receive
        labelled `what`): the ring's tail moved on; acknowledge it where the call could not;
        raise a read that failed (errno `err`) as the general path's read does."""
        self.parked = None
        self.release = False
        if not flags & _EX_ACKED:
            self.acknowledge(rid)
        if err:
            raise read_failed(self, what, cma.read_error(self.peer_pid, err))

    def take_ack(self, req: SendRequest, spin_s: float) -> None:
        """Finish REMOTE send `req` where its reader's acknowledgement is the ring's next record
        or comes within `spin_s` (ring_take)."""
        descriptor = req.descriptor
        if descriptor is None or self.native is None or self._sink is not None:
            return
        rid = CMA_DESCRIPTOR.unpack_from(descriptor)[1]
        if self.awaiting.get(rid) is not req:
            return
        ring = self.inn
        if self.native.ring_take(ring.bytes, CTRL_BYTES, ring.capacity, _acknowledging(rid), _EMPTY,
                                 int(spin_s * 1e9)):
            self._acked(rid)

    def _put(self, wire_header: bytes, payload: np.ndarray, descriptor: bytes | None) -> bool:
        ring = self.out
        words = ring.words
        cap = ring.capacity
        head = words[_HEAD]
        n = payload.nbytes
        end = head + HEADER_SIZE + (_pad(n) if descriptor is None else len(descriptor))
        if (n > PIPELINE_BYTES and descriptor is None) or end - words[_TAIL] > cap:
            return False
        pos = head % cap  # records are 64-aligned: the header never wraps, what follows may
        ring.raw[pos:pos + HEADER_SIZE] = wire_header
        if descriptor is not None:
            self._copy_in(np.frombuffer(descriptor, np.uint8), head + HEADER_SIZE)
        elif n:
            self._copy_in(payload, head + HEADER_SIZE)
        words[_HEAD] = end
        return True

    def post_control(self, req: SendRequest) -> None:
        self.stream.post(req)

    def progress(self) -> bool:
        moved = self._push() if self.sendq else False
        return self._pull() or moved

    def flush(self) -> None:
        """Hand queued sends to the ring, reading nothing."""
        if self.sendq:
            self._push()

    def queued(self) -> bool:
        """Sends this process has yet to write (a REMOTE one waiting for its reader is not)."""
        return bool(self.sendq or self.stream.sendq)

    def pending(self) -> list[SendRequest]:
        """Sends not finished yet: through the ring, read by the peer, or control messages on
        the socket."""
        return self.sendq + list(self.awaiting.values()) + list(self.stream.sendq)

    def poll_socket(self) -> bool:
        pushed = self.stream.push() if self.stream.sendq else False
        return self.stream.pull() or pushed

    # -- sender side ------------------------------------------------------------------------
    def _push(self) -> bool:
        ring = self.out
        words = ring.words
        cap = ring.capacity
        head = words[_HEAD]
        free = cap - (head - words[_TAIL])
        start = head
        while self.sendq and free >= 64:
            req = self.sendq[0]
            if req.descriptor is not None:
                record = req.wire_header + req.descriptor
                if free < len(record):
                    break
                for at in range(0, len(record), HEADER_SIZE):  # 64-byte records: one may wrap after any
                    pos = head % cap
                    ring.raw[pos:pos + HEADER_SIZE] = record[at:at + HEADER_SIZE]
                    head += HEADER_SIZE
                free -= len(record)
                req.sent = req.payload.nbytes
                self.sendq.pop(0)
                if req.header.mode == Mode.MOVE:  # the rest goes into the new ring
                    words[_HEAD] = head
                    self._moved(req.ring)  # type: ignore[attr-defined]
                    req.done = True
                    self._push()
                    return True
                if req.header.kind == Kind.ACK:  # else done once the peer acknowledges
                    req.done = True
                continue
            if not self._hdr_written:
                pos = head % cap
                ring.raw[pos:pos + HEADER_SIZE] = req.wire_header
                head += HEADER_SIZE
                free -= HEADER_SIZE
                self._hdr_written = True
            left = req.payload.nbytes - req.sent
            if left:
                n = min(left, free, PIPELINE_BYTES)
                if n < left:
                    n &= ~63  # keep records 64-aligned; the final piece is padded instead
                    if n == 0:
                        break
                head = self._copy_in(req.payload[req.sent:req.sent + n], head)
                req.sent += n
                free -= _pad(n)
                head += _pad(n) - n
                words[_HEAD] = head  # this piece is readable while the next is copied in
            if req.sent == req.payload.nbytes:
                self.sendq.pop(0)
                self._hdr_written = False
                req.done = True
        if head != start:
            words[_HEAD] = head
            return True
        return False

    def _moved(self, ring: Ring) -> None:
        """Write into `ring` from now on; the old one lives on in the reader's mapping until it
        has read the MOVE record."""
        old, self.out = self.out, ring
        assert self.source is not None
        self.source.release(old.capacity)
        old.close()

    def _copy_in(self, src: np.ndarray, head: int) -> int:
        ring = self.out
        cap = ring.capacity
        pos = head % cap
        n = len(src)
        first = min(n, cap - pos)
        ring.data[pos:pos + first] = src[:first]
        if first < n:
            ring.data[:n - first] = src[first:]
        return head + n

    # -- receiver side ----------------------------------------------------------------------
    def _pull(self) -> bool:
        ring = self.inn
        words = ring.words
        cap = ring.capacity
        tail = words[_TAIL]
        avail = words[_HEAD] - tail
        if avail == 0:
            return False
        start = tail
        data = ring.data
        while avail:
            if self._sink is None:
                pos = tail % cap
                header = self._header(ring.raw, pos)
                if header.mode == Mode.MOVE:
                    self._follow(header, pos)
                    return self._pull() or True
                if header.mode:
                    tail = self._take_remote(header, tail)
                    avail = words[_HEAD] - tail
                    continue
                if header.nbytes >= PARK_BYTES and not self.release and not self.awaiting \
                        and self.engine.may_park(self.peer, header):
                    self.parked = header
                    break
                self.parked = None
                self.release = False
                tail += HEADER_SIZE
                avail -= HEADER_SIZE
                self._sink = self.engine.match(self.peer, header)
                self._padded_left = _pad(header.nbytes)
                if header.nbytes == 0:
                    self._finish_sink()
                continue
            sink = self._sink
            take = min(avail, self._padded_left, PIPELINE_BYTES)
            pos = tail % cap
            useful = min(take, sink.nbytes - sink.received)
            first = min(useful, cap - pos)
            if first:
                sink.write(data[pos:pos + first])
            if first < useful:
                sink.write(data[:useful - first])
            tail += take
            avail -= take
            words[_TAIL] = tail  # the writer may refill this piece already
            self._padded_left -= take
            if self._padded_left == 0:
                self._finish_sink()
        if tail != start:
            words[_TAIL] = tail
            return True
        return False

    def take_now(self, wire_header: bytes, dst: np.ndarray, spin_s: float = 0.0) -> bool | None:
        """Read the message at the ring's tail straight into `dst` (a writable C-contiguous
        array) if its header is `wire_header` byte for byte and it lies whole in the ring (its
        payload may wrap), waiting for it up to `spin_s`: a point-to-point receive with no
        request, no matching and no parsing (Engine.recv_now). None: nothing whole there yet;
        False: another record comes first (the general path's)."""
        if self._sink is not None:
            return False
        ring = self.inn
        if self.native is not None:  # the same, in C (spinning without the interpreter lock)
            taken = self.native.ring_take(ring.bytes, CTRL_BYTES, ring.capacity, wire_header, dst,
                                          int(spin_s * 1e9))
        else:
            dst = byte_view(dst)
            taken = self._take(ring, wire_header, dst)
            until = time.perf_counter() + spin_s if taken is None and spin_s else 0.0
            while taken is None and time.perf_counter() < until:
                taken = self._take(ring, wire_header, dst)
        if taken:
            self.parked = None
            self.release = False
        return taken

    @staticmethod
    def _take(ring: Ring, wire_header: bytes, dst: np.ndarray) -> bool | None:
        """take_now's one look at the ring (`dst`: flat uint8)."""
        words = ring.words
        tail = words[_TAIL]
        n = dst.nbytes
        end = tail + HEADER_SIZE + _pad(n)
        avail = words[_HEAD] - tail
        if avail < HEADER_SIZE:
            return None
        cap = ring.capacity
        pos = tail % cap
        if ring.raw[pos:pos + HEADER_SIZE] != wire_header or end - tail > cap:
            return False  # (a record larger than the ring never lies whole in it)
        if avail < end - tail:
            return None
        if n:  # the payload may wrap past the ring's end
            at = (pos + HEADER_SIZE) % cap
            first = min(n, cap - at)
            dst[:first] = ring.data[at:at + first]
            if first < n:
                dst[first:] = ring.data[:n - first]
        words[_TAIL] = end
        return True

    def _follow(self, header: Header, pos: int) -> None:
        """The writer moved to another ring (its name in the record after the header): map it
        and read on from there. Its name is unlinked once mapped: nothing is left behind."""
        old = self.inn
        at = (pos + HEADER_SIZE) % old.capacity
        name = bytes(old.raw[at:at + HEADER_SIZE]).rstrip(b"\0").decode(errors="replace")
        try:
            ring = Ring(name, header.tag, create=False)
        except OSError as exc:
            raise PeerClosed(f"cannot map the ring rank {self.peer} moved to ({exc})") from exc
        if ring.nonce != header.seq:
            ring.close()
            raise PeerClosed(f"the ring rank {self.peer} moved to is not the one it announced")
        ring.unlink()
        self.inn = ring
        old.close()

    def _take_remote(self, header: Header, tail: int) -> int:
        """Act on a REMOTE or DEVICE message (hand it to its receive) or an ACK; the tail past it."""
        after = tail + _span(header)
        tail += HEADER_SIZE
        mode = header.mode
        if mode == Mode.ACK:
            self._acked(header.seq)
        elif mode == Mode.COPIED:
            self._acked(header.seq, self._records(tail, 1))
        elif mode == Mode.DEVICE:
            descriptor = self._records(tail, DEVICE_UNITS)
            rid = DEVICE_ID.unpack_from(descriptor)[0]
            self.engine.match(self.peer, header, remote=True).fetch(
                DevicePayload(self, descriptor[DEVICE_ID.size:], rid, header.nbytes))
        else:
            ring = self.inn
            where, rid = CMA_DESCRIPTOR.unpack_from(ring.raw, tail % ring.capacity)
            payload = CmaPayload(self, where, rid, header.nbytes)
            self.engine.match(self.peer, header, remote=True).fetch(payload)
        return after

    def _records(self, at: int, units: int) -> bytes:
        """`units` records of the in ring from position `at` on (a descriptor may wrap)."""
        ring = self.inn
        cap = ring.capacity
        return b"".join(bytes(ring.raw[(at + i) % cap:(at + i) % cap + HEADER_SIZE])
                        for i in range(0, units * HEADER_SIZE, HEADER_SIZE))

    def _header(self, raw: memoryview, pos: int) -> Header:
        """The header at `pos`; point-to-point headers repeat byte for byte (no sequence
        number), so their parsed form is kept, which takes a fifth of unpacking one."""
        if raw[pos] != Kind.P2P:
            return Header.unpack(raw, pos)
        wire = raw[pos:pos + HEADER_SIZE].tobytes()
        header = self._p2p_headers.get(wire)
        if header is None:
            if len(self._p2p_headers) >= _P2P_HEADERS:
                self._p2p_headers.clear()
            header = self._p2p_headers[wire] = Header.unpack(wire)
        return header

    def _finish_sink(self) -> None:
        sink, self._sink = self._sink, None
        assert sink is not None
        sink.finish()

    def close(self) -> None:
        if self.awaiting:  # the peer may still read them (its receive posted late): keep them
            _UNACKNOWLEDGED.extend(req.payload if req.holds is None else req.holds
                                   for req in self.awaiting.values())
        self.stream.close()
        words = self.out.words
        if words[_HEAD] == words[_TAIL] or self.peer in self.engine.departed:
            self.out.unlink()  # else its reader may yet follow a move into it (and unlinks it)
        for req in self.sendq:  # a move not written yet: the peer never learnt its ring's name
            if req.header.mode == Mode.MOVE:
                req.ring.unlink()  # type: ignore[attr-defined]
        self._unlink_unfollowed()
        self.inn.close()
        self.out.close()

    def _unlink_unfollowed(self) -> None:
        """Unlink the rings the writer moved to whose MOVE records this reader never read: the
        writer leaves such a ring linked for its reader (close), which would otherwise stay
        in /dev/shm until the next job's start (remove_stale). Bounded: a broken ring stops it."""
        ring, at, owned = self.inn, self.inn.words[_TAIL] + (self._padded_left if self._sink else 0), False
        for _ in range(64):
            words, cap = ring.words, ring.capacity
            target = None
            try:
                while target is None and at + HEADER_SIZE <= words[_HEAD] <= at + cap:
                    header = Header.unpack(ring.raw, at % cap)
                    if header.mode == Mode.MOVE:
                        pos = (at + HEADER_SIZE) % cap
                        target = (bytes(ring.raw[pos:pos + HEADER_SIZE]).rstrip(b"\0").decode(), header)
                    at += _span(header)
            except (ValueError, struct.error, UnicodeDecodeError):
                target = None
            if owned:
                ring.close()
            if target is None:
                return
            try:
                ring, owned = Ring(target[0], target[1].tag, create=False), True
            except (OSError, ValueError):
                return
            if ring.nonce != target[1].seq:
                ring.close()
                return
            ring.unlink()
            at = ring.words[_TAIL]
