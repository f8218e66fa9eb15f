"""Binomial trees rooted anywhere: ceil(log2 n) rounds for broadcast, reduce, gather, scatter,
and all_reduce as a binomial reduce to rank 0 followed by a binomial broadcast from it.

Ranks are renumbered relative to the root (virtual rank v = (rank - root) mod n). Virtual rank
v > 0 has parent v - lowbit(v); its subtree is the virtual ranks [v, v + lowbit(v)) that exist,
and its children are v + 2^k for 2^k < lowbit(v). The root's subtree is everyone.

Gather and scatter move whole subtrees as one message. Vector forms (gatherv, scatterv) give
each rank only its own count, so an edge whose receiver cannot know the subtree's counts
carries them first in a small int64 message: in gather every edge to a non-root parent (the
root knows every count), in scatter every edge to a non-leaf child (a leaf knows its own).
"""

from __future__ import annotations

import math

import numpy as np

from ..buffers import copy
from ..ops import ReduceOp
from .base import P2P, receive
from .prices import Link
from .registry import Algorithm, register


def binomial_broadcast(p2p: P2P, data: np.ndarray, root: int) -> None:
    n = p2p.size
    vr = (p2p.rank - root) % n
    mask = 1
    while mask < n:
        if vr & mask:
            receive(p2p, (vr - mask + root) % n, data, 0)
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if vr + mask < n:
            sends.append(p2p.isend((vr + mask + root) % n, data, 0))
        mask >>= 1
    p2p.wait(*sends)


