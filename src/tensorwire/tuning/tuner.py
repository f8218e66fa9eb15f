"""Which algorithm runs a call: the cheapest eligible one under the cost model.

The tuner prices every eligible algorithm of a collective (cost_model.py) with the link
constants installed at init (calibrate.py) for the group's tier, and runs the cheapest; the
choice is cached per group, collective and size. TENSORWIRE_ALGO and deterministic mode narrow
what is eligible (policy.py); `override` forces one algorithm for a block (`tensorwire bench
--algo`).

The one-shot shared-memory path is priced with constants of its own (a flag round, a memory
copy) where calibration measured them, single copy with its reads' (`cma`, or `cma_huge` out
of sources in huge pages: presumed where huge pages are expected, then as its sources report,
see PageDependent); everything else with its tier's.

A group spread over hosts (topology.Layout) gets every algorithm in its topology-aware order
(algorithms/ordered.arrange), and, where its hosts hold the same number of ranks, the
hierarchical algorithms too, each priced by its phases (cost_model.phase_prices) against the
flat ones.

With TENSORWIRE_DEBUG=INFO TENSORWIRE_DEBUG_SUBSYS=TUNING each new choice is logged with its
cost table and the link constants behind it (and where they came from): `explain`. Where the
COLL log has a line per call (TRACE), what the tuner hands out notes its name on each call it
runs (`noting`), for that line.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .. import log
from ..algorithms.compressed import compressed_cost
from ..algorithms.ordered import arrange
from ..algorithms.prices import Link, Shape
from ..algorithms.registry import Algorithm, algorithms_for
from ..errors import InvalidArgumentError
from ..transport.pumps import AUTO_STREAMS
from . import policy
from .cost_model import (
    BUSY,
    BUSY_PAIRS,
    BUSY_RING,
    CMA,
    CMA_COMPILED,
    CMA_FOLD,
    CMA_HUGE,
    COMPILED_BYTES,
    DIRECT_COMPILED,
    MEMORY,
    ONE_WAY,
    STREAM,
    Host,
    Links,
    LinkTable,
    Streams,
    compiled_prices,
    describe_rate,
    format_seconds,
    phase_prices,
    predict,
    price,
    spread_of,
    streams_of,
)
from .policy import REDUCTIONS, forcing, parse_algo
from .tuning_file import defaults_with_file

if TYPE_CHECKING:
    from ..group.group import Group
    from ..ops.compress import Codec
    from ..runtime import Runtime

_log = log.get("TUNING")
_coll_log = log.get("COLL")

HUGE_SEEN = 4
"""Single copy's sources count as in huge pages where at least this many eighths of each one's
bytes are (transport/pages.py): a numpy array of 4 MiB, advised by numpy but not aligned to
2 MiB, has about half of them there."""


# -- the installed constants ------------------------------------------------------------------------

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
        table = _fallbacks[path] = defaults_with_file(path)
    return table


def tier_of(group: Group) -> str:
    """The tier a group's collectives run over: its slowest link."""
    return "shm" if group.all_local else "tcp"


def link_of(group: Group) -> Link:
    return table_for(group.runtime).link(tier_of(group))


def streams_for(group: Group, table: LinkTable) -> Streams | None:
    """The Streams a group's TCP calls are priced with: what its ranks really use, as calibration
    agreed it (table.extra's "streams", the same on every rank, so every rank prices alike while
    hosts differ): the fewest streams any of its ranks offers (a pair opens the fewer of its two
    ranks'), and the fewest pump threads and cores a rank of any of them has. A runtime that
    never calibrated (tensorwire groups on another backend's world) knows only the settings:
    `auto` as a rank with cores to spare resolves it (AUTO_STREAMS streams, a thread per direction
    of each)."""
    agreed = table.extra.get("streams")
    if agreed is None:
        cfg = group.runtime.config
        nsocks = cfg.nsocks if cfg.nsocks is not None else AUTO_STREAMS
        threads = cfg.socket_threads if cfg.socket_threads is not None else 2 * nsocks
        return streams_of(table, tier_of(group), nsocks, threads)
    nsocks, threads, cores = (min(agreed[r][i] for r in group.ranks) for i in range(3))
    return streams_of(table, tier_of(group), int(nsocks), int(threads), cores)


