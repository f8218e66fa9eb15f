"""Job authentication: where a job's secret comes from, and the handshake that proves it.

Every connection a tensorwire process accepts (the store's, and a rank's during init) opens
with a mutual HMAC-SHA256 challenge-response over the job's secret K. Each side's proof covers
the other side's fresh random nonce, so neither can be replayed; the secret never crosses the
wire; and the side that dialed checks the proof of the side it reached, so a rank never
talks to an impostor that merely took over an address:

    initiator -> responder   magic | hello | Ni                       (Ni, Nr: 32 random bytes)
    responder -> initiator   magic | Nr | HMAC(K, purpose | "responder" | magic | hello | Ni | Nr)
    initiator -> responder   HMAC(K, purpose | "initiator" | magic | hello | Ni | Nr)
    responder -> initiator   0x01 (accepted), or it hangs up          (the store only)

The store confirms, so that a client it dropped while crowded retries instead of losing its
first request. Between ranks the dialer is done once it has sent its proof: the confirmation
would cost one more wait for the other rank to be scheduled on init's critical path
(docs/design/rendezvous.md#handshake).

The responder is a sans-IO state machine (`Responder`) fed by the store's event loop and by a
rank's accept loop, which read no more than it asks for, so a stranger's bytes are never
buffered beyond one handshake message. Only connection setup is touched: after the handshake
the stream carries plain frames (neither encrypted nor signed; see docs/security.md).

The secret (`Secret`): TENSORWIRE_SECRET or TENSORWIRE_SECRET_FILE when set; else, for a job
on one host, a per-user secret in a 0700 directory only this user can enter (`per_user`);
else none (`NO_SECRET`: the handshake still runs, with a key everybody knows).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import socket
import stat
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from . import log
from .errors import InvalidArgumentError, RendezvousError

NONCE_BYTES = 32
MAC_BYTES = 32
ACCEPTED = b"\x01"
_REASON_BYTES = 255  # the most of a refusal's reason that is sent (its length is one byte)
MIN_SECRET_BYTES = 16
_MAX_SECRET_FILE = 4096
ENV_SECRET = "TENSORWIRE_SECRET"
ENV_SECRET_FILE = "TENSORWIRE_SECRET_FILE"
_USER_SECRET = "secret"
_log = log.get("AUTH")
_MAKE_ONE = "e.g. python3 -c 'import secrets; print(secrets.token_hex(32))'"


# --------------------------------------------------------------------------------------------
# The secret


@dataclass(frozen=True)
class Secret:
    key: bytes
    source: str
    """Where the key came from, for messages: 'TENSORWIRE_SECRET', 'TENSORWIRE_SECRET_FILE=PATH',
    'per-user secret PATH', or 'none'."""

    @property
    def authenticated(self) -> bool:
        return self is not NO_SECRET

    def __repr__(self) -> str:  # never print the key
        return f"Secret(from {self.source})"


NO_SECRET = Secret(b"tensorwire: no secret configured", "none")
"""A job spanning hosts without a configured secret: the handshake runs, but proves nothing."""


def new_secret() -> str:
    """A fresh secret as text (256 random bits)."""
    return os.urandom(32).hex()


def _checked(raw: bytes, what: str) -> bytes:
    raw = raw.strip()
    if len(raw) < MIN_SECRET_BYTES:
        raise InvalidArgumentError(f"{what} holds {len(raw)} bytes; a secret needs at least "
                                   f"{MIN_SECRET_BYTES} ({_MAKE_ONE})")
    return raw


def _private_file(fd: int, path: str) -> None:
    """Refuse a secret anybody but this user could read or have written (as ssh refuses keys)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RendezvousError(f"secret file {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise RendezvousError(f"secret file {path} belongs to uid {st.st_uid}, not to this user "
                              f"(uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise RendezvousError(f"secret file {path} can be read by others (mode {st.st_mode & 0o777:o}); "
                              f"chmod 600 {path}")


