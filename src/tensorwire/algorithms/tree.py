"""Binomial trees rooted anywhere: log2(n) rounds for broadcast and reduce."""

from __future__ import annotations

import math

import numpy as np

from ..ops import ReduceOp
from .base import P2P
from .registry import Algorithm, Link, register


def binomial_broadcast(p2p: P2P, data: np.ndarray, root: int) -> None:
    n = p2p.size
    vr = (p2p.rank - root) % n
    mask = 1
    while mask < n:
        if vr & mask:
            p2p.wait(p2p.irecv((vr - mask + root) % n, data, 0))
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
            if child < n:
                if current is not acc:
                    np.copyto(acc, current)
                    current = acc
                p2p.wait(p2p.irecv((child + root) % n, acc, mask, reduce=op))
        else:
            p2p.wait(p2p.isend(((vr & ~mask) + root) % n, current, mask))
            return
        mask <<= 1
    if current is not acc:
        np.copyto(acc, current)


def _broadcast_cost(n: int, m: int, link: Link) -> float:
    return math.ceil(math.log2(n)) * (link.alpha + m * link.beta) if n > 1 else 0.0


def _reduce_cost(n: int, m: int, link: Link) -> float:
    return math.ceil(math.log2(n)) * (link.alpha + m * (link.beta + link.gamma)) if n > 1 else 0.0


def _binomial_reduce(p2p: P2P, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    """Registry form: non-roots accumulate into scratch, so `acc` is written at the root only."""
    binomial_reduce(p2p, data, acc if p2p.rank == root else np.empty_like(data), op, root)


register(Algorithm("binomial", "broadcast", binomial_broadcast, _broadcast_cost))
register(Algorithm("binomial", "reduce", _binomial_reduce, _reduce_cost))
