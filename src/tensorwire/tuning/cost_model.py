"""The α-β-γ cost model: the links' constants and what an algorithm's call costs on them.

Every algorithm in the registry declares its cost formula; this module prices it with the
link constants of a tier (shared memory within a host, TCP otherwise), bounded below by its
work where ranks share cores, plus memory's price for what misses the host's cache. The
constants are measured at init by `calibrate` (or read from its cache, or from
TENSORWIRE_TUNING_FILE); until then the round defaults below apply. The tuner (tuner.py)
chooses with these prices; `tensorwire plan` prints them. The evidence behind each term is
in docs/design/cost-model.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..algorithms.prices import COPY, Link, LocalPrice, RailPrice
from ..algorithms.registry import Algorithm, algorithms_for, slot_bytes
from ..buffers import PIECE
from ..config import Config
from ..transport.tcp import parts_of
from . import crossing
from .policy import REDUCTIONS, allowed, forcing, rivals

if TYPE_CHECKING:
    from .topology import Layout

TIERS = ("shm", "tcp")
"""The link tiers tensorwire runs on: shared memory within a host, TCP across hosts."""
ONE_WAY = {tier: f"{tier}_one_way" for tier in TIERS}
"""Per tier, its link for messages that go one way (probes.one_way_beta), which prices the
algorithms whose steps only send or only receive (Algorithm.one_way); the tier's own link,
measured in exchanges, where this one was not measured."""

# Link constants until calibration measures them: round figures for this class of machine
# (docs/design/cost-model.md#default-constants).
DEFAULT_LINKS = {
    "shm": Link("shm", alpha=2e-6, beta=1 / 9e9, gamma=1 / 7.5e9),
    "tcp": Link("tcp", alpha=30e-6, beta=1 / 3e9, gamma=1 / 7.5e9),
    # the one-shot path: a flag round instead of a message per peer, copies that stay in cache
    "direct": Link("direct", alpha=1e-6, beta=1 / 16e9, gamma=1 / 7.5e9),
    # single copy: a flag round, and a byte read out of a peer process (about 4x a copy's price)
    "cma": Link("cma", alpha=1e-6, beta=1 / 4e9, gamma=1 / 7.5e9),
    # ... out of a source in huge pages: the kernel pins one page per 2 MiB instead of 512
    "cma_huge": Link("cma_huge", alpha=1e-6, beta=1 / 12e9, gamma=1 / 7.5e9),
    # single copy's reductions: their flag round, whose body folds in Python (only α is used)
    "cma_fold": Link("cma_fold", alpha=3e-6, beta=1 / 4e9, gamma=1 / 7.5e9),
    # a call the compiled caller runs whole: the one shot (α and β) and single copy's rounds (α)
    "direct_compiled": Link("direct_compiled", alpha=1e-6, beta=1 / 16e9, gamma=1 / 7.5e9),
    "cma_compiled": Link("cma_compiled", alpha=1e-6, beta=1 / 4e9, gamma=1 / 7.5e9),
    # not a link: what a byte costs beyond the last-level cache, and that cache's size
    "memory": Link("memory", alpha=0.0, beta=1 / 10e9 - 1 / 40e9, gamma=1 / 14e9 - 1 / 35e9, cache=32 << 20),
    # one TCP stream driven by one thread: the default TCP link's (only its β bounds a link, see Streams)
    "tcp_stream": Link("tcp_stream", alpha=30e-6, beta=1 / 3e9, gamma=1 / 7.5e9),
}
MEMORY = "memory"
STREAM = "tcp_stream"
CMA = "cma"
CMA_HUGE = "cma_huge"
CMA_FOLD = "cma_fold"
DIRECT_COMPILED, CMA_COMPILED = "direct_compiled", "cma_compiled"
DIRECT_BOUND = 0.9  # the one shot's α is priced at most this share of the cheapest other
# all_reduce at 8 B, unless it was the slower in every round of the probe (calibrate.with_direct_bound)
COMPILED_BYTES = PIECE
"""The one shot's bodies run in C for calls of up to this many bytes (and the slot's), and
DIRECT_COMPILED prices them there (measured at it, probes.measure_compiled); beyond, the Python
body streams the message."""
BUSY, BUSY_RING, BUSY_PAIRS = "busy", "busy_ring", "busy_pairs"
"""The world's tier measured with every rank at work at once (probes.measure_busy): partners
that change, a ring's fixed ones, and partners in pairs (the α of a step that exchanges with one
partner, see Algorithm.exchanges)."""
LINKS = (*TIERS, *ONE_WAY.values(), "direct", CMA, CMA_HUGE, CMA_FOLD, DIRECT_COMPILED, CMA_COMPILED, BUSY,
         BUSY_RING, BUSY_PAIRS, MEMORY, STREAM)
"""Every link the model prices and the probe measures: the message path of each tier (in
exchanges, and one way), the one-shot shared-memory path (`direct`: a flag round and a memory
copy), single copy's reads out of a peer process (`cma`; `cma_huge` out of huge pages;
`cma_fold`: the α of the reductions' rounds, whose bodies run in Python), the α of both where
the compiled caller runs a call whole (`direct_compiled`, `cma_compiled`: see compiled_prices), the
world's tier with every rank busy (`busy`, `busy_ring`, `busy_pairs`: the bound on an
algorithm's work), and the host's memory beyond its last-level cache (`memory`, see spill);
and, measured by no probe, what one TCP stream moves (`tcp_stream`, see Streams: a default
that a tuning file may set)."""
HUGE_FROM = 256 << 10
"""Single copy's reads are priced out of huge pages (`cma_huge`, where they are expected and not
seen otherwise: tuner.PageDependent) only for messages from this size, and for its reductions
from HUGE_FOLD_FROM; below them at `cma`'s (docs/design/cost-model.md#huge-pages-from-huge_from)."""
HUGE_FOLD_FROM = 1 << 20

