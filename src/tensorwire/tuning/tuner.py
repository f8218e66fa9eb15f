"""Which algorithm runs a call: the cheapest eligible one under the α-β-γ cost model.

Every algorithm in the registry declares its cost formula; the tuner prices them with the link
constants of the group's tier (shared memory within a host, TCP otherwise) and runs the
cheapest. The constants are measured at init by `calibrate` (or read from its cache, or from
TENSORWIRE_TUNING_FILE) and installed here; until then, and for runtimes that never calibrate,
the round defaults below apply.

TENSORWIRE_ALGO forces or excludes names, NCCL-style: `allreduce:ring`, `broadcast:binomial`,
`allreduce:^direct`, `^recursive_doubling` (every collective), `allreduce:ring|direct` (either);
clauses are separated by `,` or `;`. An unqualified forced name applies to the collectives that
have an algorithm of that name and leaves the others alone. Unknown collectives or names are
an error at init that lists the known ones.

Deterministic mode (TENSORWIRE_DETERMINISTIC=1) leaves only rank-ordered reductions eligible
for all_reduce, reduce and reduce_scatter (DETERMINISTIC: the one-shot shared-memory path,
the rank_ordered message algorithm, the linear reduce), which fold every element in rank
order and so produce the same bits whatever was chosen.

The one-shot shared-memory path is priced with constants of its own (a flag round, a memory
copy) where calibration measured them, single copy with its reads' (`cma`, or `cma_huge` out
of sources in huge pages: presumed where huge pages are expected, then as its sources report,
see PageDependent); everything else with its tier's.

A group spread over hosts (topo.Layout) gets every algorithm in its topology-aware order
(algorithms/ordered.arrange), and, where its hosts hold the same number of ranks, the
hierarchical algorithms too, each priced by its phases (phase_prices) against the flat ones.

With TENSORWIRE_DEBUG=INFO TENSORWIRE_DEBUG_SUBSYS=TUNING each new choice is logged with its
cost table and the link constants behind it (and where they came from).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import log
from ..algorithms import rank_ordered
from ..algorithms.hierarchical import COPY, LocalPrice, RailPrice, Shape
from ..algorithms.ordered import arrange
from ..algorithms.registry import COLLECTIVES, Algorithm, Link, algorithms_for, slot_bytes
from ..config import Config
from ..errors import InvalidArgumentError
from . import crossing

if TYPE_CHECKING:
    from ..group.group import Group
    from ..runtime import Runtime
    from .topo import Layout

_log = log.get("TUNING")

TIERS = ("shm", "tcp")
"""The link tiers tensorwire runs on: shared memory within a host, TCP across hosts."""
ONE_WAY = {tier: f"{tier}_one_way" for tier in TIERS}
"""Per tier, its link for messages that go one way (calibrate._one_way), which prices the
algorithms whose steps only send or only receive (Algorithm.one_way); the tier's own link,
measured in exchanges, where this one was not measured."""

# Link constants until calibration measures them: round figures for this class of machine
# (shared-memory flag round trip ~1 µs from Python, memcpy ~9 GB/s, a += b ~7.5 GB/s; TCP
# loopback round trip ~25 µs, ~3 GB/s).
DEFAULT_LINKS = {
    "shm": Link("shm", alpha=2e-6, beta=1 / 9e9, gamma=1 / 7.5e9),
    "tcp": Link("tcp", alpha=30e-6, beta=1 / 3e9, gamma=1 / 7.5e9),
    # the one-shot path: a flag round instead of a message per peer (half a message's α, as
    # calibrations on the project's machine find), copies that stay in cache
    "direct": Link("direct", alpha=1e-6, beta=1 / 16e9, gamma=1 / 7.5e9),
    # single copy: a flag round, and a byte read out of a peer process (about 4x a copy's price,
    # as process_vm_readv measured against memcpy on the project's machine)
    "cma": Link("cma", alpha=1e-6, beta=1 / 4e9, gamma=1 / 7.5e9),
    # ... out of a source in huge pages: the kernel pins one page per 2 MiB instead of 512, and
    # the read ran at 48-53 against 14-15 GB/s for 4 MiB on the project's machine
    "cma_huge": Link("cma_huge", alpha=1e-6, beta=1 / 12e9, gamma=1 / 7.5e9),
    # not a link: what a byte costs beyond the last-level cache (copies 40 -> 10 GB/s, adds
    # 35 -> 14 GB/s on the project's machine), and that cache's size
    "memory": Link("memory", alpha=0.0, beta=1 / 10e9 - 1 / 40e9, gamma=1 / 14e9 - 1 / 35e9, cache=32 << 20),
}
MEMORY = "memory"
CMA = "cma"
CMA_HUGE = "cma_huge"
BUSY, BUSY_RING, BUSY_PAIRS = "busy", "busy_ring", "busy_pairs"
"""The world's tier measured with every rank at work at once (calibrate.measure_busy): partners
that change, a ring's fixed ones, and partners in pairs (the α of a step that exchanges with one
partner, see Algorithm.exchanges)."""
HUGE_FROM = 1 << 20
"""Single copy's reads are priced out of huge pages (`cma_huge`, where they are expected and not
seen otherwise: PageDependent) only for messages from this size. Below it the model prices
single copy under what it measured: at n=2 (`--algo all`, 2026-11-25) its all_reduce, all_gather
and all_to_all out of huge pages ran 1.2-2.2x their price at 256-512 KiB, where the one shot
was as fast or faster (all_to_all 256 KiB: 18-29 against 10 us), while from 1 MiB they won
(all_to_all 1 / 2 MiB: 34-40 / 55-65 against the one shot's 48 / 73 us)."""
HUGE_SEEN = 4
"""Single copy's sources count as in huge pages where at least this many eighths of each one's
bytes are (transport/pages.py): a numpy array of 4 MiB, advised by numpy but not aligned to
2 MiB, has about half of them there."""

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
far below the noise of the constants (which of the two measured faster there at n=4 over
TCP changed from sweep to sweep, by 1.1-1.6x either way)."""
REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter")
"""Collectives whose result depends on the order of the reduction (floating point)."""
DETERMINISTIC = {
    "all_reduce": frozenset({"direct", "single_copy", rank_ordered.NAME}),
    "reduce": frozenset({"direct", rank_ordered.NAME, "linear"}),
    "reduce_scatter": frozenset({"direct", "single_copy", rank_ordered.NAME}),
}
"""Per reduction, the algorithms that fold every element in rank order, ((x0 op x1) op x2) ...:
the same bits whichever of them runs."""
_ROUNDING = 1e-9
"""Relative difference of two prices that floating point alone can make."""
ALIASES = {"tree": "binomial"}
"""Family names accepted in TENSORWIRE_ALGO where no algorithm has that exact name."""


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


def _rate(seconds_per_byte: float) -> str:
    return f"{1e-9 / seconds_per_byte:.3g} GB/s" if seconds_per_byte > 0 else "inf GB/s"


def default_table() -> LinkTable:
    return LinkTable(dict(DEFAULT_LINKS), {t: "default" for t in DEFAULT_LINKS})


_installed: tuple[weakref.ref, LinkTable] | None = None
_fallbacks: dict[str, LinkTable] = {}


def install(runtime: Runtime, table: LinkTable) -> None:
    """Make `table` the constants of `runtime`'s groups (done once, at init)."""
    global _installed
    _installed = (weakref.ref(runtime), table)


def table_for(runtime: Runtime) -> LinkTable:
    """The runtime's installed constants; runtimes that never calibrated (a torch backend on
    top of another backend's world) get the defaults, overridden by their tuning file."""
    if _installed is not None and _installed[0]() is runtime:
        return _installed[1]
    path = runtime.config.tuning_file
    table = _fallbacks.get(path)
    if table is None:
        from .calibrate import apply_overrides, load_tuning_file

        table = apply_overrides(default_table(), load_tuning_file(path)) if path else default_table()
        _fallbacks[path] = table
    return table


def tier_of(group: Group) -> str:
    """The tier a group's collectives run over: its slowest link."""
    return "shm" if group.all_local else "tcp"


def link_of(group: Group) -> Link:
    return table_for(group.runtime).link(tier_of(group))


# -- TENSORWIRE_ALGO ----------------------------------------------------------------------------

def _norm(name: str) -> str:
    return name.replace("_", "").replace("-", "").strip().lower()


_COLLECTIVE_BY_NORM = {_norm(c): c for c in COLLECTIVES}


@functools.lru_cache(maxsize=64)
def parse_spec(spec: str) -> tuple[tuple[str | None, tuple[str, ...], tuple[str, ...]], ...]:
    """Clauses (collective or None, forced names, excluded names), names normalized; raises
    InvalidArgumentError for syntax errors and unknown collectives (names are checked by
    `check_algo`, which knows the registry)."""
    clauses = []
    for part in filter(None, (p.strip() for p in spec.replace(";", ",").split(","))):
        coll_text, colon, names_text = part.rpartition(":")
        coll = None
        if colon:
            coll = _COLLECTIVE_BY_NORM.get(_norm(coll_text))
            if coll is None:
                raise InvalidArgumentError(
                    f"TENSORWIRE_ALGO={spec!r}: unknown collective {coll_text.strip()!r} "
                    f"(known: {', '.join(COLLECTIVES)})")
        forced, excluded = [], []
        for name in names_text.replace("+", "|").split("|"):
            name = name.strip()
            if name.startswith("^"):
                if not _norm(name[1:]):
                    raise InvalidArgumentError(f"TENSORWIRE_ALGO={spec!r}: '^' without a name in {part!r}")
                excluded.append(_norm(name[1:]))
            elif _norm(name):
                forced.append(_norm(name))
        if not forced and not excluded:
            raise InvalidArgumentError(f"TENSORWIRE_ALGO={spec!r}: no algorithm named in {part!r}")
        clauses.append((coll, tuple(forced), tuple(excluded)))
    return tuple(clauses)


def _registered(collective: str) -> dict[str, str]:
    """Normalized name -> registered name, aliases included, for one collective."""
    names = {_norm(n): n for n in algorithms_for(collective)}
    for alias, target in ALIASES.items():
        if alias not in names and _norm(target) in names:
            names[alias] = names[_norm(target)]
    return names


def resolve(collective: str, name: str) -> str | None:
    """The registered algorithm of `collective` that `name` means (case, `_`, `-` and the
    aliases ignored as in TENSORWIRE_ALGO), or None."""
    return _registered(collective).get(_norm(name))


@functools.lru_cache(maxsize=256)
def parse_algo(spec: str, collective: str) -> tuple[frozenset[str], frozenset[str]]:
    """(forced, excluded) registered names for one collective; forced empty means 'any'."""
    known = _registered(collective)
    forced: set[str] = set()
    excluded: set[str] = set()
    for coll, f, x in parse_spec(spec):
        if coll is not None and coll != collective:
            continue
        excluded.update(known[n] for n in x if n in known)
        for n in f:
            if n in known:
                forced.add(known[n])
            elif coll is not None:  # unknown here: matches nothing (check_algo reports it at init)
                forced.add(n)
            # an unqualified forced name only binds the collectives that have it
    return frozenset(forced), frozenset(excluded)


def allowed(cfg: Config, collective: str, name: str, force: bool = True) -> bool:
    """May `name` run `collective` under TENSORWIRE_ALGO and deterministic mode? `force=False`
    applies the exclusions only (see forcing)."""
    if not cfg.algo and not cfg.deterministic:
        return True
    forced, excluded = parse_algo(cfg.algo, collective)
    if name in excluded or (force and forced and name not in forced):
        return False
    return not (cfg.deterministic and not is_deterministic(algorithms_for(collective)[name]))


def is_deterministic(alg: Algorithm) -> bool:
    """Folds in rank order (data movement without reduction is deterministic anyway)."""
    if alg.collective not in REDUCTIONS:
        return True
    return alg.name in DETERMINISTIC[alg.collective]


def check_algo(spec: str, deterministic: bool = False, rank: int | None = None) -> None:
    """Raise InvalidArgumentError naming the known algorithms if `spec` names an unknown
    collective or algorithm, or leaves deterministic mode without a reduction algorithm."""
    where = f"rank {rank}: " if rank is not None else ""
    try:
        clauses = parse_spec(spec) if spec else ()
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where}{exc}") from None
    every = sorted({n for c in COLLECTIVES for n in algorithms_for(c)})
    for coll, forced, excluded in clauses:
        for name in forced + excluded:
            if coll is not None:
                if name not in _registered(coll):
                    raise InvalidArgumentError(
                        f"{where}TENSORWIRE_ALGO={spec!r}: {coll} has no algorithm {name!r} "
                        f"(known for {coll}: {', '.join(sorted(algorithms_for(coll)))})")
            elif not any(name in _registered(c) for c in COLLECTIVES):
                raise InvalidArgumentError(
                    f"{where}TENSORWIRE_ALGO={spec!r}: no collective has an algorithm {name!r} "
                    f"(known: {', '.join(every)})")
    if deterministic:
        for coll in REDUCTIONS:
            forced, excluded = parse_algo(spec, coll)
            ordered = sorted(n for n, a in algorithms_for(coll).items() if is_deterministic(a))
            # the shared-memory path only runs on one host: something else must remain
            left = [n for n, a in algorithms_for(coll).items() if is_deterministic(a) and not a.needs_direct
                    and n not in excluded and (not forced or n in forced)]
            if not left:
                raise InvalidArgumentError(
                    f"{where}TENSORWIRE_ALGO={spec!r} leaves deterministic mode no {coll} algorithm for "
                    f"every size: only {', '.join(ordered)} reduce in rank order (unset "
                    f"TENSORWIRE_DETERMINISTIC, or allow {rank_ordered.NAME})")


