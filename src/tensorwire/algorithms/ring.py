"""Ring algorithms: bandwidth-optimal, each rank sends and receives (n-1)/n of the data per phase.

Receives reduce straight into the destination block as bytes arrive, so the reduce-scatter
phase of all_reduce moves every byte once through memory per step.
"""

from __future__ import annotations

import numpy as np

from ..ops import ReduceOp
from .base import P2P, blocks_of, exchange, split_counts
from .registry import Algorithm, Link, register


def ring_reduce_scatter_blocks(p2p: P2P, blocks: list[np.ndarray], op: ReduceOp, shift: int) -> None:
    """After this, rank r's block (r + shift) % n holds the reduction of that block over all ranks."""
    n, r = p2p.size, p2p.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_i = (r - s + shift - 1) % n
        recv_i = (r - s + shift - 2) % n
        exchange(p2p, right, blocks[send_i], left, blocks[recv_i], s, reduce=op)


def ring_all_gather_blocks(p2p: P2P, blocks: list[np.ndarray], step0: int = 0) -> None:
    """Every rank starts with its own block r filled and ends with all n blocks."""
    n, r = p2p.size, p2p.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        exchange(p2p, right, blocks[(r - s) % n], left, blocks[(r - s - 1) % n], step0 + s)


def ring_all_reduce(p2p: P2P, data: np.ndarray, op: ReduceOp) -> None:
    """Reduce-scatter then all-gather around the ring; data is a flat array, reduced in place."""
    n = p2p.size
    blocks = blocks_of(data, split_counts(len(data), n))
    # shift 1: rank r finishes the reduce-scatter owning block (r + 1) % n ...
    ring_reduce_scatter_blocks(p2p, blocks, op, shift=1)
    # ... so the all-gather starts one block ahead of the plain layout.
    rotated = [blocks[(i + 1) % n] for i in range(n)]
    ring_all_gather_blocks(p2p, rotated, step0=n)


def ring_reduce_scatter(p2p: P2P, blocks: list[np.ndarray], out: np.ndarray, op: ReduceOp) -> None:
    """Reduces scratch copies of the input blocks around the ring; block `rank` lands in `out`."""
    work = [b.copy() for b in blocks]
    ring_reduce_scatter_blocks(p2p, work, op, shift=0)
    np.copyto(out, work[p2p.rank])


# Costs (Thakur, Rabenseifner & Gropp 2005), m = bytes of the collective's `size` as nccl-tests
# counts it: the buffer for all_reduce, the whole output for all_gather, the whole input for
# reduce_scatter.
def _all_reduce_cost(n: int, m: int, link: Link) -> float:
    return 2 * (n - 1) * link.alpha + (n - 1) / n * m * (2 * link.beta + link.gamma)


def _all_gather_cost(n: int, m: int, link: Link) -> float:
    return (n - 1) * link.alpha + (n - 1) / n * m * link.beta


def _reduce_scatter_cost(n: int, m: int, link: Link) -> float:
    return (n - 1) * link.alpha + (n - 1) / n * m * (link.beta + link.gamma)


register(Algorithm("ring", "all_reduce", ring_all_reduce, _all_reduce_cost))
register(Algorithm("ring", "all_gather", ring_all_gather_blocks, _all_gather_cost))
register(Algorithm("ring", "reduce_scatter", ring_reduce_scatter, _reduce_scatter_cost))
