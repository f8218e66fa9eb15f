"""The 64-byte message header shared by the TCP and shared-memory channels.

Every message carries the matching key (context, kind, sequence, tag) and the fingerprint of
the collective that sent it, so a receiver can tell a mismatched collective from a late message
before a single payload byte lands in a user's buffer.
"""

from __future__ import annotations

import struct
import zlib
from enum import IntEnum
from typing import NamedTuple

from ..ops import ReduceOp
from ..ops.dtypes import dtype_from_code

HEADER = struct.Struct("<BBBBIQqQQiQB11x")
HEADER_SIZE = HEADER.size  # 64: keeps shared-memory ring positions 64-byte aligned
assert HEADER_SIZE == 64
SEQ_AT = struct.calcsize("<BBBBI")  # a packed header's seq (an acknowledgement's message id)
_CTX = struct.Struct("<4xI")  # a packed header's ctx (its group)
_MODE_AT = struct.calcsize("<BBBBIQqQQiQ")  # a packed header's mode


class Kind(IntEnum):
    P2P = 0
    COLL = 1
    ABORT = 2  # payload: utf-8 "ErrorClass\nmessage"; tells every peer why a group failed (or that it ended)
    BYE = 3  # the sender called destroy(): its closing socket is a goodbye, not a crash
    QUERY = 4  # "which call of this group are you in?" (sent by a waiter that has been idle a while)
    STATE = 5  # the answer: the sequence number and fingerprint of the replier's current call
    ACK = 6  # shared memory: the receiver has read a REMOTE message (seq: the sender's id for it)


class Mode(IntEnum):
    """How a message's payload travels (shared memory only; TCP always carries it INLINE)."""

    INLINE = 0  # the payload follows the header
    REMOTE = 1  # a descriptor follows: the receiver reads the payload out of the sender's memory
    ACK = 2  # no payload: the answer to a REMOTE message, which completes its send
    MOVE = 3  # the writer goes on in a larger ring: its name follows (seq: its nonce, tag: its capacity)
    DEVICE = 4  # a CUDA buffer's descriptor follows (remote.DEVICE_UNITS records): the receiver copies it
    COPIED = 5  # an ACK of a DEVICE message; the event recorded after the receiver's copy follows


class Coll(IntEnum):
    """Collective codes carried in fingerprints (0 means a point-to-point message)."""

    P2P = 0
    ALL_REDUCE = 1
    BROADCAST = 2
    REDUCE = 3
    ALL_GATHER = 4
    GATHER = 5
    SCATTER = 6
    REDUCE_SCATTER = 7
    ALL_TO_ALL = 8
    BARRIER = 9
    ALL_GATHERV = 10
    ALL_TO_ALLV = 11
    GATHERV = 12
    SCATTERV = 13
    REDUCE_SCATTERV = 14
    SPLIT = 15
    SETUP = 16

    @property
    def label(self) -> str:
        return self.name.lower()


ON_DEVICE = 0x80
"""Set in a fingerprint's collective code when the call's buffers are CUDA buffers: their
calls exchange descriptors, not payload, so a rank that passed host buffers must not match."""


def coll_label(code: int) -> str:
    """'all_reduce', or 'all_reduce of CUDA buffers' for a device call's code."""
    try:
        label = Coll(code & ~ON_DEVICE).label
    except ValueError:
        return f"collective#{code}"
    return f"{label} of CUDA buffers" if code & ON_DEVICE else label


class Fingerprint(NamedTuple):
    """What every rank of one collective call must agree on; count/root of -1 are not checked."""

    coll: int
    dtype: int = 0
    op: int = 0
    root: int = -1
    count: int = -1  # type: ignore[assignment]  # shadows tuple.count, which nothing calls on it
    aux: int = 0  # the PREMUL_SUM factor as a float64's bits, xor a vector collective's counts digest


