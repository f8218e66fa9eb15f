"""The TCP store's server: one thread, every client, no polling.

What a stranger can make the server hold is bounded (`StoreLimits`): until it has
authenticated, a connection is read no further than the handshake's next message, dropped
after `auth_timeout`, and at most `auth_pending` such connections are kept (`auth.Pending`
chooses the one a new one drops); a frame longer than the largest value allows closes its
connection unread.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import json
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from .. import auth
from ..errors import RendezvousError
from ..limits import pending_bound, start_thread
from .tcp_protocol import (
    DEFAULT_LIMITS,
    EXITED_KEY,
    I64,
    LEN,
    MAGIC,
    OP_ADD,
    OP_CHECK,
    OP_DELETE,
    OP_GET,
    OP_NAMES,
    OP_SET,
    OP_WAIT,
    OPS,
    PURPOSE,
    REFUSED_ADDRESSES,
    REFUSED_KEY,
    ST_ERROR,
    ST_EXITED,
    ST_OK,
    ST_TIMEOUT,
    StoreLimits,
    decode_request,
    pack_values,
    reply,
)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    handshake: auth.Responder | None
    """Until the client has proved it knows the secret; None once it has."""
    deadline: float
    """When an unauthenticated connection is dropped."""
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    closed: bool = False
    stats: ClientStats = field(default_factory=lambda: ClientStats())


@dataclass
class ClientStats:
    """What one client asked of the server: requests by operation, bytes each way (frames)."""

    requests: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0

    @property
    def total(self) -> int:
        return sum(self.requests.values())


@dataclass(eq=False)
class _Waiter:
    conn: _Conn
    op: int
    keys: list[str]
    missing: set[str]
    deadline: float
    done: bool = False


_ACCEPT_RETRY_S = 0.1
"""After accept() failed for want of descriptors, how long the listener rests."""


class TCPStoreServer:
    """The store's server: one daemon thread multiplexing all clients with `selectors`.

    Blocking reads are parked as waiters and answered when their key is set, or with TIMEOUT
    when their deadline passes, so nobody polls. Only clients that proved they know `secret`
    are served (`tensorwire.auth`); see the module docstring for what the others can cost.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: auth.Secret | None = None,
                 limits: StoreLimits = DEFAULT_LIMITS, backlog: int = 1024) -> None:
        self.host = host
        self.secret = secret if secret is not None else auth.for_host(host)
        self.limits = limits
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, list[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._conns: dict[socket.socket, _Conn] = {}
        self._pending: auth.Pending[_Conn] = auth.Pending()
        self._served: list[ClientStats] = []  # every authenticated client's, closed ones too
        self._listener = self._bind(host, port, backlog)
        self.port: int = self._listener.getsockname()[1]
        self._refused = auth.Refusals(f"store {host}:{self.port}")
        self._unproven = 0  # connections dropped for want of the secret (REFUSED_KEY) ...
        self._unproven_from: list[str] = []  # ... and the first addresses they came from
        self._accept_resume: float | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = False
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        thread = threading.Thread(target=self._serve, name=f"tensorwire-store:{self.port}", daemon=True)
        start_thread(thread, f"the TCP store on port {self.port}")
        self._thread = thread

    @staticmethod
    def _bind(host: str, port: int, backlog: int) -> socket.socket:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise RendezvousError(
                f"cannot host the TCP store: host name {host!r} does not resolve ({exc})") from exc
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # SO_REUSEADDR only skips TIME_WAIT leftovers on Linux; a live listener still conflicts.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise RendezvousError(
                    f"port {port} on {host} is already in use (another job, or a process of an earlier "
                    f"run still alive?); choose another MASTER_PORT or use port 0 for a free one") from exc
            if exc.errno == errno.EADDRNOTAVAIL:
                raise RendezvousError(
                    f"cannot host the TCP store on {host}:{port}: {addr[0]} is not an address of this "
                    f"machine ({socket.gethostname()}); rank 0 must run on MASTER_ADDR") from exc
            raise RendezvousError(f"cannot host the TCP store on {host}:{port}: {exc}") from exc
        sock.setblocking(False)
        return sock

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connections(self) -> tuple[int, int]:
        """(clients connected, of which not authenticated yet): for tests and diagnostics."""
        return len(self._conns), len(self._pending)

    @property
    def served(self) -> list[ClientStats]:
        """Per authenticated client (closed ones included): the requests it made and the bytes
        of its frames each way; what a job's bootstrap costs (docs/topology.md, Wiring)."""
        return list(self._served)

    def close(self) -> None:
        """Stop serving and drop every client connection; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def __enter__(self) -> TCPStoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- event loop ---------------------------------------------------------------------------

    def _next_timeout(self) -> float | None:
        times = [self._deadlines[0][0]] if self._deadlines else []
        oldest = self._pending.oldest()
        if oldest is not None:
            times.append(oldest.deadline)
        if self._accept_resume is not None:
            times.append(self._accept_resume)
        if not times:
            return None
        return min(max(0.0, min(times) - time.monotonic()), 3600.0)

    def _serve(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._sel.select(self._next_timeout()):
                    sock = key.fileobj
                    if sock is self._listener:
                        self._accept()
                    elif sock is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        conn = self._conns.get(sock)  # type: ignore[call-overload]  # sockets only
                        if conn is None:
                            continue
                        if mask & selectors.EVENT_READ:
                            self._on_readable(conn)
                        if mask & selectors.EVENT_WRITE and not conn.closed:
                            self._flush(conn)
                self._expire()
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn)
            self._sel.close()
            for s in (self._listener, self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self) -> None:
        bound = pending_bound(self.limits.auth_pending)
        for _ in range(auth.ACCEPT_BATCH):  # then the ready sockets, before the next batch
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # The connection stays in the backlog; rest rather than spin on it.
                    self._refused("(not accepted)", f"{exc.strerror}: the process's descriptor limit "
                                  f"(ulimit -n) or the system's is reached")
                    self._sel.unregister(self._listener)
                    self._accept_resume = time.monotonic() + _ACCEPT_RETRY_S
                return
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            if len(self._conns) >= self.limits.max_connections:
                self._refused(peer, f"{len(self._conns)} connections open "
                              f"(TENSORWIRE_STORE_MAX_CONNECTIONS)")
                sock.close()
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handshake = auth.Responder(self.secret.key, PURPOSE, MAGIC, 0)
            conn = _Conn(sock, peer, handshake, time.monotonic() + self.limits.auth_timeout)
            self._conns[sock] = conn
            self._pending.add(conn, handshake)
            self._sel.register(sock, selectors.EVENT_READ)
            self._on_readable(conn)  # a client's first message is often there already
            if conn.closed:  # (a flood's connection is often closed already)
                continue
            surplus = self._pending.surplus(bound, conn)
            if surplus is not None:
                self._refused(surplus[0].peer, surplus[1])
                self._drop(surplus[0])

    def _on_readable(self, conn: _Conn) -> None:
        while conn.handshake is not None:  # one message at a time, as far as has arrived
            chunk = self._recv(conn, conn.handshake.need)
            if not chunk:
                return
            try:
                answer = conn.handshake.feed(chunk)
            except auth.HandshakeFailed as exc:
                if isinstance(exc, auth.WrongSecret):
                    self._count_unproven(conn)
                self._refused(conn.peer, str(exc))
                self._drop(conn)
                return
            if conn.handshake.done:
                conn.handshake = None
                self._pending.discard(conn)
                self._served.append(conn.stats)
            self._send(conn, answer)
            if conn.handshake is None:
                return
        chunk = self._recv(conn, 1 << 20)
        if not chunk:
            return
        conn.inbuf += chunk
        while not conn.closed:
            if len(conn.inbuf) < LEN.size:
                return
            (n,) = LEN.unpack_from(conn.inbuf, 0)
            if n > self.limits.max_frame:
                self._refused(conn.peer, f"a frame of {n} bytes, more than the largest value allows "
                              f"({self.limits.max_value} bytes: TENSORWIRE_STORE_MAX_VALUE)")
                self._drop(conn)
                return
            if len(conn.inbuf) < LEN.size + n:
                return
            body = bytes(conn.inbuf[LEN.size:LEN.size + n])
            del conn.inbuf[:LEN.size + n]
            conn.stats.bytes_in += LEN.size + n
            self._handle(conn, body)

    def _recv(self, conn: _Conn, n: int) -> bytes:
        """Up to `n` bytes of `conn`; b"" where none are there yet, or it is closed (then dropped)."""
        try:
            chunk = conn.sock.recv(n)
        except (BlockingIOError, InterruptedError):
            return b""
        except OSError:
            chunk = b""
        if not chunk:
            if conn.handshake is not None:
                self._hung_up(conn, conn.handshake.progress)
            self._drop(conn)
        return chunk

    def _hung_up(self, conn: _Conn, progress: int) -> None:
        """Log an unauthenticated client that closed its connection, and how far it got. One
        that hangs up once it has the challenge is what a process with another secret does (it
        cannot check the store's proof)."""
        if progress < 2:
            self._refused(conn.peer, f"hung up during the handshake: it {auth.NOT_YET[progress]}")
            return
        self._count_unproven(conn)
        self._refused(conn.peer, "hung up after the store's challenge without proving the job's secret "
                      "(as a process with another secret does)")

    def _count_unproven(self, conn: _Conn) -> None:
        """Note in REFUSED_KEY a connection that could not prove the job's secret."""
        self._unproven += 1
        address = conn.peer.rpartition(":")[0] or conn.peer
        if address not in self._unproven_from and len(self._unproven_from) < REFUSED_ADDRESSES:
            self._unproven_from.append(address)
        self._set(REFUSED_KEY, json.dumps({"count": self._unproven, "from": self._unproven_from}).encode())

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.closed or not data:
            return
        if conn.handshake is None:
            conn.stats.bytes_out += len(data)
        was_empty = not conn.outbuf
        conn.outbuf += data
        if was_empty:
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.modify(conn.sock, events, None)

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.pop(conn.sock, None)
        self._pending.discard(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        # Its waiters are skipped lazily (conn.closed) when their key is set or they expire.

    # -- requests -----------------------------------------------------------------------------

    def _handle(self, conn: _Conn, body: bytes) -> None:
        try:
            op, timeout, keys, value = decode_request(body)
        except (struct.error, ValueError) as exc:
            self._refused(conn.peer, f"a malformed request ({exc})")
            self._drop(conn)
            return
        try:
            self._dispatch(conn, op, timeout, keys, value)
        except Exception as exc:  # a malformed request must not kill the server thread
            self._send(conn, reply(ST_ERROR, f"bad store request (op {op}): {exc!r}".encode()))

    def _dispatch(self, conn: _Conn, op: int, timeout: float, keys: list[str], value: bytes) -> None:
        if op not in OPS:
            self._send(conn, reply(ST_ERROR, f"unknown store operation {op}".encode()))
            return
        name = OP_NAMES[op]
        conn.stats.requests[name] = conn.stats.requests.get(name, 0) + 1
        if op == OP_SET:
            if len(value) > self.limits.max_value:
                raise ValueError(f"a value of {len(value)} bytes, more than TENSORWIRE_STORE_MAX_VALUE "
                                 f"({self.limits.max_value}) allows")
            self._set(keys[0], value)
            self._send(conn, reply(ST_OK))
        elif op == OP_ADD:
            key = keys[0]
            (amount,) = I64.unpack(value)
            old = self._data.get(key, b"0")
            try:
                new = int(old) + amount
            except ValueError:
                self._send(conn, reply(ST_ERROR, (
                    f"add({key!r}, {amount}): the key holds {old[:40]!r}, not an integer counter").encode()))
                return
            self._set(key, str(new).encode())
            self._send(conn, reply(ST_OK, I64.pack(new)))
        elif op == OP_CHECK:
            self._send(conn, reply(ST_OK, b"\x01" if all(k in self._data for k in keys) else b"\x00"))
        elif op == OP_DELETE:
            existed = self._data.pop(keys[0], None) is not None
            self._send(conn, reply(ST_OK, b"\x01" if existed else b"\x00"))
        else:  # GET, WAIT or MULTI_GET
            missing = {k for k in keys if k not in self._data}
            if not missing:
                self._send(conn, self._answer(op, keys))
                return
            if EXITED_KEY in self._data:
                self._send(conn, reply(ST_EXITED, self._data[EXITED_KEY]))
                return
            w = _Waiter(conn, op, keys, missing, time.monotonic() + timeout)
            for k in missing:
                self._waiters.setdefault(k, []).append(w)
            heapq.heappush(self._deadlines, (w.deadline, next(self._seq), w))

    def _set(self, key: str, value: bytes) -> None:
        if key == EXITED_KEY:
            self._exited(value)
            return
        self._data[key] = value
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return
        for w in waiters:
            if w.done or w.conn.closed:
                continue
            w.missing.discard(key)
            if not w.missing:
                w.done = True
                self._send(w.conn, self._answer(w.op, w.keys))

    def _exited(self, value: bytes) -> None:
        """A rank has exited (the first report is kept): every blocked read ends now."""
        value = self._data.setdefault(EXITED_KEY, value)
        waiters = {id(w): w for lst in self._waiters.values() for w in lst}
        self._waiters.clear()
        for w in waiters.values():
            if not (w.done or w.conn.closed):
                w.done = True
                self._send(w.conn, reply(ST_EXITED, value))

    def _answer(self, op: int, keys: list[str]) -> bytes:
        """The reply to a GET, WAIT or MULTI_GET whose keys are all set."""
        if op == OP_WAIT:
            return reply(ST_OK)
        if op == OP_GET:
            return reply(ST_OK, self._data.get(keys[0], b""))
        payload = pack_values(self._data.get(k, b"") for k in keys)
        if len(payload) > self.limits.max_value:
            return reply(ST_ERROR, f"multi_get of {len(keys)} keys: {len(payload)} bytes, more than "
                                     f"TENSORWIRE_STORE_MAX_VALUE ({self.limits.max_value}) allows".encode())
        return reply(ST_OK, payload)

    def _expire(self) -> None:
        now = time.monotonic()
        while (conn := self._pending.oldest()) is not None and conn.deadline <= now:
            self._refused(conn.peer, f"did not authenticate within {self.limits.auth_timeout:g} s "
                          f"(TENSORWIRE_AUTH_TIMEOUT)")
            self._drop(conn)
        if self._accept_resume is not None and self._accept_resume <= now:
            self._accept_resume = None
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, w = heapq.heappop(self._deadlines)
            if w.done:
                continue
            w.done = True
            for k in w.missing:
                lst = self._waiters.get(k)
                if lst is not None:
                    with contextlib.suppress(ValueError):
                        lst.remove(w)
                    if not lst:
                        del self._waiters[k]
            if not w.conn.closed:
                self._send(w.conn, reply(ST_TIMEOUT, "\n".join(sorted(w.missing)).encode()))