FOOTPRINT = {
    "all_reduce": lambda n: 2, "broadcast": lambda n: 1, "reduce": lambda n: 2,
    "all_gather": lambda n: 1 + 1 / n, "reduce_scatter": lambda n: 1 + 1 / n, "all_to_all": lambda n: 2,
    "gather": lambda n: 1 + 1 / n, "scatter": lambda n: 1 + 1 / n, "barrier": lambda n: 0,
}
"""The buffers a rank's call goes through, as multiples of m (an input and an output the size
of the call's own); a message algorithm's rings come on top (see `spill`)."""

EXCHANGE_BUSY_ALPHA = 2.0
"""Busy α of a step that exchanges with one partner, in busy α's, where no such step was
measured (`busy_pairs`: a tuning file or test that gives only `busy`); see Algorithm.exchanges."""
TIE = 0.01
"""Prices this close to the cheapest are a tie: where latency rules, the ring and pairwise
exchange (or Bruck) differ only by the β of the busy link each is priced with, a difference
far below the noise of the constants."""
ROUNDING = 1e-9
"""Relative difference of two prices that floating point alone can make."""


# -- link constants ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinkTable:
    """The link constants of one runtime, per tier, and where each came from."""

    links: dict[str, Link]
    sources: dict[str, str]
    """Per tier: 'calibrated', 'cached', 'file', 'default', or 'file+<origin>' for a partial override."""
    probe_s: float = 0.0
    """Seconds the probe took at this init (0 when nothing was measured)."""
    setup_s: float = 0.0
    """Seconds the whole tuning setup took at init (agreement, cache, probe)."""
    cache_path: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def link(self, tier: str) -> Link:
        return self.links.get(tier) or DEFAULT_LINKS.get(tier) or DEFAULT_LINKS["shm"]

    def describe(self, tier: str) -> str:
        return f"{describe_link(self.link(tier))}; {self.sources.get(tier, 'default')}"


