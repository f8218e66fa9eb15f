"""Pairwise exchange: n-1 steps, in step s each rank sends to rank+s and receives from rank-s,
so every step is a perfect matching and no link carries two messages.

all_to_all sends block rank+s and receives block rank-s. reduce_scatter sends the input block
owned by rank+s and reduces what rank-s sends of this rank's block into the output as it
arrives: no scratch copy of the input, and each output element is reduced on one rank only."""

from __future__ import annotations

import numpy as np

from ..buffers import copy
from ..ops import ReduceOp
from .base import P2P, exchange
from .prices import Link
from .registry import Algorithm, register


def pairwise_all_to_all(p2p: P2P, send_blocks: list[np.ndarray], recv_blocks: list[np.ndarray]) -> None:
    """Step s: send to rank+s, receive from rank-s; one partner pair per step, n-1 steps."""
    n, r = p2p.size, p2p.rank
    copy(recv_blocks[r], send_blocks[r])
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        exchange(p2p, dst, send_blocks[dst], src, recv_blocks[src], s)


def _own_block(n: int, m: int, link: Link) -> float:
    """Both collectives first copy this rank's own block: a local pass, priced at γ as the
    other local passes are (docs/design/algorithms.md#pairwise-own-block)."""
    return m / n * link.gamma


def _pairwise_cost(n: int, nbytes: int, link: Link) -> float:
    return (n - 1) * (link.alpha + nbytes / n * link.beta) + _own_block(n, nbytes, link)


def pairwise_reduce_scatter(p2p: P2P, blocks: list[np.ndarray], out: np.ndarray, op: ReduceOp) -> None:
    """Step s: my copy of block rank+s to its owner; rank-s's copy of my block reduced into `out`."""
    n, r = p2p.size, p2p.rank
    copy(out, blocks[r])
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        exchange(p2p, dst, blocks[dst], src, out, s, reduce=op)


def _reduce_scatter_cost(n: int, m: int, link: Link) -> float:
    """(n-1) α + (n-1)/n m (β + γ) + the own block, m = the whole input."""
    return (n - 1) * link.alpha + (n - 1) / n * m * (link.beta + link.gamma) + _own_block(n, m, link)


register(Algorithm("pairwise", "all_to_all", pairwise_all_to_all, _pairwise_cost))
register(Algorithm("pairwise", "reduce_scatter", pairwise_reduce_scatter, _reduce_scatter_cost))
