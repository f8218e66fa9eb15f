"""Rank-ordered reductions: bitwise-reproducible all_reduce, reduce and reduce_scatter.

Floating-point addition is not associative, so ring and tree schedules, which combine the
contributions in an order that depends on the rank, the group size and the segment size,
give results that differ in the last bits from run to run of a different configuration.
Here every element is reduced as ((x0 op x1) op x2) ... op x(n-1), in rank order, whatever the
transport, group size or chunking: the same bits as the one-shot shared-memory path (which
folds its slots in rank order too) and as a plain numpy loop over the ranks' inputs.

Schedule: the buffer is cut into n blocks; block b belongs to rank b. Every rank posts the
sends of all foreign blocks to their owners at once (pairwise exchange), then the owner folds
the n contributions to its block strictly in rank order: it receives rank 0's block plainly,
then receives-and-reduces rank 1's, 2's, ... one after the other, inserting its own at its
turn. Contributions that arrive early wait, buffered by the engine. all_reduce then gathers
the reduced blocks to everyone, reduce gathers them at the root.

This is the only message-path reduction the tuner allows in deterministic mode
(TENSORWIRE_DETERMINISTIC=1, `init(deterministic=True)`); elsewhere its cost keeps it out of
the way of the faster schedules unless TENSORWIRE_ALGO forces it.
"""

from __future__ import annotations

import numpy as np

from ..buffers import copy
from ..ops import ReduceOp
from ..ops.kernels import reduce_into
from .base import P2P, blocks_of, receive, split_counts
from .prices import Link
from .registry import Algorithm, register
from .tree import gather_work

NAME = "rank_ordered"
_CONTRIBUTE, _GATHER = 0, 1  # message steps


def fold_in_rank_order(p2p: P2P, acc: np.ndarray, own: np.ndarray, op: ReduceOp, step: int) -> None:
    """acc = x0 op x1 op ... op x(n-1) where x_r is rank r's contribution and x_me is `own`.

    The contributions of the other ranks arrive as messages with tag `step`; they are taken
    one at a time in rank order, so the reduction order never depends on arrival order."""
    if acc.size == 0:
        return
    me = p2p.rank
    base = None  # rank 0's own where acc lies apart from it: acc = own op x1, with no copy first
    if me == 0 and acc is not own and p2p.size > 1 and not np.may_share_memory(acc, own):
        base = own
    for r in range(p2p.size):
        if r == me:
            if r == 0:
                if acc is not own and base is None:
                    copy(acc, own)
            else:
                reduce_into(acc, own, op)
        elif r == 0:
            receive(p2p, 0, acc, step)
        else:
            receive(p2p, r, acc, step, reduce=op, base=base if r == 1 else None)


def _send_foreign(p2p: P2P, blocks: list[np.ndarray], step: int) -> list:
    """Post the send of every non-empty block to the rank that owns it."""
    me = p2p.rank
    return [p2p.isend(r, b, step) for r, b in enumerate(blocks) if r != me and b.size]


def rank_ordered_all_reduce(p2p: P2P, data: np.ndarray, op: ReduceOp) -> None:
    n, me = p2p.size, p2p.rank
    blocks = blocks_of(data, split_counts(len(data), n))
    mine = blocks[me]
    sends = _send_foreign(p2p, blocks, _CONTRIBUTE)
    # Rank 0 folds in place (its own block comes first); the others need their block intact
    # until their turn, so they fold into scratch.
    acc = mine if me == 0 else np.empty_like(mine)
    fold_in_rank_order(p2p, acc, mine, op, _CONTRIBUTE)
    p2p.wait(*sends)  # before the gather overwrites the blocks they read
    if acc is not mine:
        copy(mine, acc)
    reqs = [p2p.isend(r, mine, _GATHER) for r in range(n) if r != me and mine.size]
    reqs += [p2p.irecv(r, b, _GATHER) for r, b in enumerate(blocks) if r != me and b.size]
    p2p.wait(*reqs)


def rank_ordered_reduce(p2p: P2P, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    """Result in `acc` at the root; `data` is only read (it may be `acc` itself at the root)."""
    n, me = p2p.size, p2p.rank
    counts = split_counts(len(data), n)
    blocks = blocks_of(data, counts)
    sends = _send_foreign(p2p, blocks, _CONTRIBUTE)
    part = np.empty_like(blocks[me])
    fold_in_rank_order(p2p, part, blocks[me], op, _CONTRIBUTE)
    p2p.wait(*sends)
    if me != root:
        if part.size:
            p2p.wait(p2p.isend(root, part, _GATHER))
        return
    out = blocks_of(acc, counts)
    reqs = [p2p.irecv(r, b, _GATHER) for r, b in enumerate(out) if r != me and b.size]
    copy(out[me], part)
    p2p.wait(*reqs)


def rank_ordered_reduce_scatter(p2p: P2P, blocks: list[np.ndarray], out: np.ndarray, op: ReduceOp) -> None:
    """out = the rank-ordered fold of every rank's blocks[rank]; the inputs are only read."""
    me = p2p.rank
    own = blocks[me]
    if own.size and np.may_share_memory(own, out):
        own = own.copy()  # out is about to receive rank 0's contribution
    sends = _send_foreign(p2p, blocks, _CONTRIBUTE)
    fold_in_rank_order(p2p, out, own, op, _CONTRIBUTE)
    p2p.wait(*sends)


# Costs, with m the collective's size as the tuner counts it. The exchange moves the same bytes
# as a ring reduce-scatter; on top come the copy of the folded block and, at worst, one more
# pass over the contributions that arrive before their turn and wait in a buffer (all but
# rank 0's and one's own): passes over local memory, so priced at γ like a reduction, not at
# the link's β (docs/design/cost-model.md#the-rank-ordered-folds-passes). The gather is one
# more exchange of the reduced blocks.
def _fold_cost(n: int, m: int, link: Link) -> float:
    return ((n - 1) * link.alpha + (n - 1) / n * m * (link.beta + link.gamma)
            + (max(n - 2, 0) + 1) / n * m * link.gamma)


def _gather_cost(n: int, m: int, link: Link) -> float:
    return (n - 1) * link.alpha + (n - 1) / n * m * link.beta


def _all_reduce_cost(n: int, m: int, link: Link) -> float:
    return _fold_cost(n, m, link) + _gather_cost(n, m, link)


def _reduce_scatter_cost(n: int, m: int, link: Link) -> float:
    return _fold_cost(n, m, link)


def _reduce_work(n: int, m: int, link: Link) -> float:
    """Every rank folds its block; the gather to the root is a gather's work, not the root's
    receives on every rank."""
    return _fold_cost(n, m, link) + gather_work(n, m, link)


# they fold in group-rank order: a topology-aware order would change the bits
register(Algorithm(NAME, "all_reduce", rank_ordered_all_reduce, _all_reduce_cost, reorder=False))
register(Algorithm(NAME, "reduce", rank_ordered_reduce, _all_reduce_cost, work=_reduce_work, reorder=False))
register(Algorithm(NAME, "reduce_scatter", rank_ordered_reduce_scatter, _reduce_scatter_cost,
                   reorder=False))
