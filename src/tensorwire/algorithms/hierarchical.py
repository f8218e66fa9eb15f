"""Hierarchical collectives for groups spread over hosts: phases within each host over shared
memory, and between hosts along rails (rail i: the i-th rank of every host), each phase a
collective of a sub-group with its own algorithm choice (the one-shot path and single copy
within a host; ring, trees, recursive doubling between hosts).

all_reduce is a reduce-scatter within each host, an all_reduce of each rank's share along its
rail (every rank of a host carries its share across at once), and an all-gather within each
host: a host's link carries m per direction whatever the number of its ranks, where a flat
ring carries 2 (n-1)/n m, with every other hop of it on shared memory waiting for the link.
Large calls run in pieces, the rails carrying one while the hosts work on the next. What
crosses the rails is a parameter (`Crossing`): the compressed all_reduce sends 16-bit pieces. Small ones
take `hierarchical_leaders`: a reduce onto each host's first rank, an all_reduce among those
and a broadcast back, one message per host between hosts.
all_gather and reduce_scatter cross along the rails too (each rank's own block, or each rank's
host-reduced block); broadcast and reduce cross along the root's rail and fan out or in
within the hosts; the barrier meets within the hosts, across the first rail, and within them
again. all_to_all sends each host, along the rail, all of a rank's blocks for that host in one
message, which the host's rank on that rail hands out within its host: H - 1 + P - 1 partners
(H hosts of P ranks) where a flat exchange has n - 1, and a rank connects only to its host and
its rail, at the price of two passes through memory to regroup the blocks.

The sub-groups come from the group (`P2P.hierarchy`, built collectively on first use). Where
hosts hold different numbers of ranks (topology.Layout.shape), the all_reduce crosses on the rails
every host has (as many as the emptiest host's ranks: the others' shares are empty), the
leaders' all_reduce, all_gather and reduce_scatter, the barrier, broadcast and reduce through
rail 0 (a root whose rail not every host has goes through its host's first rank); the rails'
all_gather and reduce_scatter and the all_to_all need the same number on every host. All but
the all_reduce need even blocks (their phases use the sub-groups' list forms, or regroup
blocks by host). A failure
inside a phase aborts the parent group, and with it both sub-groups on every rank
(Engine.children).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..errors import CollectiveMismatchError, TensorwireError, in_call, retold
from ..ops import ReduceOp
from ..transport.wire import PHASE_OF, Fingerprint, phase_digest
from .base import P2P, contiguous_span, offsets_of, split_counts
from .prices import COPY, Link, LocalPrice, RailPrice, Shape
from .registry import Algorithm, register

NAME = "hierarchical"
LEADERS = "hierarchical_leaders"


@dataclass(frozen=True)
class Hierarchy:
    """What a rank of a group over hosts runs the phases on (built by group.Group.hierarchy)."""

    local: Any
    """This rank's host group: the group's ranks on its host, in group order (a Group)."""
    rail: Any
    """This rank's rail: the ranks at its index on every host, hosts in order (a Group)."""
    hosts: tuple[tuple[int, ...], ...]
    """Group ranks per host (topology.Layout.hosts)."""
    host: int
    index: int
    where: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Group rank -> (host, index)."""

    @property
    def rails(self) -> int:
        """The rails every host has: indices below this have a rank on each host."""
        return min(map(len, self.hosts))


def _summing(op: ReduceOp) -> ReduceOp:
    """The phases' op: AVG and PREMUL_SUM accumulate as a sum and are finished once, by the
    caller over the whole group (ops.finalize), never per phase."""
    return ReduceOp.SUM if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else op


def time_left(p2p: P2P) -> float:
    """The call's remaining time, which bounds every phase (and a crossing's steps)."""
    return max(1e-3, p2p.deadline - time.perf_counter())  # type: ignore[attr-defined]


def _even(counts: list[int]) -> bool:
    return min(counts) == max(counts)


PIECE_BYTES = 8 << 20
"""A large all_reduce runs in pieces of about this size, pipelined: while the rails carry one
piece between hosts (on the rail group's worker thread), the hosts reduce-scatter the next and
all-gather the last one, instead of the three phases one after the other
(docs/design/topology.md#pipelining-the-all_reduce)."""
MAX_PIECES = 8
PIECE_ALPHAS = 20
"""A piece's share crosses in at least this many of the link's α: each piece pays a step's α
on the rails, so where α is large against what a piece moves (a slow or distant link, or a
calibration that found one) fewer pieces go (docs/design/topology.md#pipelining-the-all_reduce)."""
SHARE_MIN = 1 << 10
"""The reduce-scatter/all_reduce/all-gather runs where every rank's block (bytes / group size)
holds at least this much; smaller calls take the leaders' variant (or a flat algorithm). The
cost model sees bytes, not elements, so it cannot tell where a call's shares come out uneven
(fewer elements than ranks on a host, or counts that do not divide): those run their host
phases through the vector forms, on the message path instead of the one-shot one, and a
one-element all_reduce (a loss, a flag) would go through two rounds of recursive halving and
doubling where the leaders' variant takes one shot each way. Above a KiB a block's bytes, not
the rounds, decide, and the shares' smaller messages between hosts win (a presumption:
docs/design/topology.md#pricing-the-phases)."""


def pieces(count: int, itemsize: int, per_host: int, link: Link | None = None) -> list[tuple[int, int]]:
    """Element ranges of the pieces a hierarchical all_reduce of `count` elements runs in: the
    same on every rank (`link`: the group's constants between hosts, as P2P.link gives them,
    the same everywhere). Each is cut in per_host shares, so a piece holds at least that many;
    each share must keep the link busy for PIECE_ALPHAS of its α."""
    m = count * itemsize
    k = min(MAX_PIECES, m // PIECE_BYTES, count // max(per_host, 1))
    if link is not None and link.alpha > 0:
        k = min(k, int(m * link.beta / (PIECE_ALPHAS * link.alpha * max(per_host, 1))))
    bounds = offsets_of(split_counts(count, max(1, k)))
    return list(zip(bounds[:-1], bounds[1:]))


class Crossing:
    """How a piece's shares cross between hosts, along the rails: `steps` steps per piece, each
    started by `step` (which may leave a Work running on the rail's worker thread where the
    call is pipelined, returned as the piece's state), the last waited for by `finish`, which
    leaves the reduced share in place. This one is an all_reduce of each share;
    algorithms/compressed.py sends 16-bit pieces instead."""

    steps = 1

    def __init__(self, op: ReduceOp) -> None:
        self.op = op

    def itemsize(self, data: np.ndarray) -> int:
        """Bytes an element takes on the rails, which size the pieces (`pieces`)."""
        return data.itemsize

    def step(self, k: int, rail: Any, share: np.ndarray, state: Any, pipelined: bool, p2p: P2P) -> Any:
        work = rail.all_reduce(share, self.op, async_op=pipelined, timeout=time_left(p2p))
        return work if pipelined else None

    def finish(self, rail: Any, share: np.ndarray, state: Any, p2p: P2P) -> None:
        if state is not None:
            state.wait(time_left(p2p))


def hierarchical_all_reduce(p2p: P2P, data: np.ndarray, op: ReduceOp, src: np.ndarray | None = None,
                            crossing: Crossing | None = None) -> None:
    """Pipelined over the pieces: at each tick one piece is reduce-scattered within the hosts and
    starts crossing, the ones before it take their next crossing step, and the oldest one is
    all-gathered within the hosts; the rails run the crossing steps in the order every rank
    submits them."""
    h: Hierarchy = p2p.hierarchy  # type: ignore[attr-defined]
    op = _summing(op)
    cross = crossing if crossing is not None else Crossing(op)
    inp = data if src is None else src
    rails = h.rails  # where hosts hold more, their further ranks get no share
    ranges = pieces(data.size, cross.itemsize(data), rails, p2p.link)
    pipelined = len(ranges) > 1
    parts: list[tuple[np.ndarray, list[int], np.ndarray]] = []  # (piece, counts, this rank's share)
    states: list[Any] = []
    for tick in range(len(ranges) + cross.steps):
        if tick < len(ranges):
            lo, hi = ranges[tick]
            piece = data[lo:hi]
            counts = split_counts(hi - lo, rails) + [0] * (h.local.size - rails)
            offs = offsets_of(counts)
            share = piece[offs[h.index]:offs[h.index + 1]]
            if _even(counts):
                h.local.reduce_scatter_tensor(share, inp[lo:hi], op, timeout=time_left(p2p))
            else:
                h.local.reduce_scatterv(share, inp[lo:hi], counts, op, timeout=time_left(p2p))
            parts.append((piece, counts, share))
            states.append(None)
        for k in range(cross.steps):
            i = tick - k
            if 0 <= i < len(ranges) and parts[i][2].size:
                states[i] = cross.step(k, h.rail, parts[i][2], states[i], pipelined, p2p)
        i = tick - cross.steps
        if i >= 0:
            piece, counts, share = parts[i]
            if share.size:
                cross.finish(h.rail, share, states[i], p2p)
            states[i] = None
            if _even(counts):
                h.local.all_gather_into_tensor(piece, share, timeout=time_left(p2p))
            else:
                h.local.all_gatherv(piece, share, counts, timeout=time_left(p2p))


def leaders_all_reduce(p2p: P2P, data: np.ndarray, op: ReduceOp, src: np.ndarray | None = None) -> None:
    """Within each host onto its first rank, among those (rail 0), and back within each host:
    one message per host between hosts, where the shares of `hierarchical_all_reduce` would be
    per_host messages of nearly nothing; for small calls."""
    h: Hierarchy = p2p.hierarchy  # type: ignore[attr-defined]
    op = _summing(op)
    leader = h.index == 0
    if src is None:
        h.local.reduce(data, 0, op, timeout=time_left(p2p))
    else:
        h.local.reduce(src, 0, op, out=data if leader else None, timeout=time_left(p2p))
    if leader:
        h.rail.all_reduce(data, op, timeout=time_left(p2p))
    h.local.broadcast(data, 0, timeout=time_left(p2p))


def _broadcast(group: Any, data: np.ndarray, root: int, src: np.ndarray | None, p2p: P2P) -> None:
    """group.broadcast from `root`, out of place where the root passes `src`."""
    if src is not None:
        group.broadcast(src, root, out=data, timeout=time_left(p2p))
    else:
        group.broadcast(data, root, timeout=time_left(p2p))


def hierarchical_broadcast(p2p: P2P, data: np.ndarray, root: int, src: np.ndarray | None = None) -> None:
    """Along the root's rail, then within every host from that rail's rank; where not every
    host has the root's rail: within the root's host, along rail 0, within the other hosts."""
    h: Hierarchy = p2p.hierarchy  # type: ignore[attr-defined]
    host, index = h.where[root]
    if index >= h.rails:
        if h.host == host:
            _broadcast(h.local, data, index, src, p2p)
        if h.index == 0:
            h.rail.broadcast(data, host, timeout=time_left(p2p))
        if h.host != host:
            h.local.broadcast(data, 0, timeout=time_left(p2p))
        return
    if h.index == index:
        _broadcast(h.rail, data, host, src, p2p)
    h.local.broadcast(data, index, timeout=time_left(p2p))


def hierarchical_reduce(p2p: P2P, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    """Within every host onto the rank on the root's rail, then along that rail to the root;
    where not every host has the root's rail: onto each host's first rank, along rail 0 to
    the root's host, and from its first rank to the root."""
    h: Hierarchy = p2p.hierarchy  # type: ignore[attr-defined]
    op = _summing(op)
    host, index = h.where[root]
    through = index if index < h.rails else 0
    if h.index != through:
        h.local.reduce(data, through, op, timeout=time_left(p2p))
        if p2p.rank == root:
            h.local.recv(acc, 0, timeout=time_left(p2p))
        return
    part = acc if p2p.rank == root else np.empty_like(data)
    h.local.reduce(data, through, op, out=part, timeout=time_left(p2p))
    h.rail.reduce(part, host, op, timeout=time_left(p2p))
    if through != index and h.host == host:
        h.local.send(part, index, timeout=time_left(p2p))


def hierarchical_all_gather(p2p: P2P, blocks: list[np.ndarray], src: np.ndarray | None = None) -> None:
    """Each rank's block along its rail, then each host's blocks within every host."""
    h: Hierarchy = p2p.hierarchy  # type: ignore[attr-defined]
    mine = blocks[p2p.rank] if src is None else src
    h.rail.all_gather([blocks[on[h.index]] for on in h.hosts], mine, timeout=time_left(p2p))
    for on in h.hosts:
        h.local.all_gather([blocks[g] for g in on], blocks[on[h.index]], timeout=time_left(p2p))


def hierarchical_reduce_scatter(p2p: P2P, blocks: list[np.ndarray], out: np.ndarray, op: ReduceOp) -> None:
    """Each host's blocks reduced within every host, then along the rails onto their owners."""
    h: Hierarchy = p2p.hierarchy  # type: ignore[attr-defined]
    op = _summing(op)
    partial = np.empty((len(h.hosts), out.size), dtype=out.dtype)
    for k, on in enumerate(h.hosts):
        h.local.reduce_scatter(partial[k], [blocks[g] for g in on], op, timeout=time_left(p2p))
    h.rail.reduce_scatter(out, list(partial), op, timeout=time_left(p2p))


def leaders_all_gather(p2p: P2P, blocks: list[np.ndarray], src: np.ndarray | None = None) -> None:
    """Within each host onto its first rank, among those (rail 0) host by host, and the whole
    back within each host: hosts of any number of ranks (the rails' all_gather needs the same
    number on each), one flow per host between hosts."""
    h: Hierarchy = p2p.hierarchy  # type: ignore[attr-defined]
    mine = (blocks[p2p.rank] if src is None else src).view(np.uint8)
    nbytes = mine.nbytes
    if not nbytes:  # even blocks: empty on every rank
        return
    span = _host_major(blocks, h.hosts, None)  # the output itself where its blocks lie so
    whole = span if span is not None else np.empty(len(blocks) * nbytes, dtype=np.uint8)
    counts = [len(on) * nbytes for on in h.hosts]
    offs = offsets_of(counts)
    home = whole[offs[h.host]:offs[h.host + 1]]
    leader = h.index == 0
    h.local.gather(mine, list(home.reshape(-1, nbytes)) if leader else None, 0, timeout=time_left(p2p))
    if leader:
        h.rail.all_gatherv(whole, home, counts, timeout=time_left(p2p))
    h.local.broadcast(whole, 0, timeout=time_left(p2p))
    if span is None:
        for k, g in enumerate(g for on in h.hosts for g in on):
            blocks[g].view(np.uint8)[...] = whole[k * nbytes:(k + 1) * nbytes]


def leaders_reduce_scatter(p2p: P2P, blocks: list[np.ndarray], out: np.ndarray, op: ReduceOp) -> None:
    """Every block reduced within each host onto its first rank, among those (rail 0) onto the
    host whose ranks own them, and handed out within it: hosts of any number of ranks."""
    h: Hierarchy = p2p.hierarchy  # type: ignore[attr-defined]
    if not out.size:  # even blocks: empty on every rank
        return
    op = _summing(op)
    ordered = [blocks[g] for on in h.hosts for g in on]
    inp = contiguous_span(ordered, writable=False)
    if inp is None:
        inp = np.concatenate(ordered)
    leader = h.index == 0
    acc = np.empty_like(inp) if leader else None
    h.local.reduce(inp, 0, op, out=acc, timeout=time_left(p2p))
    home = None
    if leader:
        counts = [len(on) * out.size for on in h.hosts]
        home = np.empty(counts[h.host], dtype=out.dtype)
        h.rail.reduce_scatterv(home, acc, counts, op, timeout=time_left(p2p))
    parts = list(home.reshape(-1, out.size)) if home is not None else None
    h.local.scatter(out, parts, 0, timeout=time_left(p2p))


def _host_major(blocks: list[np.ndarray], hosts: tuple[tuple[int, ...], ...], out: np.ndarray | None
                ) -> np.ndarray | None:
    """The blocks (bytes) in host order (host 0's ranks, host 1's, ...) as one view where they
    lie so, else packed into `out` (None: no copy wanted)."""
    ordered = [blocks[g] for on in hosts for g in on]
    span = contiguous_span(ordered, writable=out is None)
    if span is not None or out is None:
        return None if span is None else span.view(np.uint8)
    for k, block in enumerate(ordered):
        out[k] = block.view(np.uint8)
    return out


def hierarchical_all_to_all(p2p: P2P, sends: list[np.ndarray], recvs: list[np.ndarray]) -> None:
    """Along each rank's rail, every host's blocks in one message to that host's rank on it; then
    within every host, from each of its ranks the blocks that came for its host to their owners.
    Equal blocks only (the tuner offers it to the even form alone)."""
    h: Hierarchy = p2p.hierarchy  # type: ignore[attr-defined]
    hosts, nbytes = h.hosts, recvs[0].nbytes
    per_host = len(hosts[0])
    staged = np.empty((2, len(hosts) * per_host, nbytes), dtype=np.uint8)  # (host, rank on it, bytes)
    send = _host_major(sends, hosts, staged[1])
    h.rail.all_to_all_single(staged[0], send, timeout=time_left(p2p))
    # from host k's rank on this rail: its blocks for this host's ranks j; regroup by j
    by_rank = staged[1].reshape(per_host, len(hosts), nbytes)
    by_rank[...] = staged[0].reshape(len(hosts), per_host, nbytes).transpose(1, 0, 2)
    h.local.all_to_all_single(staged[0], staged[1], timeout=time_left(p2p))
    got = staged[0].reshape(per_host, len(hosts), nbytes)  # from this host's rank j: host k's rank j's block
    out = _host_major(recvs, hosts, None)
    if out is not None:
        out.reshape(len(hosts), per_host, nbytes)[...] = got.transpose(1, 0, 2)
        return
    for k, on in enumerate(hosts):
        for j, g in enumerate(on):
            recvs[g].view(np.uint8)[...] = got[j, k]


def hierarchical_barrier(p2p: P2P) -> None:
    h: Hierarchy = p2p.hierarchy  # type: ignore[attr-defined]
    h.local.barrier(timeout=time_left(p2p))
    if h.index == 0:
        h.rail.barrier(timeout=time_left(p2p))
    h.local.barrier(timeout=time_left(p2p))


# Costs: the phases' own cheapest algorithms, priced by the tuner (or `tensorwire plan`) on the
# host tier (`local`) and between hosts (`rail`); m as nccl-tests counts it for the collective.
def all_reduce_cost(s: Shape, m: int, local: LocalPrice, rail: RailPrice, link: Link | None = None,
                    across: Callable[[int], float] | None = None, wire: float = 1.0) -> float:
    """In k pieces (`pieces`), the rails' phase overlapping the hosts': every piece pays its own
    phases once, the rest of the call goes at the pace of the slower side. `across`: the
    price of a piece of m bytes crossing (default: the shares' all_reduce, `Crossing`);
    `wire`: the bytes on the rails per byte of the call (Crossing.itemsize)."""
    k = len(pieces(int(m * wire), 1, s.rails, link)) if m else 1
    m_k = m // k
    within = local("reduce_scatter", s.per_host, m_k) + local("all_gather", s.per_host, m_k)
    crossing = across(m_k) if across is not None else rail("all_reduce", s.hosts, m_k // s.rails, s.nic_share)
    return within + crossing + (k - 1) * max(within, crossing)


def _leaders_cost(s: Shape, m: int, local: LocalPrice, rail: RailPrice,
                  link: Link | None = None) -> float:
    return (local("reduce", s.per_host, m) + rail("all_reduce", s.hosts, m, 1.0)
            + local("broadcast", s.per_host, m))


def _broadcast_cost(s: Shape, m: int, local: LocalPrice, rail: RailPrice,
                    link: Link | None = None) -> float:
    return rail("broadcast", s.hosts, m, 1.0) + local("broadcast", s.per_host, m)


def _reduce_cost(s: Shape, m: int, local: LocalPrice, rail: RailPrice,
                 link: Link | None = None) -> float:
    return local("reduce", s.per_host, m) + rail("reduce", s.hosts, m, 1.0)


def _all_gather_cost(s: Shape, m: int, local: LocalPrice, rail: RailPrice,
                     link: Link | None = None) -> float:
    return rail("all_gather", s.hosts, m // s.per_host, s.nic_share) + \
        s.hosts * local("all_gather", s.per_host, m // s.hosts)


def _leaders_all_gather_cost(s: Shape, m: int, local: LocalPrice, rail: RailPrice,
                             link: Link | None = None) -> float:
    return (local("gather", s.per_host, m // s.hosts) + rail("all_gather", s.hosts, m, 1.0)
            + local("broadcast", s.per_host, m))


def _leaders_reduce_scatter_cost(s: Shape, m: int, local: LocalPrice, rail: RailPrice,
                                 link: Link | None = None) -> float:
    return (local("reduce", s.per_host, m) + rail("reduce_scatter", s.hosts, m, 1.0)
            + local("scatter", s.per_host, m // s.hosts))


def _reduce_scatter_cost(s: Shape, m: int, local: LocalPrice, rail: RailPrice,
                         link: Link | None = None) -> float:
    return s.hosts * local("reduce_scatter", s.per_host, m // s.hosts) + \
        rail("reduce_scatter", s.hosts, m // s.per_host, s.nic_share)


def _all_to_all_cost(s: Shape, m: int, local: LocalPrice, rail: RailPrice,
                     link: Link | None = None) -> float:
    return (rail("all_to_all", s.hosts, m, s.nic_share) + local("all_to_all", s.per_host, m)
            + 2 * local(COPY, 1, m))


def _barrier_cost(s: Shape, m: int, local: LocalPrice, rail: RailPrice,
                  link: Link | None = None) -> float:
    return 2 * local("barrier", s.per_host, 0) + rail("barrier", s.hosts, 0, 1.0)


class _Called(P2P, Protocol):
    """What a hierarchical run has of its call beyond P2P (group.CollectiveCall)."""

    @property
    def fp(self) -> Fingerprint: ...

    @property
    def what(self) -> str: ...

    @property
    def hierarchy(self) -> Hierarchy: ...


def naming(run: Callable[..., None]) -> Callable[..., None]:
    """`run`, its phases' errors naming the caller's call too: a phase fails as a call of a
    sub-group ('reduce_scatterv #5 on group world/host0'), which the caller never made."""
    @functools.wraps(run)
    def named(p2p: _Called, *args: Any) -> None:
        h: Hierarchy | None = None
        try:
            h = p2p.hierarchy  # made on first use: its errors named too
            h.local.queue.phase_of = h.rail.queue.phase_of = phase_digest(p2p.fp)
            run(p2p, *args)
        except TensorwireError as exc:
            what = p2p.what
            named = exc if f"{what}:" in str(exc) else in_call(exc, f"{what} (hierarchical)")
            if named is exc:  # named on the rank that raised it, and came with the group's abort
                raise
            if isinstance(named, CollectiveMismatchError) and PHASE_OF not in str(named):
                named = retold(named, f"{named}; {PHASE_OF}")  # (phases of other calls: compress=)
            raise named from exc
        finally:
            if h is not None:
                h.local.queue.phase_of = h.rail.queue.phase_of = 0
    return named


def _flat_never(n: int, m: int, link: Link) -> float:
    """A hierarchical algorithm has no flat price: the tuner prices its phases (`phases`)."""
    return float("inf")


register(Algorithm(LEADERS, "all_reduce", naming(leaders_all_reduce), _flat_never, phases=_leaders_cost,
                   reorder=False, out_of_place=True, uneven=True))
register(Algorithm(NAME, "all_reduce", naming(hierarchical_all_reduce), _flat_never, phases=all_reduce_cost,
                   reorder=False, out_of_place=True, eligible=lambda n, m: m >= n * SHARE_MIN, uneven=True))
register(Algorithm(LEADERS, "all_gather", naming(leaders_all_gather), _flat_never,
                   phases=_leaders_all_gather_cost, reorder=False, out_of_place=True, uneven=True,
                   uniform=False))
register(Algorithm(LEADERS, "reduce_scatter", naming(leaders_reduce_scatter), _flat_never,
                   phases=_leaders_reduce_scatter_cost, reorder=False, uneven=True, uniform=False))
for _coll, _run, _cost in (("broadcast", hierarchical_broadcast, _broadcast_cost),
                           ("reduce", hierarchical_reduce, _reduce_cost),
                           ("all_gather", hierarchical_all_gather, _all_gather_cost),
                           ("reduce_scatter", hierarchical_reduce_scatter, _reduce_scatter_cost),
                           ("all_to_all", hierarchical_all_to_all, _all_to_all_cost),
                           ("barrier", hierarchical_barrier, _barrier_cost)):
    register(Algorithm(NAME, _coll, naming(_run), _flat_never, phases=_cost, reorder=False,
                       out_of_place=_coll in ("broadcast", "all_gather"),
                       uneven=_coll in ("broadcast", "reduce", "barrier")))
