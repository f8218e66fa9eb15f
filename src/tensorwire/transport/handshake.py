"""One authenticated connection between two ranks, dialed or accepted, as a state machine that
an event loop (the wiring's thread, transport/wiring.py) drives without ever blocking.

Every socket between two ranks opens with the job's handshake (`tensorwire.auth`): both prove
they know the job's secret, so an address read from any store can at worst lead nowhere,
never to an impostor. After it, the two sides exchange small length-prefixed JSON messages
(`Messages`) to set the pair up (rings, streams), then the socket carries frames.

What a failed dial means decides what the rank does next, so it is classified here:
`Refused` (nobody listens at the address: the rank exited) and `Unreachable` (its host did not
answer within TENSORWIRE_PEER_TIMEOUT) make the peer lost; `Retry` (hung up or silent during the
handshake: a crowded listener may drop a connection) is tried again; a wrong secret, another
protocol, and a listener that turned the dial away (another job's rank, or another rank than
the one dialed: a stale address) are errors of their own.

Strangers on the listener are handshakes that never finish: each holds one of
`cfg.auth_pending` slots (`auth.Pending` chooses the one a new one beyond drops) for at most
`cfg.auth_timeout` seconds, is read no further than the handshake's next message, and is
dropped and logged (subsystem AUTH).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import struct
import time
from collections.abc import Callable

from .. import auth, limits
from ..errors import AuthenticationError, RendezvousError

HELLO = struct.Struct("<IIIQ")  # rank, the rank it dials, world size, job hash
MAGIC = b"TWpeer5\n"
PURPOSE = b"tensorwire peer v5"
_MAX_MESSAGE = 1 << 16
_LEN = struct.Struct("<I")
_LOST_ERRNOS = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN)


def job_hash(job_id: str) -> int:
    """64-bit FNV-1a of the job id: tells ranks of different jobs apart (not a secret)."""
    h = 1469598103934665603
    for b in job_id.encode():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


class Refused(Exception):
    """Nobody listens at the peer's address: its process is gone (or called destroy())."""


class Unreachable(Exception):
    """The peer's host did not answer the connection (down, or cut off)."""


class Retry(Exception):
    """The attempt failed in a way a new one may not (hung up or silent during the handshake)."""


def _send(sock: socket.socket, data: bytes) -> None:
    """A handshake or setup message (at most a few KiB) into a fresh socket's send buffer."""
    if data and sock.send(data) != len(data):
        raise ConnectionError("a setup message did not fit the socket's send buffer")


def _socket(family: int) -> socket.socket:
    try:
        return socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        if exc.errno != errno.EMFILE or not limits.raise_soft_limit():
            raise
    return socket.socket(family, socket.SOCK_STREAM)


class Dial:
    """One attempt to reach rank `peer` at `addr`: a non-blocking connect, then the initiator's
    side of the handshake. `step()` on every event of `sock`; True once authenticated."""

    def __init__(self, peer: int, addr: tuple[str, int], hello: bytes, secret: auth.Secret,
                 auth_timeout: float, connect_timeout: float, who: str,
                 prepare: Callable[[socket.socket], None] | None = None) -> None:
        """`connect_timeout` (TENSORWIRE_PEER_TIMEOUT): a TCP connect not completed by then
        reached no host, whose machine is down or cut off (a live host refuses at once where
        nobody listens); the kernel would try for ~2 min. `prepare`: what the socket needs
        before it connects (its buffer sizes)."""
        self.peer, self.addr, self.secret, self.who = peer, addr, secret, who
        self.auth_timeout, self.connect_timeout = auth_timeout, connect_timeout
        self.side = auth.Initiator(secret.key, PURPOSE, MAGIC, hello, confirm=False)
        self.connecting = True
        self.expires = time.monotonic() + connect_timeout
        try:
            family, _, _, _, address = socket.getaddrinfo(addr[0], addr[1], type=socket.SOCK_STREAM)[0]
        except socket.gaierror as exc:
            raise RendezvousError(f"{who}: rank {peer}'s address {addr[0]} does not resolve: {exc}") from exc
        try:
            self.sock = _socket(family)
        except OSError as exc:  # waiting frees no descriptor
            raise limits.translate(exc, f"{who}: connecting to rank {peer}") or exc from exc
        self.sock.setblocking(False)
        if prepare is not None:
            prepare(self.sock)
        err = self.sock.connect_ex(address)
        if err not in (0, errno.EINPROGRESS):
            self.sock.close()
            self._connect_failed(err)

    def _connect_failed(self, err: int) -> None:
        text = f"{os.strerror(err)} (connecting to {self.addr[0]}:{self.addr[1]})"
        exhausted = limits.translate(OSError(err, os.strerror(err)),
                                     f"{self.who}: connecting to rank {self.peer}")
        if exhausted is not None:  # out of ports: waiting frees none
            raise exhausted
        if err == errno.ECONNREFUSED:
            raise Refused(text)
        if err in _LOST_ERRNOS:
            raise Unreachable(text)
        raise Retry(text)

    def expired(self, now: float) -> None:
        """Raise what an attempt that ran out of time amounts to (call once `expires` passed)."""
        if self.connecting:
            raise Unreachable(f"no answer to a connection within {self.connect_timeout:g} s "
                              f"({self.addr[0]}:{self.addr[1]})")
        raise Retry(f"no answer to the handshake within {self.auth_timeout:g} s")

    def step(self) -> bool:
        sock, side = self.sock, self.side
        try:
            if self.connecting:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    self._connect_failed(err)
                self.connecting = False
                self.expires = time.monotonic() + self.auth_timeout
                _send(sock, side.first)
                return False
            data = sock.recv(side.need)
            if not data:
                raise Retry("it hung up during the handshake")
            _send(sock, side.feed(data))
        except (BlockingIOError, InterruptedError):
            return False
        except auth.WrongSecret as exc:
            raise AuthenticationError(
                f"{self.who}: rank {self.peer} at {self.addr[0]}:{self.addr[1]} could not prove that it "
                f"knows this job's secret (this rank's: {self.secret.source}); every rank needs the same "
                f"{auth.ENV_SECRET} or {auth.ENV_SECRET_FILE} (see docs/security.md)") from exc
        except auth.NotTensorwire as exc:
            raise RendezvousError(f"{self.who}: rank {self.peer}'s address {self.addr[0]}:{self.addr[1]} "
                                  f"does not speak tensorwire's protocol (another program took the port?)") \
                from exc
        except auth.TurnedAway as exc:
            raise RendezvousError(f"{self.who}: the address this rank has for rank {self.peer}, "
                                  f"{self.addr[0]}:{self.addr[1]}, is not rank {self.peer}'s: the tensorwire "
                                  f"process there turned the connection away ({exc}); the store holds a "
                                  f"stale or wrong address") from exc
        except (Refused, Unreachable, Retry):
            raise
        except (OSError, auth.HandshakeFailed) as exc:
            raise Retry(str(exc) or type(exc).__name__) from exc
        return side.done


