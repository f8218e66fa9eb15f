"""Key-value stores through which the ranks of a job find each other.

A store only bootstraps: ranks publish their addresses and counters, then talk directly. So the
stores favour clear failures over speed: every blocking call has a deadline, and every error
names the key, the endpoint and how long was waited.

The TCP protocol (version 2) is deliberately tiny. A connection opens with the job's
handshake (`tensorwire.auth`: both sides prove they know the job's secret; magic
``TWSTORE2``, empty hello), then every message is a frame ``u32 length | body`` (big endian).
A request body is ``u8 op | f64 timeout_s | u16 nkeys | (u16 len | utf-8 key) * nkeys | value``;
a reply body is ``u8 status | payload``. Blocking requests carry their own deadline, so the
server answers ``TIMEOUT`` itself and the stream never desynchronises on a slow key.

What a stranger can make the server hold is bounded (`StoreLimits`): until it has
authenticated, a connection is read no further than the handshake's next message, dropped
after `auth_timeout`, and at most `auth_pending` such connections are kept (a new one drops
the oldest); a frame longer than the largest value allows closes its connection unread.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import hashlib
import heapq
import itertools
import os
import selectors
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .. import auth, log
from ..config import AUTH_TIMEOUT_S, STORE_MAX_VALUE, Config
from ..errors import AuthenticationError, InvalidArgumentError, RendezvousError, TensorwireError, TimeoutError

DEFAULT_STORE_TIMEOUT_S = 300.0

_MAGIC = b"TWSTORE2"
_PURPOSE = b"tensorwire store v2"
_LEN = struct.Struct(">I")
_REQ_HEAD = struct.Struct(">BdH")
_U16 = struct.Struct(">H")
_I64 = struct.Struct(">q")
_KEYS_ROOM = 1 << 20
"""Room in a frame beyond its value: the request header and its keys."""
_log = log.get("AUTH")

# Request operations.
_OP_SET = 1
_OP_GET = 2
_OP_ADD = 3
_OP_WAIT = 4
_OP_CHECK = 5
_OP_DELETE = 6
_OP_MULTI_GET = 7
_OPS = frozenset(range(1, 8))
_OP_NAMES = {_OP_SET: "set", _OP_GET: "get", _OP_ADD: "add", _OP_WAIT: "wait", _OP_CHECK: "check",
             _OP_DELETE: "delete", _OP_MULTI_GET: "multi_get"}
# Reply statuses.
_ST_OK = 0
_ST_TIMEOUT = 1
_ST_ERROR = 2

# How much longer than the server-side deadline a client waits on its socket before it
# decides the server (or the network to it) is gone.
_SOCKET_GRACE_S = 10.0


@dataclass(frozen=True)
class StoreLimits:
    """What one store connection may make a process hold (TENSORWIRE_* settings in config.py)."""

    max_value: int = STORE_MAX_VALUE
    max_connections: int = 4096
    auth_timeout: float = AUTH_TIMEOUT_S
    auth_pending: int = 64

    @classmethod
    def from_config(cls, cfg: Config) -> StoreLimits:
        return cls(cfg.store_max_value, cfg.store_max_connections, cfg.auth_timeout, cfg.auth_pending)

    @property
    def max_frame(self) -> int:
        return self.max_value + _KEYS_ROOM


DEFAULT_LIMITS = StoreLimits()


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"store keys must be non-empty str, got {key!r}")
    return key


def _check_value(key: str, value: bytes) -> bytes:
    if isinstance(value, str):
        raise InvalidArgumentError(f"store value for key {key!r} must be bytes, got str (encode it first)")
    try:
        return bytes(value)
    except TypeError as exc:
        raise InvalidArgumentError(
            f"store value for key {key!r} must be bytes, got {type(value).__name__}") from exc


class Store(abc.ABC):
    """A job-wide key-value store: bytes values, atomic counters, blocking reads with deadlines."""

    def __init__(self, default_timeout: float = DEFAULT_STORE_TIMEOUT_S) -> None:
        if default_timeout <= 0:
            raise InvalidArgumentError(f"store timeout must be positive, got {default_timeout}")
        self.default_timeout = float(default_timeout)

    def _timeout(self, timeout: float | None) -> float:
        t = self.default_timeout if timeout is None else float(timeout)
        if t < 0 or t != t:
            raise InvalidArgumentError(f"store timeout must be >= 0 seconds, got {timeout}")
        return t

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Publish `value` under `key`, replacing any previous value and waking its waiters."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of `key`, waiting for it to be set; TimeoutError after `timeout` s."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the counter `key` (0 if absent) and return the new value.

        The counter is stored as ASCII decimal, so `get` of the same key reads e.g. b'3'.
        """

    @abc.abstractmethod
    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Block until every key exists; TimeoutError naming the missing ones otherwise."""

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """The values of `keys`, waiting until every one is set (TimeoutError naming the missing
        ones otherwise). One request where the store can (TCPStore, torch's): a job's bootstrap
        costs each rank a fixed number of requests, not one per peer."""
        self.wait(keys, timeout)
        return [self.get(k, 0.0) for k in keys]

    @abc.abstractmethod
    def check(self, keys: list[str]) -> bool:
        """Whether all `keys` exist right now (never blocks)."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> bool:
        """Remove `key`; returns whether it existed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and files; the store is unusable afterwards."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Wire helpers


def _encode_request(op: int, keys: Iterable[str], value: bytes = b"", timeout: float = 0.0,
                    limits: StoreLimits = DEFAULT_LIMITS) -> bytes:
    parts = []
    nkeys = 0
    for k in keys:
        raw = k.encode()
        if len(raw) > 0xFFFF:
            raise InvalidArgumentError(
                f"store key is too long ({len(raw)} bytes, at most 65535): {k[:60]!r}...")
        parts.append(_U16.pack(len(raw)) + raw)
        nkeys += 1
    if len(value) > limits.max_value:
        raise InvalidArgumentError(
            f"store value of {len(value)} bytes is larger than the store allows "
            f"({limits.max_value} bytes: TENSORWIRE_STORE_MAX_VALUE)")
    body = _REQ_HEAD.pack(op, timeout, nkeys) + b"".join(parts) + value
    if len(body) > limits.max_frame:
        raise InvalidArgumentError(f"store request of {len(body)} bytes: its keys take more than the "
                                   f"{_KEYS_ROOM} bytes a request allows them")
    return _LEN.pack(len(body)) + body


def _decode_request(body: bytes) -> tuple[int, float, list[str], bytes]:
    """Raises ValueError (struct.error, UnicodeDecodeError among them) on a malformed body."""
    op, timeout, nkeys = _REQ_HEAD.unpack_from(body, 0)
    if not timeout >= 0:  # NaN too
        raise ValueError(f"timeout {timeout}")
    pos = _REQ_HEAD.size
    keys = []
    for _ in range(nkeys):
        (n,) = _U16.unpack_from(body, pos)
        pos += _U16.size
        if pos + n > len(body):
            raise ValueError("a key runs past the end of the request")
        keys.append(body[pos:pos + n].decode())
        pos += n
    return op, timeout, keys, body[pos:]


def _reply(status: int, payload: bytes = b"") -> bytes:
    return _LEN.pack(1 + len(payload)) + bytes([status]) + payload


def _pack_values(values: Iterable[bytes]) -> bytes:
    """A multi_get's payload: each value with its length (u32, big endian)."""
    return b"".join(_LEN.pack(len(v)) + v for v in values)


def _unpack_values(payload: bytes, n: int) -> list[bytes]:
    out, pos = [], 0
    for _ in range(n):
        (size,) = _LEN.unpack_from(payload, pos)
        pos += _LEN.size
        out.append(payload[pos:pos + size])
        pos += size
    if pos != len(payload) or len(out) != n:
        raise EOFError(f"a multi_get reply of {len(payload)} bytes does not hold {n} values")
    return out


# --------------------------------------------------------------------------------------------
# Server


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
        self._pending: dict[_Conn, None] = {}  # unauthenticated, oldest first
        self._served: list[ClientStats] = []  # every authenticated client's, closed ones too
        self._listener = self._bind(host, port, backlog)
        self.port: int = self._listener.getsockname()[1]
        self._refused = auth.Refusals(f"store {host}:{self.port}")
        self._accept_resume: float | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = False
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._serve, name=f"tensorwire-store:{self.port}", daemon=True)
        self._thread.start()

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
        if self._pending:
            times.append(next(iter(self._pending)).deadline)
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
                        conn = self._conns.get(sock)  # type: ignore[arg-type]
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
        while True:
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
            if len(self._pending) >= self.limits.auth_pending:
                oldest = next(iter(self._pending))
                self._refused(oldest.peer, f"still unauthenticated when {self.limits.auth_pending} others "
                              f"were waiting (TENSORWIRE_AUTH_PENDING)")
                self._drop(oldest)
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handshake = auth.Responder(self.secret.key, _PURPOSE, _MAGIC, 0)
            conn = _Conn(sock, peer, handshake, time.monotonic() + self.limits.auth_timeout)
            self._conns[sock] = conn
            self._pending[conn] = None
            self._sel.register(sock, selectors.EVENT_READ, None)

    def _on_readable(self, conn: _Conn) -> None:
        want = conn.handshake.need if conn.handshake is not None else 1 << 20
        try:
            chunk = conn.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        if conn.handshake is not None:
            try:
                answer = conn.handshake.feed(chunk)
            except auth.HandshakeFailed as exc:
                self._refused(conn.peer, str(exc))
                self._drop(conn)
                return
            if conn.handshake.done:
                conn.handshake = None
                self._pending.pop(conn, None)
                self._served.append(conn.stats)
            self._send(conn, answer)
            return
        conn.inbuf += chunk
        while not conn.closed:
            if len(conn.inbuf) < _LEN.size:
                return
            (n,) = _LEN.unpack_from(conn.inbuf, 0)
            if n > self.limits.max_frame:
                self._refused(conn.peer, f"a frame of {n} bytes, more than the largest value allows "
                              f"({self.limits.max_value} bytes: TENSORWIRE_STORE_MAX_VALUE)")
                self._drop(conn)
                return
            if len(conn.inbuf) < _LEN.size + n:
                return
            body = bytes(conn.inbuf[_LEN.size:_LEN.size + n])
            del conn.inbuf[:_LEN.size + n]
            conn.stats.bytes_in += _LEN.size + n
            self._handle(conn, body)

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
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        # Its waiters are skipped lazily (conn.closed) when their key is set or they expire.

    # -- requests -----------------------------------------------------------------------------

    def _handle(self, conn: _Conn, body: bytes) -> None:
        try:
            op, timeout, keys, value = _decode_request(body)
        except (struct.error, ValueError) as exc:
            self._refused(conn.peer, f"a malformed request ({exc})")
            self._drop(conn)
            return
        try:
            self._dispatch(conn, op, timeout, keys, value)
        except Exception as exc:  # a malformed request must not kill the server thread
            self._send(conn, _reply(_ST_ERROR, f"bad store request (op {op}): {exc!r}".encode()))

    def _dispatch(self, conn: _Conn, op: int, timeout: float, keys: list[str], value: bytes) -> None:
        if op not in _OPS:
            self._send(conn, _reply(_ST_ERROR, f"unknown store operation {op}".encode()))
            return
        name = _OP_NAMES[op]
        conn.stats.requests[name] = conn.stats.requests.get(name, 0) + 1
        if op == _OP_SET:
            if len(value) > self.limits.max_value:
                raise ValueError(f"a value of {len(value)} bytes, more than TENSORWIRE_STORE_MAX_VALUE "
                                 f"({self.limits.max_value}) allows")
            self._set(keys[0], value)
            self._send(conn, _reply(_ST_OK))
        elif op == _OP_ADD:
            key = keys[0]
            (amount,) = _I64.unpack(value)
            old = self._data.get(key, b"0")
            try:
                new = int(old) + amount
            except ValueError:
                self._send(conn, _reply(_ST_ERROR, (
                    f"add({key!r}, {amount}): the key holds {old[:40]!r}, not an integer counter").encode()))
                return
            self._set(key, str(new).encode())
            self._send(conn, _reply(_ST_OK, _I64.pack(new)))
        elif op == _OP_CHECK:
            self._send(conn, _reply(_ST_OK, b"\x01" if all(k in self._data for k in keys) else b"\x00"))
        elif op == _OP_DELETE:
            existed = self._data.pop(keys[0], None) is not None
            self._send(conn, _reply(_ST_OK, b"\x01" if existed else b"\x00"))
        else:  # GET, WAIT or MULTI_GET
            missing = {k for k in keys if k not in self._data}
            if not missing:
                self._send(conn, self._answer(op, keys))
                return
            w = _Waiter(conn, op, keys, missing, time.monotonic() + timeout)
            for k in missing:
                self._waiters.setdefault(k, []).append(w)
            heapq.heappush(self._deadlines, (w.deadline, next(self._seq), w))

    def _set(self, key: str, value: bytes) -> None:
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

    def _answer(self, op: int, keys: list[str]) -> bytes:
        """The reply to a GET, WAIT or MULTI_GET whose keys are all set."""
        if op == _OP_WAIT:
            return _reply(_ST_OK)
        if op == _OP_GET:
            return _reply(_ST_OK, self._data.get(keys[0], b""))
        payload = _pack_values(self._data.get(k, b"") for k in keys)
        if len(payload) > self.limits.max_value:
            return _reply(_ST_ERROR, f"multi_get of {len(keys)} keys: {len(payload)} bytes, more than "
                                     f"TENSORWIRE_STORE_MAX_VALUE ({self.limits.max_value}) allows".encode())
        return _reply(_ST_OK, payload)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending and next(iter(self._pending)).deadline <= now:
            conn = next(iter(self._pending))
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
                self._send(w.conn, _reply(_ST_TIMEOUT, "\n".join(sorted(w.missing)).encode()))


