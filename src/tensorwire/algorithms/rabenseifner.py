"""Rabenseifner's all_reduce: a recursive-halving reduce-scatter, then a recursive-doubling
all-gather, on the buffer in place (Thakur, Rabenseifner & Gropp 2005).

Like the ring it moves 2 (p-1)/p of the buffer per rank and reduces (p-1)/p of it, but in
2 log2(p) rounds instead of 2 (n-1). The buffer is split into p near-equal blocks, one per
virtual rank. Non-powers of two use the fold of recursive_doubling.py: rank 2i sends its whole
buffer to rank 2i+1, which reduces it in and takes part; the result goes back at the end.

Every element is reduced on exactly one rank (the one owning its block after the halving, or
the odd rank of a folded pair) and then only copied, so every rank ends with the same bits
whatever the operand order; receives therefore reduce straight into the buffer.
"""

from __future__ import annotations

import math

import numpy as np

from ..buffers import copy
from ..ops import ReduceOp
from .base import P2P, offsets_of, receive, split_counts
from .prices import Link
from .recursive_doubling import acting_rank, doubling_all_gather, fold_shape, halving_reduce_scatter
from .registry import Algorithm, register

_RESULT_STEP = 1 << 20


def rabenseifner_all_reduce(p2p: P2P, data: np.ndarray, op: ReduceOp, src: np.ndarray | None = None) -> None:
    """In place in `data`, or (given `src`) reading the input where it is: no copy first."""
    n, r = p2p.size, p2p.rank
    if n == 1:
        if src is not None:
            copy(data, src)
        return
    p, rem = fold_shape(n)
    inputs = src
    if r < 2 * rem:
        if r % 2 == 0:  # folded away
            p2p.wait(p2p.isend(r + 1, data if src is None else src, 0))
            receive(p2p, r + 1, data, _RESULT_STEP)
            return
        receive(p2p, r - 1, data, 0, reduce=op, base=src)
        inputs = None  # the fold wrote all of data
        vr = r // 2
    else:
        vr = r - rem
    offs = offsets_of(split_counts(len(data), p))

    def peer_of(v: int) -> int:
        return acting_rank(v, rem)

    step = halving_reduce_scatter(p2p, data, offs.__getitem__, vr, p, peer_of, op, 1, inputs)
    doubling_all_gather(p2p, data, offs.__getitem__, vr, p, peer_of, step)
    if r < 2 * rem:
        p2p.wait(p2p.isend(r - 1, data, _RESULT_STEP))


def _cost(n: int, m: int, link: Link) -> float:
    """2 log2(p) α + 2 (p-1)/p m β + (p-1)/p m γ; a non-power of two adds the fold:
    the whole buffer in and reduced (α + m β + m γ) and the result back (α + m β)."""
    p, rem = fold_shape(n)
    cost = 2 * math.log2(p) * link.alpha + (p - 1) / p * m * (2 * link.beta + link.gamma)
    if rem:
        cost += 2 * link.alpha + 2 * m * link.beta + m * link.gamma
    return cost


register(Algorithm("rabenseifner", "all_reduce", rabenseifner_all_reduce, _cost, out_of_place=True,
                   exchanges=True))
