"""Pipelined chain broadcast for large messages: the buffer flows down the chain
root -> root+1 -> ... -> root-1 in segments, each rank forwarding segment s while it receives
segment s+1, so after the pipeline fills every link carries data at once.

With S segments the last rank has everything after n-2+S segment times instead of the
binomial tree's ceil(log2 n) whole-buffer times: for large m the chain approaches one m β.
Segments are SEGMENT_BYTES (512 KiB, within the 256 KiB - 1 MiB range where a segment's
α is small next to its β on both shared memory and TCP here), whole elements.
"""

from __future__ import annotations

import numpy as np

from .base import P2P
from .registry import Algorithm, Link, register

SEGMENT_BYTES = 512 << 10


def segments(data: np.ndarray) -> list[np.ndarray]:
    """The segments every rank cuts the buffer into (at least one, maybe empty)."""
    step = max(1, SEGMENT_BYTES // max(1, data.itemsize))
    return [data[i:i + step] for i in range(0, max(len(data), 1), step)]


def chain_broadcast(p2p: P2P, data: np.ndarray, root: int) -> None:
    n, r = p2p.size, p2p.rank
    if n == 1:
        return
    vr = (r - root) % n
    segs = segments(data)
    nxt = (r + 1) % n if vr < n - 1 else None
    if vr == 0:
        p2p.wait(*[p2p.isend(nxt, s, i) for i, s in enumerate(segs)])
        return
    prev = (r - 1) % n
    recvs = [p2p.irecv(prev, s, i) for i, s in enumerate(segs)]  # all posted: no unexpected copies
    sends = []
    for i, s in enumerate(segs):
        p2p.wait(recvs[i])
        if nxt is not None:
            sends.append(p2p.isend(nxt, s, i))
    p2p.wait(*sends)


def _cost(n: int, m: int, link: Link) -> float:
    """(n - 2 + S) (α + (m/S) β) with S = m / SEGMENT_BYTES segments (at least one). S is taken
    fractionally, so the last, partial segment is priced pro rata: that keeps the formula
    monotonic in m (with a whole extra segment the price would drop as m grows past a
    segment boundary, since more segments fill the pipeline faster)."""
    if n == 1:
        return 0.0
    s = max(1.0, m / SEGMENT_BYTES)
    return (n - 2 + s) * (link.alpha + m / s * link.beta)


def _work(n: int, m: int, link: Link) -> float:
    """n-1 hops of S segments each: (n-1)/n (S α + m β) per rank."""
    return (n - 1) / n * (max(1.0, m / SEGMENT_BYTES) * link.alpha + m * link.beta)


register(Algorithm("chain", "broadcast", chain_broadcast, _cost, work=_work, fixed_partners=True))
