"""Recursive doubling: log2(n) exchange rounds of the whole buffer; latency-optimal for small data.

Non-powers of two fold the first 2*(n - p) ranks pairwise onto p = 2^floor(log2 n) ranks first
and hand the result back at the end (the usual MPICH scheme).
"""

from __future__ import annotations

import numpy as np

from ..ops import ReduceOp
from .base import P2P


def recursive_doubling_all_reduce(p2p: P2P, data: np.ndarray, op: ReduceOp) -> None:
    n, r = p2p.size, p2p.rank
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    step = 0
    if r < 2 * rem:
        if r % 2 == 0:
            p2p.wait(p2p.isend(r + 1, data, step))
            p2p.wait(p2p.irecv(r + 1, data, 1 << 20))
            return
        p2p.wait(p2p.irecv(r - 1, data, step, reduce=op))
        vr = r // 2
    else:
        vr = r - rem
    snapshot = np.empty_like(data)
    mask = 1
    while mask < p:
        step += 1
        vpeer = vr ^ mask
        peer = vpeer * 2 + 1 if vpeer < rem else vpeer + rem
        np.copyto(snapshot, data)
        p2p.wait(p2p.isend(peer, snapshot, step), p2p.irecv(peer, data, step, reduce=op))
        mask <<= 1
    if r < 2 * rem:
        p2p.wait(p2p.isend(r - 1, data, 1 << 20))