def read_secret_file(path: str) -> bytes:
    """The secret in `path`, which must be this user's and private (mode 0600 or stricter)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not block
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RendezvousError(f"secret file {path} is a symbolic link, which is not followed for a "
                                  f"secret: give the file itself ({os.path.realpath(path)}?)") from exc
        raise RendezvousError(f"cannot read the secret file {path}: {exc.strerror}") from exc
    try:
        _private_file(fd, path)
        raw = os.read(fd, _MAX_SECRET_FILE + 1)
    finally:
        os.close(fd)
    if len(raw) > _MAX_SECRET_FILE:
        raise RendezvousError(f"secret file {path} is larger than {_MAX_SECRET_FILE} bytes: not a secret?")
    return _checked(raw, f"secret file {path}")


def create_secret_file(path: str) -> bytes:
    """Write a fresh secret to `path` (mode 0600) unless it exists; returns the secret in it.

    Written under a temporary name and linked into place, so a concurrent reader sees the
    whole secret or no file, and of two concurrent creators one wins and both use its secret."""
    import tempfile  # here, not at the top: every rank imports this module, few create files

    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tensorwire-secret-", dir=directory)  # mode 0600
    except OSError as exc:
        raise RendezvousError(f"cannot create the secret file {path}: {exc.strerror}") from exc
    try:
        os.write(fd, (new_secret() + "\n").encode())
        os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return read_secret_file(path)


def configured(env: Mapping[str, str] = os.environ) -> Secret | None:
    """The secret the user configured (TENSORWIRE_SECRET, else TENSORWIRE_SECRET_FILE), if any."""
    text = env.get(ENV_SECRET, "")
    if text:
        return Secret(_checked(text.encode(), ENV_SECRET), ENV_SECRET)
    path = env.get(ENV_SECRET_FILE, "")
    if path:
        return Secret(read_secret_file(path), f"{ENV_SECRET_FILE}={path}")
    return None


def user_dir() -> str:
    """This user's private directory for the per-user secret: <tmp>/tensorwire-<uid>, mode 0700.

    /tmp is shared and sticky, so anybody may have created the name first: it is used only if
    it is a real directory (not a symlink) owned by this user that nobody else can write to
    or enter, which no other (non-root) user can arrange."""
    import tempfile

    uid = os.geteuid()
    path = os.path.join(tempfile.gettempdir(), f"tensorwire-{uid}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        raise RendezvousError(
            f"{path} is not a directory of this user (uid {uid}): another user may have created it "
            f"to intercept tensorwire's per-user secret; remove it, or set {ENV_SECRET_FILE}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours: the secret file inside is checked on its own
    return path


def per_user() -> Secret:
    """This user's secret on this host, created on first use: every process of the user can
    read it, no other user can (and other users' processes are what a one-host job must keep out)."""
    path = os.path.join(user_dir(), _USER_SECRET)
    try:
        key = read_secret_file(path)
    except RendezvousError:
        if os.path.lexists(path):
            raise
        key = create_secret_file(path)
    return Secret(key, f"per-user secret {path}")


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    import ipaddress

    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def for_host(host: str, env: Mapping[str, str] = os.environ) -> Secret:
    """The secret to reach a store at `host` with when the caller names none: the configured
    one, else the per-user one where `host` is this machine's loopback, else none."""
    found = configured(env)
    if found is not None:
        return found
    return per_user() if is_loopback(host) else NO_SECRET


# --------------------------------------------------------------------------------------------
# The handshake


class HandshakeFailed(Exception):
    """The other side is not one of this job's processes (or could not prove it)."""


class NotTensorwire(HandshakeFailed):
    """The other side does not speak this protocol (another service, another version)."""


class WrongSecret(HandshakeFailed):
    """The other side speaks the protocol but proved knowledge of a different secret."""


class TurnedAway(HandshakeFailed):
    """The other side refused this connection before any proof, saying why (its `check`): the
    reason is unauthenticated, shown to the user and never acted on beyond giving up."""


def _refusal_magic(magic: bytes) -> bytes:
    """What a refusal opens with in place of `magic`: it differs in the last byte only."""
    return magic[:-1] + b"!"


def _mac(key: bytes, purpose: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, purpose + b"|" + role + b"|" + transcript, hashlib.sha256).digest()


class _Handshake:
    """One side of a handshake as a sans-IO state machine: read at most `need` bytes, pass
    them to `feed`, send what it returns; `done` at the end, `HandshakeFailed` as soon as
    anything is wrong. Nothing is buffered beyond the message it waits for."""

    def __init__(self, key: bytes, purpose: bytes, magic: bytes, sizes: list[int]) -> None:
        self._key = key
        self._purpose = purpose
        self._magic = magic
        self._sizes = [len(magic), *sizes]
        self._stage = 0
        self._buf = bytearray()
        self._transcript = b""
        self.done = False

    @property
    def need(self) -> int:
        return self._sizes[self._stage] - len(self._buf) if not self.done else 0

    def feed(self, data: bytes) -> bytes:
        if len(data) > self.need:
            raise HandshakeFailed("sent more than the handshake asks for")
        self._buf += data
        if self._stage == 0 and not self._magic.startswith(bytes(self._buf)):
            raise NotTensorwire("not a tensorwire connection (wrong protocol magic)")
        if len(self._buf) < self._sizes[self._stage]:
            return b""
        got, self._buf = bytes(self._buf), bytearray()
        self._stage += 1
        return self._on_message(self._stage - 1, got) if self._stage > 1 else b""

    def _on_message(self, stage: int, got: bytes) -> bytes:
        raise NotImplementedError

    def _proof(self, role: bytes) -> bytes:
        return _mac(self._key, self._purpose, role, self._transcript)


class Responder(_Handshake):
    """The accepting side. `check(hello)` may reject a hello by returning a reason (another
    job) before any proof is sent; `hello` is what the initiator announced. `confirm`: answer
    the initiator's proof with ACCEPTED (the initiator must expect it alike)."""

    def __init__(self, key: bytes, purpose: bytes, magic: bytes, hello_size: int,
                 check: Callable[[bytes], str | None] | None = None, confirm: bool = True) -> None:
        super().__init__(key, purpose, magic, [hello_size + NONCE_BYTES, MAC_BYTES])
        self._check = check
        self._confirm = confirm
        self.hello = b""
        self.refusal = b""  # what to send before hanging up on a hello `check` turned away

    @property
    def progress(self) -> int:
        """How far the initiator got: 0 nothing received, 1 part of its first message, 2 all
        of it (the challenge is answered: its proof is due)."""
        return 2 if self._stage >= 2 else int(bool(self._stage or self._buf))

    def _on_message(self, stage: int, got: bytes) -> bytes:
        if stage == 1:
            self.hello = got[:-NONCE_BYTES]
            reason = self._check(self.hello) if self._check is not None else None
            if reason:
                text = reason.encode("ascii", "replace")[:_REASON_BYTES]
                self.refusal = _refusal_magic(self._magic) + bytes([len(text)]) + text
                raise HandshakeFailed(reason)
            nonce = os.urandom(NONCE_BYTES)
            self._transcript = self._magic + got + nonce
            return self._magic + nonce + self._proof(b"responder")
        if not hmac.compare_digest(got, self._proof(b"initiator")):
            raise WrongSecret("wrong proof (not this job's secret, or a replayed handshake)")
        self.done = True
        return ACCEPTED if self._confirm else b""


class Initiator(_Handshake):
    """The dialing side: send `first`, then feed what comes back. NotTensorwire or WrongSecret
    if the other side is not who it should be (nothing that depends on the secret is sent
    then); `HandshakeFailed` if it answers with anything but the acceptance. Without `confirm`
    it is done once its proof is returned (to be sent): one round trip fewer, and a proof the
    responder drops (it never does for the right secret; it may evict a connection when
    crowded) shows as the connection closing at its first read."""

    def __init__(self, key: bytes, purpose: bytes, magic: bytes, hello: bytes, confirm: bool = True) -> None:
        super().__init__(key, purpose, magic, [NONCE_BYTES + MAC_BYTES, len(ACCEPTED)] if confirm
                         else [NONCE_BYTES + MAC_BYTES])
        self.first = magic + hello + os.urandom(NONCE_BYTES)
        self._confirm = confirm
        self._refused: bytearray | None = None  # a refusal's length and reason, once it opened with one

    @property
    def need(self) -> int:
        got = self._refused
        if got is None:
            return super().need
        return 1 - len(got) if not got else 1 + got[0] - len(got)

    def feed(self, data: bytes) -> bytes:
        if self._refused is None:
            if self._stage or bytes(self._buf) + data != _refusal_magic(self._magic):
                return super().feed(data)
            self._buf, self._refused = bytearray(), bytearray()
            return b""
        if len(data) > self.need:
            raise HandshakeFailed("sent more than a refusal holds")
        self._refused += data
        if self.need == 0:
            reason = self._refused[1:].decode("ascii", "replace")
            raise TurnedAway("".join(c if c.isprintable() else "?" for c in reason))
        return b""

    def _on_message(self, stage: int, got: bytes) -> bytes:
        if stage == 1:
            self._transcript = self.first + got[:NONCE_BYTES]
            if not hmac.compare_digest(got[NONCE_BYTES:], self._proof(b"responder")):
                raise WrongSecret("the other side could not prove it knows this job's secret")
            self.done = not self._confirm
            return self._proof(b"initiator")
        if got != ACCEPTED:
            raise HandshakeFailed("the other side answered the handshake with something unexpected")
        self.done = True
        return b""


def initiate(sock: socket.socket, key: bytes, purpose: bytes, magic: bytes, hello: bytes) -> None:
    """The dialing side on a blocking socket (its timeout bounds each read): see Initiator;
    ConnectionError if the other side hangs up, which is also how it refuses this side."""
    side = Initiator(key, purpose, magic, hello)
    sock.sendall(side.first)
    while not side.done:
        data = sock.recv(side.need)
        if not data:
            raise ConnectionError("the other side closed the connection during the handshake")
        answer = side.feed(data)
        if answer:
            sock.sendall(answer)


class Refusals:
    """Logs the connections a listener drops (subsystem AUTH, level WARN): the first at once,
    then at most one line a second with the count of those left out, so that a flood of
    strangers cannot flood the log."""

    def __init__(self, where: str, interval_s: float = 1.0) -> None:
        self.where = where
        self.interval_s = interval_s
        self.count = 0
        self._last = -interval_s
        self._untold = 0

    def __call__(self, peer: str, reason: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._untold += 1
            return
        more = f" (and {self._untold} more since the last report)" if self._untold else ""
        _log.warning("%s: dropped a connection from %s: %s%s", self.where, peer, reason, more)
        self._last, self._untold = now, 0


ACCEPT_BATCH = 16
"""Connections a listener accepts before it reads those already accepted: under a flood of
connections, a real client's handshake is read while its connection is held."""

T = TypeVar("T", bound=Hashable)
NOT_YET = ("had sent nothing", "had sent part of its first message", "had not proved itself")
"""What an initiator had done at each `Responder.progress`, for the lines that say why it was dropped."""


class Pending(Generic[T]):
    """The connections a listener holds until they authenticate (oldest first), at most a bound.

    Where one more would exceed it, the one dropped is the one that got least far in its
    handshake (sent nothing, then part of its first message, then no proof yet), the oldest of
    those, never the one just accepted: a flood of connections that send little or nothing
    cannot push out a real client, which sends its whole first message at once and its proof
    one round trip later. Progress is looked up when a connection must go (it only grows)."""

    def __init__(self) -> None:
        self._sides: dict[T, Responder] = {}  # arrival order
        self._by_progress: tuple[dict[T, None], ...] = ({}, {}, {})

    def __len__(self) -> int:
        return len(self._sides)

    def __iter__(self) -> Iterator[T]:
        """Oldest first, over a copy (they may be dropped meanwhile)."""
        return iter(list(self._sides))

    def oldest(self) -> T | None:
        return next(iter(self._sides), None)

    def add(self, item: T, side: Responder) -> None:
        self._sides[item] = side
        self._by_progress[0][item] = None

    def discard(self, item: T) -> None:
        if self._sides.pop(item, None) is not None:
            for group in self._by_progress:
                group.pop(item, None)

    def surplus(self, bound: int, newest: T) -> tuple[T, str] | None:
        """The connection to drop where more than `bound` are held, `newest` aside, and why."""
        if len(self._sides) <= bound:
            return None
        for stage, group in enumerate(self._by_progress):
            found, further = None, []
            for item in group:
                now = self._sides[item].progress
                if now != stage:  # it got further since: filed where it is now, below
                    further.append((item, now))
                elif item is not newest:
                    found = item
                    break
            for item, now in further:
                del group[item]
                self._by_progress[now][item] = None
            if found is not None:
                return found, (f"{NOT_YET[stage]} when {bound} connections were waiting to authenticate "
                               f"(TENSORWIRE_AUTH_PENDING, at most an eighth of ulimit -n)")
        return None
