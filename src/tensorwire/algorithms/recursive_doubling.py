"""Recursive doubling: log2(n) exchange rounds of the whole buffer; latency-optimal for small data.

Non-powers of two fold the first 2*(n - p) ranks pairwise onto p = 2^floor(log2 n) ranks first
and hand the result back at the end (the usual MPICH scheme). In every combination the lower
rank's operand is on the left, so both partners compute bitwise the same value even for ops
that are not bitwise commutative (complex multiplication).
"""

from __future__ import annotations

import math

import numpy as np

from ..ops import ReduceOp, reduce_into
from .base import P2P
from .registry import Algorithm, Link, register

_RESULT_STEP = 1 << 20


def _combine(data: np.ndarray, incoming: np.ndarray, op: ReduceOp, mine_first: bool) -> None:
    """data = data op incoming if mine_first else incoming op data, in place in `data`."""
    if mine_first:
        reduce_into(data, incoming, op)
    else:
        reduce_into(incoming, data, op)
        np.copyto(data, incoming)


def recursive_doubling_all_reduce(p2p: P2P, data: np.ndarray, op: ReduceOp) -> None:
    n, r = p2p.size, p2p.rank
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    incoming = np.empty_like(data)
    if r < 2 * rem:
        if r % 2 == 0:
            p2p.wait(p2p.isend(r + 1, data, 0))
            p2p.wait(p2p.irecv(r + 1, data, _RESULT_STEP))
            return
        p2p.wait(p2p.irecv(r - 1, incoming, 0))
        _combine(data, incoming, op, mine_first=False)
        vr = r // 2
    else:
        vr = r - rem
    snapshot = np.empty_like(data)
    mask, step = 1, 0
    while mask < p:
        step += 1
        vpeer = vr ^ mask
        peer = vpeer * 2 + 1 if vpeer < rem else vpeer + rem
        np.copyto(snapshot, data)
        p2p.wait(p2p.isend(peer, snapshot, step), p2p.irecv(peer, incoming, step))
        _combine(data, incoming, op, mine_first=vr < vpeer)
        mask <<= 1
    if r < 2 * rem:
        p2p.wait(p2p.isend(r - 1, data, _RESULT_STEP))


def _cost(n: int, m: int, link: Link) -> float:
    """log2(p) full exchanges, plus the fold-in and hand-back for ranks beyond a power of two."""
    p = 1 << (n.bit_length() - 1)
    rounds = math.log2(p) + (2 if n > p else 0)
    return rounds * (link.alpha + m * link.beta) + (math.log2(p) + (n > p)) * m * link.gamma


register(Algorithm("recursive_doubling", "all_reduce", recursive_doubling_all_reduce, _cost))