# -- the choice ------------------------------------------------------------------------------------

def forcing(cfg: Config, collective: str, shape: Shape | None) -> bool:
    """Does TENSORWIRE_ALGO's forcing bind a group? Not where it forces only hierarchical
    algorithms and the group cannot run them (`shape` None: a group on one host, or the host
    groups and rails its phases run on, which choose their own algorithms, or a call whose
    blocks may differ; or the rails' variants on hosts holding different numbers of ranks)."""
    forced = parse_algo(cfg.algo, collective)[0] if cfg.algo else frozenset()
    if not forced:
        return True
    algs = algorithms_for(collective)
    return not all(name in algs and algs[name].phases is not None and not runs_on(algs[name], shape)
                   for name in forced)


def runs_on(alg: Algorithm, shape: Shape | None) -> bool:
    """Whether a hierarchical algorithm can run on a group of this shape."""
    return shape is not None and (alg.uniform if shape.uniform else alg.uneven)


def shape_of(group: Group) -> Shape | None:
    """The shape a group's hierarchical algorithms run in (topo.Layout.shape), or None."""
    layout = group.layout
    return None if layout is None else layout.shape


def candidates(group: Group, collective: str, nbytes: int, direct_ok: bool = True) -> list[Algorithm]:
    direct = group.direct
    cfg = group.runtime.config
    shape = shape_of(group) if direct_ok else None  # a call with uneven blocks runs no hierarchy
    force = forcing(cfg, collective, shape)
    out = []
    for alg in algorithms_for(collective).values():
        if alg.phases is not None and not runs_on(alg, shape):
            continue
        if alg.needs_direct and (not direct_ok or direct is None
                                 or slot_bytes(alg, group.size, nbytes) > direct.slot_bytes
                                 or (alg.needs_single_copy and (not direct.single_copy or (
                                     direct.crowded and not alg.single_copy_crowded)))
                                 or (nbytes < alg.crowded_below and group.engine.oversubscribed
                                     and alg.name not in parse_algo(cfg.algo, collective)[0])):
            continue
        if alg.eligible(group.size, nbytes) and allowed(cfg, collective, alg.name, force):
            out.append(alg)
    return out


