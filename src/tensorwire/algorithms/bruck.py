"""Bruck's algorithms: ceil(log2 n) rounds for any n, at distances 1, 2, 4, ... (Bruck et al.
1997; Thakur, Rabenseifner & Gropp 2005). Latency-optimal for small messages; the price is
local rotations of the data, and (all_to_all) each block travelling up to log2(n) times.

Both keep the data in "position" order relative to the rank, which is what lets every round
be one message whatever n is:

all_gather: position j of a scratch buffer holds rank (rank + j) mod n's block. Round k sends
positions [0, c) to rank - 2^k and receives positions [2^k, 2^k + c) from rank + 2^k, with
c = min(2^k, n - 2^k); the final rotation copies position j out to block (rank + j) mod n.

all_to_all: position j holds a block travelling j ranks forward (initially this rank's block
for rank + j). Round k sends every position with bit k set to rank + 2^k, which keeps it at
the same position; after the last round position j holds what rank - j sent here.
Blocks may differ in size (all_to_all with split sizes): a receiver knows the size of the
blocks that arrive at their destination (its own receive counts), but not of those still
travelling, so a round that moves such blocks first sends their sizes (a few int64s) ahead of
the data. Those rounds are the ones of distance 2^k with positions >= 2^(k+1): none for n <= 3.

Uneven all_to_all calls are priced by the tuner with each rank's own total, so ranks may pick
different algorithms for one call; Bruck then runs the pairwise exchange instead (see
`bruck_all_to_all`).
"""

from __future__ import annotations

import math

import numpy as np

from ..buffers import copy
from ..transport.wire import Coll
from .base import P2P, exchange, offsets_of, receive
from .pairwise import pairwise_all_to_all
from .prices import Link
from .registry import Algorithm, register


def bruck_all_gather(p2p: P2P, blocks: list[np.ndarray]) -> None:
    n, r = p2p.size, p2p.rank
    if n == 1:
        return
    order = [(r + j) % n for j in range(n)]  # position j -> the rank whose block it holds
    offs = offsets_of([blocks[i].size for i in order])
    buf = np.empty(offs[-1], dtype=blocks[r].dtype)
    buf[:offs[1]] = blocks[r]
    dist, step = 1, 0
    while dist < n:
        c = min(dist, n - dist)
        exchange(p2p, (r - dist) % n, buf[:offs[c]], (r + dist) % n, buf[offs[dist]:offs[dist + c]], step)
        dist <<= 1
        step += 1
    for j in range(1, n):
        copy(blocks[order[j]], buf[offs[j]:offs[j + 1]])


def _call_is(p2p: P2P, coll: Coll) -> bool:
    """Is this call the given collective? (One without a fingerprint: never.)"""
    return p2p.fp is not None and p2p.fp.coll == coll


def bruck_all_to_all(p2p: P2P, sends: list[np.ndarray], recvs: list[np.ndarray]) -> None:
    """Bruck's all_to_all, for equal or unequal blocks.

    A call in the vector form (fingerprint ALL_TO_ALLV: the list form, or split sizes) runs
    the pairwise exchange instead: the tuner priced it with this rank's own total, which
    differs between ranks when the splits do, so other ranks may have chosen pairwise for
    this very call, and every rank must run the same schedule. Looking at the block sizes
    cannot decide this: a rank sees only its own sends and receives, and those can be even
    on one rank and uneven on another. A bare P2P (no fingerprint) always runs Bruck, and
    sends the sizes of travelling blocks; an even call (ALL_TO_ALL) knows them all.
    """
    if _call_is(p2p, Coll.ALL_TO_ALLV):
        pairwise_all_to_all(p2p, sends, recvs)
        return
    n, r = p2p.size, p2p.rank
    copy(recvs[r], sends[r])
    if n == 1:
        return
    even = _call_is(p2p, Coll.ALL_TO_ALL)
    dtype = recvs[r].dtype
    held = [sends[(r + j) % n] for j in range(n)]  # read-only views until replaced
    sizes = np.array([b.size for b in held], dtype=np.int64)
    dist, step = 1, 0
    while dist < n:
        moving = [j for j in range(dist, n) if j & dist]
        # sizes the receiver cannot know (blocks still travelling), unless all blocks are equal
        travelling = [] if even else [j for j in moving if j >= 2 * dist]
        dst, src = (r + dist) % n, (r - dist) % n
        out = held[moving[0]] if len(moving) == 1 else np.concatenate([held[j] for j in moving])
        reqs = []
        if travelling:  # sizes and data leave at once; the data is received once the sizes are in
            reqs += [p2p.isend(dst, sizes[travelling], 2 * step), p2p.isend(dst, out, 2 * step + 1)]
            incoming_sizes = np.empty(len(travelling), dtype=np.int64)
            receive(p2p, src, incoming_sizes, 2 * step)
            sizes[travelling] = incoming_sizes
        for j in moving:
            if j < 2 * dist:  # arrived: the size is this rank's receive count from rank - j
                sizes[j] = recvs[(r - j) % n].size
        single = len(moving) == 1 and moving[0] < 2 * dist  # a single arriving block: in place
        into = recvs[(r - moving[0]) % n] if single else np.empty(int(sizes[moving].sum()), dtype=dtype)
        recv = p2p.irecv(src, into, 2 * step + 1)
        if not travelling:  # posted after the receive, so the peer's bytes need no detour
            reqs.append(p2p.isend(dst, out, 2 * step + 1))
        p2p.wait(recv, *reqs)
        start = 0
        for j in moving:
            held[j] = into if single else into[start:start + sizes[j]]
            start += int(sizes[j])
        dist <<= 1
        step += 1
    for j in range(1, n):
        if held[j] is not recvs[(r - j) % n]:
            copy(recvs[(r - j) % n], held[j])


# Costs (Thakur, Rabenseifner & Gropp 2005) plus the local rotation the paper describes but
# does not price: one pass over the result (all_gather) or over what each rank sends
# (all_to_all) through memory, priced at γ like any other memory-bound pass. It is what makes
# recursive doubling (no rotation) the cheaper all_gather for powers of two, where both take
# log2(n) rounds.
def _all_gather_cost(n: int, m: int, link: Link) -> float:
    """ceil(log2 n) α + (n-1)/n m β + m γ, m = the whole output."""
    if n == 1:
        return 0.0
    return math.ceil(math.log2(n)) * link.alpha + (n - 1) / n * m * link.beta + m * link.gamma


def _all_to_all_cost(n: int, m: int, link: Link) -> float:
    """ceil(log2 n) α + (Σ_k c_k / n) m β + m γ, m = what one rank sends, c_k = blocks moved in
    round k (n/2 for powers of two: the paper's log2(n) m/2 β)."""
    if n == 1:
        return 0.0
    rounds = math.ceil(math.log2(n))
    moved = sum(sum(1 for j in range(n) if j >> k & 1) for k in range(rounds))
    return rounds * link.alpha + moved / n * m * link.beta + m * link.gamma


register(Algorithm("bruck", "all_gather", bruck_all_gather, _all_gather_cost))
# exchanges: round k+1 forwards what round k received, so each round waits for the partner's
# previous one (docs/design/algorithms.md#bruck-all_to_all).
register(Algorithm("bruck", "all_to_all", bruck_all_to_all, _all_to_all_cost, exchanges=True))
