"""The TCP store's client, which can also host the server in its own process (rank 0)."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time

from .. import auth
from ..errors import (
    AuthenticationError,
    InvalidArgumentError,
    RendezvousError,
    StoreLostError,
    TensorwireError,
    TimeoutError,
)
from .store import DEFAULT_STORE_TIMEOUT_S, Store, check_key, check_value
from .tcp_protocol import (
    DEFAULT_LIMITS,
    I64,
    LEN,
    MAGIC,
    OP_ADD,
    OP_CHECK,
    OP_DELETE,
    OP_GET,
    OP_MULTI_GET,
    OP_SET,
    OP_WAIT,
    PURPOSE,
    REFUSED_KEY,
    ST_EXITED,
    ST_OK,
    ST_TIMEOUT,
    StoreLimits,
    encode_request,
    key_batches,
    unpack_values,
)
from .tcp_server import TCPStoreServer

# How much longer than the server-side deadline a client waits on its socket before it
# decides the server (or the network to it) is gone.
_SOCKET_GRACE_S = 10.0
_CONNECT_FIRST_S = 0.25
"""How long a first connection attempt waits for the server's answer before it dials again
(each next one 1.5 times as long, up to 5 s): a store whose accept queue a flood keeps full leaves
some attempts unanswered, which the kernel retries only after seconds."""


class TCPStore(Store):
    """Client of a `TCPStoreServer`, optionally hosting that server in this process.

    One socket, one request at a time under a lock: store traffic is rare and small, and a
    strict request/reply stream keeps failure handling simple (any socket error poisons the
    client, and every later call says why).
    """

    def __init__(self, host: str, port: int, *, timeout: float = DEFAULT_STORE_TIMEOUT_S,
                 server: bool = False, secret: auth.Secret | None = None,
                 limits: StoreLimits = DEFAULT_LIMITS, connect_within: float | None = None) -> None:
        """`secret`: the job's (default: `auth.for_host(host)`); `limits` bound what the
        server hosted here holds and the replies this client accepts; `connect_within`: how
        long to try reaching the server (default `timeout`)."""
        super().__init__(timeout)
        self.host = host
        self.secret = secret if secret is not None else auth.for_host(host)
        self.limits = limits
        self._server: TCPStoreServer | None = (
            TCPStoreServer(host, port, secret=self.secret, limits=limits) if server else None)
        self.port: int = self._server.port if self._server is not None else int(port)
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._closed_by_server = False
        self._closed = False
        try:
            self._sock = self._connect(self.default_timeout if connect_within is None else connect_within)
        except BaseException:
            if self._server is not None:
                self._server.close()
            raise

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def hosting(self) -> bool:
        return self._server is not None

    def _connect(self, timeout: float) -> socket.socket:
        start = time.monotonic()
        deadline = start + timeout
        delay, connect_s = 0.01, _CONNECT_FIRST_S
        last: BaseException | None = None
        cut = 0  # connections the server accepted, then closed before the handshake ended
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            sock: socket.socket | None = None
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(remaining, connect_s))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(min(max(deadline - time.monotonic(), 0.1), self.limits.auth_timeout))
                auth.initiate(sock, self.secret.key, PURPOSE, MAGIC, b"")
                sock.settimeout(None)
                return sock
            except auth.NotTensorwire as exc:
                if sock is not None:
                    sock.close()
                raise RendezvousError(
                    f"{self.address} answered, but not as a tensorwire store (wrong protocol)") \
                    from exc
            except auth.WrongSecret as exc:
                if sock is not None:
                    sock.close()
                raise AuthenticationError(
                    f"the TCP store at {self.address} could not prove that it knows this job's "
                    f"secret (this process's: {self.secret.source}): the store's host and every rank need "
                    f"the same {auth.ENV_SECRET} or {auth.ENV_SECRET_FILE}; see docs/security.md") from exc
            except RendezvousError:
                if sock is not None:
                    sock.close()
                raise
            except (OSError, ConnectionError, EOFError, auth.HandshakeFailed) as exc:
                last = exc  # hung up mid-handshake (busy, or our proof refused): try again
                if sock is None and isinstance(exc, socket.timeout):  # unanswered: dial again now
                    connect_s = min(1.5 * connect_s, 5.0)
                    continue
                if sock is not None:
                    cut += 1
                    sock.close()
            if isinstance(last, socket.gaierror):
                break  # a name that does not resolve will not start resolving by itself
            time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
            delay = min(delay * 2, 0.5)
        waited = time.monotonic() - start
        if cut:
            raise RendezvousError(
                f"the TCP store at {self.address} was reachable, but closed the connection or "
                f"went silent during the handshake {cut} times in {waited:.1f} s (last error: {last}): it is "
                f"overloaded (a flood of connections to its port?) or turned this process away (as many "
                f"clients as TENSORWIRE_STORE_MAX_CONNECTIONS?); its host logs what it dropped with "
                f"TENSORWIRE_DEBUG=WARN TENSORWIRE_DEBUG_SUBSYS=AUTH")
        if last is None:
            raise RendezvousError(f"could not connect to the TCP store at {self.address}: its "
                                  f"timeout of {timeout:.3g} s (TENSORWIRE_TIMEOUT or timeout=) ran out "
                                  f"before a first attempt")
        until = "" if isinstance(last, socket.gaierror) else \
            ", its whole timeout (TENSORWIRE_TIMEOUT or timeout=)"
        raise RendezvousError(
            f"could not connect to the TCP store at {self.address} after trying for "
            f"{waited:.1f} s{until} (last error: {last}); is rank 0 running, and are MASTER_ADDR/MASTER_PORT "
            f"right?")

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
        (n,) = LEN.unpack(self._recv_exact(sock, LEN.size))
        if not 0 < n <= self.limits.max_frame:
            raise EOFError(f"the store sent a reply of {n} bytes (at most {self.limits.max_frame} expected)")
        body = self._recv_exact(sock, n)
        return body[0], body[1:]

    def _call(self, what: str, op: int, keys: list[str], value: bytes = b"",
              timeout: float = 0.0) -> tuple[int, bytes]:
        frame = encode_request(op, keys, value, timeout, self.limits)
        with self._lock:
            if self._closed:
                raise RendezvousError(f"{what}: the store client for {self.address} is closed")
            if self._broken is not None:
                raise StoreLostError(f"{what}: the connection to the TCP store at {self.address} "
                                     f"was lost earlier ({self._broken})", self._closed_by_server)
            # The server answers blocking requests itself at their deadline; silence beyond
            # that (plus a grace) means the server or the path to it is gone.
            limit = timeout + _SOCKET_GRACE_S if op in (OP_GET, OP_WAIT, OP_MULTI_GET) \
                else self.default_timeout
            try:  # None: forever, or past what a socket can time
                self._sock.settimeout(None if limit >= threading.TIMEOUT_MAX else limit)
                self._sock.sendall(frame)
                return self._read_reply(self._sock)
            except (OSError, EOFError) as exc:
                reason = (f"no reply within {limit:.1f} s"
                          if isinstance(exc, socket.timeout) else str(exc) or type(exc).__name__)
                self._broken = reason
                self._closed_by_server = isinstance(exc, (EOFError, ConnectionResetError, BrokenPipeError))
                with contextlib.suppress(OSError):
                    self._sock.close()
                raise StoreLostError(f"{what}: lost the TCP store at {self.address}: {reason}; did rank 0 "
                                     f"(the store host) exit or crash?", self._closed_by_server) from exc

    def _raise_error(self, what: str, status: int, payload: bytes) -> None:
        detail = payload.decode(errors="replace")
        if status == ST_EXITED:
            raise RendezvousError(f"{what} on the store at {self.address} cannot complete: {detail}")
        raise InvalidArgumentError(f"{what} failed on the store at {self.address}: {detail}")

    def set(self, key: str, value: bytes) -> None:
        check_key(key)
        status, payload = self._call(f"set({key!r})", OP_SET, [key], check_value(key, value))
        if status != ST_OK:
            self._raise_error(f"set({key!r})", status, payload)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        check_key(key)
        t = self._timeout(timeout)
        status, payload = self._call(f"get({key!r})", OP_GET, [key], timeout=t)
        if status == ST_TIMEOUT:
            raise TimeoutError(f"store get({key!r}) timed out after {t:g} s waiting for the key to be set "
                               f"(TCP store at {self.address})")
        if status != ST_OK:
            self._raise_error(f"get({key!r})", status, payload)
        return payload

    def add(self, key: str, amount: int) -> int:
        check_key(key)
        status, payload = self._call(f"add({key!r})", OP_ADD, [key], I64.pack(int(amount)))
        if status != ST_OK:
            self._raise_error(f"add({key!r}, {amount})", status, payload)
        return I64.unpack(payload)[0]

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        keys = [check_key(k) for k in keys]
        if not keys:
            return
        t = self._timeout(timeout)
        status, payload = self._call(f"wait({keys!r})", OP_WAIT, keys, timeout=t)
        if status == ST_TIMEOUT:
            missing = payload.decode().split("\n")
            raise TimeoutError(f"store wait timed out after {t:g} s; keys still missing: {missing} "
                               f"(TCP store at {self.address})")
        if status != ST_OK:
            self._raise_error(f"wait({keys!r})", status, payload)

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        keys = [check_key(k) for k in keys]
        if not keys:
            return []
        t = self._timeout(timeout)
        batches = key_batches(keys)
        if len(batches) > 1:  # more keys than one request carries (a world's cards past ~40k ranks)
            deadline = time.monotonic() + t
            return [value for batch in batches
                    for value in self.multi_get(batch, max(deadline - time.monotonic(), 1e-3))]
        what = f"multi_get({len(keys)} keys from {keys[0]!r})"
        status, payload = self._call(what, OP_MULTI_GET, keys, timeout=t)
        if status == ST_TIMEOUT:
            missing = payload.decode().split("\n")
            raise TimeoutError(f"store multi_get timed out after {t:g} s; keys still missing: {missing} "
                               f"(TCP store at {self.address})")
        if status != ST_OK:
            self._raise_error(what, status, payload)
        try:
            return unpack_values(payload, len(keys))
        except (EOFError, struct.error) as exc:
            raise RendezvousError(f"{what}: the TCP store at {self.address} sent a malformed reply ({exc})") \
                from exc

    def check(self, keys: list[str]) -> bool:
        keys = [check_key(k) for k in keys]
        status, payload = self._call(f"check({keys!r})", OP_CHECK, keys)
        if status != ST_OK:
            self._raise_error(f"check({keys!r})", status, payload)
        return payload == b"\x01"

    def delete_key(self, key: str) -> bool:
        check_key(key)
        status, payload = self._call(f"delete_key({key!r})", OP_DELETE, [key])
        if status != ST_OK:
            self._raise_error(f"delete_key({key!r})", status, payload)
        return payload == b"\x01"

    def refusals(self) -> str:
        try:
            if not self.check([REFUSED_KEY]):
                return ""
            seen = json.loads(self.get(REFUSED_KEY, 0.0))
            count, sources = int(seen["count"]), [str(a) for a in seen["from"]]
        except (TensorwireError, ValueError, KeyError, TypeError):
            return ""
        return (f"the store refused {count} connection(s) from {', '.join(sources)} that could not prove "
                f"the job's secret (another {auth.ENV_SECRET}, {auth.ENV_SECRET_FILE} or --secret-file "
                f"there?)")

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