# -- the choice ------------------------------------------------------------------------------------

def shape_of(group: Group) -> Shape | None:
    """The shape a group's hierarchical algorithms run in (topology.Layout.shape), or None."""
    layout = group.layout
    return None if layout is None else layout.shape


def candidates(group: Group, collective: str, nbytes: int, direct_ok: bool = True) -> list[Algorithm]:
    return [alg for alg in algorithms_for(collective).values() if not refusal(group, alg, nbytes, direct_ok)]


def refusal(group: Group, alg: Algorithm, nbytes: int, direct_ok: bool = True) -> str:
    """'' where `alg` is a candidate for this call of nbytes on the group, else why not (what
    `tensorwire bench --algo` says of an algorithm it cannot force)."""
    shape = shape_of(group) if direct_ok else None  # a call with uneven blocks runs no hierarchy
    return why_not(group, alg, nbytes, direct_ok, shape, forcing(group.runtime.config, alg.collective, shape,
                                                                   direct_ok))


def why_not(group: Group, alg: Algorithm, nbytes: int, direct_ok: bool, shape: Shape | None,
            force: bool = True) -> str:
    """'' where `alg` may run this call of nbytes on the group, else why not (policy.why_not
    with what the group has)."""
    direct = group.direct if direct_ok else None
    return policy.why_not(alg, group.size, nbytes, group.runtime.config,
                          slot=None if direct is None else direct.slot_bytes,
                          single_copy=direct is not None and direct.single_copy,
                          crowded=direct is not None and direct.crowded,
                          oversubscribed=direct is not None and group.engine.oversubscribed, shape=shape,
                          force=force)


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
    compiled: bool = False
    """Priced as a call the compiled caller runs whole (cost_model.compiled_prices)."""
    direct_ok: bool = True
    """A call that may take the one-shot path (not one of uneven blocks)."""

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
    pages stay with the other choice (single copy no longer runs to report otherwise; see
    docs/design/cost-model.md#huge-pages-from-huge_from)."""

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
                self.learned(seen)

    def learned(self, seen: int) -> None:
        """Single copy's sources were `seen` eighths in huge pages (under HUGE_SEEN): the other
        choice runs from now on, also where the compiled caller ran the call (and tells this)."""
        self.group.huge_seen[self.key] = False
        _log.info("%s %d B on group %s: single copy's sources were %d/8 in huge pages; from now on %s runs",
                  self.key[0], self.key[1], self.group.name, seen, self.small.name)
        self.group.plans.recompile()


def noting(run: Any, name: str) -> Any:
    """`run`, which first notes on its call that `name` runs it (group/call_log.py)."""
    def noted(call: Any, *args: Any) -> Any:
        call.algo = name
        return run(call, *args)
    return noted


def _logged(choice: Algorithm | PageDependent) -> Algorithm | PageDependent:
    """`choice` with runs that note their names (`noting`) where the COLL log has a line per
    call; as it is elsewhere (decided once per choice, never per call)."""
    if not log.per_call(_coll_log):
        return choice
    if isinstance(choice, PageDependent):
        choice.huge, choice.small = _logged(choice.huge), _logged(choice.small)  # type: ignore[assignment]
        return choice
    return replace(choice, run=noting(choice.run, choice.name))


def phased(group: Group, table: LinkTable, algs: list[Algorithm],
           nbytes: int) -> list[tuple[float, str, Algorithm]]:
    """(predicted seconds, name, algorithm) of the hierarchical ones among `algs`, by their phases."""
    cfg = group.runtime.config
    local, rail = phase_prices(table, cfg, "tcp" if cfg.transport == "tcp" else "shm",
                               streams=streams_for(group, table))
    shape = shape_of(group)
    between = table.link(tier_of(group))  # what the group's calls see as P2P.link
    return [(a.phases(shape, nbytes, local, rail, between), a.name, a) for a in algs if a.phases is not None]


def decide(group: Group, collective: str, nbytes: int, direct_ok: bool = True,
           compiled: bool = False) -> Decision:
    """Price every eligible algorithm for one call (uncached, unlogged: `select` does that);
    `compiled`: a call the compiled caller runs whole (cost_model.compiled_prices)."""
    options = candidates(group, collective, nbytes, direct_ok)
    if not options:
        cfg = group.runtime.config
        mode = " in deterministic mode" if cfg.deterministic and collective in REDUCTIONS else ""
        shape = shape_of(group) if direct_ok else None
        forced = parse_algo(cfg.algo, collective)[0] if cfg.algo else frozenset()
        reasons = "; ".join(f"{name}: {why_not(group, alg, nbytes, direct_ok, shape, False) or 'excluded'}"
                            for name, alg in sorted(algorithms_for(collective).items())
                            if not forced or name in forced)
        raise InvalidArgumentError(
            f"rank {group.runtime.rank}: TENSORWIRE_ALGO={cfg.algo!r} leaves no {collective} algorithm{mode} "
            f"for {nbytes} bytes on {group.size} ranks ({reasons})")
    tier = tier_of(group)
    table = table_for(group.runtime)
    whole = group.direct is not None and nbytes <= min(COMPILED_BYTES, group.direct.slot_bytes)
    model = Model.of(group, table, compiled, whole, collective in REDUCTIONS)
    key = (collective, nbytes)
    host = model.links.host
    if host is not None and host.huge and not group.huge_seen.get(key, True):
        model = model.out_of_huge_pages()
    priced = model.price(options, nbytes)
    if any(a.phases is not None for a in options):
        priced = sorted(priced + phased(group, table, options, nbytes), key=lambda p: p[0])
    best: Algorithm = priced[0][2]
    choice: Algorithm | PageDependent = best
    if model.links.host is not None and model.links.host.huge and best.needs_single_copy:
        small = model.out_of_huge_pages().price(options, nbytes)[0][2]
        if small is not best:
            choice = PageDependent(group, key, best, small)
    path, spread = model.links.path(), model.links.spread
    bound = frozenset() if model.links.busy is None else frozenset(
        name for t, name, alg in priced
        if alg.phases is None and t > predict(alg, group.size, nbytes, path, spread(alg)) * (1 + 1e-9))
    layout = group.layout
    if layout is not None:  # spread over hosts: every algorithm runs in the topology's order
        priced = [(t, name, arrange(alg, layout)) for t, name, alg in priced]
        choice = priced[0][2]
    return Decision(collective, nbytes, group.size, tier, priced, choice, bound, compiled, direct_ok)


@dataclass(frozen=True)
class Model:
    """What prices a group's calls under one table of constants (see cost_model.Links)."""

    n: int
    links: Links
    single_copy: bool = False
    """The group can read its peers' memory (single copy's algorithms are priced)."""

    @classmethod
    def of(cls, group: Group, table: LinkTable, compiled: bool = False, whole: bool = False,
           folds: bool = False) -> Model:
        """`compiled`: the model of a call the compiled caller runs whole; `whole`: at a size where
        the one shot's body runs in C, `folds`: a reduction (cost_model.compiled_prices)."""
        tier = tier_of(group)
        busy, busy_ring, busy_pairs = (table.links.get(BUSY), table.links.get(BUSY_RING),
                                       table.links.get(BUSY_PAIRS)) \
            if tier == table.extra.get("busy_tier") else (None, None, None)
        direct = table.links.get("direct") if group.direct is not None else None
        host = host_of(group, table)
        if compiled:
            direct, host = compiled_prices(table.links, direct, host, whole, folds)
        links = Links(table.link(tier), direct, busy, busy_ring, busy_pairs, table.links.get(ONE_WAY[tier]),
                      host, spread_of(group.layout), streams_for(group, table))
        return cls(group.size, links, bool(group.direct is not None and group.direct.single_copy))

    def price(self, algs: list[Algorithm], nbytes: int) -> list[tuple[float, str, Algorithm]]:
        return price(algs, self.n, nbytes, self.links)

    def out_of_huge_pages(self) -> Model:
        """The model with single copy's sources in 4 KiB pages (Host.huge)."""
        host = self.links.host
        if host is None:
            return self
        return replace(self, links=replace(self.links, host=replace(host, huge=False)))


def host_of(group: Group, table: LinkTable | None = None) -> Host | None:
    """The host a single-host group's ranks share, for the cost of what misses its cache and of
    single copy's reads; None for groups across hosts (their links cost more than memory, and
    ranks on other hosts could see another cache: every rank must price alike). Ranks of one
    host that talk over TCP (TENSORWIRE_TRANSPORT=tcp) share it too, as the calibration found
    (its `hosts`): loopback copies through the kernel's socket buffers cost memory like the
    rings do (docs/design/cost-model.md#the-spill)."""
    table = table or table_for(group.runtime)
    if not group.all_local:
        hosts = table.extra.get("hosts")
        if not hosts or len({hosts[r] for r in group.ranks}) != 1:
            return None
    huge = table.extra.get("huge_pages", group.runtime.config.huge_pages)  # agreed at calibration
    return Host(table.link(MEMORY), group.size, group.ring_bytes, table.link(CMA),
                table.link(CMA_HUGE), table.link(CMA_FOLD), huge, table.extra.get("cores", 0))


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
        return self.decisions[next(reversed(self.decisions))] if self.decisions else None

    def pick(self, nbytes: int, direct_ok: bool, compiled: bool) -> Algorithm | PageDependent:
        key = (nbytes, direct_ok)
        alg = self._picked.get(key)
        if alg is None:
            decision = decide(self.group, self.collective, nbytes, direct_ok, compiled)
            self.decisions[key] = decision
            names = [n for _, n, _ in decision.priced]
            if self.name is not None and self.name not in names:
                g = self.group
                raise InvalidArgumentError(
                    f"rank {g.runtime.rank}: {self.collective} of {nbytes} bytes on {g.size} ranks cannot "
                    f"run {self.name!r} (eligible: {', '.join(names)})")
            alg = _logged(decision.priced[names.index(self.name)][2] if self.name is not None else
                          decision.choice)
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
    """The cheapest eligible algorithm (cached per group, collective and size). One choice
    serves every call of them, priced as the compiled caller runs a planned one where the group
    has it and it takes the collective (cost_model.compiled_prices): which calls a rank runs
    planned depends on that rank alone (its arguments: out= only on a root, a first call, async,
    a list form), and ranks must agree on the algorithm, or the call fails as a mismatch."""
    compiled = collective in group.plans.priced_in_c
    if _override is not None and _override.group is group and _override.collective == collective:
        return _override.pick(nbytes, direct_ok, compiled)
    key = (collective, nbytes, direct_ok)
    choice = group.choices.get(key)
    if choice is not None:
        return choice
    decision = decide(group, collective, nbytes, direct_ok, compiled)
    choice = _logged(decision.choice)
    if _log.isEnabledFor(20):
        _log.info("%s", explain(group, decision))
    if len(group.choices) < 4096:
        group.choices[key] = choice
    return choice


def compresses(group: Group, nbytes: int, codec: Codec, itemsize: int) -> bool:
    """Whether an all_reduce with compress= runs compressed: where the group spans hosts, so
    that shares cross a link between them; on one host it is exact (nothing crosses). Logged
    once per group, size and codec under TUNING, priced against the exact choice."""
    key = ("all_reduce", nbytes, codec.name)
    known = group.choices.get(key)
    if known is not None:
        return known
    layout = group.layout
    if _log.isEnabledFor(20):
        where = f"all_reduce {nbytes} B compress={codec.name} on {group.size} ranks of group {group.name}"
        if layout is None:
            _log.info("%s: on one host nothing crosses a link between hosts -> exact", where)
        else:
            exact = decide(group, "all_reduce", nbytes)
            _log.info("%s over %d hosts: compressed %s, exact %s %s -> compressed", where, len(layout.hosts),
                      format_seconds(compressed_price(group, layout.hosts, nbytes, itemsize)),
                      exact.choice.name, format_seconds(exact.priced[0][0]))
    if len(group.choices) < 4096:
        group.choices[key] = layout is not None
    return layout is not None


def compressed_price(group: Group, hosts: tuple[tuple[int, ...], ...], nbytes: int, itemsize: int) -> float:
    """The compressed all_reduce's predicted time at the group's constants (as `phased`), its
    ranks on `hosts` (topology.Layout.hosts)."""
    shape = shape_of(group) or Shape(len(hosts), 1, 1.0)
    cfg = group.runtime.config
    table = table_for(group.runtime)
    local, rail = phase_prices(table, cfg, "tcp" if cfg.transport == "tcp" else "shm",
                               streams=streams_for(group, table))
    return compressed_cost(shape, nbytes, local, rail, table.link(tier_of(group)), itemsize)


def explain(group: Group, decision: Decision) -> str:
    """The TUNING log's line for a new choice: every price, what bounds it (busy-bound, flows
    sharing a host's link), and the link constants behind it with where they came from."""
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
    streams = streams_for(group, table)
    if streams is not None and streams.stream is not None:
        shown += (f", {streams.nsocks} stream(s) a pair with {streams.threads} thread(s) a rank, each stream "
                  f"at most {describe_rate(streams.stream)} ({table.sources.get(STREAM, 'default')})")
    if ONE_WAY[tier] in table.links and any(a.one_way for _, _, a in decision.priced):
        shown += f", one way ({table.describe(ONE_WAY[tier])})"
    if group.direct is not None and any(a.needs_direct for _, _, a in decision.priced):
        shown += f", direct path ({table.describe('direct')})"
        if decision.compiled:
            shown += ", run whole in C (" + ", ".join(
                f"{what} α {table.links[name].alpha * 1e6:.3g} us"
                for what, name in (("one shot", DIRECT_COMPILED), ("single copy", CMA_COMPILED))
                if name in table.links) + ")"
    collective, choice = decision.collective, decision.choice
    mode = " [deterministic]" if cfg.deterministic and collective in REDUCTIONS else ""
    excluded = [name for name, alg in algorithms_for(collective).items()
                if refusal(group, alg, decision.nbytes, decision.direct_ok) == policy.EXCLUDED]
    if excluded:  # the algorithms this call could have run but for it
        mode += f" [TENSORWIRE_ALGO excludes {', '.join(excluded)}]"
    chosen = (choice.name if not isinstance(choice, PageDependent) else
              f"{choice.huge.name} while its sources are in huge pages, else {choice.small.name}")
    return (f"{collective} {decision.nbytes} B on {group.size} ranks of group {group.name}"
            f"{IN_C if decision.compiled else ''} over {shown}{mode}: {costs} -> {chosen}")


IN_C = ", for every call, priced as the compiled caller runs a planned one,"
"""What a choice's TUNING line says where the group's compiled caller takes the collective:
every call runs it, planned or not, priced as the caller runs its planned calls (select)."""


def run(group: Group, call: Any, collective: str, nbytes: int, *args: Any, direct_ok: bool = True) -> None:
    select(group, collective, nbytes, direct_ok).run(call, *args)
