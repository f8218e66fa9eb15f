"""The algorithm registry: every algorithm declares the collective it serves and its cost.

The tuner prices every eligible algorithm of a collective with the α-β-γ model (Thakur,
Rabenseifner & Gropp 2005; tuning/cost_model.py) for the group's link tier, bounded below by
the algorithm's total work where ranks share cores (`work`), and runs the cheapest;
`tensorwire plan` prints the same table. The measurements behind the flags below:
docs/design/cost-model.md#the-algorithms-flags. An algorithm module calls `register(...)` at
import for each entry.

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
from .prices import CostFn

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
               "gather", "scatter", "barrier")


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
    costs a turn of the scheduler, which the slots' one shot and streams pay less often; the
    reductions, which read 2(n-1)/n of m per rank instead of the slots' n m, still win."""
    named_where_crowded: bool = False
    """needs_direct only: where ranks outnumber cores, only TENSORWIRE_ALGO naming it runs it:
    the single copy reduce, whose root waits for folds that wait for cores."""
    out_of_place: bool = False
    """all_reduce, broadcast and all_gather: reads the input where it is (`src`) instead of in
    the output it was first copied into: a pass over the data saved, and (single copy) peers
    that read lines the source has not just written."""
    exchanges: bool = False
    """Its steps exchange with one partner and reduce what they received before the next step
    (recursive doubling's all_reduce, recursive halving, Rabenseifner). Where ranks share cores
    such a step waits for both partners to be scheduled, where steps that send to one rank and
    receive from another (ring, pairwise, dissemination) let ranks drift. The tuner prices the
    work of these algorithms with the α the probe measured for steps in pairs (`busy_pairs`,
    probes.measure_busy), twice the busy α where it has none."""
    fixed_partners: bool = False
    """Every step sends to the same rank and receives from the same other rank (ring, chain).
    On shaped links such flows kept the link's pace where partners that change lost up to
    half of it; the tuner prices their work with the busy link measured in a ring
    (`busy_ring`) where that is the faster one (never slower: see cost_model.predict)."""
    one_way: bool = False
    """Every step only sends or only receives (trees, the linear rooted algorithms): where a
    link is a copy by each side, as through shared memory or TCP on one host, both copies run
    at once and a byte costs about half of an exchange's, whose ranks both copy in and out.
    The tuner prices its path with the link measured one way (cost_model.ONE_WAY)."""
    copies: float = 2.0
    """Copies of a byte that its β counts once, for what bytes beyond the host's cache cost
    (cost_model.spill): a message is copied into a ring or socket and out of it (2); the
    one-shot path copies a byte once per β (1), and single copy reads it once (1). 0: none,
    reductions included: the one-shot all_reduce streams its input through the slots a piece
    at a time and folds each piece while it is in cache, its one read and one write of memory
    hidden under the n reads and n-1 folds."""
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
    rank where the rails' variants use every rank, the same bytes, and ran slower while priced
    alike (one flow a host is one process's work and one connection's pace, which the model
    does not see)."""
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