def phase_prices(table: LinkTable, cfg: Config, local_tier: str = "shm",
                 rail_tier: str = "tcp") -> tuple[LocalPrice, RailPrice]:
    """How the tuner prices a hierarchical algorithm's phases (Algorithm.phases): each at the
    cheapest flat algorithm of its collective that the phase's sub-group could run (`local`
    prices a pass through memory too, as the collective COPY on one rank). Within a
    host on `local_tier`, with the one-shot path at its own constants (single copy is left
    out: a host group may not get it). Between hosts on `rail_tier`, its β (and the busy
    links', where the world measured them on that tier: the rails run while every rank works,
    as the flat algorithms do, and are priced alike) multiplied by the flows that share a
    host's link.

    A host phase costs, on top, what the busy probe found a step costs beyond the rail's α
    (busy α − α): where ranks share cores, each phase waits for its ranks to be woken, as each
    step of a flat algorithm does (`predict`). Without it, on 4 and 8 emulated hosts x 2 ranks
    on 2 vCPUs (busy α 421 µs against 28), the hierarchical all_gather and reduce_scatter of
    64 B-16 KiB measured 2.0-2.5x their price and 1.4-2.8x the flat algorithms' time they were
    chosen over (docs/benchmarks/hosts-netns.md); where each rank has a core the difference,
    and so the charge, is small."""
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
        t = cheapest(collective, n, nbytes,
                     lambda a: predict(a, n, nbytes, local_link, direct if one_shot else None), one_shot)
        return t + woken if n >= 2 else t

    def rail(collective: str, n: int, nbytes: int, share: float) -> float:
        return cheapest(collective, n, nbytes, lambda a: predict(
            a, n, nbytes, rail_link, None, busy[0], busy[1], None, busy[2], one_way, share), False)

    return local, rail


