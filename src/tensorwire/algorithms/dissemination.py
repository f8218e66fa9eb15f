"""Dissemination barrier: ceil(log2 n) rounds; in round k each rank signals rank + 2^k."""

from __future__ import annotations

import math

import numpy as np

from .base import P2P, exchange
from .prices import Link
from .registry import Algorithm, register


def dissemination_barrier(p2p: P2P) -> None:
    """ceil(log2 n) rounds of empty messages at distance 1, 2, 4, ..."""
    n, r = p2p.size, p2p.rank
    empty = np.empty(0, dtype=np.uint8)
    dist, step = 1, 0
    while dist < n:
        exchange(p2p, (r + dist) % n, empty, (r - dist) % n, empty, step)
        dist <<= 1
        step += 1


def _cost(n: int, nbytes: int, link: Link) -> float:
    return math.ceil(math.log2(n)) * link.alpha if n > 1 else 0.0


register(Algorithm("dissemination", "barrier", dissemination_barrier, _cost))