def describe_link(link: Link) -> str:
    """'α 2.0 us, β 9.00 GB/s, γ 7.50 GB/s': latency, and β and γ as rates; the memory entry
    as its cache and the cost per byte beyond it."""
    if link.cache:
        return (f"cache {link.cache / (1 << 20):.3g} MiB, beyond it +{link.beta * 1e9:.3g} ns per byte "
                f"copied, +{link.gamma * 1e9:.3g} ns per byte reduced")
    return (f"α {link.alpha * 1e6:.3g} us, β {_rate(link.beta)}, γ {_rate(link.gamma)}")


def describe_rate(link: Link) -> str:
    """A link's β as a rate: '3 GB/s'."""
    return _rate(link.beta)


def _rate(seconds_per_byte: float) -> str:
    return f"{1e-9 / seconds_per_byte:.3g} GB/s" if seconds_per_byte > 0 else "inf GB/s"


def format_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def default_table() -> LinkTable:
    return LinkTable(dict(DEFAULT_LINKS), {t: "default" for t in DEFAULT_LINKS})


def shared(link: Link | None, flows: float) -> Link | None:
    """`link` (priced per flow) where `flows` of them share it: β that many times."""
    return None if link is None else replace(link, beta=link.beta * flows)


# -- streams over TCP -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Streams:
    """How a rank's large TCP messages move: over `nsocks` streams a pair (TENSORWIRE_NSOCKS),
    with `threads` pump threads (TENSORWIRE_SOCKET_THREADS, resolved), on `cores` cores a rank
    (0: not known). A stream driven by one thread moves at most `stream`'s rate, so a
    connection reaches min(link, drivers × stream) (docs/design/tcp.md#streams-in-the-cost-model).
    `stream` None: the link's β already holds its streams (it was measured through them)."""

    nsocks: int = 1
    threads: int = 0
    stream: Link | None = None
    cores: float = 0.0

    def drivers(self, piece: int) -> int:
        """The streams that move a message of `piece` bytes at once: one without pump threads
        (the rank's own thread moves every part); with them, the parts it is split into
        (`tcp.parts_of`: one per PUMP_BYTES, each a pump's), a pumped one per two threads (one
        each way) and one more driven by the rank's thread, no more than the rank's cores."""
        moving = min(parts_of(piece, self.nsocks, self.threads > 0), 1 + self.threads // 2)
        return max(1, min(moving, int(self.cores))) if self.cores else moving

    def link(self, link: Link | None, piece: int) -> Link | None:
        """`link` at the rate its streams reach for messages of `piece` bytes."""
        if link is None or self.stream is None:
            return link
        return replace(link, beta=max(link.beta, self.stream.beta / self.drivers(piece)))


def streams_of(table: LinkTable, tier: str, nsocks: int, threads: int, cores: float = 0.0) -> Streams | None:
    """The Streams of `tier`'s connections (None on shared memory). A link the tuning file or
    the defaults give is the link's rate, which streams fill up to what each moves (the
    `tcp_stream` entry); a measured one already holds the streams it was measured through."""
    if tier != "tcp":
        return None
    source = table.sources.get(tier, "")
    stated = source == "default" or source.startswith("file")
    return Streams(max(1, nsocks), max(0, threads), table.link(STREAM) if stated else None, cores)


# -- one host's memory ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Host:
    """What the ranks of a single-host group share: memory (its cache and what a byte costs
    beyond it, the `memory` entry), how many of them run a call, each pair's ring, and what
    reading a peer process's memory costs (`cma`, single copy's link; `cma_huge` out of huge
    pages, where its sources are in them, `huge`, and messages from HUGE_FROM)."""

    memory: Link
    ranks: int
    ring_bytes: int
    cma: Link = DEFAULT_LINKS[CMA]
    cma_huge: Link = DEFAULT_LINKS[CMA_HUGE]
    cma_fold: Link = DEFAULT_LINKS[CMA_FOLD]
    huge: bool = True
    """Single copy's sources in huge pages: expected (Config.huge_pages), or as last seen."""
    cores: int = 0
    """Cores that run the ranks (0: a core each)."""

    def reads(self, nbytes: int, folds: bool = False) -> Link:
        """Single copy's link for a message of nbytes (see HUGE_FROM); where the call `folds`
        (a reduction), at the α of its rounds (`cma_fold`)."""
        link = self.cma_huge if self.huge and nbytes >= (HUGE_FOLD_FROM if folds else HUGE_FROM) else self.cma
        return replace(link, alpha=self.cma_fold.alpha) if folds else link

    def crowded_memory(self) -> Link:
        """The memory's price for a byte when every rank works at once: where ranks outnumber
        cores, a core moves the bytes of ranks/cores of them, so each waits that much longer
        for what misses the cache. A link measured with every rank at work (`busy`, the
        one-shot path's `direct`) already holds that for the bytes in cache; the memory entry
        is measured by one process alone (docs/design/cost-model.md#crowded-memory)."""
        crowding = self.ranks / self.cores if self.cores else 1.0
        if crowding <= 1:
            return self.memory
        return replace(self.memory, beta=self.memory.beta * crowding, gamma=self.memory.gamma * crowding)


def spill(alg: Algorithm, n: int, nbytes: int, host: Host) -> float:
    """The share of a call's bytes that misses the host's cache: 0 while every rank's buffers
    (FOOTPRINT; a message algorithm's rings on top) fit it together, 1 - cache/footprint beyond
    (docs/design/cost-model.md#memory-beyond-the-cache)."""
    per_rank = FOOTPRINT[alg.collective](n) * nbytes
    if not alg.needs_direct:
        per_rank += 2 * min(nbytes, host.ring_bytes)  # the rings it writes into and reads out of
    total = host.ranks * per_rank
    return 0.0 if total <= host.memory.cache else 1 - host.memory.cache / total


def compiled_prices(links: Mapping[str, Link], direct: Link | None, host: Host | None,
                    whole: bool = True, folds: bool = False) -> tuple[Link | None, Host | None]:
    """The one shot's link and the host's reads for a call the compiled caller runs whole
    (group/planned.py), where those were measured through it: single copy's rounds at
    CMA_COMPILED's α (its reads' β as they are); the one shot at DIRECT_COMPILED's α where its
    body runs in C at this size (`whole`: a call of up to COMPILED_BYTES), and at its β too
    where the call `folds` (a reduction: the compiled body folds as it reads, which the β
    fitted to an all_reduce holds; the other collectives only copy). Never above the Python
    path's, which the other links price (docs/design/cost-model.md#compiled-calls)."""
    reads = links.get(CMA_COMPILED)
    if host is not None and reads is not None:
        host = replace(host, cma=compiled_link(host.cma, reads), cma_huge=compiled_link(host.cma_huge, reads))
    if direct is not None and whole:
        direct = compiled_link(direct, links.get(DIRECT_COMPILED), beta=folds)
    return direct, host


def compiled_link(link: Link, measured: Link | None, beta: bool = False) -> Link:
    """`link` at the α (and `beta`: the β) of `measured` (None: not measured), where lower."""
    if measured is None:
        return link
    return replace(link, alpha=min(measured.alpha, link.alpha),
                   beta=min(measured.beta, link.beta) if beta else link.beta)


def beyond_cache(link: Link, share: float, memory: Link, copies: float) -> Link:
    """`link` with the memory's cost of `share` of every byte moved (`copies` copies each) and reduced."""
    return replace(link, beta=link.beta + share * copies * memory.beta,
                   gamma=link.gamma + share * min(copies, 1.0) * memory.gamma)


# -- the price of a call ----------------------------------------------------------------------------

Spread = Callable[[Algorithm], float]
"""The flows an algorithm puts on a host's link at once (crossing.algorithm_share) in a group."""


def one_flow(alg: Algorithm) -> float:
    """The Spread of a group on one host: no link shared."""
    return 1.0


@dataclass(frozen=True)
class Links:
    """What prices a call besides its algorithm (see predict): the tier's `link` and, where
    they exist, the one-shot path's own (`direct`), the tier with every rank at work (`busy`;
    `busy_ring`, `busy_pairs`), messages one way (`one_way`), the one host (`host`), the
    flows each algorithm puts on a host's link (`spread`) and what TCP's streams reach
    (`streams`). A job's tuner builds it for a group (tuner.Model), `tensorwire plan` for a
    tier (pricing.Tier), so both price alike."""

    link: Link
    direct: Link | None = None
    busy: Link | None = None
    busy_ring: Link | None = None
    busy_pairs: Link | None = None
    one_way: Link | None = None
    host: Host | None = None
    spread: Spread = one_flow
    streams: Streams | None = None

    def path(self) -> Links:
        """The links of an algorithm's path alone: no bound by the work of a busy host."""
        return replace(self, busy=None, busy_ring=None, busy_pairs=None)


def predict(alg: Algorithm, n: int, nbytes: int, links: Links, flows: float = 1.0) -> float:
    """Predicted seconds of one call. The one-shot shared-memory path is priced with its own
    constants (`direct`) where they were measured, and single copy with the host's (Host.reads); a
    message algorithm's time is bounded below
    by its work at the constants measured with every rank busy (`busy`; `busy_ring` for the
    algorithms with fixed partners; the α of `busy_pairs` for a step that exchanges with one
    partner), where those exist; the path of an algorithm whose steps go one way over the
    tier's link for such messages (`one_way`), where it was measured: the work of every rank
    is the same either way (each byte still costs a copy by each side). On one host (`host`)
    the bytes that miss the cache cost the
    memory's price on top, per copy (Algorithm.copies): a lone rank's on the path over the
    link, a crowded host's (Host.crowded_memory) where every rank works at once (the busy
    links' work, the one-shot path). With a busy link, no step of the path costs less than
    its α (a rank that shares its core is woken for each message). Across hosts, `flows` is the
    flows the algorithm puts on a host's link at once (crossing.py): the links' β count that
    many times (each link is priced per flow), and then no more than `streams` reach (a rank's
    streams are its own, not shared), at a message of the call's share a rank. The evidence:
    docs/design/cost-model.md."""
    link, direct, busy, busy_ring, busy_pairs = links.link, links.direct, links.busy, links.busy_ring, \
        links.busy_pairs
    one_way, host, streams = links.one_way, links.host, links.streams
    if flows != 1.0:
        link, busy, busy_ring, one_way = (shared(x, flows) for x in (link, busy, busy_ring, one_way))  # type: ignore[assignment]
    if streams is not None:
        piece = nbytes // max(1, n)
        link, one_way = streams.link(link, piece), streams.link(one_way, piece)  # type: ignore[assignment]
    share = spill(alg, n, nbytes, host) if host is not None else 0.0
    if alg.needs_direct:
        own = host.reads(nbytes, alg.collective in REDUCTIONS) if alg.needs_single_copy and host is not None \
            else direct or link
        if share:
            # single copy's link was measured with every rank reading beyond the cache, so it
            # holds its crowding: a lone rank's memory on top, the crowded one for the others
            memory = host.memory if alg.needs_single_copy else host.crowded_memory()  # type: ignore[union-attr]
            own = beyond_cache(own, share, memory, alg.copies)
        return alg.cost(n, nbytes, own)
    if alg.one_way and one_way is not None:
        link = replace(one_way, name=link.name)  # the tier's link still (the linear reduce asks which)
    if busy is not None and busy.alpha > link.alpha:
        # a step of the path costs at least the busy α: where ranks share cores, each message
        # of a chain waits for its receiver to be scheduled (cost-model.md#a-step-at-the-busy-alpha)
        link = replace(link, alpha=busy.alpha)
    if share:
        copies = alg.copies
        link = beyond_cache(link, share, host.memory, copies)  # type: ignore[union-attr]
        crowded = host.crowded_memory()  # type: ignore[union-attr]
        busy = busy and beyond_cache(busy, share, crowded, copies)
        busy_ring = busy_ring and beyond_cache(busy_ring, share, crowded, copies)
    t = alg.cost(n, nbytes, link)
    if busy is None:
        return t
    if alg.fixed_partners and busy_ring is not None and busy_ring.beta < busy.beta:
        # flows to fixed partners kept a shaped link's pace; where the probe's ring measured
        # slower (ranks outnumbering cores), the rings ran at the changing partners' rate
        busy = busy_ring
    if alg.exchanges:
        # never below the shifts' α: the probe's rounds in pairs run back to back in step, while
        # a call's exchanges wait for both partners, scheduled apart (cost-model.md#steps-in-pairs)
        pairs_alpha = EXCHANGE_BUSY_ALPHA * busy.alpha if busy_pairs is None else max(busy_pairs.alpha,
                                                                                      busy.alpha)
        busy = replace(busy, alpha=pairs_alpha)
    return max(t, (alg.work or alg.cost)(n, nbytes, busy))


def price(algs: list[Algorithm], n: int, nbytes: int, links: Links) -> list[tuple[float, str, Algorithm]]:
    """(predicted seconds, name, algorithm), cheapest first. Ties (typically several algorithms
    bounded by the same work of a busy host), within TIE of the cheapest, go to the shorter
    critical path, then by name: critical paths that differ only in their last bits count as
    one (the same formula written two ways, as the binomial and linear reduce at n=2)."""
    spread = links.spread
    priced = sorted((predict(alg, n, nbytes, links, spread(alg)), alg.name, alg)
                    for alg in algs if alg.phases is None)  # phases: see tuner.decide
    if not priced:
        return priced
    tied = [p for p in priced if p[0] <= priced[0][0] * (1 + TIE)]
    if len(tied) > 1:
        path = links.path()
        paths = {p[1]: predict(p[2], n, nbytes, path, spread(p[2])) for p in tied}
        shortest = min(paths.values()) * (1 + ROUNDING)
        tied.sort(key=lambda p: (0.0 if paths[p[1]] <= shortest else paths[p[1]], p[1]))
    return tied + priced[len(tied):]


def bound_direct(direct: Link, links: Links, n: int, single_copy: bool) -> Link:
    """The one-shot path's `direct` with its α at most DIRECT_BOUND of the cheapest other
    all_reduce of 8 bytes on n ranks (by messages, or single copy where the group has it),
    priced at `links`: the one shot exists to beat the rest at small sizes
    (calibrate.with_direct_bound says when a measured α is held to it)."""
    bound = DIRECT_BOUND * price(rivals("all_reduce", "direct", n, 8, single_copy), n, 8, links)[0][0]
    return direct if direct.alpha <= bound else replace(direct, alpha=bound)


# -- groups across hosts ----------------------------------------------------------------------------

def phase_prices(table: LinkTable, cfg: Config, local_tier: str = "shm", rail_tier: str = "tcp",
                 streams: Streams | None = None) -> tuple[LocalPrice, RailPrice]:
    """How a hierarchical algorithm's phases (Algorithm.phases) are priced: each at the
    cheapest flat algorithm of its collective that the phase's sub-group could run (`local`
    prices a pass through memory too, as the collective COPY on one rank). Within a
    host on `local_tier`, with the one-shot path at its own constants (single copy is left
    out: a host group may not get it). Between hosts on `rail_tier`, its β (and the busy
    links', where the world measured them on that tier: the rails run while every rank works,
    as the flat algorithms do, and are priced alike) multiplied by the flows that share a
    host's link, up to what the rails' `streams` reach.

    A host phase costs, on top, what the busy probe found a step costs beyond the rail's α
    (busy α − α): where ranks share cores, each phase waits for its ranks to be woken, as each
    step of a flat algorithm does (`predict`; docs/design/topology.md#pricing-the-phases)."""
    local_link, rail_link = table.link(local_tier), table.link(rail_tier)
    direct = table.links.get("direct") or DEFAULT_LINKS["direct"]
    memory = table.links.get(MEMORY) or DEFAULT_LINKS[MEMORY]
    across = table.extra.get("busy_tier") == rail_tier
    busy = tuple(table.links.get(b) if across else None for b in (BUSY, BUSY_RING, BUSY_PAIRS))
    woken = max(0.0, busy[0].alpha - rail_link.alpha) if busy[0] is not None else 0.0
    one_way = table.links.get(ONE_WAY[rail_tier]) if rail_tier in ONE_WAY else None

    def cheapest(collective: str, n: int, nbytes: int, price_one: Callable[[Algorithm], float],
                 one_host: bool) -> float:
        if n < 2:
            return 0.0
        force = forcing(cfg, collective, None)
        costs = [price_one(a) for a in algorithms_for(collective).values()
                 if a.phases is None and a.eligible(n, nbytes) and allowed(cfg, collective, a.name, force)
                 and (not a.needs_direct or (one_host and not a.needs_single_copy
                                            and slot_bytes(a, n, nbytes) <= cfg.direct_slot(n)))]
        return min(costs, default=float("inf"))

    def local(collective: str, n: int, nbytes: int) -> float:
        if collective == COPY:  # a pass through memory, at the one-shot path's copies
            return nbytes * (direct.beta + (memory.beta if nbytes > memory.cache else 0.0))
        one_shot = local_tier == "shm"
        within = Links(local_link, direct if one_shot else None)
        t = cheapest(collective, n, nbytes, lambda a: predict(a, n, nbytes, within), one_shot)
        return t + woken if n >= 2 else t

    between = Links(rail_link, None, busy[0], busy[1], busy[2], one_way, streams=streams)

    def rail(collective: str, n: int, nbytes: int, share: float) -> float:
        return cheapest(collective, n, nbytes, lambda a: predict(a, n, nbytes, between, share), False)

    return local, rail


def spread_of(layout: Layout | None) -> Spread:
    """How many flows each flat algorithm puts on a host's link at once in a group of this
    layout (one_flow on one host): an algorithm that runs in the topology's order sees its ranks
    host by host, the others in the group's order; the shared-memory path crosses no link."""
    if layout is None:
        return one_flow
    counts, placement = tuple(len(h) for h in layout.hosts), layout.placement
    return lambda alg: 1.0 if alg.needs_direct else crossing.algorithm_share(  # (a test's one host)
        alg, counts, layout.nics, None if alg.reorder else placement)


def per_flow(table: LinkTable, layout: Layout | None) -> LinkTable:
    """`table` with the busy links measured across hosts brought back to one flow: the probe
    ran on the world's placement, whose ranks shared their hosts' links as its pattern made
    them (crossing.probe_shares); each algorithm is then priced with the flows its own pattern
    puts there (spread_of, phase_prices' rails; docs/design/topology.md)."""
    measured = [b for b in (BUSY, BUSY_RING)
                if b in table.links and not table.sources.get(b, "").startswith("file")]
    if layout is None or table.extra.get("busy_tier") != "tcp" or not measured:
        return table
    shares = dict(zip((BUSY, BUSY_RING), crossing.probe_shares(layout.placement, layout.nics)))
    links = dict(table.links)
    for b in measured:
        links[b] = shared(links[b], 1 / shares[b])  # type: ignore[assignment]
    return replace(table, links=links, extra={**table.extra, "busy_flows": shares})