def shared(link: Link | None, flows: float) -> Link | None:
    """`link` (priced per flow) where `flows` of them share it: β that many times."""
    return None if link is None else replace(link, beta=link.beta * flows)


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
    huge: bool = True
    """Single copy's sources in huge pages: expected (Config.huge_pages), or as last seen."""
    cores: int = 0
    """Cores that run the ranks (0: a core each)."""

    def reads(self, nbytes: int) -> Link:
        """Single copy's link for a message of nbytes (see HUGE_FROM)."""
        return self.cma_huge if self.huge and nbytes >= HUGE_FROM else self.cma

    def crowded_memory(self) -> Link:
        """The memory's price for a byte when every rank works at once: where ranks outnumber
        cores, a core moves the bytes of ranks/cores of them, so each waits that much longer
        for what misses the cache. A link measured with every rank at work (`busy`, the
        one-shot path's `direct`) already holds that for the bytes in cache; the memory entry
        is measured by one process alone. At n=4 on 2 cores (Intel VM, shm-n4 sweep of
        2026-11-26) the one shot's all_gather and all_to_all measured 0.90-1.35x their price
        from 1 MiB with the factor, 1.16-1.66x without it."""
        crowding = self.ranks / self.cores if self.cores else 1.0
        if crowding <= 1:
            return self.memory
        return replace(self.memory, beta=self.memory.beta * crowding, gamma=self.memory.gamma * crowding)


