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
from .registry import Algorithm, Link, register


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
        self.prev_fp = (0, 0)
        self.prev_call = None

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    # -- the protocol -----------------------------------------------------------------------------
    def enter(self, call) -> int:
        """Take the next slot parity, once every rank is past the call that last used it.

        Every rank published that previous call, so its fingerprints are checked here too: a
        rank that returned without waiting (a broadcast root) learns of a mismatch now."""
        self.parity ^= 1
        if self.prev_seq:
            self._wait(call, range(self.size), self.prev_seq)
            words, lines = self.seg.words, self.seg.lines
            base = 1 + (self.parity ^ 1) * 3
            for r in range(self.size):
                line = lines[r] + base
                if words[line] == self.prev_seq and (words[line + 1], words[line + 2]) != self.prev_fp:
                    theirs = _fp_from_words(words[line + 1], words[line + 2])
                    raise self.engine.mismatch_error(
                        f"{self.prev_call.what} (found at {call.what})",
                        _fp_from_words(*self.prev_fp), theirs, self.members[r])
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
        self.prev_fp = (a, b)
        self.prev_call = call

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
                    # gone, and (re-read after the loss was noticed) never entered this call
                    if self.members[r] in lost and words[lines[r]] < seq:
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


def _publish_all(dp: DirectPath, call, arrays: list[np.ndarray]) -> int:
    """Enter, copy `arrays` back to back into this rank's slot, publish, wait for everyone."""
    p = dp.enter(call)
    mine = dp.slot(dp.rank, p, dp.slot_bytes)
    offset = 0
    for a in arrays:
        _put(mine[offset:], a)
        offset += a.nbytes
    dp.publish(call, p)
    dp.wait(call, p, range(dp.size))
    return p


def _fold(dp: DirectPath, p: int, out: np.ndarray, offset: int, op: ReduceOp) -> None:
    """out = slot_0 op slot_1 op ... in rank order (the same bits on every rank)."""
    np.copyto(out, _typed(dp.slot(0, p, dp.slot_bytes)[offset:], out))
    for r in range(1, dp.size):
        reduce_into(out, _typed(dp.slot(r, p, dp.slot_bytes)[offset:], out), op)


def direct_all_reduce(call, data: np.ndarray, op: ReduceOp) -> None:
    dp = call.group.direct
    p = _publish_all(dp, call, [data])
    _fold(dp, p, data, 0, op)


def direct_reduce(call, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    dp = call.group.direct
    p = dp.enter(call)
    _put(dp.slot(dp.rank, p, data.nbytes), data)
    dp.publish(call, p)
    if dp.rank == root:
        dp.wait(call, p, range(dp.size))
        _fold(dp, p, acc, 0, op)


def direct_broadcast(call, data: np.ndarray, root: int) -> None:
    dp = call.group.direct
    p = dp.enter(call)
    if dp.rank == root:
        _put(dp.slot(root, p, data.nbytes), data)
    dp.publish(call, p)
    if dp.rank != root:
        dp.wait(call, p, (root,))
        np.copyto(data, _typed(dp.slot(root, p, data.nbytes), data))


def direct_barrier(call) -> None:
    dp = call.group.direct
    p = dp.enter(call)
    dp.publish(call, p)
    dp.wait(call, p, range(dp.size))


def direct_all_gather(call, blocks: list[np.ndarray]) -> None:
    dp = call.group.direct
    p = _publish_all(dp, call, [blocks[dp.rank]])
    for r, out in enumerate(blocks):
        if r != dp.rank:
            np.copyto(out, _typed(dp.slot(r, p, out.nbytes), out))


def direct_reduce_scatter(call, blocks: list[np.ndarray], out: np.ndarray, op: ReduceOp) -> None:
    """Every rank publishes all its blocks; rank r folds block r of every slot, in rank order."""
    dp = call.group.direct
    p = _publish_all(dp, call, blocks)
    _fold(dp, p, out, sum(b.nbytes for b in blocks[:dp.rank]), op)


def direct_all_to_all(call, sends: list[np.ndarray], recvs: list[np.ndarray]) -> None:
    """Equal blocks only: block `rank` of peer r's slot is ours."""
    dp = call.group.direct
    p = _publish_all(dp, call, sends)
    block = sends[0].nbytes
    for r, out in enumerate(recvs):
        np.copyto(out, _typed(dp.slot(r, p, dp.slot_bytes)[dp.rank * block:], out))


# Cost: one flag round (α), the bytes copied into the slot and read out of slots (β), and the
# bytes reduced (γ), as multiples of m (the collective's size as nccl-tests counts it).
_VOLUMES = {  # collective: (copied in, read, reduced) as functions of n
    "all_reduce": (lambda n: 1, lambda n: n, lambda n: n - 1),
    "reduce": (lambda n: 1, lambda n: n, lambda n: n - 1),
    "broadcast": (lambda n: 1, lambda n: 1, lambda n: 0),
    "barrier": (lambda n: 0, lambda n: 0, lambda n: 0),
    "all_gather": (lambda n: 1 / n, lambda n: 1, lambda n: 0),
    "reduce_scatter": (lambda n: 1, lambda n: 1, lambda n: (n - 1) / n),
    "all_to_all": (lambda n: 1, lambda n: 1, lambda n: 0),
}
_RUN = {"all_reduce": direct_all_reduce, "reduce": direct_reduce, "broadcast": direct_broadcast,
        "barrier": direct_barrier, "all_gather": direct_all_gather,
        "reduce_scatter": direct_reduce_scatter, "all_to_all": direct_all_to_all}


def _cost_of(collective: str):
    copied, read, reduced = _VOLUMES[collective]

    def cost(n: int, m: int, link: Link) -> float:
        return link.alpha + (copied(n) + read(n)) * m * link.beta + reduced(n) * m * link.gamma
    return cost


for _collective, _run in _RUN.items():
    register(Algorithm("direct", _collective, _run, _cost_of(_collective), needs_direct=True))
