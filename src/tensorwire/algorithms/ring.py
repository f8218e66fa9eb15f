"""Ring algorithms: bandwidth-optimal, each rank sends and receives (n-1)/n of the data per phase.

Receives reduce straight into the destination block as bytes arrive, so the reduce-scatter
phase of all_reduce moves every byte once through memory per step.
"""

from __future__ import annotations

import numpy as np

from ..buffers import copy
from ..ops import ReduceOp
from .base import P2P, blocks_of, exchange, split_counts
from .prices import Link
from .registry import Algorithm, register


def ring_reduce_scatter_blocks(p2p: P2P, blocks: list[np.ndarray], op: ReduceOp, shift: int,
                               inputs: list[np.ndarray] | None = None) -> None:
    """After this, rank r's block (r + shift) % n holds the reduction of that block over all ranks.

    With `inputs` (out of place), `blocks` start empty: every block is received exactly once
    before it is sent on, so it is first written as input op payload, and the one block sent
    before any receive goes straight from `inputs`."""
    n, r = p2p.size, p2p.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_i = (r - s + shift - 1) % n
        recv_i = (r - s + shift - 2) % n
        send = inputs[send_i] if inputs is not None and s == 0 else blocks[send_i]
        base = None if inputs is None else inputs[recv_i]
        exchange(p2p, right, send, left, blocks[recv_i], s, reduce=op, base=base)


def ring_all_gather_blocks(p2p: P2P, blocks: list[np.ndarray], step0: int = 0) -> None:
    """Every rank starts with its own block r filled and ends with all n blocks."""
    n, r = p2p.size, p2p.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        exchange(p2p, right, blocks[(r - s) % n], left, blocks[(r - s - 1) % n], step0 + s)


def ring_all_reduce(p2p: P2P, data: np.ndarray, op: ReduceOp, src: np.ndarray | None = None) -> None:
    """Reduce-scatter then all-gather around the ring; data is a flat array, reduced in place
    (or, given `src`, the reduction of src lands in data without copying src there first)."""
    n = p2p.size
    if n == 1 and src is not None:
        copy(data, src)
    counts = split_counts(len(data), n)
    blocks = blocks_of(data, counts)
    inputs = None if src is None else blocks_of(src, counts)
    # shift 1: rank r finishes the reduce-scatter owning block (r + 1) % n ...
    ring_reduce_scatter_blocks(p2p, blocks, op, shift=1, inputs=inputs)
    # ... so the all-gather starts one block ahead of the plain layout.
    rotated = [blocks[(i + 1) % n] for i in range(n)]
    ring_all_gather_blocks(p2p, rotated, step0=n)


def ring_reduce_scatter(p2p: P2P, blocks: list[np.ndarray], out: np.ndarray, op: ReduceOp) -> None:
    """The input blocks are kept: partial sums alternate between two scratch blocks (one is
    received while the other is sent on) and the last one, block `rank`, lands in `out`."""
    n, r = p2p.size, p2p.rank
    if n == 1:
        copy(out, blocks[0])
        return
    scratch = np.empty((2, max(b.size for b in blocks)), out.dtype)
    dest = list(blocks)  # the block sent first is never received: its entry is not used
    for s in range(n - 1):
        i = (r - s - 2) % n  # the block received at step s
        dest[i] = out if s == n - 2 else scratch[s % 2][:blocks[i].size]
    ring_reduce_scatter_blocks(p2p, dest, op, shift=0, inputs=blocks)


# Costs (Thakur, Rabenseifner & Gropp 2005), m = bytes of the collective's `size` as nccl-tests
# counts it: the buffer for all_reduce, the whole output for all_gather, the whole input for
# reduce_scatter.
def _all_reduce_cost(n: int, m: int, link: Link) -> float:
    return 2 * (n - 1) * link.alpha + (n - 1) / n * m * (2 * link.beta + link.gamma)


def _all_gather_cost(n: int, m: int, link: Link) -> float:
    return (n - 1) * link.alpha + (n - 1) / n * m * link.beta


def _reduce_scatter_cost(n: int, m: int, link: Link) -> float:
    return (n - 1) * link.alpha + (n - 1) / n * m * (link.beta + link.gamma)


register(Algorithm("ring", "all_reduce", ring_all_reduce, _all_reduce_cost, out_of_place=True,
                   fixed_partners=True))
register(Algorithm("ring", "all_gather", ring_all_gather_blocks, _all_gather_cost, fixed_partners=True))
register(Algorithm("ring", "reduce_scatter", ring_reduce_scatter, _reduce_scatter_cost, fixed_partners=True))
