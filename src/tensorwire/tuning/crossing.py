"""How many flows a flat algorithm puts on a host's network link at once, as a factor on β.

The network's constants are measured per flow (probes.measure_pair: two ranks, one
connection). A flat algorithm across hosts runs every rank at once, and where several ranks of
a host send across in the same step they divide the host's link (its interfaces) between them:
a ring in the topology's order crosses once per host, a pairwise exchange from nearly every
rank in nearly every step, recursive doubling in its steps of a distance at least the ranks
per host, a binomial tree as its subtrees fan out. How much depends on the algorithm's pattern
and the ranks' placement, so it is read off the pattern itself: the algorithm runs on a P2P
that records its messages and moves no data (`trace`: no schedule depends on the data, but
for block counts sent ahead, which the recorder fills in), the messages are put in rounds by
causality (a message goes when its sender has posted it and its receiver its receive, after
everything either side waited for), and each round costs the larger of its busiest rank's
bytes and its busiest host link's. `share` is the sum of those
over the sum of the busiest ranks' bytes: 1 where no host link carries more than one flow's
bytes in any round, the ranks per interface where every rank crosses in every round.

The tuner prices the flat algorithms across hosts with β (and the busy links') times their
share, as it prices the rails of the hierarchical ones with the ranks that share a link; the
busy links measured across hosts are first brought back to one flow by the share of the probe's
own pattern (`probe_shares`).
"""

from __future__ import annotations

import functools
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence

import numpy as np

from ..algorithms.prices import Link
from ..algorithms.registry import Algorithm, algorithms_for
from ..ops import ReduceOp
from ..ops.dtypes import dtype_code
from ..transport.wire import Coll, Fingerprint

TRACE_RANKS = 32
"""Patterns are traced on at most this many ranks (a larger layout is scaled down, hosts
first): tracing is Python work per message, once per algorithm and size of group, and a
pattern's share changes little once it spans several hosts
(docs/design/topology.md#tracing-patterns)."""
_BLOCK = 64
"""Elements (float32) of a traced block: shares are ratios of bytes, whatever their size."""
_LINK = Link("trace", alpha=1e-5, beta=1e-10, gamma=1e-10)
"""What a traced algorithm sees as its link (chain sizes its pieces by it)."""

Message = tuple[int, int, int, int]
"""(round, sender, receiver, bytes)."""


class _Req:
    __slots__ = ("send", "peer", "step", "nbytes", "posted", "round")
    done = True

    def __init__(self, send: bool, peer: int, step: int, nbytes: int) -> None:
        self.send, self.peer, self.step, self.nbytes = send, peer, step, nbytes
        self.posted = 0
        self.round: int | None = None


class _Recorder:
    """One rank's P2P in a call of even blocks (its fingerprint: an algorithm that serves the
    vector forms too may look); records posts and waits, moves nothing."""

    def __init__(self, rank: int, size: int, collective: str) -> None:
        self.rank, self.size, self.link = rank, size, _LINK
        self.fp = Fingerprint(Coll[collective.upper()], dtype_code(np.dtype(np.float32)), 0, -1, _BLOCK)
        self.ops: list[_Req | tuple[_Req, ...]] = []

    def _post(self, send: bool, peer: int, data: np.ndarray, step: int) -> _Req:
        req = _Req(send, peer, step, data.nbytes)
        self.ops.append(req)
        return req

    def isend(self, peer: int, data: np.ndarray, step: int) -> _Req:
        return self._post(True, peer, data, step)

    def irecv(self, peer: int, data: np.ndarray, step: int, reduce: ReduceOp | None = None,
              base: np.ndarray | None = None) -> _Req:
        # the one thing a schedule reads from what arrives: the element counts of blocks a
        # receiver cannot know (the trees' gather and scatter send them ahead, in int64), each
        # _BLOCK in the traced call
        data[...] = _BLOCK if data.dtype == np.int64 else 0
        return self._post(False, peer, data, step)

    def wait(self, *reqs: _Req) -> None:
        self.ops.append(reqs)

    def exchange_now(self, *args: object) -> tuple[bool, bool]:
        return False, False  # every step recorded as its posts and wait


def _call(alg: Algorithm, p2p: _Recorder) -> None:
    """Run `alg` for one rank on blocks of _BLOCK elements (root 0), as collectives.py calls it."""
    n, me = p2p.size, p2p.rank
    flat = np.zeros(n * _BLOCK, np.float32)
    blocks = [flat[i * _BLOCK:(i + 1) * _BLOCK] for i in range(n)]
    one = np.zeros(_BLOCK, np.float32)
    coll = alg.collective
    if coll == "all_reduce":
        alg.run(p2p, flat, ReduceOp.SUM)
    elif coll == "broadcast":
        alg.run(p2p, flat, 0)
    elif coll == "reduce":
        alg.run(p2p, flat, np.zeros_like(flat), ReduceOp.SUM, 0)
    elif coll == "all_gather":
        alg.run(p2p, blocks)
    elif coll == "reduce_scatter":
        alg.run(p2p, blocks, one, ReduceOp.SUM)
    elif coll == "all_to_all":
        out = np.zeros_like(flat)
        alg.run(p2p, blocks, [out[i * _BLOCK:(i + 1) * _BLOCK] for i in range(n)])
    elif coll == "gather":
        alg.run(p2p, one, blocks if me == 0 else None, 0)
    elif coll == "scatter":
        alg.run(p2p, blocks if me == 0 else None, one, 0)
    else:
        alg.run(p2p)


