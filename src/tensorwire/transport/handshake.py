"""Authenticated connections between ranks, dialed and accepted side by side in one loop.

Every socket between two ranks opens with the job's handshake (`tensorwire.auth`): both prove
they know the job's secret, so an address read from any store can at worst lead nowhere,
never to an impostor. A rank dials the ranks it must and accepts the others on its listener
all at once, in one non-blocking event loop and without threads: each handshake waits for the
other rank to be scheduled twice, which on a loaded host costs milliseconds, and done one
after another (or in threads that compete for the GIL) those waits added up.

Strangers on the listener are handshakes that never finish: each holds one of
`cfg.auth_pending` slots (a new one beyond drops the oldest) for at most `cfg.auth_timeout`
seconds, is read no further than the handshake's next message, and is dropped and logged
(subsystem AUTH); the job's own handshakes go on meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import struct
import time
from dataclasses import dataclass

from .. import auth, limits
from ..config import Config
from ..errors import AuthenticationError, RendezvousError, TimeoutError

HELLO = struct.Struct("<IIQ")  # rank, world size, job hash
MAGIC = b"TWpeer2\n"
PURPOSE = b"tensorwire peer v2"
_RETRY_S = 0.05


def job_hash(job_id: str) -> int:
    """64-bit FNV-1a of the job id: tells ranks of different jobs apart (not a secret)."""
    h = 1469598103934665603
    for b in job_id.encode():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def connect_pairs(rank: int, world_size: int, listener: socket.socket, dial_to: dict[int, tuple[str, int]],
                  accept_from: set[int], job_id: str, secret: auth.Secret, cfg: Config, deadline: float,
                  who: str) -> dict[int, socket.socket]:
    """Authenticated sockets (blocking, timeout until `deadline`) to the ranks of `dial_to`,
    dialed at their addresses, and from those of `accept_from`, accepted on `listener`.

    A dial that is refused, hung up on or unanswered is retried until `deadline`;
    AuthenticationError where a rank proves another secret, TimeoutError naming the ranks
    still missing at `deadline`."""
    return _Pairing(rank, world_size, listener, dial_to, accept_from, job_id, secret, cfg, deadline,
                    who).run()


@dataclass(eq=False)
class _Dial:
    addr: tuple[str, int]
    sock: socket.socket | None = None
    side: auth.Initiator | None = None
    connecting: bool = False
    expires: float = 0.0
    retry_at: float = 0.0
    error: str = "no attempt yet"


@dataclass(eq=False)
class _Incoming:
    side: auth.Responder
    expires: float
    peer: str


class _Pairing:
    def __init__(self, rank: int, world_size: int, listener: socket.socket,
                 dial_to: dict[int, tuple[str, int]], accept_from: set[int], job_id: str, secret: auth.Secret,
                 cfg: Config, deadline: float, who: str) -> None:
        self.rank, self.world_size, self.listener = rank, world_size, listener
        self.accept_from, self.secret, self.cfg, self.deadline, self.who = (
            accept_from, secret, cfg, deadline, who)
        self.job = job_hash(job_id)
        self.hello = HELLO.pack(rank, world_size, self.job)
        self.dials = {r: _Dial(addr) for r, addr in dial_to.items()}
        self.incoming: dict[socket.socket, _Incoming] = {}  # oldest first
        self.done: dict[int, socket.socket] = {}
        self.refused = auth.Refusals(f"rank {rank} (listening on port {listener.getsockname()[1]})")
        self.sel = selectors.DefaultSelector()

    def run(self) -> dict[int, socket.socket]:
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        want = len(self.dials) + len(self.accept_from)
        try:
            while len(self.done) < want:
                now = time.monotonic()
                if now >= self.deadline:
                    raise self._timeout()
                self._expire(now)
                for r, d in self.dials.items():
                    if d.sock is None and r not in self.done and d.retry_at <= now:
                        self._start(r, d)
                for key, _ in self.sel.select(max(0.0, self._wake() - now)):
                    if key.data is None:
                        self._accept()
                    elif isinstance(key.data, int):
                        self._on_dial(key.data, self.dials[key.data])
                    else:
                        self._on_incoming(key.fileobj)  # type: ignore[arg-type]
            return dict(self.done)
        except BaseException:
            for sock in self.done.values():
                sock.close()
            raise
        finally:
            for sock in [*self.incoming, *(d.sock for d in self.dials.values() if d.sock is not None)]:
                sock.close()
            self.sel.close()

    def _wake(self) -> float:
        times = [self.deadline, *(i.expires for i in self.incoming.values())]
        for r, d in self.dials.items():
            if r not in self.done:
                times.append(d.expires if d.sock is not None else d.retry_at)
        return min(times)

    def _timeout(self) -> TimeoutError:
        lost = [f"rank {r} at {d.addr[0]}:{d.addr[1]} ({d.error})" for r, d in sorted(self.dials.items())
                if r not in self.done]
        silent = sorted(self.accept_from - set(self.done))
        parts = ([f"could not connect to {', '.join(lost)}"] if lost else []) + (
            [f"rank(s) {', '.join(map(str, silent))} never connected"] if silent else [])
        return TimeoutError(f"{self.who}: {'; '.join(parts)}")

    def _expire(self, now: float) -> None:
        for sock in [s for s, i in self.incoming.items() if i.expires <= now]:
            self._drop(sock, f"did not authenticate within {self.cfg.auth_timeout:g} s "
                       f"(TENSORWIRE_AUTH_TIMEOUT)")
        for d in self.dials.values():
            if d.sock is not None and d.expires <= now:
                self._retry(d, f"no answer to the handshake within {self.cfg.auth_timeout:g} s")

    # -- dialing ------------------------------------------------------------------------------

    def _start(self, r: int, d: _Dial) -> None:
        try:
            family, _, _, _, address = socket.getaddrinfo(d.addr[0], d.addr[1], type=socket.SOCK_STREAM)[0]
        except socket.gaierror as exc:
            raise RendezvousError(f"{self.who}: rank {r}'s address {d.addr[0]} does not resolve: "
                                  f"{exc}") from exc
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:  # waiting frees no descriptor
            raise limits.translate(exc, f"{self.who}: connecting to rank {r}") or exc from exc
        sock.setblocking(False)
        d.sock, d.connecting, d.expires = sock, True, time.monotonic() + self.cfg.auth_timeout
        d.side = auth.Initiator(self.secret.key, PURPOSE, MAGIC, self.hello, confirm=False)
        err = sock.connect_ex(address)
        if err not in (0, errno.EINPROGRESS):
            why = f"{self.who}: connecting to rank {r}"
            exhausted = limits.translate(OSError(err, os.strerror(err)), why)
            if exhausted is not None:  # out of ports: waiting frees none
                raise exhausted
            self._retry(d, os.strerror(err))
            return
        self.sel.register(sock, selectors.EVENT_WRITE, r)

    def _on_dial(self, r: int, d: _Dial) -> None:
        sock, side = d.sock, d.side
        assert sock is not None and side is not None
        try:
            if d.connecting:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, f"connect: {errno.errorcode.get(err, err)}")
                d.connecting = False
                self._send(sock, side.first)
                self.sel.modify(sock, selectors.EVENT_READ, r)
                return
            data = sock.recv(side.need)
            if not data:
                raise ConnectionError("it hung up during the handshake")
            self._send(sock, side.feed(data))
        except (BlockingIOError, InterruptedError):
            return
        except auth.WrongSecret as exc:
            raise AuthenticationError(
                f"{self.who}: rank {r} at {d.addr[0]}:{d.addr[1]} could not prove that it knows this job's "
                f"secret (this rank's: {self.secret.source}); every rank needs the same {auth.ENV_SECRET} or "
                f"{auth.ENV_SECRET_FILE} (see docs/security.md)") from exc
        except auth.NotTensorwire as exc:
            raise RendezvousError(f"{self.who}: rank {r}'s address {d.addr[0]}:{d.addr[1]} does not speak "
                                  f"tensorwire's protocol (another program took the port?)") from exc
        except (OSError, auth.HandshakeFailed) as exc:
            self._retry(d, str(exc) or type(exc).__name__)
            return
        if side.done:
            self.sel.unregister(sock)
            d.sock = None
            self.done[r] = self._ready(sock)

    def _retry(self, d: _Dial, why: str) -> None:
        if d.sock is not None:
            with contextlib.suppress(KeyError, ValueError):  # not registered if connect failed at once
                self.sel.unregister(d.sock)
            d.sock.close()
        d.sock, d.error, d.retry_at = None, why, time.monotonic() + _RETRY_S

    # -- accepting ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise limits.translate(exc, f"{self.who}: accepting connections") or exc from exc
            if len(self.incoming) >= self.cfg.auth_pending:
                self._drop(next(iter(self.incoming)), f"still unauthenticated when {self.cfg.auth_pending} "
                           f"others were waiting (TENSORWIRE_AUTH_PENDING)")
            sock.setblocking(False)
            side = auth.Responder(self.secret.key, PURPOSE, MAGIC, HELLO.size, self._other_job, confirm=False)
            expires = time.monotonic() + self.cfg.auth_timeout
            self.incoming[sock] = _Incoming(side, expires, f"{addr[0]}:{addr[1]}")
            self.sel.register(sock, selectors.EVENT_READ, "in")

    def _other_job(self, hello: bytes) -> str | None:
        return None if HELLO.unpack(hello)[2] == self.job else "a rank of another job"

    def _on_incoming(self, sock: socket.socket) -> None:
        side = self.incoming[sock].side
        try:
            data = sock.recv(side.need)
            if not data:
                self._drop(sock, "closed the connection during the handshake")
                return
            self._send(sock, side.feed(data))
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, auth.HandshakeFailed) as exc:
            self._drop(sock, str(exc) or type(exc).__name__)
            return
        if not side.done:
            return
        del self.incoming[sock]
        self.sel.unregister(sock)
        peer, size, _ = HELLO.unpack(side.hello)
        if size != self.world_size:
            sock.close()
            raise RendezvousError(f"{self.who}: rank {peer} has world size {size}, this rank "
                                  f"{self.world_size}")
        if peer in self.done or peer not in self.accept_from:
            sock.close()
            raise RendezvousError(f"{self.who}: two processes claim rank {peer}")
        self.done[peer] = self._ready(sock)

    def _drop(self, sock: socket.socket, reason: str) -> None:
        self.refused(self.incoming.pop(sock).peer, reason)
        self.sel.unregister(sock)
        sock.close()

    # -- both ---------------------------------------------------------------------------------

    @staticmethod
    def _send(sock: socket.socket, data: bytes) -> None:
        """A handshake message (at most 72 bytes) into a fresh socket's empty send buffer."""
        if data and sock.send(data) != len(data):
            raise ConnectionError("the handshake did not fit the socket's send buffer")

    def _ready(self, sock: socket.socket) -> socket.socket:
        sock.setblocking(True)
        sock.settimeout(max(0.1, self.deadline - time.monotonic()))
        return sock