_COUNTS = "per-rank counts differ (every rank must pass the same counts)"
_AUX: dict[int, str] = {Coll.GATHERV: _COUNTS, Coll.SCATTERV: _COUNTS, Coll.ALL_GATHERV: _COUNTS,
        Coll.REDUCE_SCATTERV: "per-rank counts (or the PREMUL_SUM factor) differ",
        Coll.ALL_REDUCE: "compress= (or the PREMUL_SUM factor) differs",
        Coll.SETUP: "the group's members in another order (each must pass new_group the same ranks in the "
                    "same order), or another TENSORWIRE_TRANSPORT (every rank must use the same)"}
"""What a difference in `aux` means, by collective."""
_LIST_FORMS = (("all_gather", {Coll.ALL_GATHER, Coll.ALL_GATHERV}),
               ("reduce_scatter", {Coll.REDUCE_SCATTER, Coll.REDUCE_SCATTERV}))
_FACTORED = (Coll.REDUCE, Coll.REDUCE_SCATTER, Coll.ALL_REDUCE, Coll.REDUCE_SCATTERV)  # PREMUL_SUM's
_PHASE_OF_WHAT = "its collective, dtype, op, root, count or compress="
PHASE_OF = f"the hierarchical call this is a phase of differs ({_PHASE_OF_WHAT})"


def phase_digest(fp: Fingerprint) -> int:
    """What a hierarchical call mixes into its phases' fingerprints (their `aux`), so that ranks
    whose calls differ where no phase's own arguments show it (compress=, AVG against SUM, the
    PREMUL_SUM factor) fail a phase as a mismatch instead of summing different things."""
    return zlib.crc32(struct.pack("<5qQ", *fp[:5], fp.aux & 0xFFFFFFFFFFFFFFFF)) << 32


def dtype_label(code: int) -> str:
    """A fingerprint's dtype code as its name."""
    try:
        return str(dtype_from_code(code))
    except Exception:  # an unknown code is itself the finding
        return f"dtype#{code}"


def op_label(code: int) -> str:
    """A fingerprint's op code as its name."""
    try:
        return ReduceOp(code).name
    except ValueError:
        return f"op#{code}"


def differences(mine: Fingerprint, other: Fingerprint) -> list[str]:
    """Human-readable fields that differ between our fingerprint and a peer's (both
    fingerprints of a point-to-point message: its element count and dtype)."""
    if mine.coll != other.coll:
        if mine.coll ^ other.coll == ON_DEVICE:
            return [f"{coll_label(mine.coll)} vs {coll_label(other.coll)} (every rank must pass buffers "
                    "of the same kind: all CUDA or all host)"]
        pair = {mine.coll & ~ON_DEVICE, other.coll & ~ON_DEVICE}
        uneven = next((f" (a list-form {v} whose blocks differ in size runs as {v}v: every rank must pass "
                       f"the same block sizes)" for v, c in _LIST_FORMS if pair == c), "")
        return [f"collective {coll_label(mine.coll)} vs {coll_label(other.coll)}{uneven}"]
    if mine.coll == Coll.P2P and mine.count >= 0 and other.count >= 0:  # a receive vs its send
        return [f"receive of {mine.count} x {dtype_label(mine.dtype)} vs send of {other.count} x "
                f"{dtype_label(other.dtype)} "
                "(a receive must match its send's dtype and element count)"]
    out = []
    if mine.dtype != other.dtype:
        out.append(f"dtype {dtype_label(mine.dtype)} vs {dtype_label(other.dtype)}")
    if mine.op != other.op:
        out.append(f"op {op_label(mine.op)} vs {op_label(other.op)}")
    if mine.root != other.root:
        out.append(f"root {mine.root} vs {other.root}")
    if mine.count != other.count and mine.count >= 0 and other.count >= 0:
        what = "sum(counts)" if mine.coll == Coll.SCATTERV else "count"
        out.append(f"{what} {mine.count} vs {other.count}")
    if mine.aux != other.aux:
        coll = mine.coll & ~ON_DEVICE
        factored = coll in _FACTORED
        if coll == Coll.SETUP or (coll in _AUX and (mine.aux ^ other.aux) & 0xFFFFFFFF):  # the low half:
            out.append(_AUX[coll])  # the counts' or compress='s digest
        elif factored:  # a factor (AVG runs as one in a hierarchical call's phases), or phase_digest's
            out.append(f"the PREMUL_SUM factor differs (or, in a phase of a hierarchical call, that call "
                       f"differs: {_PHASE_OF_WHAT})")
        else:
            out.append(PHASE_OF)
    return out