# --------------------------------------------------------------------------------------------
# TCP client


class TCPStore(Store):
    """Client of a `TCPStoreServer`, optionally hosting that server in this process.

    One socket, one request at a time under a lock: store traffic is rare and small, and a
    strict request/reply stream keeps failure handling simple (any socket error poisons the
    client, and every later call says why).
    """

    def __init__(self, host: str, port: int, *, timeout: float = DEFAULT_STORE_TIMEOUT_S,
                 server: bool = False, secret: auth.Secret | None = None,
                 limits: StoreLimits = DEFAULT_LIMITS) -> None:
        """`secret`: the job's (default: `auth.for_host(host)`); `limits` bound what the
        server hosted here holds and the replies this client accepts."""
        super().__init__(timeout)
        self.host = host
        self.secret = secret if secret is not None else auth.for_host(host)
        self.limits = limits
        self._server: TCPStoreServer | None = (
            TCPStoreServer(host, port, secret=self.secret, limits=limits) if server else None)
        self.port: int = self._server.port if self._server is not None else int(port)
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._closed = False
        try:
            self._sock = self._connect(self.default_timeout)
        except BaseException:
            if self._server is not None:
                self._server.close()
            raise

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def server(self) -> TCPStoreServer | None:
        """The server hosted by this client, if it hosts one."""
        return self._server

    def _connect(self, timeout: float) -> socket.socket:
        start = time.monotonic()
        deadline = start + timeout
        delay = 0.01
        last: BaseException | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            sock: socket.socket | None = None
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(remaining, 5.0))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(min(max(deadline - time.monotonic(), 0.1), self.limits.auth_timeout))
                auth.initiate(sock, self.secret.key, _PURPOSE, _MAGIC, b"")
                sock.settimeout(None)
                return sock
            except auth.NotTensorwire as exc:
                sock.close()
                raise RendezvousError(
                    f"{self.address} answered, but not as a tensorwire store (wrong protocol)") from exc
            except auth.WrongSecret as exc:
                sock.close()
                raise AuthenticationError(
                    f"the TCP store at {self.address} could not prove that it knows this job's secret "
                    f"(this process's: {self.secret.source}): the store's host and every rank need the "
                    f"same {auth.ENV_SECRET} or {auth.ENV_SECRET_FILE}; see docs/security.md") from exc
            except RendezvousError:
                if sock is not None:
                    sock.close()
                raise
            except (OSError, ConnectionError, EOFError, auth.HandshakeFailed) as exc:
                last = exc  # hung up mid-handshake (busy, or our proof refused): try again
                if sock is not None:
                    sock.close()
            if isinstance(last, socket.gaierror):
                break  # a name that does not resolve will not start resolving by itself
            time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
            delay = min(delay * 2, 0.5)
        waited = time.monotonic() - start
        raise RendezvousError(
            f"could not connect to the TCP store at {self.address} after trying for {waited:.1f} s "
            f"(last error: {last}); is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?")

    @staticmethod
    def _recv_exact(sock: socket.socket, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            r = sock.recv_into(view[got:], n - got)
            if r == 0:
                raise EOFError("the store server closed the connection")
            got += r
        return bytes(buf)

    def _read_reply(self, sock: socket.socket) -> tuple[int, bytes]:
        (n,) = _LEN.unpack(self._recv_exact(sock, _LEN.size))
        if not 0 < n <= self.limits.max_frame:
            raise EOFError(f"the store sent a reply of {n} bytes (at most {self.limits.max_frame} expected)")
        body = self._recv_exact(sock, n)
        return body[0], body[1:]

    def _call(self, what: str, op: int, keys: list[str], value: bytes = b"",
              timeout: float = 0.0) -> tuple[int, bytes]:
        frame = _encode_request(op, keys, value, timeout, self.limits)
        with self._lock:
            if self._closed:
                raise RendezvousError(f"{what}: the store client for {self.address} is closed")
            if self._broken is not None:
                raise RendezvousError(f"{what}: the connection to the TCP store at {self.address} "
                                      f"was lost earlier ({self._broken})")
            # The server answers blocking requests itself at their deadline; silence beyond
            # that (plus a grace) means the server or the path to it is gone.
            if op in (_OP_GET, _OP_WAIT, _OP_MULTI_GET):
                sock_timeout: float | None = timeout + _SOCKET_GRACE_S
            else:
                sock_timeout = self.default_timeout
            if sock_timeout == float("inf"):
                sock_timeout = None
            try:
                self._sock.settimeout(sock_timeout)
                self._sock.sendall(frame)
                return self._read_reply(self._sock)
            except (OSError, EOFError) as exc:
                reason = (f"no reply within {sock_timeout:.1f} s"
                          if isinstance(exc, socket.timeout) else str(exc) or type(exc).__name__)
                self._broken = reason
                with contextlib.suppress(OSError):
                    self._sock.close()
                raise RendezvousError(f"{what}: lost the TCP store at {self.address}: {reason}; "
                                      f"did rank 0 (the store host) exit or crash?") from exc

    def _raise_error(self, what: str, payload: bytes) -> None:
        detail = payload.decode(errors="replace")
        raise InvalidArgumentError(f"{what} failed on the store at {self.address}: {detail}")

    def set(self, key: str, value: bytes) -> None:
        _check_key(key)
        status, payload = self._call(f"set({key!r})", _OP_SET, [key], _check_value(key, value))
        if status != _ST_OK:
            self._raise_error(f"set({key!r})", payload)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        _check_key(key)
        t = self._timeout(timeout)
        status, payload = self._call(f"get({key!r})", _OP_GET, [key], timeout=t)
        if status == _ST_TIMEOUT:
            raise TimeoutError(f"store get({key!r}) timed out after {t:g} s waiting for the key to be set "
                               f"(TCP store at {self.address})")
        if status != _ST_OK:
            self._raise_error(f"get({key!r})", payload)
        return payload

    def add(self, key: str, amount: int) -> int:
        _check_key(key)
        status, payload = self._call(f"add({key!r})", _OP_ADD, [key], _I64.pack(int(amount)))
        if status != _ST_OK:
            self._raise_error(f"add({key!r}, {amount})", payload)
        return _I64.unpack(payload)[0]

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        keys = [_check_key(k) for k in keys]
        if not keys:
            return
        t = self._timeout(timeout)
        status, payload = self._call(f"wait({keys!r})", _OP_WAIT, keys, timeout=t)
        if status == _ST_TIMEOUT:
            missing = payload.decode().split("\n")
            raise TimeoutError(f"store wait timed out after {t:g} s; keys still missing: {missing} "
                               f"(TCP store at {self.address})")
        if status != _ST_OK:
            self._raise_error(f"wait({keys!r})", payload)

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        keys = [_check_key(k) for k in keys]
        if not keys:
            return []
        t = self._timeout(timeout)
        what = f"multi_get({len(keys)} keys from {keys[0]!r})"
        status, payload = self._call(what, _OP_MULTI_GET, keys, timeout=t)
        if status == _ST_TIMEOUT:
            missing = payload.decode().split("\n")
            raise TimeoutError(f"store multi_get timed out after {t:g} s; keys still missing: {missing} "
                               f"(TCP store at {self.address})")
        if status != _ST_OK:
            self._raise_error(what, payload)
        try:
            return _unpack_values(payload, len(keys))
        except (EOFError, struct.error) as exc:
            raise RendezvousError(f"{what}: the TCP store at {self.address} sent a malformed reply ({exc})") \
                from exc

    def check(self, keys: list[str]) -> bool:
        keys = [_check_key(k) for k in keys]
        status, payload = self._call(f"check({keys!r})", _OP_CHECK, keys)
        if status != _ST_OK:
            self._raise_error(f"check({keys!r})", payload)
        return payload == b"\x01"

    def delete_key(self, key: str) -> bool:
        _check_key(key)
        status, payload = self._call(f"delete_key({key!r})", _OP_DELETE, [key])
        if status != _ST_OK:
            self._raise_error(f"delete_key({key!r})", payload)
        return payload == b"\x01"

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(OSError):
                self._sock.close()
        if self._server is not None:
            self._server.close()

    def __repr__(self) -> str:
        return f"TCPStore({self.address}{', hosting' if self._server else ''})"


# --------------------------------------------------------------------------------------------
# File store


class FileStore(Store):
    """A store in a directory, for processes of one host that share no launcher-provided store.

    One file per key, written to a temporary name then renamed (readers see whole values or
    nothing); counters are updated under an `fcntl` lock. Reads poll, backing off to ~10 ms:
    there is no cross-process wakeup in the stdlib that is simpler than that.
    """

    _LOCK_NAME = ".lock"
    _USERS_KEY = "__tensorwire_users__"

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = DEFAULT_STORE_TIMEOUT_S,
                 cleanup: bool = False) -> None:
        super().__init__(timeout)
        self.path = os.fspath(path)
        self._cleanup = cleanup
        self._closed = False
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise RendezvousError(f"cannot create the file store directory {self.path}: {exc}") from exc
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise RendezvousError(f"the file store directory {self.path} is not writable by this process")
        if cleanup:
            self.add(self._USERS_KEY, 1)

    def _file(self, key: str) -> str:
        name = urllib.parse.quote(key, safe="-_.")
        if len(name) > 200 or name.startswith("."):
            name = "h_" + hashlib.sha256(key.encode()).hexdigest()
        return os.path.join(self.path, name)

    def _write(self, key: str, value: bytes) -> None:
        target = self._file(key)
        tmp = f"{os.path.join(self.path, '.tmp')}-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
        try:
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise RendezvousError(f"file store {self.path}: cannot write key {key!r}: {exc}") from exc

    def _read(self, key: str) -> bytes | None:
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RendezvousError(f"file store {self.path}: cannot read key {key!r}: {exc}") from exc

    def _poll(self, keys: list[str], timeout: float) -> list[str]:
        """Wait until no key is missing or the deadline passes; returns the keys still missing."""
        deadline = time.monotonic() + timeout
        delay = 0.0005
        missing = [k for k in keys if not os.path.exists(self._file(k))]
        while missing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return missing
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.01)
            missing = [k for k in missing if not os.path.exists(self._file(k))]
        return []

    def _ensure_open(self, what: str) -> None:
        if self._closed:
            raise RendezvousError(f"{what}: the file store {self.path} is closed")

    def set(self, key: str, value: bytes) -> None:
        self._ensure_open(f"set({key!r})")
        self._write(_check_key(key), _check_value(key, value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        self._ensure_open(f"get({key!r})")
        _check_key(key)
        t = self._timeout(timeout)
        deadline = time.monotonic() + t
        while True:
            value = self._read(key)
            if value is not None:
                return value
            if self._poll([key], max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(f"store get({key!r}) timed out after {t:g} s waiting for the key "
                                   f"to be set (file store {self.path})")

    def add(self, key: str, amount: int) -> int:
        self._ensure_open(f"add({key!r})")
        _check_key(key)
        lock_path = os.path.join(self.path, self._LOCK_NAME)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise RendezvousError(f"file store {self.path}: cannot open its lock file: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            old = self._read(key) or b"0"
            try:
                new = int(old) + int(amount)
            except ValueError:
                raise InvalidArgumentError(f"add({key!r}, {amount}) on file store {self.path}: the key holds "
                                           f"{old[:40]!r}, not an integer counter") from None
            self._write(key, str(new).encode())
            return new
        finally:
            os.close(fd)  # closing releases the flock

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        self._ensure_open(f"wait({keys!r})")
        keys = [_check_key(k) for k in keys]
        t = self._timeout(timeout)
        missing = self._poll(keys, t)
        if missing:
            raise TimeoutError(f"store wait timed out after {t:g} s; keys still missing: {missing} "
                               f"(file store {self.path})")

    def check(self, keys: list[str]) -> bool:
        self._ensure_open(f"check({keys!r})")
        return all(os.path.exists(self._file(_check_key(k))) for k in keys)

    def delete_key(self, key: str) -> bool:
        self._ensure_open(f"delete_key({key!r})")
        try:
            os.unlink(self._file(_check_key(key)))
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        """Close; with cleanup=True the last of the processes that opened the directory removes it."""
        if self._closed:
            return
        if self._cleanup:
            with contextlib.suppress(TensorwireError, OSError):
                if self.add(self._USERS_KEY, -1) <= 0:
                    for name in os.listdir(self.path):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(self.path, name))
                    with contextlib.suppress(OSError):
                        os.rmdir(self.path)
        self._closed = True

    def __repr__(self) -> str:
        return f"FileStore({self.path!r})"


# --------------------------------------------------------------------------------------------
# Prefix view


class PrefixStore(Store):
    """A namespace inside another store, so groups and subsystems cannot collide on key names.

    Closing a prefix view closes the inner store only where the view owns it (`owns`: the view
    is its only user); otherwise many views share one connection.
    """

    def __init__(self, prefix: str, inner: Store, *, owns: bool = False) -> None:
        super().__init__(inner.default_timeout)
        if not prefix:
            raise InvalidArgumentError("PrefixStore needs a non-empty prefix")
        self.prefix = prefix
        self.inner = inner
        self.owns = owns

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{_check_key(key)}"

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.inner.get(self._k(key), timeout)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self._k(key), amount)

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        self.inner.wait([self._k(k) for k in keys], timeout)

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        return self.inner.multi_get([self._k(k) for k in keys], timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check([self._k(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self._k(key))

    def close(self) -> None:
        if self.owns:
            self.inner.close()

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.inner!r})"


# --------------------------------------------------------------------------------------------
# torch.distributed adapter


class TorchStoreAdapter(Store):
    """Our Store API over a `torch.distributed.Store`, for torchrun's agent store or a store
    torch hands to our process-group backend. torch is imported only here, only when used."""

    def __init__(self, torch_store: Any, *, timeout: float | None = None) -> None:
        if timeout is None:
            t = getattr(torch_store, "timeout", None)
            seconds = t.total_seconds() if t is not None else 0.0
            timeout = seconds if seconds > 0 else DEFAULT_STORE_TIMEOUT_S
        super().__init__(timeout)
        self.torch_store = torch_store

    @staticmethod
    def _td(seconds: float) -> Any:
        from datetime import timedelta
        return timedelta(seconds=seconds)

    def _translate(self, what: str, exc: BaseException, timeout: float | None = None) -> TensorwireError:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "timeout" in text.lower() or "timed out" in text.lower() or type(exc).__name__ == "DistStoreError":
            waited = f" after {timeout:g} s" if timeout is not None else ""
            return TimeoutError(f"store {what} timed out{waited} (torch store: {text})")
        return RendezvousError(f"store {what} failed on the torch store: {text}")

    def set(self, key: str, value: bytes) -> None:
        _check_key(key)
        value = _check_value(key, value)
        try:
            self.torch_store.set(key, value)
        except RuntimeError as exc:
            raise self._translate(f"set({key!r})", exc) from exc

    def get(self, key: str, timeout: float | None = None) -> bytes:
        _check_key(key)
        t = self._timeout(timeout)
        try:
            # torch's get() uses the store-wide timeout; waiting first applies ours.
            self.torch_store.wait([key], self._td(t))
            return bytes(self.torch_store.get(key))
        except RuntimeError as exc:
            raise self._translate(f"get({key!r})", exc, t) from exc

    def add(self, key: str, amount: int) -> int:
        _check_key(key)
        try:
            return int(self.torch_store.add(key, int(amount)))
        except RuntimeError as exc:
            raise self._translate(f"add({key!r})", exc) from exc

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        keys = [_check_key(k) for k in keys]
        t = self._timeout(timeout)
        try:
            self.torch_store.wait(keys, self._td(t))
        except RuntimeError as exc:
            raise self._translate(f"wait({keys!r})", exc, t) from exc

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        if not keys:
            return []
        self.wait(keys, timeout)
        try:
            return [bytes(v) for v in self.torch_store.multi_get(keys)]
        except RuntimeError as exc:
            raise self._translate(f"multi_get({len(keys)} keys)", exc) from exc

    def check(self, keys: list[str]) -> bool:
        keys = [_check_key(k) for k in keys]
        try:
            return bool(self.torch_store.check(keys))
        except RuntimeError as exc:
            raise self._translate(f"check({keys!r})", exc) from exc

    def delete_key(self, key: str) -> bool:
        _check_key(key)
        try:
            return bool(self.torch_store.delete_key(key))
        except RuntimeError as exc:
            raise self._translate(f"delete_key({key!r})", exc) from exc

    def close(self) -> None:
        # torch stores close when garbage-collected; dropping our reference is all we can do.
        self.torch_store = None

    def __repr__(self) -> str:
        return f"TorchStoreAdapter({self.torch_store!r})"
