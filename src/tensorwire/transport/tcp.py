"""Framed, non-blocking message streams over the sockets of a peer pair.

A `SocketStream` per socket; a TCP channel has one, or TENSORWIRE_NSOCKS of them, over which
it splits large messages (`parts_of`): the first stream carries every header, the payload's
first part and whole small messages, the others the other parts in the same message order. The
header of a message that may be split (from SPLIT_BYTES) is followed by the count of its parts,
so the receiver learns what each stream carries next from the first stream alone, whatever pump
threads the sender has. The shared-memory channel keeps one stream too, for control messages and
because a closed socket is the fastest way to learn that a peer died.

Each stream's share of a message from SPLIT_BYTES ends in a trailer word: whole, or void where
the sender's group was aborted before its last byte left (a send that timed out or was
interrupted partway: the rest of its bytes still go, to keep the stream framed, but are not
what the sender's caller sent). A receive of a void message fails with the abort.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import math
import select
import socket
import struct
import termios
import time
from collections import deque
from typing import NoReturn

import numpy as np

from ..buffers import byte_view
from ..config import Config
from ..errors import InvalidArgumentError, ResourceError
from .channel import Channel, ChannelOwner, PeerClosed
from .pumps import PUMP_BYTES, Job, fold_job, recv_job, send_job
from .requests import RecvRequest, SendRequest, Sink
from .wire import HEADER_SIZE, Header, MalformedHeader, check_tcp

_MAX_IO = 1 << 30  # bytes per syscall: stays below the kernel's ~2 GiB per-call limit
_TCP_RTO_MAX_MS = 44  # Linux 6.15's TCP_RTO_MAX_MS (linux/tcp.h): at least 1000
SPLIT_BYTES = 256 << 10
"""Messages from this size may be split over a pair's streams where it has several (TENSORWIRE_NSOCKS)."""
_PARTS = struct.Struct("<I")  # after the header of a message from SPLIT_BYTES: the count of its parts
_TRAILER = struct.Struct("<I")  # after each stream's part of a message from SPLIT_BYTES
_WHOLE, _VOID = 0, 0x44494F56
_INT = struct.Struct("i")
NOW_BYTES = 64 << 10
"""Point-to-point payloads up to this size go to the socket at once, with no request
(TcpChannel.put_now): a rest the kernel does not take is copied, so it stays small. Receives
take them so too (SocketStream.take_now)."""
_PEEK_BYTES = HEADER_SIZE + NOW_BYTES
_PULL_FRAMES = 64
"""Headers one `pull` reads at most: a peer that sends as fast as this rank reads must not keep
one round of progress (and the engine's lock) going forever, or nothing it read gets matched."""