def spill(alg: Algorithm, n: int, nbytes: int, host: Host) -> float:
    """The share of a call's bytes that misses the host's cache: 0 while every rank's buffers
    (FOOTPRINT; a message algorithm's rings on top) fit it together, 1 - cache/footprint beyond.
    On the project's machine (32 MiB shared) a copy of a MiB ran at 40-47 GB/s, of 16 MiB
    (both arrays: 32 MiB) at 17, of 64 MiB at 11; message algorithms measured 1.5-4x their
    price from 8 MiB at n=2 (`--algo all`, interleaved) before this share was priced."""
    per_rank = FOOTPRINT[alg.collective](n) * nbytes
    if not alg.needs_direct:
        per_rank += 2 * min(nbytes, host.ring_bytes)  # the rings it writes into and reads out of
    total = host.ranks * per_rank
    return 0.0 if total <= host.memory.cache else 1 - host.memory.cache / total


def beyond_cache(link: Link, share: float, memory: Link, copies: float) -> Link:
    """`link` with the memory's cost of `share` of every byte moved (`copies` copies each) and reduced."""
    return replace(link, beta=link.beta + share * copies * memory.beta,
                   gamma=link.gamma + share * min(copies, 1.0) * memory.gamma)


def predict(alg: Algorithm, n: int, nbytes: int, link: Link, direct: Link | None = None,
            busy: Link | None = None, busy_ring: Link | None = None, host: Host | None = None,
            busy_pairs: Link | None = None, one_way: Link | None = None, flows: float = 1.0) -> float:
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
    many times (each link is priced per flow)."""
    if flows != 1.0:
        link, busy, busy_ring, one_way = (shared(x, flows) for x in (link, busy, busy_ring, one_way))  # type: ignore[assignment]
    share = spill(alg, n, nbytes, host) if host is not None else 0.0
    if alg.needs_direct:
        own = host.reads(nbytes) if alg.needs_single_copy and host is not None else direct or link
        if share:
            # single copy's link was measured with every rank reading beyond the cache (n
            # ranks' sources and outputs of a MiB each) and holds its crowding: at n=4 on 2
            # cores its reductions measured 0.55-0.73x their price from 1 MiB with the crowded
            # memory on top, 0.70-0.96x with a lone rank's (three shm-n4 sweeps of 2026-11-26)
            memory = host.memory if alg.needs_single_copy else host.crowded_memory()  # type: ignore[union-attr]
            own = beyond_cache(own, share, memory, alg.copies)
        return alg.cost(n, nbytes, own)
    if alg.one_way and one_way is not None:
        link = replace(one_way, name=link.name)  # the tier's link still (the linear reduce asks which)
    if busy is not None and busy.alpha > link.alpha:
        # a step of the path costs at least the busy α: where ranks share cores, each message
        # of a chain waits for its receiver to be scheduled. At n=4 on 2 cores over TCP the
        # tree all_reduce (4 one-way steps, priced at its work: 1.5 busy α) measured 1.8-2.5x
        # its price at 16 B-16 KiB as mean calls, recursive doubling 1.05-1.2x; re-priced so
        # (offline, the launches' recorded constants, judged by the mean call), the choice's
        # forced run came within 10% at 84 of 97 sizes against 76 (tcp-n4, a4ffeb7), 82 against
        # 77 (netns4, db7a887), 95 against 94 (shm-n4), 90 as before at n=2
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
        # slower (ranks outnumbering cores: 2-3x), the rings ran at the changing partners' rate
        busy = busy_ring
    if alg.exchanges:
        # never below the shifts' α: the probe's rounds in pairs run back to back in step, while
        # a call's exchanges wait for both partners, scheduled apart. On 4 emulated hosts whose
        # ranks yield, the pairs measured 67-71 µs against the shifts' 77-96, and recursive
        # doubling, priced below the tree on them, took 1.4x the tree's time at 16 B-16 KiB
        # (netns4 sweeps at c40c14a and 493fbcc); at the shifts' α the choice's forced run was
        # within 10% at 6 more sizes of each, and the same at every size of the earlier sweeps
        pairs_alpha = EXCHANGE_BUSY_ALPHA * busy.alpha if busy_pairs is None else max(busy_pairs.alpha,
                                                                                      busy.alpha)
        busy = replace(busy, alpha=pairs_alpha)
    return max(t, (alg.work or alg.cost)(n, nbytes, busy))


Spread = Callable[[Algorithm], float]
"""The flows an algorithm puts on a host's link at once (crossing.algorithm_share) in a group."""


def one_flow(alg: Algorithm) -> float:
    """The Spread of a group on one host: no link shared."""
    return 1.0


