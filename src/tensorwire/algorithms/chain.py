"""Pipelined chain broadcast for large messages: the buffer flows down the chain
root -> root+1 -> ... -> root-1 in segments, each rank forwarding segment s while it receives
segment s+1, so after the pipeline fills every link carries data at once.

With S segments the last rank has everything after n-2+S segment times instead of the
binomial tree's ceil(log2 n) whole-buffer times: for large m the chain approaches one m β.
S is the count that makes (n-2+S)(α + (m/S) β) least for the group's link, sqrt((n-2) m β / α):
more segments fill the pipeline sooner but pay α each, so the fewer bytes a link moves in one
α, the more segments (a 1 Gbit/s link with α = 100 us cuts 1 MiB into 13, loopback TCP into
about 8). Every rank derives S from the same agreed link constants (P2P.link).
"""

from __future__ import annotations

import math

import numpy as np

from .base import P2P
from .prices import Link
from .registry import Algorithm, register

MIN_SEGMENT_BYTES = 8 << 10
"""Below this a segment's α outweighs what it saves on every link tensorwire runs over."""


def best_segments(n: int, m: int, link: Link) -> float:
    """S for n ranks and m bytes over `link` (see the module's docstring), between one and as
    many as segments of MIN_SEGMENT_BYTES allow. Taken fractionally for pricing: the least
    time over a range that widens with m then grows with m (a whole S would drop it by a
    little where S steps up)."""
    if n <= 2:
        return 1.0
    most = max(1.0, m / MIN_SEGMENT_BYTES)
    if link.alpha <= 0:
        return most
    return max(1.0, min(math.sqrt((n - 2) * m * link.beta / link.alpha), most))


def segment_count(n: int, m: int, link: Link) -> int:
    """The whole number of segments a call runs with (best_segments rounded)."""
    return max(1, round(best_segments(n, m, link)))


def segments(data: np.ndarray, count: int) -> list[np.ndarray]:
    """`data` cut into `count` near-equal runs of whole elements (at least one, maybe empty)."""
    step = max(1, -(-len(data) // count))
    return [data[i:i + step] for i in range(0, max(len(data), 1), step)]


def chain_broadcast(p2p: P2P, data: np.ndarray, root: int) -> None:
    n, r = p2p.size, p2p.rank
    if n == 1:
        return
    vr = (r - root) % n
    segs = segments(data, segment_count(n, data.nbytes, p2p.link))
    nxt, last = (r + 1) % n, vr == n - 1
    if vr == 0:
        p2p.wait(*[p2p.isend(nxt, s, i) for i, s in enumerate(segs)])
        return
    prev = (r - 1) % n
    recvs = [p2p.irecv(prev, s, i) for i, s in enumerate(segs)]  # all posted: no unexpected copies
    sends = []
    for i, s in enumerate(segs):
        p2p.wait(recvs[i])
        if not last:
            sends.append(p2p.isend(nxt, s, i))
    p2p.wait(*sends)


def _cost(n: int, m: int, link: Link) -> float:
    """(n - 2 + S) (α + (m/S) β), S from best_segments."""
    if n == 1:
        return 0.0
    s = best_segments(n, m, link)
    return (n - 2 + s) * (link.alpha + m / s * link.beta)


def _work(n: int, m: int, link: Link) -> float:
    """n-1 hops of S segments each: (n-1)/n (S α + m β) per rank."""
    return (n - 1) / n * (best_segments(n, m, link) * link.alpha + m * link.beta)


register(Algorithm("chain", "broadcast", chain_broadcast, _cost, work=_work, fixed_partners=True))
