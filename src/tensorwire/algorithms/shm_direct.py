"""One-shot collectives through a group's shared segment, for small messages on one host.

Every rank copies its contribution into its own slot once and publishes a flag; readers take
what they need straight out of the other ranks' slots. There are no per-peer messages, no
headers and no matching: a small all_reduce costs one copy in, one flag store, one wait and
n-1 reductions. Every rank reduces the slots in rank order, so all ranks get bitwise the same
result. Fingerprints live beside the flags, so a mismatched call is still caught here.
"""

from __future__ import annotations

import functools

import numpy as np

from ..errors import CollectiveMismatchError
from ..ops import ReduceOp, reduce_into
from ..transport.engine import Backoff, Engine
from ..transport.shm import GroupSegment
from ..transport.wire import Fingerprint


def _fp_words(fp: Fingerprint) -> tuple[int, int]:
    """Two words; the op parameter (aux) is folded to 32 bits: enough to tell factors apart."""
    a = fp.coll | fp.dtype << 8 | fp.op << 16 | ((fp.root + 1) & 0xFFFFFF) << 24
    aux32 = (fp.aux ^ fp.aux >> 32) & 0xFFFFFFFF
    return a, ((fp.count + 1) & 0xFFFFFFFF) | aux32 << 32


def _fp_from_words(a: int, b: int) -> Fingerprint:
    return Fingerprint(a & 0xFF, a >> 8 & 0xFF, a >> 16 & 0xFF, (a >> 24 & 0xFFFFFF) - 1,
                       (b & 0xFFFFFFFF) - 1, b >> 32)


class DirectPath:
    """The direct path of one group on this rank: which slot is next, and how to wait."""

    def __init__(self, seg: GroupSegment, rank: int, engine: Engine, ctx: int, members: list[int]) -> None:
        self.seg = seg
        self.rank = rank
        self.size = seg.size
        self.engine = engine
        self.ctx = ctx
        self.members = tuple(members)
        self.slot_bytes = seg.slot_bytes
        self.parity = 1
        self.prev_seq = 0

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    # -- the protocol -----------------------------------------------------------------------------
    def enter(self, call) -> int:
        """Take the next slot parity, once every rank is past the call that last used it."""
        self.parity ^= 1
        if self.prev_seq:
            self._wait(call, range(self.size), self.prev_seq)
        return self.parity

    def publish(self, call, parity: int) -> None:
        words, line = self.seg.words, self.seg.lines[self.rank]
        a, b = _fp_words(call.fp)
        base = line + 1 + parity * 3
        words[base] = call.seq
        words[base + 1] = a
        words[base + 2] = b
        words[line] = call.seq  # last: publishes the data and the fingerprint above
        self.prev_seq = call.seq

    def wait(self, call, parity: int, ranks) -> None:
        """Wait for `ranks` to publish this call, then check they called the same thing."""
        self._wait(call, ranks, call.seq)
        words, lines = self.seg.words, self.seg.lines
        a, b = _fp_words(call.fp)
        for r in ranks:
            base = lines[r] + 1 + parity * 3
            if words[base] != call.seq or words[base + 1] != a or words[base + 2] != b:
                raise self._mismatch_with(call, r)

    def _wait(self, call, ranks, seq: int) -> None:
        words, lines = self.seg.words, self.seg.lines
        pending = [r for r in ranks if words[lines[r]] < seq]
        if not pending:
            return
        backoff = Backoff(self.engine, call.deadline, self.ctx, call.seq, self.members,
                          functools.partial(self.cross_check, call))
        lost = self.engine.lost
        while pending:
            pending = [r for r in pending if words[lines[r]] < seq]
            if pending:
                backoff.idle(functools.partial(self._timeout, call, pending))
                for r in pending:
                    if self.members[r] in lost:  # left the job without entering this call
                        raise self.engine.lost_error(self.members[r])

    def _mismatch_with(self, call, r: int) -> CollectiveMismatchError:
        words, line = self.seg.words, self.seg.lines[r]
        for parity in (0, 1):
            base = line + 1 + parity * 3
            if words[base] == call.seq:
                theirs = _fp_from_words(words[base + 1], words[base + 2])
                mine = _fp_from_words(*_fp_words(call.fp))  # compared as stored: aux folded
                return self.engine.mismatch_error(call.what, mine, theirs, self.members[r])
        return CollectiveMismatchError(
            f"rank {self.engine.rank}: {call.what}: group rank {r} is out of step with this rank "
            f"(it published call #{words[line]})")

    def _timeout(self, call, pending: list[int]):
        from ..errors import TimeoutError

        world = [self.members[r] for r in pending]
        return TimeoutError(
            f"rank {self.engine.rank}: {call.what} timed out waiting for rank(s) "
            f"{', '.join(map(str, world))} to enter it (shared-memory path). The peer is stuck, "
            f"slower than the timeout, or never called this operation.")

    def cross_check(self, call) -> None:
        """A peer that sent messages for this call took the message path: it called otherwise."""
        for (peer, key), queue in list(self.engine.unexpected.items()):
            if key[0] == self.ctx and key[2] == call.seq and queue:
                raise self.engine.mismatch_error(call.what, call.fp, queue[0].header.fp, peer)

    def published(self, seq: int) -> list[tuple[int, Fingerprint]]:
        """(group rank, fingerprint) of peers that entered call `seq` through this path."""
        out = []
        words = self.seg.words
        for r, line in enumerate(self.seg.lines):
            for parity in (0, 1):
                base = line + 1 + parity * 3
                if r != self.rank and words[base] == seq:
                    out.append((r, _fp_from_words(words[base + 1], words[base + 2])))
        return out

    def slot(self, r: int, parity: int, nbytes: int) -> np.ndarray:
        return self.seg.slots[r][parity][:nbytes]


