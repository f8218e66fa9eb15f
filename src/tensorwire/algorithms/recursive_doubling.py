"""Recursive doubling and halving: log2(n) rounds between partners at distance 1, 2, 4, ...

all_reduce: every round exchanges the whole buffer; latency-optimal for small data. In every
combination the lower rank's operand is on the left, so both partners compute bitwise the same
value even for ops that are not bitwise commutative (complex multiplication).

all_gather (recursive doubling): round k exchanges the 2^k blocks each partner holds, so the
held range doubles every round. reduce_scatter (recursive halving): round k sends the half of
the current range the partner keeps and reduces the half this rank keeps, so the range halves
every round; each element is reduced on one rank only, so receive-and-reduce is safe.

Non-powers of two fold the first 2*(n - p) ranks pairwise onto p = 2^floor(log2 n) "virtual"
ranks first and hand the result back at the end (the usual MPICH scheme): virtual rank v < rem
is the odd rank 2v + 1 acting for real ranks 2v and 2v + 1, virtual rank v >= rem is rank
v + rem. Virtual ranks cover consecutive real ranks, so a range of virtual blocks is always one
contiguous range of the packed buffer. The halving and doubling loops are shared with
rabenseifner.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..buffers import copy
from ..ops import ReduceOp
from ..ops.kernels import reduce_into
from .base import P2P, contiguous_span, exchange, offsets_of, packed, receive
from .prices import Link
from .registry import Algorithm, register

_RESULT_STEP = 1 << 20


def _combine(data: np.ndarray, incoming: np.ndarray, op: ReduceOp, mine_first: bool) -> None:
    """data = data op incoming if mine_first else incoming op data, in place in `data`."""
    if mine_first:
        reduce_into(data, incoming, op)
    else:
        reduce_into(incoming, data, op)
        copy(data, incoming)


def recursive_doubling_all_reduce(p2p: P2P, data: np.ndarray, op: ReduceOp) -> None:
    n, r = p2p.size, p2p.rank
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    incoming = np.empty_like(data)
    if r < 2 * rem:
        if r % 2 == 0:
            p2p.wait(p2p.isend(r + 1, data, 0))
            receive(p2p, r + 1, data, _RESULT_STEP)
            return
        receive(p2p, r - 1, incoming, 0)
        _combine(data, incoming, op, mine_first=False)
        vr = r // 2
    else:
        vr = r - rem
    mask, step = 1, 0
    while mask < p:
        step += 1
        vpeer = vr ^ mask
        peer = vpeer * 2 + 1 if vpeer < rem else vpeer + rem
        # a send is done once its bytes are in the ring or the socket: `data` is free again
        # when both are done, and only then is the partner's half combined into it
        exchange(p2p, peer, data, peer, incoming, step)
        _combine(data, incoming, op, mine_first=vr < vpeer)
        mask <<= 1
    if r < 2 * rem:
        p2p.wait(p2p.isend(r - 1, data, _RESULT_STEP))


def _cost(n: int, m: int, link: Link) -> float:
    """log2(p) full exchanges, plus the fold-in and hand-back for ranks beyond a power of two."""
    p = 1 << (n.bit_length() - 1)
    rounds = math.log2(p) + (2 if n > p else 0)
    return rounds * (link.alpha + m * link.beta) + (math.log2(p) + (n > p)) * m * link.gamma


register(Algorithm("recursive_doubling", "all_reduce", recursive_doubling_all_reduce, _cost, exchanges=True))


# -- virtual ranks, and the halving / doubling loops over them ------------------------------------

def fold_shape(n: int) -> tuple[int, int]:
    """(p, rem): the power of two the group folds onto and how many ranks are folded away."""
    p = 1 << (n.bit_length() - 1)
    return p, n - p


def acting_rank(v: int, rem: int) -> int:
    """The real rank that acts for virtual rank v (the odd rank of a folded pair)."""
    return 2 * v + 1 if v < rem else v + rem


def first_rank(v: int, rem: int) -> int:
    """The first real rank virtual rank v stands for (v = p gives n: the end of the last range)."""
    return 2 * v if v < rem else v + rem


def halving_reduce_scatter(p2p: P2P, work: np.ndarray, bound: Callable[[int], int], vr: int, p: int,
                           peer_of: Callable[[int], int], op: ReduceOp, step0: int,
                           inputs: np.ndarray | None = None) -> int:
    """Recursive halving over p virtual ranks, in place in `work` (or, given `inputs`, reading
    them where they are: the first round sends their half and reduces into work = inputs op
    payload, and every later round only touches what the first one wrote).

    Afterwards work[bound(vr):bound(vr + 1)] holds that range reduced over all virtual ranks
    (bound(v) is the element offset where virtual block v starts). Each round sends the half
    of the current range the partner keeps and reduces the partner's copy of the other half
    into this rank's, as it arrives. Returns the next free step number.
    """
    lo, mask, step = 0, p >> 1, step0
    src = work if inputs is None else inputs
    while mask:
        vpeer = vr ^ mask
        mid = lo + mask
        keep, give = ((lo, mid), (mid, mid + mask)) if vr < vpeer else ((mid, mid + mask), (lo, mid))
        peer = peer_of(vpeer)
        kept = slice(bound(keep[0]), bound(keep[1]))
        exchange(p2p, peer, src[bound(give[0]):bound(give[1])], peer, work[kept], step, reduce=op,
                 base=None if src is work else src[kept])
        src = work
        lo = keep[0]
        mask >>= 1
        step += 1
    return step


def doubling_all_gather(p2p: P2P, buf: np.ndarray, bound: Callable[[int], int], vr: int, p: int,
                        peer_of: Callable[[int], int], step0: int) -> int:
    """Recursive doubling over p virtual ranks: virtual block vr of `buf` filled on entry, all
    of `buf` on exit. Round k exchanges the 2^k blocks each partner holds. Returns the next step."""
    mask, step = 1, step0
    while mask < p:
        mine = vr & ~(mask - 1)
        theirs = mine ^ mask
        peer = peer_of(vr ^ mask)
        ours, other = buf[bound(mine):bound(mine + mask)], buf[bound(theirs):bound(theirs + mask)]
        exchange(p2p, peer, ours, peer, other, step)
        mask <<= 1
        step += 1
    return step


# -- all_gather -----------------------------------------------------------------------------------

def recursive_doubling_all_gather(p2p: P2P, blocks: list[np.ndarray]) -> None:
    """log2(p) rounds of doubling ranges; works in the output when its blocks are one buffer
    (the single-tensor and vector forms), else through a packed scratch copy."""
    n, r = p2p.size, p2p.rank
    if n == 1:
        return
    offs = offsets_of([b.size for b in blocks])
    buf = contiguous_span(blocks)
    staged = buf is None
    if buf is None:
        buf = np.empty(offs[-1], dtype=blocks[r].dtype)
        buf[offs[r]:offs[r + 1]] = blocks[r]
    p, rem = fold_shape(n)
    if r < 2 * rem and r % 2 == 0:  # folded away: hand my block over, get everything back
        p2p.wait(p2p.isend(r + 1, buf[offs[r]:offs[r + 1]], 0))
        receive(p2p, r + 1, buf, _RESULT_STEP)
    else:
        if r < 2 * rem:
            receive(p2p, r - 1, buf[offs[r - 1]:offs[r]], 0)
        vr = r // 2 if r < 2 * rem else r - rem
        doubling_all_gather(p2p, buf, lambda v: offs[first_rank(v, rem)], vr, p,
                            lambda v: acting_rank(v, rem), 1)
        if r < 2 * rem:
            p2p.wait(p2p.isend(r - 1, buf, _RESULT_STEP))
    if staged:
        for i, b in enumerate(blocks):
            if i != r:
                copy(b, buf[offs[i]:offs[i + 1]])


# -- reduce_scatter -------------------------------------------------------------------------------

def recursive_halving_reduce_scatter(p2p: P2P, blocks: list[np.ndarray], out: np.ndarray,
                                     op: ReduceOp) -> None:
    """log2(p) rounds of halving ranges into a scratch buffer, the input read where it is (when
    its blocks form one span); block `rank` lands in `out`."""
    n, r = p2p.size, p2p.rank
    if n == 1:
        copy(out, blocks[0])
        return
    offs = offsets_of([b.size for b in blocks])
    p, rem = fold_shape(n)
    if r < 2 * rem and r % 2 == 0:  # folded away: my whole input to r + 1, my block back from it
        p2p.wait(p2p.isend(r + 1, packed(blocks), 0), p2p.irecv(r + 1, out, _RESULT_STEP))
        return
    work = np.empty(offs[-1], dtype=out.dtype)
    inputs: np.ndarray | None = packed(blocks)
    if r < 2 * rem:
        receive(p2p, r - 1, work, 0, reduce=op, base=inputs)
        inputs = None  # the fold wrote all of work
    vr = r // 2 if r < 2 * rem else r - rem
    halving_reduce_scatter(p2p, work, lambda v: offs[first_rank(v, rem)], vr, p,
                           lambda v: acting_rank(v, rem), op, 1, inputs)
    copy(out, work[offs[r]:offs[r + 1]])
    if r < 2 * rem:
        p2p.wait(p2p.isend(r - 1, work[offs[r - 1]:offs[r]], _RESULT_STEP))


# Costs (Thakur, Rabenseifner & Gropp 2005) with m = the whole output (all_gather) or the whole
# input (reduce_scatter). A non-power of two adds the fold: all_gather one block in (α + m/n β)
# and the whole result back (α + m β); reduce_scatter the whole input in (α + m β + m γ) and
# one block back (α + m/n β).
def _all_gather_cost(n: int, m: int, link: Link) -> float:
    p, rem = fold_shape(n)
    cost = math.log2(p) * link.alpha + (p - 1) / p * m * link.beta
    if rem:
        cost += 2 * link.alpha + (1 / n + 1) * m * link.beta
    return cost


def _reduce_scatter_cost(n: int, m: int, link: Link) -> float:
    p, rem = fold_shape(n)
    cost = math.log2(p) * link.alpha + (p - 1) / p * m * (link.beta + link.gamma)
    if rem:
        cost += 2 * link.alpha + (1 + 1 / n) * m * link.beta + m * link.gamma
    return cost


register(Algorithm("recursive_doubling", "all_gather", recursive_doubling_all_gather, _all_gather_cost))
register(Algorithm("recursive_halving", "reduce_scatter", recursive_halving_reduce_scatter,
                   _reduce_scatter_cost, exchanges=True))
