"""Broadcast as a binomial scatter followed by a ring all-gather (van de Geijn; Thakur,
Rabenseifner & Gropp 2005): the root's buffer is cut into n blocks, the tree hands block v to
virtual rank v = (rank - root) mod n, and the ring then circulates the blocks. Every rank
receives about 2 (n-1)/n of the buffer instead of the binomial tree's log2(n) whole copies.

The blocks are consecutive ranges of the buffer, so a subtree's blocks are one range and move
as one message, received in place; nothing is staged.
"""

from __future__ import annotations

import math

import numpy as np

from .base import P2P, blocks_of, offsets_of, receive, split_counts
from .prices import Link
from .registry import Algorithm, register
from .ring import ring_all_gather_blocks


def scatter_allgather_broadcast(p2p: P2P, data: np.ndarray, root: int) -> None:
    n, r = p2p.size, p2p.rank
    if n == 1:
        return
    counts = split_counts(len(data), n)  # block v belongs to virtual rank v
    offs = offsets_of(counts)
    vr = (r - root) % n
    if vr:
        low = vr & -vr
        top = min(vr + low, n)
        receive(p2p, (vr - low + root) % n, data[offs[vr]:offs[top]], 0)
    else:
        low = 1 << (n - 1).bit_length()
    sends, mask = [], low >> 1
    while mask:
        child = vr + mask
        if child < n:
            top = min(child + mask, n)
            sends.append(p2p.isend((child + root) % n, data[offs[child]:offs[top]], 0))
        mask >>= 1
    p2p.wait(*sends)
    blocks = blocks_of(data, counts)
    # the ring runs on real ranks: real rank i holds block (i - root) mod n
    ring_all_gather_blocks(p2p, [blocks[(i - root) % n] for i in range(n)], step0=1)


def _cost(n: int, m: int, link: Link) -> float:
    """Binomial scatter + ring all-gather: (ceil(log2 n) + n - 1) α + 2 (n-1)/n m β."""
    if n == 1:
        return 0.0
    return (math.ceil(math.log2(n)) + n - 1) * link.alpha + 2 * (n - 1) / n * m * link.beta


def _work(n: int, m: int, link: Link) -> float:
    """The scatter's n-1 messages carry log2(n)/2 m bytes in all (a block crosses as many
    edges as its depth); the ring keeps every rank busy: per rank
    ((n-1) α + log2(n)/2 m β) / n + (n-1) (α + m/n β)."""
    if n == 1:
        return 0.0
    scatter = ((n - 1) * link.alpha + math.log2(n) / 2 * m * link.beta) / n
    return scatter + (n - 1) * (link.alpha + m / n * link.beta)


register(Algorithm("scatter_allgather", "broadcast", scatter_allgather_broadcast, _cost, work=_work))