def _put(slot: np.ndarray, data: np.ndarray) -> None:
    if data.nbytes:
        slot[:data.nbytes] = data.reshape(-1).view(np.uint8)


def _typed(slot: np.ndarray, like: np.ndarray) -> np.ndarray:
    return slot[:like.nbytes].view(like.dtype)


def direct_all_reduce(dp: DirectPath, call, data: np.ndarray, op: ReduceOp) -> None:
    p = dp.enter(call)
    _put(dp.slot(dp.rank, p, data.nbytes), data)
    dp.publish(call, p)
    dp.wait(call, p, range(dp.size))
    np.copyto(data, _typed(dp.slot(0, p, data.nbytes), data))
    for r in range(1, dp.size):
        reduce_into(data, _typed(dp.slot(r, p, data.nbytes), data), op)


def direct_reduce(dp: DirectPath, call, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    p = dp.enter(call)
    _put(dp.slot(dp.rank, p, data.nbytes), data)
    dp.publish(call, p)
    if dp.rank != root:
        return
    dp.wait(call, p, range(dp.size))
    np.copyto(acc, _typed(dp.slot(0, p, data.nbytes), data))
    for r in range(1, dp.size):
        reduce_into(acc, _typed(dp.slot(r, p, data.nbytes), data), op)


def direct_broadcast(dp: DirectPath, call, data: np.ndarray, root: int) -> None:
    p = dp.enter(call)
    if dp.rank == root:
        _put(dp.slot(root, p, data.nbytes), data)
    dp.publish(call, p)
    if dp.rank != root:
        dp.wait(call, p, (root,))
        np.copyto(data, _typed(dp.slot(root, p, data.nbytes), data))


def direct_barrier(dp: DirectPath, call) -> None:
    p = dp.enter(call)
    dp.publish(call, p)
    dp.wait(call, p, range(dp.size))


def direct_all_gather(dp: DirectPath, call, data: np.ndarray, outs: list[np.ndarray]) -> None:
    p = dp.enter(call)
    _put(dp.slot(dp.rank, p, data.nbytes), data)
    dp.publish(call, p)
    dp.wait(call, p, range(dp.size))
    for r, out in enumerate(outs):
        if r != dp.rank or out.ctypes.data != data.ctypes.data:
            np.copyto(out, _typed(dp.slot(r, p, out.nbytes), out))


def direct_reduce_scatter(dp: DirectPath, call, blocks: list[np.ndarray], out: np.ndarray,
                          op: ReduceOp) -> None:
    """Every rank publishes all its blocks; rank r reduces block r of every slot, in rank order."""
    p = dp.enter(call)
    mine = dp.slot(dp.rank, p, dp.slot_bytes)
    offset = 0
    for b in blocks:
        _put(mine[offset:], b)
        offset += b.nbytes
    dp.publish(call, p)
    dp.wait(call, p, range(dp.size))
    start = sum(b.nbytes for b in blocks[:dp.rank])
    np.copyto(out, _typed(dp.slot(0, p, dp.slot_bytes)[start:], out))
    for r in range(1, dp.size):
        reduce_into(out, _typed(dp.slot(r, p, dp.slot_bytes)[start:], out), op)


def direct_all_to_all(dp: DirectPath, call, sends: list[np.ndarray], recvs: list[np.ndarray]) -> None:
    """Equal blocks only: block `rank` of peer r's slot is ours."""
    p = dp.enter(call)
    mine = dp.slot(dp.rank, p, dp.slot_bytes)
    offset = 0
    for b in sends:
        _put(mine[offset:], b)
        offset += b.nbytes
    dp.publish(call, p)
    dp.wait(call, p, range(dp.size))
    block = sends[0].nbytes
    for r, out in enumerate(recvs):
        np.copyto(out, _typed(dp.slot(r, p, dp.slot_bytes)[dp.rank * block:], out))