@functools.lru_cache(maxsize=256)
def trace(collective: str, name: str, n: int) -> tuple[Message, ...]:
    """The messages of one call of a flat algorithm on n ranks, in rounds (module docstring)."""
    alg = algorithms_for(collective)[name]
    recorders = [_Recorder(r, n, collective) for r in range(n)]
    with np.errstate(all="ignore"):  # scratch buffers hold whatever was there
        for p2p in recorders:
            _call(alg, p2p)
    return rounds([p.ops for p in recorders])


def rounds(ops: Sequence[Sequence[_Req | tuple[_Req, ...]]]) -> tuple[Message, ...]:
    """Put recorded messages in rounds: each rank's clock starts at 0 and moves, at a wait, to
    one past the latest round of what it waited for; a message's round is the later of its
    posts. Messages between two ranks with the same step match in order, as on the wire."""
    n = len(ops)
    pos, clock = [0] * n, [0] * n
    waiting: dict[tuple[bool, int, int, int], deque[_Req]] = defaultdict(deque)
    out: list[Message] = []
    moved = True
    while moved:
        moved = False
        for r in range(n):
            mine = ops[r]
            while pos[r] < len(mine):
                op = mine[pos[r]]
                if isinstance(op, _Req):
                    op.posted = clock[r]
                    src, dst = (r, op.peer) if op.send else (op.peer, r)
                    other = waiting[(not op.send, src, dst, op.step)]
                    if other:
                        peer = other.popleft()
                        op.round = peer.round = max(op.posted, peer.posted)
                        out.append((op.round, src, dst, op.nbytes if op.send else peer.nbytes))
                    else:
                        waiting[(op.send, src, dst, op.step)].append(op)
                else:
                    if any(q.round is None for q in op):
                        break
                    clock[r] = max([clock[r], *(q.round + 1 for q in op)])  # type: ignore[operator]
                pos[r] += 1
                moved = True
    stuck = [r for r in range(n) if pos[r] < len(ops[r])]
    if stuck:
        raise RuntimeError(f"traced pattern does not complete: ranks {stuck[:8]} wait for messages "
                           "never sent")
    return tuple(out)


def share(messages: Iterable[Message], placement: Sequence[int], nics: Sequence[int]) -> float:
    """Σ max(busiest rank's bytes, busiest host link's bytes) / Σ busiest rank's bytes over the
    rounds; `placement[r]` is rank r's host, `nics[h]` the interfaces host h's ranks spread over."""
    ranks: dict[int, dict[tuple[int, bool], int]] = defaultdict(lambda: defaultdict(int))
    links: dict[int, dict[tuple[int, bool], int]] = defaultdict(lambda: defaultdict(int))
    for t, src, dst, nbytes in messages:
        ranks[t][(src, True)] += nbytes
        ranks[t][(dst, False)] += nbytes
        hs, hd = placement[src], placement[dst]
        if hs != hd:
            links[t][(hs, True)] += nbytes
            links[t][(hd, False)] += nbytes
    flows = total = 0.0
    for t, busiest in ranks.items():
        b = max(busiest.values())
        link = max((v / nics[h] for (h, _), v in links.get(t, {}).items()), default=0.0)
        flows += b
        total += max(b, link)
    return total / flows if flows else 1.0


def block(counts: Sequence[int]) -> tuple[int, ...]:
    """The placement of ranks numbered host by host: counts[h] ranks on host h."""
    return tuple(h for h, c in enumerate(counts) for _ in range(c))


def scaled(counts: Sequence[int], nics: Sequence[int],
           most: int = TRACE_RANKS) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Hosts' rank counts and interfaces for a trace of at most `most` ranks: hosts beyond the
    first that fit dropped (two kept at least), then each host's ranks and interfaces cut in
    proportion (one each at least)."""
    counts, nics = list(counts), list(nics)
    while sum(counts) > most and len(counts) > 2:
        counts.pop()
        nics.pop()
    if sum(counts) > most:
        f = most / sum(counts)
        nics = [max(1, round(k * f)) for k in nics]
        counts = [max(1, int(c * f)) for c in counts]
    return tuple(counts), tuple(nics)


@functools.lru_cache(maxsize=1024)
def algorithm_share(alg: Algorithm, counts: tuple[int, ...], nics: tuple[int, ...],
                    placement: tuple[int, ...] | None = None) -> float:
    """The share of a flat algorithm on hosts of `counts` ranks (`nics` interfaces each), its
    ranks numbered host by host (the topology's order, algorithms/ordered.py), or as
    `placement` gives each rank's host (an algorithm that keeps the group's order)."""
    if placement is None and sum(counts) > TRACE_RANKS:
        counts, nics = scaled(counts, nics)
    where = block(counts) if placement is None else placement[:TRACE_RANKS]
    return share(trace(alg.collective, alg.name, len(where)), where, nics)


def doubling(n: int) -> list[int]:
    """The distances 1, 2, 4, ... below n (1 at least) that the busy probe's shifts and pairs
    run through (probes.measure_busy)."""
    return [1 << k for k in range(max(1, (n - 1).bit_length()))]


def shift_rounds(n: int, dists: Sequence[int]) -> tuple[Message, ...]:
    """The busy probe's rounds (probes.measure_busy): in round i every rank sends to r + dists[i]."""
    return tuple((i, r, (r + d) % n, 1) for i, d in enumerate(dists) for r in range(n) if d % n)


def probe_shares(placement: Sequence[int], nics: Sequence[int]) -> tuple[float, float]:
    """(shifting, ring): the shares the busy probe measured its β under on the world's
    placement: its shifts by d = 1, 2, 4, ... in turn (each round as long as the others), and
    its ring (d = 1)."""
    n = len(placement)
    each = [share(shift_rounds(n, [d]), placement, nics) for d in doubling(n)]
    return sum(each) / len(each), each[0]
