"""The algorithm registry: every algorithm declares the collective it serves and its cost.

The tuner prices every eligible algorithm of a collective with the α-β-γ model (Thakur,
Rabenseifner & Gropp 2005) for the group's link tier, bounded below by the algorithm's total
work where ranks share cores (`work`), and runs the cheapest; `tensorwire plan`
prints the same table. An algorithm module calls `register(...)` at import for each entry.

`run` signatures, by collective (arrays are flat, contiguous numpy views; `p2p` is the call):
  all_reduce      run(p2p, data, op, src)                 src: the input where it is apart (an
                                                          out-of-place call), else None (in place)
  broadcast       run(p2p, data, root, src)               in place; src: the root's input where it
                                                          is apart (an out-of-place call), else None
  reduce          run(p2p, data, acc, op, root)           result in acc at root; data is kept
  all_gather      run(p2p, blocks, src)                   src: this rank's input where it is
                                                          apart, else None (blocks[rank] filled)
  reduce_scatter  run(p2p, blocks, out, op)               blocks: the input, kept; block rank -> out
  all_to_all      run(p2p, sends, recvs)
  gather          run(p2p, send, recv_blocks | None, root)
  scatter         run(p2p, send_blocks | None, recv, root)
  barrier         run(p2p)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..buffers import copy

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
               "gather", "scatter", "barrier")


@dataclass(frozen=True)
class Link:
    """Cost constants of one tier of links (shared memory, TCP, a hypothetical fabric)."""

    name: str
    alpha: float  # seconds per message (latency)
    beta: float  # seconds per byte moved
    gamma: float  # seconds per byte reduced
    cache: float = 0.0
    """The `memory` entry only: bytes of last-level cache that a host's ranks share; its β and
    γ are then what a byte copied or reduced costs on top of a link's own beyond that cache."""


CostFn = Callable[[int, int, Link], float]  # (ranks, bytes, link) -> predicted seconds