P2P_FINGERPRINT = Fingerprint(Coll.P2P)


class Header(NamedTuple):
    kind: int
    ctx: int
    seq: int
    tag: int
    nbytes: int
    fp: Fingerprint
    mode: int = Mode.INLINE

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.ctx, self.kind, self.seq, self.tag)

    def pack(self) -> bytes:
        return pack_header(self.kind, self.ctx, self.seq, self.tag, self.nbytes, self.fp, self.mode)

    @classmethod
    def unpack(cls, raw, offset: int = 0) -> Header:
        """From HEADER_SIZE bytes of `raw` at `offset` (a ring is read in place, no slice)."""
        kind, coll, dtype, op, ctx, seq, tag, nbytes, count, root, aux, mode = HEADER.unpack_from(raw, offset)
        if count == 0xFFFFFFFFFFFFFFFF:
            count = -1
        return cls(kind, ctx, seq, tag, nbytes, Fingerprint(coll, dtype, op, root, count, aux), mode)


MAX_CONTROL_BYTES = 1 << 20
"""Largest control payload (an ABORT's error text)."""
BYE_NOTE_BYTES = 512
"""Largest goodbye note (the peers its sender had lost, and why)."""
_CONTROL_MAX = {int(Kind.ABORT): MAX_CONTROL_BYTES, int(Kind.BYE): BYE_NOTE_BYTES, int(Kind.QUERY): 0,
                int(Kind.STATE): 0}
"""The control kinds TCP carries (ACK is shared memory's), and the payload each may have."""
_COLL_CODES = frozenset(int(c) for c in Coll)
_NOT_DEVICE = ~ON_DEVICE


class MalformedHeader(ValueError):
    """A header no tensorwire process sends: a broken or hostile stream."""


def check_tcp(header: Header, max_message: int) -> None:
    """Validate a header that arrived over TCP before anything is allocated for its payload:
    a kind and collective tensorwire knows, the inline mode (the only one TCP carries), no
    payload where its kind has none, and at most `max_message` bytes (TENSORWIRE_MAX_MESSAGE)
    where it has one. Plain int comparisons (under a microsecond a message); TCP only, whose
    peers are the ones a network can reach."""
    kind, nbytes = header.kind, header.nbytes
    if kind <= 1:  # P2P, COLL: the data
        ok = nbytes <= max_message
    else:
        limit = _CONTROL_MAX.get(kind)
        ok = limit is not None and nbytes <= limit
    if ok and not header.mode and header.fp.coll & _NOT_DEVICE in _COLL_CODES:
        return
    if kind in _CONTROL_MAX or kind <= 1:
        if header.mode or header.fp.coll & _NOT_DEVICE not in _COLL_CODES:
            raise MalformedHeader(f"mode {header.mode} or collective {header.fp.coll} unknown over TCP")
        if kind <= 1:
            raise MalformedHeader(f"a payload of {nbytes} bytes announced, more than TENSORWIRE_MAX_MESSAGE "
                                  f"({max_message}) allows")
        raise MalformedHeader(f"a {Kind(kind).name} message of {nbytes} bytes")
    raise MalformedHeader(f"unknown message kind {kind}")


def ctx_of(wire: bytes) -> int:
    """The group (ctx) of a packed header."""
    return _CTX.unpack_from(wire)[0]


def with_mode(wire: bytes, mode: int) -> bytes:
    """A packed header with another mode: the same message, sent another way."""
    return wire[:_MODE_AT] + bytes((mode,)) + wire[_MODE_AT + 1:]


def pack_header(kind: int, ctx: int, seq: int, tag: int, nbytes: int, fp: Fingerprint,
                mode: int = 0) -> bytes:
    """A header's wire form, with no Header made first (half of its cost on a small message's path)."""
    return HEADER.pack(kind, fp.coll, fp.dtype, fp.op, ctx, seq, tag, nbytes, fp.count & 0xFFFFFFFFFFFFFFFF,
                       fp.root, fp.aux, mode)