def price(algs: list[Algorithm], n: int, nbytes: int, link: Link, direct: Link | None = None,
          busy: Link | None = None, busy_ring: Link | None = None, host: Host | None = None,
          busy_pairs: Link | None = None, one_way: Link | None = None,
          spread: Spread = one_flow) -> list[tuple[float, str, Algorithm]]:
    """(predicted seconds, name, algorithm), cheapest first. Ties (typically several algorithms
    bounded by the same work of a busy host), within TIE of the cheapest, go to the shorter
    critical path, then by name: critical paths that differ only in their last bits count as
    one (the same formula written two ways, as the binomial and linear reduce at n=2: ordered
    by rounding, `tensorwire plan` listed a crossover between them at every other size)."""
    priced = sorted((predict(alg, n, nbytes, link, direct, busy, busy_ring, host, busy_pairs, one_way,
                             spread(alg)), alg.name, alg)
                    for alg in algs if alg.phases is None)  # phases: see decide
    if not priced:
        return priced
    tied = [p for p in priced if p[0] <= priced[0][0] * (1 + TIE)]
    if len(tied) > 1:
        paths = {p[1]: predict(p[2], n, nbytes, link, direct, host=host, one_way=one_way, flows=spread(p[2]))
                 for p in tied}
        shortest = min(paths.values()) * (1 + _ROUNDING)
        tied.sort(key=lambda p: (0.0 if paths[p[1]] <= shortest else paths[p[1]], p[1]))
    return tied + priced[len(tied):]


@dataclass(frozen=True)
class Decision:
    """What the tuner saw for one call: every eligible algorithm with its predicted time."""

    collective: str
    nbytes: int
    nranks: int
    tier: str
    priced: list[tuple[float, str, Algorithm]]
    """(predicted seconds, name, algorithm), cheapest first, with single copy's sources as they
    are presumed or were last seen: priced[0] is what runs next."""
    choice: Algorithm | PageDependent
    """What the tuner hands out: priced[0], or a PageDependent where single copy wins only out
    of huge pages."""
    work_bound: frozenset[str] = frozenset()
    """The algorithms priced with the constants of a host whose ranks are all busy (predict: at
    their work, or their path at the busy α a step) rather than at their path over the link:
    what the TUNING log marks busy-bound."""

    def predicted(self, name: str) -> float:
        return next(t for t, n, _ in self.priced if n == name)


class PageDependent:
    """The choice for a call size where single copy wins only if its sources' buffers lie in
    huge pages (Host.huge), which the tuner cannot see when it chooses: single copy where they
    are presumed to (Config.huge_pages) or were in single copy's last call of this collective
    and size (every source reports its own, transport/pages.py), else the other choice.

    Resolved as each call runs, never when it is planned: calls run in the same order on every
    rank, and each rank learns the same report from every source in that call, so every rank
    takes the same branch, however far ahead a rank queued its calls. Sizes found out of huge
    pages stay with the other choice (single copy no longer runs to report otherwise); a source
    in 4 KiB pages made single copy 1.4-1.6x slower than the one shot at 2-16 MiB (n=2), one in
    huge pages 1.4-2x faster at 1-4 MiB."""

    def __init__(self, group: Group, key: tuple[str, int], huge: Algorithm, small: Algorithm) -> None:
        self.group, self.key, self.huge, self.small = group, key, huge, small
        self.name = f"{huge.name}|{small.name}"
        self.collective = huge.collective
        self.needs_direct = huge.needs_direct and small.needs_direct

    def current(self) -> Algorithm:
        """What the next call runs."""
        return self.huge if self.group.huge_seen.get(self.key, True) else self.small

    def run(self, call: Any, *args: Any) -> None:
        alg = self.current()
        alg.run(call, *args)
        if alg is self.huge:
            seen = self.group.direct.huge_eighths  # type: ignore[union-attr]
            if seen < HUGE_SEEN:
                self.group.huge_seen[self.key] = False
                _log.info("%s %d B on group %s: single copy's sources were %d/8 in huge pages; "
                          "from now on %s runs", self.key[0], self.key[1], self.group.name, seen,
                          self.small.name)


def phased(group: Group, table: LinkTable, algs: list[Algorithm],
           nbytes: int) -> list[tuple[float, str, Algorithm]]:
    """(predicted seconds, name, algorithm) of the hierarchical ones among `algs`, by their phases."""
    cfg = group.runtime.config
    local, rail = phase_prices(table, cfg, "tcp" if cfg.transport == "tcp" else "shm")
    shape = shape_of(group)
    between = table.link(tier_of(group))  # what the group's calls see as P2P.link
    return [(a.phases(shape, nbytes, local, rail, between), a.name, a) for a in algs if a.phases is not None]


