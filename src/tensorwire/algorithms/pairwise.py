"""Pairwise exchange all-to-all: n-1 steps, in step s each rank sends to rank+s and
receives from rank-s, so every step is a perfect matching and no link carries two messages."""

from __future__ import annotations

import numpy as np

from .base import P2P
from .registry import Algorithm, Link, register


def pairwise_all_to_all(p2p: P2P, send_blocks: list[np.ndarray], recv_blocks: list[np.ndarray]) -> None:
    """Step s: send to rank+s, receive from rank-s; one partner pair per step, n-1 steps."""
    n, r = p2p.size, p2p.rank
    np.copyto(recv_blocks[r], send_blocks[r])
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        p2p.wait(p2p.isend(dst, send_blocks[dst], s), p2p.irecv(src, recv_blocks[src], s))


def _pairwise_cost(n: int, nbytes: int, link: Link) -> float:
    return (n - 1) * (link.alpha + nbytes / n * link.beta)


register(Algorithm("pairwise", "all_to_all", pairwise_all_to_all, _pairwise_cost))
