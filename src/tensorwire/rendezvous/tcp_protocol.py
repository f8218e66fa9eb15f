"""The TCP store's wire protocol (version 2), shared by its client and its server.

The protocol is deliberately tiny. A connection opens with the job's handshake
(`tensorwire.auth`: both sides prove they know the job's secret; magic ``TWSTORE2``, empty
hello), then every message is a frame ``u32 length | body`` (big endian). A request body is
``u8 op | f64 timeout_s | u16 nkeys | (u16 len | utf-8 key) * nkeys | value``; a reply body is
``u8 status | payload``. Blocking requests carry their own deadline, so the server answers
``TIMEOUT`` itself and the stream never desynchronises on a slow key.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from ..config import AUTH_TIMEOUT_S, STORE_MAX_VALUE, Config
from ..errors import InvalidArgumentError

MAGIC = b"TWSTORE2"
PURPOSE = b"tensorwire store v2"
LEN = struct.Struct(">I")
REQ_HEAD = struct.Struct(">BdH")
U16 = struct.Struct(">H")
I64 = struct.Struct(">q")
KEYS_ROOM = 1 << 20
"""Room in a frame beyond its value: the request header and its keys."""

# Request operations.
OP_SET = 1
OP_GET = 2
OP_ADD = 3
OP_WAIT = 4
OP_CHECK = 5
OP_DELETE = 6
OP_MULTI_GET = 7
OPS = frozenset(range(1, 8))
OP_NAMES = {OP_SET: "set", OP_GET: "get", OP_ADD: "add", OP_WAIT: "wait", OP_CHECK: "check",
            OP_DELETE: "delete", OP_MULTI_GET: "multi_get"}
# Reply statuses.
ST_OK = 0
ST_TIMEOUT = 1
ST_ERROR = 2
ST_EXITED = 3
"""A blocking read of a key that is not set, after a rank of the job has exited: the payload says
which rank and how (EXITED_KEY)."""

EXITED_KEY = "tw/exited"
"""Set by `tensorwire run` when one of its ranks exits. The launcher's ranks form one world of
fixed size, and every store read they block on waits for every rank (or for rank 0), so from
then on the server answers such a read at once with ST_EXITED and this key's value, instead of
letting it wait out the timeout."""


REFUSED_KEY = "tw/refused"
"""Kept by the server: how many connections it dropped because they could not prove the job's
secret, and from where (JSON: count, addresses), so that a rank that times out waiting for others
can say that some came with another secret. Only a hint: anyone can connect with a wrong secret."""
REFUSED_ADDRESSES = 8
"""The most addresses REFUSED_KEY names (a flood's are counted, not listed)."""


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
        return self.max_value + KEYS_ROOM


DEFAULT_LIMITS = StoreLimits()


def key_batches(keys: list[str]) -> list[list[str]]:
    """`keys` cut into runs that each fit one request: at most 65535 keys, in KEYS_ROOM bytes."""
    batches: list[list[str]] = [[]]
    room = KEYS_ROOM - REQ_HEAD.size
    for k in keys:
        size = U16.size + len(k.encode())
        if batches[-1] and (len(batches[-1]) == 0xFFFF or size > room):
            batches.append([])
            room = KEYS_ROOM - REQ_HEAD.size
        batches[-1].append(k)
        room -= size
    return batches


def encode_request(op: int, keys: Iterable[str], value: bytes = b"", timeout: float = 0.0,
                   limits: StoreLimits = DEFAULT_LIMITS) -> bytes:
    parts = []
    nkeys = 0
    for k in keys:
        raw = k.encode()
        if len(raw) > 0xFFFF:
            raise InvalidArgumentError(
                f"store key is too long ({len(raw)} bytes, at most 65535): {k[:60]!r}...")
        parts.append(U16.pack(len(raw)) + raw)
        nkeys += 1
    if len(value) > limits.max_value:
        raise InvalidArgumentError(
            f"store value of {len(value)} bytes is larger than the store allows "
            f"({limits.max_value} bytes: TENSORWIRE_STORE_MAX_VALUE)")
    body = REQ_HEAD.pack(op, timeout, nkeys) + b"".join(parts) + value
    if len(body) > limits.max_frame:
        raise InvalidArgumentError(f"store request of {len(body)} bytes: its keys take more than the "
                                   f"{KEYS_ROOM} bytes a request allows them")
    return LEN.pack(len(body)) + body


def decode_request(body: bytes) -> tuple[int, float, list[str], bytes]:
    """Raises ValueError (struct.error, UnicodeDecodeError among them) on a malformed body."""
    op, timeout, nkeys = REQ_HEAD.unpack_from(body, 0)
    if not timeout >= 0:  # NaN too
        raise ValueError(f"timeout {timeout}")
    pos = REQ_HEAD.size
    keys = []
    for _ in range(nkeys):
        (n,) = U16.unpack_from(body, pos)
        pos += U16.size
        if pos + n > len(body):
            raise ValueError("a key runs past the end of the request")
        keys.append(body[pos:pos + n].decode())
        pos += n
    return op, timeout, keys, body[pos:]


def reply(status: int, payload: bytes = b"") -> bytes:
    return LEN.pack(1 + len(payload)) + bytes([status]) + payload


def pack_values(values: Iterable[bytes]) -> bytes:
    """A multi_get's payload: each value with its length (u32, big endian)."""
    return b"".join(LEN.pack(len(v)) + v for v in values)


def unpack_values(payload: bytes, n: int) -> list[bytes]:
    out, pos = [], 0
    for _ in range(n):
        (size,) = LEN.unpack_from(payload, pos)
        pos += LEN.size
        out.append(payload[pos:pos + size])
        pos += size
    if pos != len(payload) or len(out) != n:
        raise EOFError(f"a multi_get reply of {len(payload)} bytes does not hold {n} values")
    return out