def decide(group: Group, collective: str, nbytes: int, direct_ok: bool = True) -> Decision:
    """Price every eligible algorithm for one call (uncached, unlogged: `select` does that)."""
    options = candidates(group, collective, nbytes, direct_ok)
    if not options:
        cfg = group.runtime.config
        known = ", ".join(algorithms_for(collective))
        mode = " in deterministic mode" if cfg.deterministic and collective in REDUCTIONS else ""
        raise InvalidArgumentError(
            f"rank {group.runtime.rank}: TENSORWIRE_ALGO={cfg.algo!r} leaves no {collective} algorithm{mode} "
            f"for {nbytes} bytes on {group.size} ranks (known: {known})")
    tier = tier_of(group)
    table = table_for(group.runtime)
    model = Model.of(group, table)
    key = (collective, nbytes)
    if model.host is not None and model.host.huge and not group.huge_seen.get(key, True):
        model = replace(model, host=replace(model.host, huge=False))
    priced = model.price(options, nbytes)
    if any(a.phases is not None for a in options):
        priced = sorted(priced + phased(group, table, options, nbytes), key=lambda p: p[0])
    choice: Algorithm | PageDependent = priced[0][2]
    if model.host is not None and model.host.huge and choice.needs_single_copy:
        small = replace(model, host=replace(model.host, huge=False)).price(options, nbytes)[0][2]
        if small is not choice:
            choice = PageDependent(group, key, choice, small)
    bound = frozenset() if model.busy is None else frozenset(
        name for t, name, alg in priced
        if alg.phases is None and t > predict(alg, group.size, nbytes, model.link, model.direct,
                                              host=model.host, one_way=model.one_way,
                                              flows=model.spread(alg)) * (1 + 1e-9))
    layout = group.layout
    if layout is not None:  # spread over hosts: every algorithm runs in the topology's order
        priced = [(t, name, arrange(alg, layout)) for t, name, alg in priced]
        choice = priced[0][2]
    return Decision(collective, nbytes, group.size, tier, priced, choice, bound)


