"""The probe at init: α and β of every link the job uses, measured on the world group.

For each tier present, the lowest pair of ranks joined by it runs a few small exchanges (α),
1 MiB exchanges (β) and 1 MiB messages one way; then every rank exchanges at once, with
changing partners (`busy`), with a ring's fixed ones (`busy_ring`) and in pairs
(`busy_pairs`): what a step costs when every rank works (on a host with more ranks than cores
they take turns, which the lone pair never sees). On one host every rank takes part in
all_reduces through the group's shared segment (the one-shot path) and in single copy's
all_gathers, and rank 0 measures its memory (host_probes.py). The maximum over ranks of each
measurement becomes everybody's. The reasoning and the measurements behind each count:
docs/design/calibration.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algorithms.recursive_doubling import recursive_doubling_all_reduce
from ..algorithms.registry import algorithms_for
from ..buffers import huge_zeros
from ..ops import ReduceOp
from . import crossing, tuner
from .cost_model import BUSY, CMA, CMA_FOLD, CMA_HUGE, COMPILED_BYTES, MEMORY, TIERS
from .host_probes import measure_copy, measure_gamma, measure_memory

if TYPE_CHECKING:
    from ..group.calls import CollectiveCall
    from ..group.group import Group

# Short batches, best one kept for a link: on a busy machine a batch that was not preempted is
# likelier the shorter it is, and those constants describe the links, not the neighbours'
# load. The busy links and the direct path take typical rounds instead (see measure_busy).
ALPHA_BATCHES, ALPHA_ROUNDS = 12, 4  # small exchanges: the best (busy: median) batch mean is α
BETA_BYTES, BETA_TIMED = 1 << 20, 8  # 1 MiB exchanges: the median of this many gives β, after
# untimed ones that write a shared-memory ring once around (two over TCP, see measure_pair)
BETA_BUDGET_S = 0.15  # ... but no more of them than fit in this time (at least one timed)
ONE_WAY_TIMED = 4  # 1 MiB sent one way and acknowledged: the median of this many gives β one way
BUSY_BYTES, BUSY_BETA_ROUNDS = 2 << 20, 6  # rounds with every rank busy: their mean gives the busy β;
# twice the cached 1 MiB (a large message's bytes cost more) and half a default ring (no stalls)
BUSY_WARM_ROUNDS = 2  # ... after this many per partner distance (every ring written once around)
BUSY_WARM_ROUNDS_ACROSS_HOSTS = 6  # ... or this many where ranks are on several hosts (TCP ramp-up)
DIRECT_CALLS, DIRECT_SERIES = 24, 3  # all_reduces through the shared segment, back to back, in
# this many series, the least series' mean call kept: the direct path
CROWDED_CALLS, CROWDED_WARM, CROWDED_BATCHES = 6, 2, 3  # ... and the busy α's batches: down to this
# many where a machine's ranks crowd its cores (crowded), as the check of a cache entry counts them
CROWDED_LONG_WARM, CROWDED_LONG_CALLS = 1, 3  # ... and the long calls' series there (the one shot's β,
# single copy): each call is a mean over every rank's turn, and the check does not measure them
CROWDED_BUSY_BYTES = 256 << 10  # ... and the busy rounds' size there, one warm-up round a distance:
# rounds that do not grow every partner's ring (docs/design/calibration.md#the-crowded-probes-time)
BUSY_ROUND_S, SLOW_BUSY_BYTES = 0.02, 64 << 10  # ... and cut to a round of this time on a slow link,
# down to this size (busy_bytes; docs/design/calibration.md#slow-links)
DIRECT_BYTES = 1 << 20  # ... at 8 bytes (α) and at this size, or the slot's if smaller (β)
DIRECT_WARM = 8  # ... after this many untimed: the first calls after init are slower than the
# steady state, enough to flip small all_reduces to the tree (docs/design/calibration.md#warm-calls)
DIRECT_ROUNDS = 3  # rounds of the one shot's 8 B calls against recursive doubling's, spread over
# the probe: the median round gives the one shot's α (see probe, calibrate.with_direct_bound)
CMA_BYTES = 1 << 20  # ... single copy's block a rank, for its β (see measure_cma)
LOAD_SLACK = 0.5  # cores of other processes' CPU beyond those a probe left idle that make its
# constants untrusted: used by the job that measured them, not cached for the next (foreign_cores)


# -- the one-shot path and single copy: every rank of one host -------------------------------------

def typical(world: Group, run: Callable[[], object], what: str | None, warm: int = DIRECT_WARM,
            series: int = DIRECT_SERIES, calls: int = DIRECT_CALLS) -> float:
    """Seconds of one call of `run` (collective over `world`) as the model is judged
    (`tensorwire bench --algo`, benchmarks.algos.JUDGED): after DIRECT_WARM untimed calls,
    DIRECT_CALLS back to back on every rank, the slowest rank's mean call; the least of
    DIRECT_SERIES series. The message algorithms' busy links are such means too (measure_busy),
    so the one shot and the messages are priced in one statistic. Several series, since one
    alone meets a rank that lost its core for a while (docs/design/calibration.md#typical-calls).

    The series run inside one of the group's own calls named `what` (CallQueue.run_internal):
    a rank lost meanwhile fails the call on every rank, at no cost per timed call; None where
    `run` makes API calls, each entered as a call of its own."""

    def timed(_call: object = None) -> np.ndarray:
        for _ in range(warm):
            run()
        means = np.zeros(series)
        for s in range(series):
            t0 = time.perf_counter()
            for _ in range(calls):
                run()
            means[s] = (time.perf_counter() - t0) / calls
        return means

    means = timed() if what is None else world.queue.run_internal(what, timed)
    over_ranks(world, means)
    return float(means.min())


def over_ranks(world: Group, values: np.ndarray, what: str = "calibration probe",
               op: ReduceOp = ReduceOp.MAX) -> None:
    """`values` (contiguous) becomes its reduction by `op` over the ranks of `world`, in one of
    the group's own calls named `what` (CallQueue.run_internal)."""
    world.queue.run_internal(what, lambda call: recursive_doubling_all_reduce(call, values.reshape(-1), op))


def crowded(count: int, least: int, crowding: float) -> int:
    """How many of the probe's `count` repeated calls (or batches) to make where a machine of
    the job runs `crowding` ranks per core: all up to 2, fewer beyond in proportion, down to
    `least`. Each call then waits for every rank's turn on a core, so it is itself a mean over
    the ranks' turns, and the probe's time would otherwise grow with the ranks
    (docs/design/calibration.md#what-a-first-job-holds)."""
    return max(least, min(count, int(2 * count / max(crowding, 1e-9))))


def series_counts(crowding: float) -> dict[str, int]:
    """`typical`'s counts of the one-host probes' calls where machines run `crowding` ranks a core."""
    return {"warm": crowded(DIRECT_WARM, CROWDED_WARM, crowding),
            "calls": crowded(DIRECT_CALLS, CROWDED_CALLS, crowding),
            "series": crowded(DIRECT_SERIES, 1, crowding)}


def long_counts(counts: dict[str, int], crowding: float) -> dict[str, int]:
    """`typical`'s counts of the long calls (the one shot's β, single copy) from series_counts'."""
    return counts if crowding <= 2 else {**counts, "warm": CROWDED_LONG_WARM, "calls": CROWDED_LONG_CALLS}


def small_all_reduces(world: Group, **counts: int) -> tuple[float, float]:
    """One round of evidence: the one shot's 8-byte all_reduce and recursive doubling's (the
    message algorithm such calls would otherwise take), each timed as `typical` times it, back
    to back, so that both meet the same conditions (`counts`: typical's)."""
    algs = algorithms_for("all_reduce")
    data = np.ones(2, dtype=np.float32)

    def timed(name: str) -> float:
        run = algs[name].run
        return max(typical(world, lambda: run(world.queue.internal_call("calibration probe"), data,
                                              ReduceOp.MAX),
                           "calibration probe", **counts), 1e-8)

    return timed("direct"), timed("recursive_doubling")


def measure_direct(world: Group, long: dict[str, int], **counts: int) -> tuple[float, float, float]:
    """(α, recursive doubling's 8-byte call, β) of the one-shot shared-memory path, from
    all_reduces through the group segment (every rank of the world takes part, see `typical`):
    α is a call's time at 8 bytes, in the first round of small_all_reduces (`probe` takes the
    median of DIRECT_ROUNDS); β is fitted to the time at DIRECT_BYTES (up to the slot),
    counting a reduced byte like a copied one, and never below a lone copy's (`counts`:
    typical's; `long`: those of the call at DIRECT_BYTES). Every rank works in these calls,
    contention included, as for the busy link. Not a bare barrier, nor a copy timed alone:
    when ranks share cores the copy in and the fold cost as much as the flag round, and each
    rank copies while the others do."""
    run = algorithms_for("all_reduce")["direct"].run
    n = world.size
    big = np.ones(min(DIRECT_BYTES, world.direct.slot_bytes) // 4, dtype=np.float32)  # type: ignore[union-attr]
    alpha, messages = small_all_reduces(world, **counts)
    one = typical(world, lambda: run(world.queue.internal_call("calibration probe"), big, ReduceOp.MAX),
                  "calibration probe", **long)
    slope = (one - alpha) / ((1 + n + n - 1) * big.nbytes)  # copy in, n reads, n-1 folds
    return alpha, messages, max(slope, measure_copy())  # never faster than a copy alone (noise can say so)


def measure_cma(world: Group, **counts: int) -> tuple[float, float, float, float]:
    """(α, β, β out of huge pages, a reduction's α) of single copy, from its all_gather (every rank of
    the world takes part, as in measure_direct): α is half a call's time at 8 bytes a rank (two flag
    rounds), the reduction's a third of its all_reduce's (three such rounds around a body that
    folds in Python); each β is fitted to the time at about CMA_BYTES read by each rank, in n-1 blocks out of
    its peers' memory (the block shrinks as n grows, so that n blocks stay near CMA_BYTES of memory a
    rank). A read across processes pins the source's pages and costs far more than a copy out of 4 KiB
    pages, so the one-shot path's β does not price it; out of huge pages it costs less (which sources
    are: tuner.PageDependent; docs/design/cost-model.md#single-copys-reads). `counts`: typical's."""
    run = algorithms_for("all_gather")["single_copy"].run
    n = world.size

    def timed(blocks: list[np.ndarray]) -> float:
        return typical(world, lambda: run(world.queue.internal_call("calibration probe"), blocks, None),
                       "calibration probe", **counts)

    small = timed([np.ones(8, dtype=np.uint8) for _ in range(n)])
    block = max(CMA_BYTES // (n - 1) // 4096 * 4096, 4096)

    def slope(blocks: list[np.ndarray]) -> float:
        return max((timed(blocks) - small) / ((n - 1) * block), measure_copy())

    whole = huge_zeros(n * block)
    whole[...] = 1  # the pages exist before the timing
    fold = algorithms_for("all_reduce")["single_copy"].run
    two = np.ones(2, dtype=np.float32)
    folds = typical(world, lambda: fold(world.queue.internal_call("calibration probe"), two, ReduceOp.MAX),
                    "calibration probe", **counts)
    return (max(small / 2, 1e-8), slope([np.ones(block, dtype=np.uint8) for _ in range(n)]),
            slope([whole[r * block:(r + 1) * block] for r in range(n)]), max(folds / 3, 1e-8))


@contextlib.contextmanager
def _own_calls(world: Group) -> Iterator[None]:
    """The API calls made inside count as the group's own (CallQueue.internal): the user's first
    call is still #1 in every message that names it; nor are they logged, and they take the
    paths they take where nothing is logged (CallQueue.logged)."""
    queue = world.queue
    users = queue.seq - queue.internal
    logged, queue.logged = queue.logged, False
    try:
        yield
    finally:
        queue.internal = queue.seq - users
        queue.logged = logged


def measure_compiled(world: Group, cma: bool, long: dict[str, int],
                     **counts: int) -> tuple[float, float, float]:
    """(α and β of the one shot, α of single copy; 0 where not measured) in calls the compiled
    caller runs whole: the API's own all_reduces (sums, which fold in C) of 8 bytes and of
    COMPILED_BYTES (or the slot's, if smaller), and 8-byte all_gather_into_tensor, planned on
    that algorithm (tuner.override) and repeated, so that every timed call is one C call, API,
    checks and body (group/planned.py). β is fitted as in measure_direct (floored at a lone copy
    of the message), single copy's α is half a call (two flag rounds) as in measure_cma
    (`counts`, `long`: typical's, as there).
    Needs the tuner's constants installed (calibrate.at_init's provisional ones)."""
    n = world.size

    def forced(collective: str, name: str, nbytes: int, run: Callable[[], object], **how: int) -> float:
        if name not in {a.name for a in tuner.candidates(world, collective, nbytes)}:
            return 0.0  # TENSORWIRE_ALGO leaves it out (alike on every rank): never priced
        with tuner.override(world, collective, name), _own_calls(world):
            return max(typical(world, run, None, **how), 1e-8)

    small, block, blocks = np.ones(2, np.float32), np.ones(8, np.uint8), np.zeros(8 * n, np.uint8)
    big = np.ones(min(COMPILED_BYTES, world.direct.slot_bytes) // 4, np.float32)  # type: ignore[union-attr]
    alpha = forced("all_reduce", "direct", small.nbytes, lambda: world.all_reduce(small), **counts)
    one = forced("all_reduce", "direct", big.nbytes, lambda: world.all_reduce(big), **long)
    units = 1 + n + n - 1  # copy in, n reads, n-1 folds, as in measure_direct; the compiled body folds
    # as it reads, beating that floor (a lone copy a unit), but still copies the message in once
    fitted = max((one - alpha) / (units * big.nbytes), measure_copy() / units) if one and alpha else 0.0
    beta = np.array([fitted])  # the copy floor is this rank's own measurement: every rank takes the largest
    over_ranks(world, beta)
    reads = forced("all_gather", "single_copy", blocks.nbytes,
                   lambda: world.all_gather_into_tensor(blocks, block), **counts) / 2 if cma else 0.0
    return alpha, float(beta[0]), reads


# -- messages: a pair of ranks, and every rank at once ---------------------------------------------

def _exchange(call: CollectiveCall, peer: int, out: np.ndarray, into: np.ndarray, step: int) -> None:
    call.wait(call.isend(peer, out, step), call.irecv(peer, into, step))


def busy_bytes(beta: float, crowded: bool) -> int:
    """The busy rounds' size: BUSY_BYTES (CROWDED_BUSY_BYTES where `crowded`), cut where the
    slowest link the lone pairs measured (`beta`, seconds a byte) would make a round outlast
    BUSY_ROUND_S, down to SLOW_BUSY_BYTES: the probe's time then follows the links' speed
    (docs/design/calibration.md#slow-links)."""
    full = CROWDED_BUSY_BYTES if crowded else BUSY_BYTES
    fit = int(BUSY_ROUND_S / beta) >> 12 << 12 if beta > 0 else full
    return max(SLOW_BUSY_BYTES, min(full, fit))


def measure_busy(call: CollectiveCall, step0: int, across_hosts: bool = False,
                 batches: int = ALPHA_BATCHES, crowded: bool = False,
                 nbytes: int = BUSY_BYTES) -> tuple[float, float, float, float]:
    """(α, β, β in a ring, α in pairs) of a step when every rank works: all ranks at once,
    round k sending to rank r + d and receiving from r - d, d = 1, 2, 4, ... (a dissemination
    pattern: every rank takes part whatever n is, and the partners change from round to round
    as in pairwise exchange, recursive doubling or a tree); then the same with d = 1
    throughout, the fixed partners of a ring or a chain; then 8-byte rounds in pairs, each rank
    exchanging with rank r XOR d (where there is one), as the steps of recursive doubling,
    recursive halving, Rabenseifner and Bruck do (Algorithm.exchanges).

    The median of `batches` 8-byte batches gives α; β is the mean of a few rounds of `nbytes`
    (busy_bytes), slow ones
    included: contention is the point, and a long call meets the preempted rounds that a median
    would drop. Each pattern is run untimed BUSY_WARM_ROUNDS per distance first, more across
    hosts, where fresh TCP connections ramp up (BUSY_WARM_ROUNDS_ACROSS_HOSTS); there the
    dissemination rounds are timed twice, before and after the ring's, and the faster kept: the
    collectives that follow run in the steady state (docs/design/calibration.md#the-busy-links)."""
    rounds = Rounds(call, step0)
    dists = rounds.dists
    big_out, big_in = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)  # pages touched

    def mean_round(distances: list[int], count: int) -> float:
        t0 = time.perf_counter()
        for i in range(count):
            rounds.shift(big_out, big_in, distances[i % len(distances)])
        return (time.perf_counter() - t0) / count

    for i in range(2):  # everyone is here
        rounds.small_shift(dists[i % len(dists)])
    # every ring written once around: its pages are touched, as in steady use
    warm = BUSY_WARM_ROUNDS_ACROSS_HOSTS if across_hosts else 1 if crowded else BUSY_WARM_ROUNDS
    mean_round(dists, warm * len(dists))
    alpha = rounds.alpha(rounds.small_shift, batches)

    def beta(mean: float) -> float:  # at least half of a round is bandwidth, as in measure_pair
        return max((mean - alpha) / nbytes, mean / nbytes / 2, 1e-13)

    count = -(-BUSY_BETA_ROUNDS // len(dists)) * len(dists)  # every distance as often
    shifting = beta(mean_round(dists, count))
    mean_round([1], warm)  # untimed: right after the change of pattern a shaped ring ran slow
    ring = beta(mean_round([1], count))
    if across_hosts:
        shifting = min(shifting, beta(mean_round(dists, count)))
    for d in dists:  # the pairs once round, untimed: every rank is past the ring
        rounds.pair(d)
    return alpha, shifting, ring, rounds.alpha(rounds.pair, batches)


class Rounds:
    """Rounds in which every rank exchanges at once, each message step numbered from `step0`
    (measure_busy, and the check of a cached entry): shifts by d (send to rank r + d, receive
    from r - d) and pairs (exchange with r XOR d), d = 1, 2, 4, ..."""

    def __init__(self, call: CollectiveCall, step0: int) -> None:
        self.call, self.step = call, step0
        self.n, self.r = call.group.size, call.group.rank
        self.dists = crossing.doubling(self.n)
        self._out, self._in = np.zeros(8, np.uint8), np.zeros(8, np.uint8)

    def _exchange(self, dst: int, src: int, out: np.ndarray, into: np.ndarray) -> None:
        if dst < self.n:  # in pairs, a rank without a partner sits the round out
            self.call.wait(self.call.irecv(src, into, self.step), self.call.isend(dst, out, self.step))
        self.step += 1

    def shift(self, out: np.ndarray, into: np.ndarray, d: int) -> None:
        self._exchange((self.r + d) % self.n, (self.r - d) % self.n, out, into)

    def small_shift(self, d: int) -> None:
        self.shift(self._out, self._in, d)

    def pair(self, d: int) -> None:
        self._exchange(self.r ^ d, self.r ^ d, self._out, self._in)

    def alpha(self, round_: Callable[[int], None], batches: int = ALPHA_BATCHES) -> float:
        """The median batch's mean round: ALPHA_ROUNDS 8-byte rounds a batch, distances in turn."""
        means = []
        for _ in range(batches):
            t0 = time.perf_counter()
            for i in range(ALPHA_ROUNDS):
                round_(self.dists[i % len(self.dists)])
            means.append((time.perf_counter() - t0) / ALPHA_ROUNDS)
        return max(statistics.median(means), 1e-8)


def measure_pair(call: CollectiveCall, peer: int, step0: int, warm: int = 2) -> tuple[float, float, float]:
    """(α, β, β one way) over the link to `peer`, which runs the same function toward this rank.

    α is the time of one exchange of 8 bytes (both ranks send and receive, as an algorithm's
    step does), the best batch mean; β comes from the median of a few 1 MiB exchanges after
    `warm` untimed ones: over TCP two, which may ride a shaper's burst allowance (tc tbf lets
    its bucket through at line rate) that a long transfer does not get; through shared memory
    enough to write the ring once around, as the first touch of its pages is slow
    (docs/design/calibration.md#a-pairs-β)."""
    big_out, big_in = np.ones(BETA_BYTES, np.uint8), np.ones(BETA_BYTES, np.uint8)  # pages touched
    alpha = pair_alpha(call, peer, step0, ALPHA_BATCHES)
    step = step0 + 2 + ALPHA_BATCHES * ALPHA_ROUNDS
    bigs: list[float] = []
    rounds = warm + BETA_TIMED
    for i in range(rounds):  # fewer on a slow link: the probe stays well under a second
        # the first byte says whether this side wants another round; both sides see both
        # flags, so they stop after the same exchange
        big_out[0] = i + 1 < rounds and (i <= warm or sum(bigs) < BETA_BUDGET_S)
        t0 = time.perf_counter()
        _exchange(call, peer, big_out, big_in, step)
        step += 1
        bigs.append(time.perf_counter() - t0)
        if not (big_out[0] and big_in[0]):
            break
    # the median, not the best: the odd fast exchange had swung the best of a few from launch
    # to launch
    big = statistics.median(bigs[warm:])
    # at least half of a 1 MiB exchange is bandwidth: on a busy machine α comes out inflated,
    # and subtracting it whole would make the link look faster than memory
    beta = max((big - alpha) / BETA_BYTES, big / BETA_BYTES / 2, 1e-13)
    return alpha, beta, one_way_beta(call, peer, step, alpha, big_out, big_in)


def pair_alpha(call: CollectiveCall, peer: int, step0: int, batches: int) -> float:
    """α over the link to `peer`, which runs the same toward this rank: the best of `batches`
    batch means of ALPHA_ROUNDS 8-byte exchanges, after two that start both sides together and
    warm the path (2 + batches x ALPHA_ROUNDS message steps from step0)."""
    out, into = np.zeros(8, np.uint8), np.zeros(8, np.uint8)
    for step in range(step0, step0 + 2):
        _exchange(call, peer, out, into, step)
    step, best = step0 + 2, math.inf
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(ALPHA_ROUNDS):
            _exchange(call, peer, out, into, step)
            step += 1
        best = min(best, (time.perf_counter() - t0) / ALPHA_ROUNDS)
    return max(best, 1e-8)


def one_way_beta(call: CollectiveCall, peer: int, step: int, alpha: float, out: np.ndarray,
                 into: np.ndarray) -> float:
    """β of a message that goes one way (the lower rank sends, the other acknowledges with 8
    bytes), as the steps of a tree or a linear rooted algorithm do: the median of
    ONE_WAY_TIMED after one untimed. Where the link is a copy by each side (shared memory, TCP
    on one host) the two copies run at once, and a byte costs about half what an exchange's
    does, whose ranks both copy in and out; a wire of full duplex costs the same either way
    (docs/design/cost-model.md#messages-one-way)."""
    ack_out, ack_in = np.zeros(8, np.uint8), np.zeros(8, np.uint8)
    sends = call.group.rank < peer
    times = []
    for _ in range(1 + ONE_WAY_TIMED):
        t0 = time.perf_counter()
        if sends:
            call.wait(call.isend(peer, out, step))
            call.wait(call.irecv(peer, ack_in, step + 1))
        else:
            call.wait(call.irecv(peer, into, step))
            call.wait(call.isend(peer, ack_out, step + 1))
        times.append(time.perf_counter() - t0)
        step += 2
    one = statistics.median(times[1:])
    return max((one - alpha) / BETA_BYTES, one / BETA_BYTES / 2, 1e-13)


# -- the whole probe --------------------------------------------------------------------------------

def probe(world: Group, pairs: dict[str, tuple[int, int]], direct: bool, cma: bool,
          across_hosts: bool, crowding: float, own_core: bool = True) -> dict[str, Any]:
    """Measure the direct path and single copy on everyone, every tier on its pair, every rank
    at once (the busy link), and γ and memory on rank 0; the maximum over ranks of each, the
    same everywhere. The one shot's α is the median of DIRECT_ROUNDS rounds of
    small_all_reduces spread over the probe (at its start, after single copy, after the busy
    link), each against recursive doubling: a rank preempted for a whole round (every series
    of it) moves neither the median nor the evidence of calibrate.with_direct_bound. `crowding`:
    the most ranks per core of any machine of the job, the same on every rank; beyond two the
    series, the rounds, the busy batches and the busy rounds' size shrink (crowded,
    CROWDED_BUSY_BYTES), the long calls' series most (CROWDED_LONG_CALLS). `own_core`: this
    rank is the first on its core (as `spread` yields), and such ranks alone measure the busy
    γ: no more of them contend for memory at once.

    Ranks with nothing (more) to measure wait politely, sleeping between polls, rather than
    spinning: on a host with more ranks than cores a spinning bystander would be measured
    along with the link."""
    me = world.rank
    wire_partners(world)
    # (α, β, β one way) per tier, busy (α, β, β in a ring, α in pairs, γ), direct (α, β), γ,
    # memory (cache, β, γ), cma (α, β, β out of huge pages, a reduction's α), then the rounds: the one shot's
    # 8 B call and recursive doubling's, per round
    n_rounds = crowded(DIRECT_ROUNDS, 1, crowding)
    measured = np.zeros(3 * len(TIERS) + 15 + 2 * n_rounds, dtype=np.float64)
    busy = slice(3 * len(TIERS), 3 * len(TIERS) + 5)
    own, gamma, memory = slice(busy.stop, busy.stop + 2), busy.stop + 2, slice(busy.stop + 3, busy.stop + 6)
    reads = slice(memory.stop, memory.stop + 4)
    rounds = measured[reads.stop:].reshape(2, n_rounds)
    counts = series_counts(crowding)
    long = long_counts(counts, crowding)
    if direct:  # first: they need every rank anyway
        rounds[0, 0], rounds[1, 0], measured[own.stop - 1] = measure_direct(world, long, **counts)
    if cma:
        measured[reads] = measure_cma(world, **long)
    if direct and n_rounds > 1:
        rounds[:, 1] = small_all_reduces(world, **counts)

    def messages(call: CollectiveCall) -> None:
        _max_politely(world, call, np.zeros(1), _SETTLE)  # the lone pairs start once every rank is done
        # with the calls above, not while the last ranks still share the cores with them
        for i, tier in enumerate(TIERS):
            pair = pairs.get(tier)
            if pair is not None and me in pair:
                peer = pair[1] if me == pair[0] else pair[0]
                # once around the ring the 1 MiB messages write: one grows to hold two (4 MiB,
                # ShmChannel._grow), never past the ring planned (TENSORWIRE_SHM_RING, /dev/shm)
                warm = 1 + min(world.ring_bytes, 4 * BETA_BYTES) // BETA_BYTES if tier == "shm" else 2
                measured[3 * i: 3 * i + 3] = measure_pair(call, peer, i * 1000, warm)
        slowest = np.array([max(measured[1: 3 * len(TIERS): 3])])  # the pairs' largest β, agreed:
        _max_politely(world, call, slowest, _SYNC)  # the busy rounds start together, after the lone pairs
        measured[busy.start: busy.start + 4] = measure_busy(
            call, len(TIERS) * 1000, across_hosts, crowded(ALPHA_BATCHES, CROWDED_BATCHES, crowding),
            crowding > 2, busy_bytes(float(slowest[0]), crowding > 2))

    world.queue.run_internal("calibration probe", messages)
    if own_core:
        measured[busy.stop - 1] = measure_gamma()
    if direct:
        for r in range(2, n_rounds):
            rounds[:, r] = small_all_reduces(world, **counts)
        measured[own.start] = statistics.median(rounds[0])
    if me == 0:
        measured[gamma] = measure_gamma()
        measured[memory] = measure_memory()
    world.queue.run_internal("calibration probe", lambda call: _max_politely(world, call, measured, _RESULTS))
    out: dict[str, Any] = {t: tuple(float(v) for v in measured[3 * i: 3 * i + 3])
                           for i, t in enumerate(TIERS)}
    out["direct"] = tuple(float(v) for v in measured[own])
    out["rounds"] = [[float(v) for v in row] for row in rounds]
    out[BUSY] = tuple(float(v) for v in measured[busy])
    out["gamma"] = float(measured[gamma])
    out[MEMORY] = tuple(float(v) for v in measured[memory])
    alpha, beta, huge_beta, fold_alpha = (float(v) for v in measured[reads])
    out[CMA], out[CMA_HUGE], out[CMA_FOLD] = (alpha, beta), (alpha, huge_beta), (fold_alpha, beta)
    return out


@contextlib.contextmanager
def spread(world: Any, hosts: list[int]) -> Iterator[bool]:
    """Within: where a host's ranks outnumber its cores, each runs on one core, the host's
    ranks dealt round the cores in rank order; as before after. The probe otherwise measures
    whichever placement the scheduler picked, which differs from launch to launch
    (docs/design/calibration.md#spread-over-the-cores). Yields whether this rank is the
    first on its core (probe's `own_core`)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        yield True
        return
    mine = [r for r in range(world.size) if hosts[r] == hosts[world.rank]]
    if len(mine) <= len(cores) or not world.engine.oversubscribed:  # or a launcher bound them apart
        yield True
        return
    index = mine.index(world.rank)
    os.sched_setaffinity(0, {cores[index % len(cores)]})
    try:
        yield index < len(cores)
    finally:
        os.sched_setaffinity(0, cores)


def wire_partners(world: Group) -> None:
    """Connect, all at once, the ranks this one exchanges with in the busy rounds' shifts and
    the polite maxima (r ± d, d = 1, 2, 4, ...; recursive doubling's r XOR d talk already), and
    wait until they are: else each round waits for its pairs' setup in turn, and a setup
    running beside a measurement is measured with it. Collective over the world."""
    n, r, engine = world.size, world.rank, world.engine
    peers = {world.ranks[(r + s * d) % n] for d in crossing.doubling(n) for s in (1, -1)}
    engine.reach(peers)
    deadline = time.perf_counter() + world.timeout  # past it, the rounds' waits name the missing

    while any(engine.connecting(p) for p in peers) and time.perf_counter() < deadline:
        engine.sleep_on_sockets(_WIRING_NAP_S)


def _max_politely(world: Group, call: CollectiveCall, values: np.ndarray, step0: int) -> None:
    """`values` becomes its maximum over ranks, the same on every rank (and no rank returns
    before all have arrived), waiting without spinning: rounds in which rank r sends to r + d
    and receives from r - d, d = 1, 2, 4, ... (the maximum of what arrived is all a rank sends
    on). Only the busy rounds' partners: no rank is wired to more peers than a cached job's
    check wires it to (a gather at rank 0 would wire rank 0 to every rank, and every rank to it)."""
    n, r = world.size, world.rank
    got = np.empty_like(values)
    for step, d in enumerate(crossing.doubling(n), step0):
        reqs = [call.irecv((r - d) % n, got, step), call.isend_waking((r + d) % n, values, step)]
        _wait_politely(world, call, reqs)
        np.maximum(values, got, out=values)


_SETTLE, _SYNC = 30_000, 40_000
_RESULTS = 50_000  # message steps of the probe's results (the pairs use steps below)
_POLITE_NAP_S = 0.02  # the longest sleep of a polite wait, which its message's arrival cuts short
_WIRING_NAP_S = 0.005  # a wait for the wiring thread's connections (no socket of theirs to wake it)


def _wait_politely(world: Group, call: CollectiveCall, reqs: list) -> None:
    """call.wait without spinning: poll, then sleep on the sockets, which wake at once for the
    round's message (sent on the pair's socket: `isend_waking`), TCP data or a peer that went
    away. On a crowded host every wake of a rank sitting out a lone measurement (or a round)
    takes a turn from the ranks that work (docs/design/calibration.md#polite-rounds)."""
    engine = world.engine
    while not all(r.done for r in reqs):
        with engine.lock:
            engine.progress()
        if all(r.done for r in reqs):
            break
        engine.check_group(world.ctx, call.seq, world.ranks)  # aborted, or a member crashed
        if time.perf_counter() > call.deadline:
            break  # call.wait raises the TimeoutError naming whom it waited for
        engine.sleep_on_sockets(_POLITE_NAP_S)
    call.wait(*reqs)


# -- what else ran -----------------------------------------------------------------------------------

def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the machine has spent busy since boot, steal included: a neighbour VM's turn
    is load too; NaN where /proc/stat cannot say), CPU seconds of this process (every thread)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            # user nice system idle iowait irq softirq steal
            ticks = [int(v) for v in f.readline().split()[1:9]]
        machine = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        machine = math.nan
    return machine, time.process_time()


def foreign_cores(world: Group, machines: list[int], before: tuple[float, float], t0: float) -> float:
    """On the busiest of the job's machines (ranks that share a kernel: topology.machine_id), the
    cores' worth of CPU that processes outside the job used since `before` (cpu_seconds at
    perf_counter `t0`) beyond the cores the job left idle and /proc/stat's resolution (a tick
    per CPU at each end): above LOAD_SLACK the probe measured the neighbours as much as the
    links. Collective; 0 where /proc/stat cannot say."""
    machine, own = cpu_seconds()
    rows = np.zeros((world.size, 4))
    rows[world.rank] = (machine - before[0], own - before[1], time.perf_counter() - t0, os.cpu_count() or 1)
    over_ranks(world, rows, op=ReduceOp.SUM)
    hz = os.sysconf("SC_CLK_TCK")
    worst = 0.0
    for m in set(machines):
        ranks = [r for r in range(world.size) if machines[r] == m]
        busy, _, wall, cpus = rows[ranks[0]]
        if not math.isfinite(busy) or wall <= 0:
            continue
        others = (busy - rows[ranks, 1].sum()) / wall
        worst = max(worst, float(others - max(cpus - len(ranks), 0) - 2 * cpus / (hz * wall)))
    return worst
