"""Running an algorithm in another rank order: the algorithm sees virtual ranks, results land in
the callers' slots.

An algorithm's pattern follows rank numbers (the ring's neighbours r ± 1, recursive doubling's
partners r ^ 2^k, a binomial tree's children root + 2^k), so where ranks are numbered across
hosts (a cyclic placement: rank r on host r mod H) every hop of a ring crosses between hosts.
`arrange` gives an algorithm a view of its call in which virtual rank v is group rank
order[v] (topology.Layout: each host's ranks together; for rooted collectives the root's host
first, the root at 0): messages go to the group rank behind each virtual one, and the blocks
of block-wise collectives (all_gather, reduce_scatter, all_to_all, gather, scatter) are handed
over in virtual order, so every block is still the caller's own. Groups on one host and
orders that are the identity keep the algorithm as it is: nothing is added to their calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..ops import ReduceOp
from .base import P2P, Request
from .prices import Link
from .registry import Algorithm

if TYPE_CHECKING:
    from ..transport.wire import Fingerprint


class Orders(Protocol):
    """A group's orders (topology.Layout): virtual rank -> group rank."""

    @property
    def ring(self) -> tuple[int, ...]: ...

    def rooted(self, root: int) -> tuple[int, ...]: ...


class Reordered:
    """A call seen in another order: virtual rank v is the call's group rank order[v]."""

    __slots__ = ("call", "order", "rank", "size")

    def __init__(self, call: P2P, order: Sequence[int], inverse: Sequence[int]) -> None:
        self.call = call
        self.order = order
        self.rank = inverse[call.rank]
        self.size = call.size

    @property
    def link(self) -> Link:
        return self.call.link

    @property
    def fp(self) -> Fingerprint | None:
        return self.call.fp

    def isend(self, peer: int, data: np.ndarray, step: int) -> Request:
        return self.call.isend(self.order[peer], data, step)

    def irecv(self, peer: int, data: np.ndarray, step: int, reduce: ReduceOp | None = None,
              base: np.ndarray | None = None) -> Request:
        return self.call.irecv(self.order[peer], data, step, reduce, base)

    def wait(self, *reqs: Request) -> None:
        self.call.wait(*reqs)

    def exchange_now(self, dst: int | None, send: np.ndarray | None, src: int, recv: np.ndarray, step: int,
                     reduce: ReduceOp | None = None, base: np.ndarray | None = None) -> tuple[bool, bool]:
        return self.call.exchange_now(None if dst is None else self.order[dst], send, self.order[src], recv,
                                      step, reduce, base)


def by_world_rank(call: P2P, ranks: Sequence[int]) -> Reordered:
    """`call` with its members in world rank order, whatever order its group lists them in (a
    group's setup exchange, which every member must meet however it numbered the group)."""
    order = sorted(range(len(ranks)), key=ranks.__getitem__)
    return Reordered(call, order, _inverse(order))


def _inverse(order: Sequence[int]) -> list[int]:
    out = [0] * len(order)
    for v, g in enumerate(order):
        out[g] = v
    return out


ROOTED = ("broadcast", "reduce", "gather", "scatter")


def arrange(alg: Algorithm, orders: Orders | None) -> Algorithm:
    """`alg` running in `orders` (None: a group on one host; `alg` as it is)."""
    if orders is None or not alg.reorder or alg.needs_direct:
        return alg
    run = alg.run
    coll = alg.collective
    if coll in ROOTED:
        views: dict[int, tuple[tuple[int, ...], list[int]] | None] = {}

        def view(p2p: P2P, root: int) -> tuple[P2P, int]:
            """The call as the algorithm sees it, and the root's rank there (0, or `root` itself
            where the rooted order is the identity: a block placement's rank 0)."""
            if root not in views:
                order = orders.rooted(root)
                views[root] = None if list(order) == sorted(order) else (order, _inverse(order))
            entry = views[root]
            return (p2p, root) if entry is None else (Reordered(p2p, entry[0], entry[1]), 0)

        def slots(blocks: list | None, v: P2P) -> list | None:
            return blocks if blocks is None or not isinstance(v, Reordered) else [blocks[g] for g in v.order]

        rooted_run: Callable[..., None]  # the collective's own signature (algorithms.base.Algorithm.run)
        if coll == "broadcast":
            def rooted_run(p2p: P2P, data: np.ndarray, root: int, src: Any = None) -> None:
                v, r = view(p2p, root)
                run(v, data, r, src)
        elif coll == "reduce":
            def rooted_run(p2p: P2P, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
                v, r = view(p2p, root)
                run(v, data, acc, op, r)
        elif coll == "gather":
            def rooted_run(p2p: P2P, send: np.ndarray, blocks: list | None, root: int) -> None:
                v, r = view(p2p, root)
                run(v, send, slots(blocks, v), r)
        else:
            def rooted_run(p2p: P2P, blocks: list | None, recv: np.ndarray, root: int) -> None:
                v, r = view(p2p, root)
                run(v, slots(blocks, v), recv, r)
        return replace(alg, run=rooted_run)
    order = orders.ring
    if list(order) == sorted(order):
        return alg  # hosts already numbered together (a block placement)
    inverse = _inverse(order)
    ordered_run: Callable[..., None]
    if coll == "all_gather":
        def ordered_run(p2p: P2P, blocks: list, src: Any = None) -> None:
            run(Reordered(p2p, order, inverse), [blocks[g] for g in order], src)
    elif coll == "reduce_scatter":
        def ordered_run(p2p: P2P, blocks: list, out: np.ndarray, op: ReduceOp) -> None:
            run(Reordered(p2p, order, inverse), [blocks[g] for g in order], out, op)
    elif coll == "all_to_all":
        def ordered_run(p2p: P2P, sends: list, recvs: list) -> None:
            run(Reordered(p2p, order, inverse), [sends[g] for g in order], [recvs[g] for g in order])
    else:  # all_reduce (data, op, src), barrier (): nothing indexed by rank
        def ordered_run(p2p: P2P, *args: Any) -> None:
            run(Reordered(p2p, order, inverse), *args)
    return replace(alg, run=ordered_run)