@dataclass(frozen=True)
class Model:
    """What prices a group's calls under one table of constants: its tier's link and the links
    beside it (see predict)."""

    n: int
    link: Link
    direct: Link | None
    busy: Link | None
    busy_ring: Link | None
    busy_pairs: Link | None
    one_way: Link | None
    host: Host | None
    single_copy: bool = False
    """The group can read its peers' memory (single copy's algorithms are priced)."""
    spread: Spread = one_flow
    """Across hosts: the flows each flat algorithm puts on a host's link (crossing.py)."""

    @classmethod
    def of(cls, group: Group, table: LinkTable) -> Model:
        tier = tier_of(group)
        busy = (tuple(table.links.get(b) for b in (BUSY, BUSY_RING, BUSY_PAIRS))
                if tier == table.extra.get("busy_tier") else (None, None, None))
        direct = table.links.get("direct") if group.direct is not None else None
        return cls(group.size, table.link(tier), direct, *busy, table.links.get(ONE_WAY[tier]),
                   host_of(group, table), bool(group.direct is not None and group.direct.single_copy),
                   spread_of(group.layout))

    def price(self, algs: list[Algorithm], nbytes: int) -> list[tuple[float, str, Algorithm]]:
        return price(algs, self.n, nbytes, self.link, self.direct, self.busy, self.busy_ring, self.host,
                     self.busy_pairs, self.one_way, self.spread)

    def cheapest_besides(self, collective: str, nbytes: int, name: str) -> float:
        """The price of the cheapest algorithm of `collective` other than `name` that the
        group has (by messages, or single copy where it reads its peers), whatever
        TENSORWIRE_ALGO allows: what the one-shot path is built to beat at small sizes
        (calibrate.bound_direct)."""
        algs = [a for a in algorithms_for(collective).values()
                if a.name != name and a.eligible(self.n, nbytes)
                and (not a.needs_direct or (a.needs_single_copy and self.single_copy))]
        return self.price(algs, nbytes)[0][0]


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
    puts there (spread_of, phase_prices' rails). On 2 emulated hosts of 4 ranks at 1 Gbit/s
    the probe's shifts measured 0.051 GB/s, its pattern's share there 2.33, the link 0.112."""
    measured = [b for b in (BUSY, BUSY_RING)
                if b in table.links and not table.sources.get(b, "").startswith("file")]
    if layout is None or table.extra.get("busy_tier") != "tcp" or not measured:
        return table
    shares = dict(zip((BUSY, BUSY_RING), crossing.probe_shares(layout.placement, layout.nics)))
    links = dict(table.links)
    for b in measured:
        links[b] = shared(links[b], 1 / shares[b])  # type: ignore[assignment]
    return replace(table, links=links, extra={**table.extra, "busy_flows": shares})


def host_of(group: Group, table: LinkTable | None = None) -> Host | None:
    """The host a single-host group's ranks share, for the cost of what misses its cache and of
    single copy's reads; None for groups across hosts (their links cost more than memory, and
    ranks on other hosts could see another cache: every rank must price alike). Ranks of one
    host that talk over TCP (TENSORWIRE_TRANSPORT=tcp) share it too, as the calibration found
    (its `hosts`): loopback copies through the kernel's socket buffers cost memory like the
    rings do (unpriced, the tcp-n4 sweep of 2026-11-26 measured the message algorithms at
    1.2-1.8x their price from 1 MiB)."""
    table = table or table_for(group.runtime)
    if not group.all_local:
        hosts = table.extra.get("hosts")
        if not hosts or len({hosts[r] for r in group.ranks}) != 1:
            return None
    huge = table.extra.get("huge_pages", group.runtime.config.huge_pages)  # agreed at calibration
    return Host(table.link(MEMORY), group.size, group.ring_bytes, table.link(CMA),
                table.link(CMA_HUGE), huge, table.extra.get("cores", 0))


class Override:
    """Within `override(group, collective, name)`: that collective on that group runs `name`
    (None: the tuner's own choice), and the decision behind each call size is kept, so a
    benchmark can time every algorithm and set the measurement beside the prediction."""

    def __init__(self, group: Group, collective: str, name: str | None) -> None:
        self.group, self.collective, self.name = group, collective, name
        self.decisions: dict[tuple[int, bool], Decision] = {}
        self._picked: dict[tuple[int, bool], Algorithm | PageDependent] = {}

    @property
    def decision(self) -> Decision | None:
        """The decision of the most recent call size (None before the first call)."""
        return next(reversed(self.decisions.values()), None)

    def pick(self, nbytes: int, direct_ok: bool) -> Algorithm | PageDependent:
        key = (nbytes, direct_ok)
        alg = self._picked.get(key)
        if alg is None:
            decision = decide(self.group, self.collective, nbytes, direct_ok)
            self.decisions[key] = decision
            names = [n for _, n, _ in decision.priced]
            if self.name is not None and self.name not in names:
                g = self.group
                raise InvalidArgumentError(
                    f"rank {g.runtime.rank}: {self.collective} of {nbytes} bytes on {g.size} ranks cannot "
                    f"run {self.name!r} (eligible: {', '.join(names)})")
            alg = decision.priced[names.index(self.name)][2] if self.name is not None else decision.choice
            self._picked[key] = alg
        return alg


_override: Override | None = None


@contextlib.contextmanager
def override(group: Group, collective: str, name: str | None = None) -> Iterator[Override]:
    """Run `collective` on `group` with algorithm `name` (or the tuner's choice) inside the
    block; every rank of the group must do the same. Not nested, not meant for training."""
    global _override
    if _override is not None:
        raise RuntimeError("tuner.override is already active")
    _override = Override(group, collective, name)
    group.plans.clear()  # calls planned before (or inside) the block chose their algorithm then
    try:
        yield _override
    finally:
        _override = None
        group.plans.clear()


def select(group: Group, collective: str, nbytes: int, direct_ok: bool = True) -> Algorithm | PageDependent:
    """The cheapest eligible algorithm (cached per group, collective and size)."""
    if _override is not None and _override.group is group and _override.collective == collective:
        return _override.pick(nbytes, direct_ok)
    key = (collective, nbytes, direct_ok)
    choice = group.choices.get(key)
    if choice is not None:
        return choice
    decision = decide(group, collective, nbytes, direct_ok)
    choice = decision.choice
    if _log.isEnabledFor(20):
        cfg = group.runtime.config
        table = table_for(group.runtime)
        tier = decision.tier
        bound = decision.work_bound
        spread = spread_of(group.layout)

        def notes(name: str, alg: Algorithm) -> str:
            flows = spread(alg) if alg.phases is None else 1.0
            said = [*(["busy-bound"] if name in bound else []),
                    *([f"{flows:.3g} flows a host link"] if flows > 1 + 1e-9 else [])]
            return f" ({', '.join(said)})" if said else ""

        costs = ", ".join(f"{name} {format_seconds(t)}{notes(name, alg)}" for t, name, alg in decision.priced)
        shown = f"{tier} ({table.describe(tier)})"
        probe = table.extra.get("busy_flows", {})

        def busy(b: str) -> str:
            return table.describe(b) + (f", per flow: the probe put {probe[b]:.3g} on a host link"
                                        if probe.get(b, 1.0) > 1 + 1e-9 else "")

        if tier == table.extra.get("busy_tier") and BUSY in table.links:
            shown += f", every rank busy ({busy(BUSY)})"
            if BUSY_RING in table.links:
                shown += f", in a ring ({busy(BUSY_RING)})"
            if BUSY_PAIRS in table.links:
                shown += f", in pairs ({table.describe(BUSY_PAIRS)})"
        if ONE_WAY[tier] in table.links and any(a.one_way for _, _, a in decision.priced):
            shown += f", one way ({table.describe(ONE_WAY[tier])})"
        if group.direct is not None and any(a.needs_direct for _, _, a in decision.priced):
            shown += f", direct path ({table.describe('direct')})"
        _log.info("%s %d B on %d ranks of group %s over %s%s: %s -> %s", collective, nbytes,
                  group.size, group.name, shown,
                  " [deterministic]" if cfg.deterministic and collective in REDUCTIONS else "",
                  costs, choice.name if not isinstance(choice, PageDependent) else
                  f"{choice.huge.name} while its sources are in huge pages, else {choice.small.name}")
    if len(group.choices) < 4096:
        group.choices[key] = choice
    return choice


def run(group: Group, call: Any, collective: str, nbytes: int, *args: Any, direct_ok: bool = True) -> None:
    select(group, collective, nbytes, direct_ok).run(call, *args)


def format_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"
