"""Linear gather, scatter and reduce: the root exchanges with every other rank directly."""

from __future__ import annotations

import numpy as np

from ..buffers import copy
from ..ops import ReduceOp
from .base import P2P, receive
from .prices import Link
from .rank_ordered import fold_in_rank_order
from .registry import Algorithm, register
from .tree import gather_work, reduce_work


def linear_gather(p2p: P2P, send: np.ndarray, recv_blocks: list[np.ndarray] | None, root: int) -> None:
    """The root posts all receives at once; order of arrival does not matter."""
    if p2p.rank != root:
        p2p.wait(p2p.isend(root, send, 0))
        return
    assert recv_blocks is not None
    reqs = [p2p.irecv(peer, recv_blocks[peer], 0) for peer in range(p2p.size) if peer != root]
    if recv_blocks[root] is not send:
        copy(recv_blocks[root], send)
    p2p.wait(*reqs)


def linear_scatter(p2p: P2P, send_blocks: list[np.ndarray] | None, recv: np.ndarray, root: int) -> None:
    if p2p.rank != root:
        receive(p2p, root, recv, 0)
        return
    assert send_blocks is not None
    reqs = [p2p.isend(peer, send_blocks[peer], 0) for peer in range(p2p.size) if peer != root]
    if send_blocks[root] is not recv:
        copy(recv, send_blocks[root])
    p2p.wait(*reqs)


def linear_reduce(p2p: P2P, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    """Every rank sends its buffer to the root, which folds them into `acc` strictly in rank
    order, ((x0 op x1) op x2) ..., receiving and reducing one peer after the other: the same
    bits as ops.reference and the rank-ordered algorithms, whatever the arrival order.
    `data` is never written (unless it is `acc`); on non-roots `acc` is not touched."""
    r = p2p.rank
    if r != root:
        if data.size:  # an empty contribution is not sent: the fold below skips empty buffers
            p2p.wait(p2p.isend(root, data, 0))
        return
    own = data
    if root != 0 and acc.size and np.may_share_memory(acc, data):
        own = data.copy()  # acc is about to receive rank 0's buffer
    fold_in_rank_order(p2p, acc, own, op, 0)


ROOT_OVERHEAD = 0.25
"""A message beyond the first at a linear root costs this fraction of α: its peers send at
once, so the wire latencies overlap and the root pays one α plus its own handling of each
further message (docs/design/cost-model.md#rooted-collectives)."""


def _root_latency(n: int, link: Link) -> float:
    return (1 + ROOT_OVERHEAD * (n - 2)) * link.alpha if n > 1 else 0.0


def _gather_cost(n: int, nbytes: int, link: Link) -> float:
    """The root receives n-1 messages of nbytes/n each, their bytes serialised on its link:
    overlapped latency + (n-1)/n m β. The β term is tree.py's binomial one, so the choice
    between them depends on n only (gatherv sizes its call per rank)."""
    return _root_latency(n, link) + (n - 1) / n * nbytes * link.beta


def _scatter_cost(n: int, nbytes: int, link: Link) -> float:
    """As the gather: the root posts its sends at once and they go into the peers' rings or
    sockets without waiting for the receivers, so their latencies overlap; the bytes leave
    the root one message after another (why not (n-1) α: docs/design/algorithms.md#linear-scatter)."""
    return _gather_cost(n, nbytes, link)


def _reduce_cost(n: int, m: int, link: Link) -> float:
    """n-1 whole buffers into the root, each folded there in rank order, after the overlapped
    latency. Over a network they share the root's link: (n-1) m (β + γ). Through shared memory
    every sender has a ring of its own to the root, which folds straight out of it (a receive
    with `reduce=`): the first buffer arrives at β and the root's n-1 folds set the pace,
    m β + (n-1) m γ (docs/design/algorithms.md#linear-reduce)."""
    if link.name == "shm":
        return _root_latency(n, link) + m * link.beta + (n - 1) * m * link.gamma
    return _root_latency(n, link) + (n - 1) * m * (link.beta + link.gamma)


# every rank talks to the root: no order to choose (and the reduce folds in rank order)
register(Algorithm("linear", "gather", linear_gather, _gather_cost, work=gather_work, one_way=True,
                   reorder=False))
register(Algorithm("linear", "scatter", linear_scatter, _scatter_cost, work=gather_work, one_way=True,
                   reorder=False))
register(Algorithm("linear", "reduce", linear_reduce, _reduce_cost, work=reduce_work, one_way=True,
                   reorder=False))