class Incoming:
    """A connection accepted on the listener, until it proves the job's secret: the
    responder's side of the handshake. `step()` on every event; True once authenticated
    (`rank` and `world_size` are then the dialer's); HandshakeFailed or OSError: drop it."""

    def __init__(self, sock: socket.socket, addr: str, secret: auth.Secret, job: int, me: int,
                 auth_timeout: float) -> None:
        self.sock, self.addr, self.job, self.me = sock, addr, job, me
        self.side = auth.Responder(secret.key, PURPOSE, MAGIC, HELLO.size, self._not_for_me, confirm=False)
        self.expires = time.monotonic() + auth_timeout
        self.rank = self.world_size = -1

    def _not_for_me(self, hello: bytes) -> str | None:
        """Why a hello is not for this rank (another job's, or meant for another rank: an
        address in the store that is not that rank's), before any proof is given."""
        _, to, _, job = HELLO.unpack(hello)
        if job != self.job:
            return "a rank of another job"
        return None if to == self.me else f"a connection meant for rank {to}"

    def step(self) -> bool:
        """Read the handshake as far as it has arrived, one message at a time."""
        while not self.side.done:
            try:
                data = self.sock.recv(self.side.need)
            except (BlockingIOError, InterruptedError):
                return False
            if not data:
                raise ConnectionError("closed the connection during the handshake")
            try:
                answer = self.side.feed(data)
            except auth.HandshakeFailed:
                if self.side.refusal:  # tell the dialer why, so that it stops trying (best effort)
                    with contextlib.suppress(OSError):
                        self.sock.send(self.side.refusal)
                raise
            _send(self.sock, answer)
        self.rank, _, self.world_size, _ = HELLO.unpack(self.side.hello)
        return True


class Messages:
    """Length-prefixed JSON setup messages on a non-blocking socket, read without reading a
    byte past the message (what follows is the channel's)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._want = _LEN.size
        self._body = False

    def send(self, obj: object) -> None:
        raw = json.dumps(obj).encode()
        _send(self.sock, _LEN.pack(len(raw)) + raw)

    def receive(self) -> dict | None:
        """The next whole message, or None until it has arrived; ConnectionError if the peer
        hung up."""
        while True:
            try:
                data = self.sock.recv(self._want - len(self._buf))
            except (BlockingIOError, InterruptedError):
                return None
            if not data:
                raise ConnectionError("it hung up while the pair was being set up")
            self._buf += data
            if len(self._buf) < self._want:
                continue
            if not self._body:
                (n,) = _LEN.unpack(self._buf)
                if not 0 < n <= _MAX_MESSAGE:
                    raise ConnectionError(f"a setup message of {n} bytes")
                self._buf, self._want, self._body = bytearray(), n, True
                continue
            raw, self._buf, self._want, self._body = bytes(self._buf), bytearray(), _LEN.size, False
            try:
                msg = json.loads(raw)
            except RecursionError:  # nested past the parser's depth: a peer's junk
                raise ValueError("a setup message nested too deep") from None
            if not isinstance(msg, dict):
                raise ConnectionError("a setup message that is not an object")
            return msg