def binomial_reduce(p2p: P2P, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    """`acc` receives the partial reduction (the result at the root); `data` is left untouched
    unless it is `acc` itself. Leaves never receive, so they send `data` without copying it."""
    n = p2p.size
    vr = (p2p.rank - root) % n
    mask = 1
    current = data
    while mask < n:
        if vr & mask == 0:
            child = vr | mask
            if child < n:  # acc = current op the child's, with no copy of current first where apart
                base = None
                if current is not acc:
                    if np.may_share_memory(acc, current):
                        copy(acc, current)
                    else:
                        base = current
                    current = acc
                receive(p2p, (child + root) % n, acc, mask, reduce=op, base=base)
        else:
            p2p.wait(p2p.isend(((vr & ~mask) + root) % n, current, mask))
            return
        mask <<= 1
    if current is not acc:
        copy(acc, current)


def _broadcast_cost(n: int, m: int, link: Link) -> float:
    return math.ceil(math.log2(n)) * (link.alpha + m * link.beta) if n > 1 else 0.0


def _reduce_cost(n: int, m: int, link: Link) -> float:
    return math.ceil(math.log2(n)) * (link.alpha + m * (link.beta + link.gamma)) if n > 1 else 0.0


def _broadcast_work(n: int, m: int, link: Link) -> float:
    """n-1 messages of m in all, a sender's and a receiver's half each: (n-1)/n (α + m β) per rank."""
    return (n - 1) / n * (link.alpha + m * link.beta)


def reduce_work(n: int, m: int, link: Link) -> float:
    """n-1 messages, each reduced once: (n-1)/n (α + m β + m γ) per rank (a linear reduce too)."""
    return (n - 1) / n * (link.alpha + m * (link.beta + link.gamma))


def _binomial_reduce(p2p: P2P, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    """Registry form: non-roots accumulate into scratch, so `acc` is written at the root only."""
    binomial_reduce(p2p, data, acc if p2p.rank == root else np.empty_like(data), op, root)


def tree_all_reduce(p2p: P2P, data: np.ndarray, op: ReduceOp) -> None:
    """Binomial reduce onto rank 0 in place, then binomial broadcast from it. The result is
    computed once, on rank 0, so every rank gets the same bits."""
    binomial_reduce(p2p, data, data, op, 0)  # steps 1, 2, 4, ...
    binomial_broadcast(p2p, data, 0)  # step 0


def _all_reduce_cost(n: int, m: int, link: Link) -> float:
    """Reduce then broadcast: 2 ceil(log2 n) (α + m β) + ceil(log2 n) m γ."""
    return _reduce_cost(n, m, link) + _broadcast_cost(n, m, link)


def _all_reduce_work(n: int, m: int, link: Link) -> float:
    return reduce_work(n, m, link) + _broadcast_work(n, m, link)


# -- gather and scatter ---------------------------------------------------------------------------

_SIZES_STEP, _DATA_STEP = 0, 1


def _subtree(v: int, n: int) -> int:
    """How many virtual ranks the subtree of v holds (all n for the root)."""
    return n if v == 0 else min(v & -v, n - v)


def _children(v: int, n: int) -> list[int]:
    """Children of virtual rank v, nearest (smallest subtree) first."""
    span = 1 << (n - 1).bit_length() if v == 0 else v & -v
    out, mask = [], 1
    while mask < span and v + mask < n:
        out.append(v + mask)
        mask <<= 1
    return out


def binomial_gather(p2p: P2P, send: np.ndarray, recv_blocks: list[np.ndarray] | None, root: int) -> None:
    n, r = p2p.size, p2p.rank
    vr = (r - root) % n

    def real(v: int) -> int:
        return (v + root) % n

    kids = _children(vr, n)
    if vr == 0:
        assert recv_blocks is not None
        if recv_blocks[root] is not send:
            copy(recv_blocks[root], send)
        if n == 2:  # one child, a leaf: its one message straight into its block
            receive(p2p, real(1), recv_blocks[real(1)], _DATA_STEP)
            return
        reqs, unpack = [], []
        for c in kids:
            size = _subtree(c, n)
            if size == 1:  # a leaf: straight into its output block
                reqs.append(p2p.irecv(real(c), recv_blocks[real(c)], _DATA_STEP))
                continue
            dests = [recv_blocks[real(v)] for v in range(c, c + size)]
            tmp = np.empty(sum(d.size for d in dests), dtype=send.dtype)
            reqs.append(p2p.irecv(real(c), tmp, _DATA_STEP))
            unpack.append((tmp, dests))
        p2p.wait(*reqs)
        for tmp, dests in unpack:
            start = 0
            for d in dests:
                copy(d, tmp[start:start + d.size])
                start += d.size
        return
    parent = real(vr - (vr & -vr))
    tell_parent = vr - (vr & -vr) != 0  # the root knows every count already
    if not kids:
        reqs = [p2p.isend(parent, np.array([send.size], dtype=np.int64), _SIZES_STEP)] if tell_parent else []
        p2p.wait(p2p.isend(parent, send, _DATA_STEP), *reqs)
        return
    counts = [np.empty(_subtree(c, n), dtype=np.int64) for c in kids]
    p2p.wait(*[p2p.irecv(real(c), cnt, _SIZES_STEP) for c, cnt in zip(kids, counts)])
    mine = np.concatenate([np.array([send.size], dtype=np.int64), *counts])
    sends = [p2p.isend(parent, mine, _SIZES_STEP)] if tell_parent else []
    buf = np.empty(int(mine.sum()), dtype=send.dtype)
    buf[:send.size] = send
    reqs, start = [], send.size
    for c, cnt in zip(kids, counts):
        total = int(cnt.sum())
        reqs.append(p2p.irecv(real(c), buf[start:start + total], _DATA_STEP))
        start += total
    p2p.wait(*reqs)
    p2p.wait(p2p.isend(parent, buf, _DATA_STEP), *sends)


def binomial_scatter(p2p: P2P, send_blocks: list[np.ndarray] | None, recv: np.ndarray, root: int) -> None:
    n, r = p2p.size, p2p.rank
    vr = (r - root) % n

    def real(v: int) -> int:
        return (v + root) % n

    kids = _children(vr, n)[::-1]  # farthest (largest subtree) first: it has the most to forward
    if vr == 0:
        assert send_blocks is not None
        if send_blocks[root] is not recv:
            copy(recv, send_blocks[root])
        reqs = []
        for c in kids:
            size = _subtree(c, n)
            if size == 1:
                reqs.append(p2p.isend(real(c), send_blocks[real(c)], _DATA_STEP))
                continue
            srcs = [send_blocks[real(v)] for v in range(c, c + size)]
            reqs.append(p2p.isend(real(c), np.array([s.size for s in srcs], dtype=np.int64), _SIZES_STEP))
            reqs.append(p2p.isend(real(c), np.concatenate(srcs), _DATA_STEP))
        p2p.wait(*reqs)
        return
    parent = real(vr - (vr & -vr))
    if not kids:
        receive(p2p, parent, recv, _DATA_STEP)
        return
    counts = np.empty(_subtree(vr, n), dtype=np.int64)
    receive(p2p, parent, counts, _SIZES_STEP)
    offs = np.concatenate([[0], np.cumsum(counts)]).tolist()
    buf = np.empty(offs[-1], dtype=recv.dtype)
    receive(p2p, parent, buf, _DATA_STEP)
    copy(recv, buf[:offs[1]])
    reqs = []
    for c in kids:
        lo, hi = c - vr, c - vr + _subtree(c, n)
        if hi - lo > 1:
            reqs.append(p2p.isend(real(c), counts[lo:hi], _SIZES_STEP))
        reqs.append(p2p.isend(real(c), buf[offs[lo]:offs[hi]], _DATA_STEP))
    p2p.wait(*reqs)


def _gather_cost(n: int, m: int, link: Link) -> float:
    """ceil(log2 n) α + (n-1)/n m β, m = all blocks together. The β term is written exactly as
    linear.py's, so the choice between the two depends on n alone, never on m (the gather's
    tree copies no more than the root's receives do)."""
    return math.ceil(math.log2(n)) * link.alpha + (n - 1) / n * m * link.beta if n > 1 else 0.0


def _scatter_cost(n: int, m: int, link: Link) -> float:
    """ceil(log2 n) α + the longest path of binomial_scatter as written: the root concatenates
    each non-leaf child's blocks before sending them, a non-leaf copies its own block out of
    what it received before it forwards (store and forward), and every rank sends to its
    children one after another, farthest first. Sends cost β, local copies γ (a pass over
    memory, like a reduction). Fewer latencies than the linear scatter's n-1 but more bytes
    (docs/design/algorithms.md#tree-scatter). The choice depends on m, which every rank of a
    scatter or scatterv knows alike (the fingerprint carries it: counts that sum differently
    fail as a mismatch)."""
    block = m / n

    def longest(v: int, t: float) -> float:
        kids = _children(v, n)[::-1]
        t += block * link.gamma if v and kids else 0.0
        latest = t
        for c in kids:
            size = _subtree(c, n) * block
            t += size * (link.beta + (link.gamma if v == 0 and size > block else 0.0))
            latest = max(latest, longest(c, t))
        return latest

    return math.ceil(math.log2(n)) * link.alpha + longest(0, 0.0) if n > 1 else 0.0


def gather_work(n: int, m: int, link: Link) -> float:
    """Every block crosses to or from the root once: (n-1)/n (α + m/n β) per rank. Both gathers
    and both scatters declare this one work: where it bounds them all, the critical path
    breaks the tie (cost_model.price)."""
    return (n - 1) / n * (link.alpha + m / n * link.beta) if n > 1 else 0.0


register(Algorithm("binomial", "broadcast", binomial_broadcast, _broadcast_cost, work=_broadcast_work,
                   one_way=True))
register(Algorithm("binomial", "reduce", _binomial_reduce, _reduce_cost, work=reduce_work, one_way=True))
register(Algorithm("tree", "all_reduce", tree_all_reduce, _all_reduce_cost, work=_all_reduce_work,
                   one_way=True))
register(Algorithm("binomial", "gather", binomial_gather, _gather_cost, work=gather_work, one_way=True))
register(Algorithm("binomial", "scatter", binomial_scatter, _scatter_cost, work=gather_work, one_way=True))