def parts_of(nbytes: int, streams: int, pumped: bool) -> int:
    """Over how many of a pair's `streams` a rank sends a message of `nbytes`: all of them from
    SPLIT_BYTES where it has no pump threads (the kernel's buffers of each then take a share at
    once); with pumps (`pumped`) one per PUMP_BYTES, so that every part is one a pump takes and a
    stream more never leaves the rank's own thread moving several parts in turn
    (docs/design/tcp.md#splitting-a-message-over-streams)."""
    if nbytes < SPLIT_BYTES:
        return 1
    return max(1, min(streams, nbytes // PUMP_BYTES)) if pumped else min(streams, nbytes // 64)


def split(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each of `parts` parts of a message: equal ones that start at multiples of
    64 bytes (so a folding receive stages whole elements), the last longer by the rest."""
    per = nbytes // parts // 64 * 64
    return [(i * per, nbytes if i == parts - 1 else (i + 1) * per) for i in range(parts)]


class _Part:
    """One stream's part of a split message: sent like a message of its own (the first part
    with the header), the message done when all its parts are."""

    __slots__ = ("req", "payload", "wire_header", "_sent", "left")
    header = property(lambda self: self.req.header)
    error = property(lambda self: self.req.error)

    def __init__(self, req: SendRequest, start: int, end: int, header: bytes | None, left: list[int]) -> None:
        self.req = req
        self.payload = req.payload[start:end]
        self.wire_header = header
        self._sent = 0
        self.left = left  # parts of the message not sent yet (shared)

    @property
    def sent(self) -> int:
        return self._sent

    @sent.setter
    def sent(self, value: int) -> None:  # the message's count too: what a timeout says went
        self.req.sent += value - self._sent
        self._sent = value

    @property
    def done(self) -> bool:
        return False

    @done.setter
    def done(self, value: bool) -> None:
        self.left[0] -= 1
        if not self.left[0]:
            self.req.sent = self.req.payload.nbytes
            self.req.done = True


def _trailed(header: Header) -> bool:
    """Whether a message's parts end in a trailer word (the data kinds from SPLIT_BYTES)."""
    return header.kind <= 1 and header.nbytes >= SPLIT_BYTES


def drain(sock: socket.socket) -> bool:
    """Read and drop what `sock` holds now (it closes): False where its peer closed it, or it failed."""
    try:
        while sock.recv(1 << 16):
            pass
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        pass
    return False


def unsent_bytes(sock: socket.socket) -> int:
    """Bytes written to `sock` that its peer's kernel has yet to acknowledge (SIOCOUTQ)."""
    try:
        return _INT.unpack(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(_INT.size)))[0]
    except OSError:
        return 0


def congestion_in_use(cfg: Config) -> str:
    """The congestion control tensorwire's connections run: TENSORWIRE_TCP_CONGESTION, else the
    system's default."""
    return cfg.tcp_congestion or f"{_proc_text('tcp_congestion_control')} (the system's)"


def _proc_text(name: str) -> str:
    try:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


@functools.cache
def _rto_max_ms(peer_timeout: float) -> int:
    """The least cap on the retransmission timeout (ms, from 1 s) under which the kernel still
    gives a connection with data unacknowledged longer than tensorwire's own verdict takes
    (TENSORWIRE_PEER_TIMEOUT, and two fifths of it more, at least 2 s): the kernel gives up
    after tcp_retries2 retransmissions, their timeout doubling from 200 ms up to the cap, so a
    low cap would end the connection first. 0: no cap does."""
    try:
        retries = int(_proc_text("tcp_retries2"))
    except ValueError:
        retries = 15
    need = peer_timeout + max(2.0, 0.4 * peer_timeout)
    for ms in range(1000, 120_001, 250):
        cap = ms / 1000
        doublings = min(retries, int(math.log2(cap / 0.2)))
        if (2 ** (doublings + 1) - 1) * 0.2 + (retries - doublings) * cap > need:
            return ms
    return 0


def tune_socket(sock: socket.socket, cfg: Config) -> None:
    """No Nagle, the send and receive buffers `cfg` asks for (TENSORWIRE_TCP_SNDBUF and
    TENSORWIRE_TCP_RCVBUF; 0: the kernel's autotuning) and its congestion control
    (TENSORWIRE_TCP_CONGESTION) if given. The receive buffer is deep so that a receiver waiting
    for its turn does not stall its sender; the send buffer small so that a rank does not run
    into its next step while its last one's bytes still wait to leave; see docs/design/tcp.md.

    A connection with nothing to send whose peer's host stops answering (down, cut off: no
    reset ever comes) fails once it was silent for TENSORWIRE_PEER_TIMEOUT, and not before:
    keepalive probes every fifth of it while idle, as many unanswered as fill it (the kernel's
    timers, nothing per message); an outage shorter than that is lived through. One with data
    waiting for an acknowledgement sends no keepalive: idle waiters look at those
    (failures.Failures.check_silent); where the kernel lets it (Linux 6.15), it retransmits at
    least every `_rto_max_ms`, so that such data moves within about that of a link's return,
    not after the several seconds exponential backoff has reached by then."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        bound = max(1, math.ceil(cfg.peer_timeout))
        interval = max(1, bound // 5)
        for opt, value in ((socket.TCP_KEEPIDLE, interval), (socket.TCP_KEEPINTVL, interval),
                           (socket.TCP_KEEPCNT, -(-bound // interval))):
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        cap = _rto_max_ms(cfg.peer_timeout)
        if cap:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, _TCP_RTO_MAX_MS, cap)
            except OSError:  # an older kernel: backoff as it goes
                pass
        if cfg.tcp_congestion:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cfg.tcp_congestion.encode())
            except OSError as exc:
                raise InvalidArgumentError(
                    f"TENSORWIRE_TCP_CONGESTION={cfg.tcp_congestion!r}: the kernel refused it "
                    f"({exc.strerror}); available here: {_proc_text('tcp_available_congestion_control')}, "
                    f"allowed without CAP_NET_ADMIN: {_proc_text('tcp_allowed_congestion_control')}") from exc
    size_buffers(sock, cfg)


def size_buffers(sock: socket.socket, cfg: Config) -> None:
    """TENSORWIRE_TCP_SNDBUF and TENSORWIRE_TCP_RCVBUF, before the socket connects (a dialed
    one) or listens: the window scale is agreed as the connection opens, and a receive buffer
    shrunk after that stalls the connection (docs/design/tcp.md)."""
    for opt, size in ((socket.SO_SNDBUF, cfg.tcp_sndbuf), (socket.SO_RCVBUF, cfg.tcp_rcvbuf)):
        if size:
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
            except OSError:
                pass


class SocketStream:
    """Sends queued requests and parses arriving frames, never blocking."""

    def __init__(self, sock: socket.socket, peer: int, engine: ChannelOwner, staging_bytes: int,
                 max_message: int) -> None:
        """`max_message`: the largest payload a header may announce (TENSORWIRE_MAX_MESSAGE)."""
        sock.setblocking(False)
        self.sock = sock
        self.peer = peer
        self.engine = engine
        self.sendq: deque[SendRequest] = deque()
        self._hdr_sent = 0
        self._trail_out = memoryview(bytearray(_TRAILER.size))  # the head of sendq's trailer
        self._trail_sent = 0
        self._trail_in = memoryview(bytearray(_TRAILER.size))
        self._trail_left = 0  # bytes of the current sink's trailer still to read
        self._hdr = bytearray(HEADER_SIZE + _PARTS.size)
        self._hdr_view = memoryview(self._hdr)
        self._hdr_got = 0
        self._hdr_want = HEADER_SIZE  # and the parts' count, once the header says it follows
        self._sink: Sink | None = None
        self._at = self._end = 0  # the bytes of the sink this stream fills: [_at, _end)
        self._staging = np.empty(max(staging_bytes, 64) // 64 * 64, dtype=np.uint8)
        self._staged = 0
        self.max_message = max_message
        self.others: list[SocketStream] = []  # a pair's further streams, where this is its first
        self.headers = True  # this stream carries the headers (the pair's first)
        self.expect: deque[tuple[Sink, int, int]] = deque()  # parts it carries next (further streams)
        self._tx: Job | None = None  # a pump thread writes the head of sendq's payload
        self._rx: Job | None = None  # a pump thread reads this stream's part of _sink
        self._peek: memoryview | None = None  # take_now's look at the next message (made on first use)

    # -- sending ------------------------------------------------------------------------
    def post(self, req: SendRequest) -> None:
        self.sendq.append(req)

    def queue_rest(self, wire_header: bytes, payload: np.ndarray, n: int) -> None:
        """A message the kernel took only `n` bytes of (TcpChannel.put_now): its rest queued
        first, with a copy of the payload (its caller may reuse the array at once), and kept
        moving by the engine while nobody waits on it."""
        header = Header.unpack(wire_header)
        req = SendRequest(self.peer, header, byte_view(payload).copy(),
                          f"send to rank {self.peer} (tag {header.tag})", wire_header)
        self._hdr_sent = min(n, len(wire_header))
        req.sent = n - self._hdr_sent
        self.sendq.append(req)
        self.engine.watch_in_background(req)

    def push(self) -> bool:
        """Write as much of the queue as the kernel takes now; hand a large rest to a pump."""
        moved = False
        while self.sendq:
            req = self.sendq[0]
            head = req.wire_header  # None: a part whose message's header another stream carries
            size = 0 if head is None else len(head)
            trail = _TRAILER.size if head is None or _trailed(req.header) else 0
            job = self._tx
            if job is not None:  # a pump thread writes this part's payload
                if not job.done:
                    return moved
                self._tx = None
                if job.error is not None:
                    raise PeerClosed(f"send failed: {job.error}")
                req.sent = req.payload.nbytes
                n = 1
            elif self._hdr_sent == size and self._pump_send(req):
                return True
            else:
                try:
                    n = self._write(req, head, size, trail)
                except (BlockingIOError, InterruptedError):
                    return moved
                except OSError as exc:
                    raise PeerClosed(f"send failed: {exc}") from exc
            moved = moved or n > 0
            if self._hdr_sent == size and req.sent == req.payload.nbytes and self._trail_sent == trail:
                self.sendq.popleft()
                self._hdr_sent = self._trail_sent = 0
                req.done = True
            elif n == 0:
                return moved
        return moved

    def _write(self, req: SendRequest, head: bytes | None, size: int, trail: int) -> int:
        """One system call's worth of the head of the queue: what is left of its header and
        payload, or, once they are in the kernel, its trailer (whole, or void where its group
        was aborted by then; a call of its own: docs/design/tcp.md#trailers)."""
        bufs = []
        if self._hdr_sent < size:
            bufs.append(memoryview(head)[self._hdr_sent:])  # type: ignore[arg-type]  # size 0 where head is None
        rest = req.payload.nbytes - req.sent
        if rest:
            bufs.append(req.payload[req.sent:req.sent + _MAX_IO].data)
        elif trail:
            if not self._trail_sent:
                _TRAILER.pack_into(self._trail_out, 0, _WHOLE if req.error is None else _VOID)
            bufs.append(self._trail_out[self._trail_sent:])
        n = self.sock.sendmsg(bufs) if len(bufs) > 1 else self.sock.send(bufs[0])
        took = min(n, size - self._hdr_sent)
        self._hdr_sent += took
        payload = min(n - took, rest)
        req.sent += payload
        self._trail_sent += n - took - payload
        return n

    def _pump_send(self, req: SendRequest) -> bool:
        """Hand the rest of `req`'s payload to a pump thread, if it is large and one is idle."""
        pumps = self.engine.pumps
        if pumps is None or req.payload.nbytes - req.sent < PUMP_BYTES:
            return False
        job = send_job(self.sock, req.payload[req.sent:].data)
        if not pumps.start(job):
            return False
        self._tx = job
        return True

    # -- receiving ----------------------------------------------------------------------
    def take_now(self, wire_header: bytes, dst: np.ndarray, spin_s: float) -> bool | None:
        """Read the next message straight into `dst` (a writable C-contiguous array of at most
        NOW_BYTES) if its header is `wire_header` byte for byte and it is whole in the socket,
        looking for it up to `spin_s`: a point-to-point receive with no request, matching or
        parsing (Engine.recv_now). None: not whole yet; False: something else comes first, or
        this stream is inside a message (the general path's)."""
        n = HEADER_SIZE + dst.nbytes
        if self._sink is not None or self._hdr_got or self.expect or not self.headers or n > _PEEK_BYTES:
            return False
        if self._peek is None:
            self._peek = memoryview(bytearray(_PEEK_BYTES))
        peek, sock = self._peek, self.sock
        until = time.perf_counter() + spin_s if spin_s else 0.0
        while True:
            try:
                got = sock.recv_into(peek, n, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                got = -1
            except OSError as exc:
                raise PeerClosed(f"receive failed: {exc}") from exc
            if got == 0:
                raise PeerClosed("connection closed by peer")
            if got >= HEADER_SIZE and peek[:HEADER_SIZE] != wire_header:
                return False
            if got == n:
                break
            if not until or time.perf_counter() > until:
                return None
        sock.recv_into(peek, HEADER_SIZE)  # both are in the socket already: no wait, no short read
        if dst.nbytes:
            sock.recv_into(byte_view(dst), dst.nbytes)  # type: ignore[arg-type, unused-ignore]  # numpy's stubs: ndarray a buffer from Python 3.12 only
        return True

    def pull(self) -> bool:
        """Read the frames the kernel holds now (up to _PULL_FRAMES headers), handing payloads
        to their sinks."""
        moved = False
        frames = 0
        while True:
            if self._rx is not None and not self._collect():
                return moved
            try:
                if self._sink is None:
                    if self.expect:  # a further stream: the next part the headers announced
                        self._sink, self._at, self._end = self.expect.popleft()
                        self._trail_left = _TRAILER.size
                        continue
                    if not self.headers:
                        return moved
                    n = self.sock.recv_into(self._hdr_view[self._hdr_got:self._hdr_want])
                    if n == 0:
                        raise PeerClosed("connection closed by peer")
                    moved = True
                    self._hdr_got += n
                    if self._hdr_got == self._hdr_want:
                        self._begin()
                        frames += 1
                        if frames == _PULL_FRAMES:
                            return True
                    continue
                if not self._read_payload():
                    return moved
                moved = True
            except (BlockingIOError, InterruptedError):
                return moved
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return moved
                raise PeerClosed(f"receive failed: {exc}") from exc

    def _begin(self) -> None:
        """A header is in, and the count of its parts where one follows it: match the message to
        its sink, and tell the pair's other streams which of its bytes they carry."""
        header = Header.unpack(self._hdr)
        parts = 1
        if self._hdr_want == HEADER_SIZE:
            try:
                check_tcp(header, self.max_message)
            except MalformedHeader as exc:
                self._malformed(f"a malformed message header ({exc})")
            if self.others and header.kind <= 1 and header.nbytes >= SPLIT_BYTES:
                self._hdr_want += _PARTS.size  # the count of its parts follows
                return
        else:
            (parts,) = _PARTS.unpack_from(self._hdr, HEADER_SIZE)
            if not 1 <= parts <= min(len(self.others) + 1, header.nbytes // 64):
                self._malformed(f"a message of {header.nbytes} bytes in {parts} parts over "
                                f"{len(self.others) + 1} streams")
        self._hdr_got, self._hdr_want = 0, HEADER_SIZE
        sink = self._sink = self.engine.match(self.peer, header)
        self._at, self._end = 0, sink.nbytes
        if _trailed(header):
            self._trail_left = _TRAILER.size
            sink.trailers = parts
        if parts > 1:
            cuts = split(sink.nbytes, parts)
            self._end = cuts[0][1]
            for stream, (start, end) in zip(self.others, cuts[1:]):
                stream.expect.append((sink, start, end))
        if self._end == 0:
            self._complete()

    def _malformed(self, what: str) -> NoReturn:
        self.sock.shutdown(socket.SHUT_RDWR)  # the stream is lost: say so to the peer
        raise PeerClosed(f"sent {what}")

    def _read_payload(self) -> bool:
        sink = self._sink
        assert sink is not None
        if self._at == self._end:
            return self._read_trailer(sink)
        if self.engine.pumps is not None and self._staged == 0 and self._end - self._at >= PUMP_BYTES \
                and self._pump_recv(sink):
            return True
        want = min(self._end - self._at - self._staged, _MAX_IO)
        view = sink.direct_at(self._at, want) if self._staged == 0 else None
        if view is not None:
            n = self.sock.recv_into(view, want)
            if n == 0:
                raise PeerClosed("connection closed by peer")
            sink.advance(n)
            self._at += n
        else:
            room = min(want, len(self._staging) - self._staged)
            n = self.sock.recv_into(self._staging.data[self._staged:self._staged + room], room)
            if n == 0:
                raise PeerClosed("connection closed by peer")
            self._staged += n
            if self._at + self._staged == self._end or self._staged == len(self._staging):
                sink.write_at(self._at, self._staging[:self._staged])
                self._at += self._staged
                self._staged = 0
        if self._at == self._end:
            self._complete()
        return n > 0

    def _pump_recv(self, sink: Sink) -> bool:
        """Hand the rest of this stream's bytes of `sink` to a pump thread, if one is idle: it
        receives straight into the destination, or through the staging buffer and folds."""
        start, nbytes = self._at, self._end - self._at
        view = sink.direct_at(start, nbytes)
        if view is not None:
            job = recv_job(self.sock, view)
        elif isinstance(sink, RecvRequest):
            job = fold_job(self.sock, nbytes, lambda offset, data: sink.place_at(start + offset, data),
                           self._staging)
        else:
            return False
        pumps = self.engine.pumps
        assert pumps is not None
        if not pumps.start(job):
            return False
        self._rx = job
        pumps.receiving.add(self.sock)
        return True

    def _collect(self) -> bool:
        """Take back a pumped receive that is done (False: still running)."""
        job = self._rx
        assert job is not None
        if not job.done:
            return False
        self._rx = None
        self._unregister()
        if job.error is not None:
            raise PeerClosed(f"receive failed: {job.error}")
        sink = self._sink
        assert sink is not None
        sink.advance(self._end - self._at)
        self._at = self._end
        self._complete()
        return True

    def _read_trailer(self, sink: Sink) -> bool:
        at = _TRAILER.size - self._trail_left
        n = self.sock.recv_into(self._trail_in[at:], self._trail_left)
        if n == 0:
            raise PeerClosed("connection closed by peer")
        self._trail_left -= n
        if not self._trail_left:
            (word,) = _TRAILER.unpack(self._trail_in)
            if word not in (_WHOLE, _VOID):
                self._malformed(f"a message trailer {word:#x}")
            sink.void = sink.void or word == _VOID
            sink.trailers -= 1
            self._complete()
        return True

    def _complete(self) -> None:
        """This stream's bytes of the sink are in (and its trailer, where it has one); the
        message is, once every stream's are."""
        if self._trail_left:
            return
        sink, self._sink = self._sink, None
        assert sink is not None
        if sink.received >= sink.nbytes and not sink.trailers:
            sink.finish()

    def finish_with_departed(self, until: float) -> None:
        """After the peer's goodbye, by `until`: the part a pump thread was writing, done (the
        peer may have read it all before it left), and the rest of a part of what the peer sent
        before it left that this stream is in or was told of (a pump thread's receive ends
        first). It all comes: the peer closed after its last byte."""
        while self._tx is not None and not self._tx.done and time.perf_counter() < until:
            time.sleep(0.0005)
        try:
            self.push()  # takes a finished pump's part as sent
        except PeerClosed:
            pass
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while time.perf_counter() < until:
            if self._rx is not None and not self._rx.done:
                time.sleep(0.0005)
                continue
            try:
                if self.pull():
                    continue
            except PeerClosed:
                return
            if self._sink is None and not self.expect:
                return
            poller.poll(10)

    def stop_pumps(self) -> None:
        """End this stream's pump jobs (its peer is lost, or it closes): each sees it within
        its next wait for the socket."""
        for job in (self._tx, self._rx):
            if job is not None:
                job.cancelled = True
        if self._rx is not None:
            self._unregister()

    def _unregister(self) -> None:
        pumps = self.engine.pumps
        if pumps is not None:
            pumps.receiving.discard(self.sock)

    def close(self) -> None:
        self.stop_pumps()
        try:
            self.sock.close()
        except OSError:
            pass


class TcpChannel(Channel):
    """Everything to one peer over its sockets: one stream, or several (TENSORWIRE_NSOCKS) that
    carry the parts of large messages side by side."""

    kind = "tcp"
    sends_now = True
    takes_now = True

    def __init__(self, streams: list[SocketStream] | SocketStream) -> None:
        self.streams = streams if isinstance(streams, list) else [streams]
        self.stream = self.streams[0]
        self.others = self.streams[1:]
        self.stream.others = self.others
        for other in self.others:
            other.headers = False
        self.sockets = [s.sock for s in self.streams]
        self.peer = self.stream.peer

    def post(self, req: SendRequest) -> None:
        n = req.payload.nbytes
        if n > self.stream.max_message:  # its receiver would take the stream for a hostile one
            self.stream.engine.refused_as_posted += 1
            req.fail(ResourceError(
                f"rank {self.stream.engine.rank}: {req.what}: a message of {n} bytes, more than "
                f"TENSORWIRE_MAX_MESSAGE ({self.stream.max_message}) lets one carry over TCP: raise it "
                f"on every rank (docs/security.md)"))
            return
        if not self.others or n < SPLIT_BYTES or req.header.kind > 1:
            self.stream.post(req)
            return
        parts = parts_of(n, len(self.streams), self.stream.engine.pumps is not None)
        head = req.wire_header + _PARTS.pack(parts)
        left = [parts]
        for i, (stream, (start, end)) in enumerate(zip(self.streams, split(n, parts))):
            stream.post(_Part(req, start, end, head if i == 0 else None, left))  # type: ignore[arg-type]

    def post_control(self, req: SendRequest) -> None:
        self.stream.post(req)

    def put_now(self, wire_header: bytes, payload: np.ndarray) -> bool:
        """Hand a small point-to-point message (`payload`: a C-contiguous array) to the first
        stream's socket in one `sendmsg`, with no request, where nothing is queued before it;
        False: nothing sent, `post` it (Engine.send_now)."""
        stream = self.stream
        if stream.sendq or payload.nbytes > NOW_BYTES:
            return False
        try:
            n = stream.sock.sendmsg([wire_header, payload])  # type: ignore[list-item, unused-ignore]  # as above
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise PeerClosed(f"send failed: {exc}") from exc
        if n < len(wire_header) + payload.nbytes:
            stream.queue_rest(wire_header, payload, n)
        return True

    def take_now(self, wire_header: bytes, dst: np.ndarray, spin_s: float = 0.0) -> bool | None:
        """ShmChannel.take_now over the first stream (SocketStream.take_now)."""
        return self.stream.take_now(wire_header, dst, spin_s)

    def progress(self) -> bool:
        if not self.others:
            pushed = self.stream.push() if self.stream.sendq else False
            return self.stream.pull() or pushed
        moved = False
        closed: PeerClosed | None = None
        for stream in self.streams:
            try:
                if stream.sendq and stream.push():
                    moved = True
                if stream.pull():
                    moved = True
            except PeerClosed as exc:  # read what the other streams hold before saying so
                closed = closed or exc
        if closed is not None:
            raise closed
        return moved

    def flush(self) -> None:
        """Hand queued sends to the kernel, reading nothing."""
        for stream in self.streams:
            if stream.sendq:
                stream.push()

    def poll_socket(self) -> bool:
        return self.progress()

    def queued(self) -> bool:
        """Sends this process has yet to hand to the kernel."""
        return any(stream.sendq for stream in self.streams)

    def blocked_writers(self) -> list[socket.socket]:
        """Those of the streams with sends queued that no pump thread writes."""
        return [stream.sock for stream in self.streams if stream.sendq and stream._tx is None]

    def pending(self) -> list[SendRequest]:
        """Sends not finished yet."""
        out: dict[int, SendRequest] = {}
        for stream in self.streams:
            for item in stream.sendq:
                req = getattr(item, "req", item)
                out[id(req)] = req
        return list(out.values())

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