@dataclass(frozen=True)
class Algorithm:
    name: str
    collective: str
    run: Callable[..., None]
    cost: CostFn
    eligible: Callable[[int, int], bool] = field(default=lambda n, nbytes: True)
    """(ranks, bytes) -> can it run (e.g. a power-of-two-only variant, a size cap)."""
    needs_direct: bool = False
    """Runs on the group's shared segment (single-host groups only)."""
    slot_need: Callable[[int, int], int] | None = None
    """needs_direct only: bytes of its slot one rank fills for (ranks, bytes); None: all of them."""
    needs_single_copy: bool = False
    """needs_direct only: reads peers' memory directly (cross-memory attach, transport/cma.py),
    which a group's setup enables only where every rank could."""
    single_copy_crowded: bool = False
    """needs_single_copy only: still worth it where ranks outnumber cores. There, a flag round
    costs a turn of the scheduler, which the slots' one shot and streams pay less often: at
    n=4 on 2 cores (interleaved, 9 calls each) the single copy all_gather took 1.40 ms against
    0.82 ms on the slots at 1 MiB and 3.45 against 2.28 ms at 4 MiB. The reductions, which
    read 2(n-1)/n of m per rank instead of the slots' n m, still won: see single_copy.py."""
    crowded_below: int = 0
    """needs_direct only: where ranks outnumber cores, calls smaller than this many bytes leave
    it out (0: none do). The rooted one shots hold every rank to the root's pace (a slot is
    refilled only once all ranks are past the call that last used it), where a tree's or the
    linear path's senders run ahead: at n=4 on 2 cores the one-shot gather took 119-160 us at
    16 B-16 KiB against the linear gather's 68-98 us, and the scatter 132-166 us against the
    binomial tree's 106-137 us (shm-n4 sweep at d277243); the broadcast 28-59 us at 16 B-256
    KiB against the binomial tree's 19-33 us and the reduce 35-70 us at 16 B-256 KiB against
    20-54 us for the tree or the linear reduce (shm-n4 sweep of 2026-11-25; in the one of
    2026-11-22 69-164 against 43-157 us, and the reduce lost at all those sizes but 64 KiB,
    119 against 129 us). From a MiB the one shot's single copy in and out won there: broadcast
    152 against 333-397 us (332 against 810-1168), and a broadcast past the slot streams, 2-2.6x
    faster than the tree at 4-16 MiB. At n=2 the one shots won (gather 20 and scatter 28 us
    against 50 and 42). TENSORWIRE_ALGO naming it still runs it."""
    out_of_place: bool = False
    """all_reduce, broadcast and all_gather: reads the input where it is (`src`) instead of in
    the output it was first copied into: a pass over the data saved, and (single copy) peers
    that read lines the source has not just written, which ran 2.3-2.5x faster at 1-8 MiB."""
    exchanges: bool = False
    """Its steps exchange with one partner and reduce what they received before the next step
    (recursive doubling's all_reduce, recursive halving, Rabenseifner). Where ranks share cores
    such a step waits for both partners to be scheduled: the n=4 sweeps measured 2-2.7x the
    busy α per step, against about 1x for steps that send to one rank and receive from another
    (ring, pairwise, dissemination), which let ranks drift; recursive doubling's all_gather,
    which exchanges but does not reduce, measured no such penalty; Bruck's all_to_all, whose
    rounds forward what the previous round received, measured it (AMD EPYC VM; on the Intel
    Xeon VM such steps cost what the others do). The tuner prices the work of these algorithms
    with the α the probe measured for steps in pairs (`busy_pairs`, calibrate.measure_busy),
    twice the busy α where it has none."""
    fixed_partners: bool = False
    """Every step sends to the same rank and receives from the same other rank (ring, chain).
    On shaped links such flows kept the link's pace where partners that change lost up to half
    of it (4 emulated hosts at 1 Gbit/s: the ring reduce_scatter ran 1.5-2.3x faster than the
    pairwise and recursive-halving ones at 16-64 MiB, under BBR, whose pacing without fq
    idle spells slow, and with send buffers deep enough for a rank to run ahead into its next
    partner: see transport.tcp.tune_socket; with cubic and 256 KiB, recursive halving and
    doubling ran within 1.02x of the ring at 1-64 MiB, the pairwise reduce_scatter 1.07-1.15x); the
    tuner prices their work with the busy link measured in a ring (`busy_ring`) where that is
    the faster one (never slower: see tuner.predict)."""
    one_way: bool = False
    """Every step only sends or only receives (trees, the linear rooted algorithms): where a
    link is a copy by each side, as through shared memory or TCP on one host, both copies run
    at once and a byte costs about half of an exchange's, whose ranks both copy in and out.
    The tuner prices its path with the link measured one way (tuner.ONE_WAY)."""
    copies: float = 2.0
    """Copies of a byte that its β counts once, for what bytes beyond the host's cache cost
    (tuner.spill): a message is copied into a ring or socket and out of it (2); the one-shot
    path copies a byte once per β (1), and single copy reads it once (1). 0: none, reductions
    included: the one-shot all_reduce streams its input through the slots a piece at a time and
    folds each piece while it is in cache, its one read and one write of memory hidden under
    the n reads and n-1 folds (n=4, 16 and 64 MiB, four sweeps of 2026-11-25: 0.39-0.61 of its
    price with memory charged, 0.70-1.18 without)."""
    reorder: bool = True
    """Runs in the group's topology-aware order where its ranks span hosts (algorithms/ordered.py):
    the algorithm sees virtual ranks, the results land in the callers' slots. False where the
    order cannot matter (every rank talks to the root) or must not change (the rank-ordered
    reductions fold in group-rank order), and for the algorithms that place themselves."""
    phases: Callable[..., float] | None = None
    """A hierarchical algorithm's cost (algorithms/hierarchical.py): (Shape, bytes, price of a
    phase within a host, price of a phase between hosts, the link between hosts) -> seconds.
    It runs where every host holds the same number of ranks (or, `uneven`, any numbers),
    and only where blocks are even; `cost` is never asked."""
    uneven: bool = False
    """A hierarchical algorithm whose hosts may hold different numbers of ranks (it crosses
    between hosts only on the rails every host has)."""
    uniform: bool = True
    """A hierarchical algorithm offered where every host holds as many ranks. The leaders'
    all_gather and reduce_scatter are not: they carry a host's bytes between hosts through one
    rank where the rails' variants use every rank, the same bytes, and on emulated hosts of 2
    ranks at 1 Gbit/s they ran 1.2-1.3x slower at 256 KiB-64 MiB while priced alike (one flow
    a host is one process's work and one connection's pace, which the model does not see)."""
    work: CostFn | None = None
    """The CPU time an average rank spends on the call (all ranks' together / n). Where ranks
    outnumber cores they take turns, and the call cannot end before the host has done all the
    work: the tuner prices T = max(cost(link), work(busy link)), the busy link's constants
    being measured with every rank exchanging at once. None: every rank works at every step
    (ring, recursive doubling, ...), so work is the cost itself. Trees leave ranks idle and
    declare less."""


_REGISTRY: dict[str, dict[str, Algorithm]] = {c: {} for c in COLLECTIVES}


def register(alg: Algorithm) -> Algorithm:
    """Add `alg`, adapted (`taking_input_apart`) so that all runs of a collective take the
    same arguments."""
    if alg.collective not in _REGISTRY:
        raise ValueError(f"unknown collective {alg.collective!r} (known: {', '.join(COLLECTIVES)})")
    if alg.name in _REGISTRY[alg.collective]:
        raise ValueError(f"{alg.collective}: algorithm {alg.name!r} registered twice")
    _REGISTRY[alg.collective][alg.name] = alg = taking_input_apart(alg)
    return alg


def taking_input_apart(alg: Algorithm) -> Algorithm:
    """`alg`, where it serves all_reduce, broadcast or all_gather without reading the input
    apart (not `out_of_place`), with a run that takes `src` anyway and copies it into the
    output first."""
    if alg.out_of_place or alg.collective not in ("all_reduce", "broadcast", "all_gather"):
        return alg
    run = alg.run
    if alg.collective == "all_gather":
        def all_gather(p2p, blocks, src=None):
            if src is not None:
                copy(blocks[p2p.rank], src)
            run(p2p, blocks)
        return replace(alg, run=all_gather)

    def copied_in(p2p, data, arg, src=None):  # all_reduce's op, broadcast's root
        if src is not None:
            copy(data, src)
        run(p2p, data, arg)
    return replace(alg, run=copied_in)


def slot_bytes(alg: Algorithm, n: int, nbytes: int) -> int:
    """How much of a rank's shared-memory slot `alg` needs for this call."""
    return nbytes if alg.slot_need is None else alg.slot_need(n, nbytes)


def algorithms_for(collective: str) -> dict[str, Algorithm]:
    return _REGISTRY[collective]
