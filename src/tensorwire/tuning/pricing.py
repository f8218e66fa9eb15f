"""The pricing core of `tensorwire plan`: the tiers a collective is priced on (this host's
calibrated links, hypothetical ones, the tuning file's), every algorithm's predicted time, the
sizes where the cheapest one changes, and a cluster's flat against hierarchical algorithms.

The named hypothetical tiers use the latency and bandwidth commonly cited for that hardware
(docs/tuning.md gives the sources), so a collective can be priced on a machine one does not
have. tools/plan.py is the command around it (its arguments, the probe of missing local
tiers, the report).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..algorithms.compressed import compressed_cost
from ..algorithms.prices import Link, LocalPrice, RailPrice, Shape
from ..algorithms.registry import Algorithm, algorithms_for
from ..config import Config
from ..errors import InvalidArgumentError
from ..transport import native
from . import crossing, policy
from .cache import cache_dir, cached_entries, host_hash, probed_cores
from .cost_model import (
    BUSY,
    BUSY_PAIRS,
    BUSY_RING,
    CMA,
    CMA_COMPILED,
    CMA_FOLD,
    CMA_HUGE,
    COMPILED_BYTES,
    DEFAULT_LINKS,
    DIRECT_COMPILED,
    LINKS,
    MEMORY,
    ONE_WAY,
    STREAM,
    TIERS,
    Host,
    Links,
    LinkTable,
    Streams,
    bound_direct,
    compiled_prices,
    phase_prices,
    price,
    shared,
)
from .policy import REDUCTIONS, forcing
from .tuning_file import REQUIRED, overridden


@dataclass(frozen=True)
class Hypothetical:
    label: str
    alpha: float  # seconds
    bandwidth: float  # bytes per second, one direction


HYPOTHETICAL = {  # α and one-direction bandwidth as commonly cited (docs/tuning.md, "Sources")
    "nvlink": Hypothetical("NVLink, GPU to GPU within a server", 1e-6, 300e9),
    "pcie": Hypothetical("PCIe 4.0 x16 through the host", 2e-6, 25e9),
    "ib-ndr": Hypothetical("InfiniBand NDR, 400 Gb/s per port", 3e-6, 50e9),
    "eth25g": Hypothetical("Ethernet 25 Gb/s", 30e-6, 3.1e9),
}
LOCAL = TIERS
SWEEP = (1, 1 << 40)  # sizes searched for crossovers


@dataclass
class Tier:
    name: str
    link: Link
    origin: str
    direct_ok: bool = False  # the one-shot shared-memory path exists on this tier
    direct: Link | None = None  # ... and its own constants, where they were measured
    memory: Link | None = None  # one host's memory beyond its cache (shared memory only)
    cma: Link | None = None  # ... and its reads across processes (single copy)
    cma_huge: Link | None = None  # ... out of huge pages (None: none expected, Config.huge_pages)
    cma_fold: Link | None = None  # ... the α of the reductions' rounds
    compiled: dict[str, Link] = field(default_factory=dict)  # calls run whole in C (compiled_prices)
    one_way: Link | None = None  # messages one way, where measured (cost_model.ONE_WAY)
    stream: Link | None = None  # what one TCP stream moves, where that bounds this tier (not measured)
    cores: int = 0  # the cores this tier's ranks share on one host (0: a core each)
    busy: tuple[Link | None, Link | None, Link | None] = (None, None, None)
    """This host's tier with every rank at work (cost_model.BUSY, BUSY_RING, BUSY_PAIRS), as
    calibrated or set by the tuning file: a job's calls on one host cost no less than their work
    at these."""
    busy_origin: tuple[str, str, str] = ("", "", "")
    """Where each of `busy` came from."""
    config: Config = field(default_factory=Config)
    """The settings of a job priced here: its rings, its one-shot slot."""

    def host(self, n: int) -> Host | None:
        """The one host that n ranks on this tier share (its default rings), or None."""
        if self.memory is None:
            return None
        cma = self.cma or DEFAULT_LINKS[CMA]
        return Host(self.memory, n, self.config.shm_ring_bytes, cma, self.cma_huge or cma,
                    self.cma_fold or DEFAULT_LINKS[CMA_FOLD], huge=self.cma_huge is not None,
                    cores=self.cores)

    def compiles(self, collective: str) -> bool:
        """Whether a job prices its calls of `collective` as run whole in C (tuner.select's
        `compiled`): where the compiled links were measured, for every collective but the
        barrier (chosen once, from Python: collectives.barrier)."""
        return bool(self.compiled) and collective != "barrier"

    def own(self, collective: str, n: int, m: int, whole: bool = True) -> tuple[Link | None, Host | None]:
        """The one shot's link and the host of a call of `collective`, m bytes on n ranks, priced as
        a job prices its calls: `whole`, run whole in C where `compiles` (the one shot's body
        where the call fits its slot too, tuner.decide), else from Python."""
        links = self.compiled if whole and self.compiles(collective) else {}
        body = m <= min(COMPILED_BYTES, self.config.direct_slot(n))
        return compiled_prices(links, self.direct, self.host(n), body, collective in REDUCTIONS)

    def cost(self, alg: Algorithm, n: int, m: int, streams: Streams | None = None) -> float:
        return self.price([alg], n, m, streams)[0][0]

    def links(self, collective: str, n: int, m: int, whole: bool = True,
              streams: Streams | None = None) -> Links:
        """What a job's tuner prices a call of `collective` with, m bytes on n ranks on this
        tier (tuner.Model); `whole`: run whole in C where it `compiles` (Tier.own), else from
        Python."""
        direct, host = self.own(collective, n, m, whole)
        return Links(self.link, direct, *self.busy, self.one_way, host, streams=streams)

    def bounded_direct(self, n: int, single_copy: bool) -> Link:
        """The one shot's link bounded as a job bounds it at init (calibrate.with_direct_bound:
        at the links of a first call, not run whole in C)."""
        assert self.direct is not None
        return bound_direct(self.direct, self.links("all_reduce", n, 8, whole=False), n, single_copy)

    def price(self, algs: list[Algorithm], n: int, m: int,
              streams: Streams | None = None) -> list[tuple[float, str, Algorithm]]:
        """(predicted seconds, name, algorithm) of `algs` for m bytes on n ranks, cheapest first
        (see `links`), as a job prices its calls."""
        return price(algs, n, m, self.links(algs[0].collective, n, m, streams=streams)) if algs else []

    def streams(self, nsocks: int, threads: int, cores: float = 0.0) -> Streams:
        """This tier's connections over `nsocks` streams a pair and `threads` pump threads a
        rank, on `cores` cores a rank (0: not known)."""
        return Streams(max(1, nsocks), max(0, threads), self.stream, cores)


# -- link constants ----------------------------------------------------------------------------

def cached_links(cfg: Config, n: int = 2, since: float = math.inf) -> dict[str, tuple[Link, str]]:
    """This host's calibrated links (on this host alone) from its cache, each from the entry
    whose rank count is nearest `n`, the newest of those: where ranks outnumber cores the
    constants differ (docs/design/calibration.md#plans-rank-count). Only entries that a job
    would trust (cache.read_cache): measured without load, and no older than
    TENSORWIRE_CACHE_MAX_AGE; or written from `since` on (plan's own probe, loaded or not).
    Entries a job started here would write (cache.probed_cores: these settings and cores) come
    first; another one is named as such."""
    me = format(host_hash(), "016x")
    found: dict[str, tuple[Link, str]] = {}
    now = time.time()
    cores = len(os.sched_getaffinity(0))
    entries = []
    for entry in cached_entries(cache_dir(cfg.cache_dir)):  # newest first
        created = float(entry.get("created", 0))
        if entry.get("hosts") != [me] or (created < since and (
                not entry.get("trusted", False) or not 0 <= now - created <= cfg.cache_max_age)):
            continue
        entries.append((probed_cores(entry, cfg, cores), entry))
    # stable: newest among equals
    entries.sort(key=lambda e: (e[0] != cores, abs(int(e[1].get("world_size") or 2) - n)))
    for probed, entry in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.get("created", 0)))
        measured_over = "shm" if "shm" in entry.get("tiers", ()) else "tcp"  # what its busy links measured
        for tier, values in entry["links"].items():
            name = f"{tier}@{measured_over}" if tier in BUSY_LINKS else tier
            if tier in LINKS and name not in found and all(f in values for f in REQUIRED):
                origin = f"cached {when}, {entry.get('world_size', '?')}-rank probe, {entry['path']}"
                if probed != cores:
                    origin += "; " + (f"probed on {probed} usable core(s), not the {cores} of a job here"
                                      if probed is not None else NOT_HERE) + ": no job here uses it"
                if not entry.get("trusted", False):
                    origin += "; measured under load: a job measures again"
                if tier == "direct" and entry.get("direct_slower"):
                    origin += DIRECT_SLOWER
                found[name] = (Link(tier, **values), origin)
    return found


BUSY_LINKS = (BUSY, BUSY_RING, BUSY_PAIRS)
NOT_HERE = ("probed with other settings (TCP's, TENSORWIRE_SPIN_US, TENSORWIRE_BIND, TENSORWIRE_SHM_RING or "
            "TENSORWIRE_SHM_DIRECT), kernel, Python or numpy")
"""What differs for a cached entry whose key no core count here gives (cache.environment_digest)."""
DIRECT_SLOWER = "; slower than the messages in every round of its probe"
"""The end of a cached one shot's origin whose α is priced as measured (calibrate.with_direct_bound)."""


def tiers(names: list[str], cfg: Config, file: dict[str, dict[str, float]],
          local: dict[str, tuple[Link, str]], gamma: float | None, n: int = 2, cores: int = 0) -> list[Tier]:
    """The tiers `names`, the local ones with the constants in `local` (cached_links, and
    what a probe added), the others hypothetical, given as NAME=ALPHA_US:GBPS or from the
    tuning file (`file`, as tuning_file.load_tuning_file reads it, which also overrides the
    others' constants); `gamma` prices their reductions (None: this host's). Every tier but
    shared memory carries what one TCP stream moves (`tcp_stream`, the file's or the default),
    unless its link was measured here, through the streams. `cores`: those this host's n
    ranks share, for the local tiers (0: a core each)."""
    if gamma is None:  # the shared-memory link's γ, whichever tiers are listed beside
        shm = local.get("shm") or cached_links(cfg, n).get("shm")
        gamma = (shm[0] if shm else DEFAULT_LINKS["shm"]).gamma
    out = []
    stream = _with(DEFAULT_LINKS[STREAM], file.get(STREAM, {}))
    for name in names:
        custom = _custom(name)
        if custom is not None:
            out.append(Tier(custom.name, Link(custom.name, custom.alpha, custom.beta, gamma),
                            "given on the command line", stream=stream))
            continue
        if name in LOCAL:
            link, origin = local.get(name, (DEFAULT_LINKS[name], "default: no calibration found"))
        elif name in HYPOTHETICAL:
            h = HYPOTHETICAL[name]
            link = Link(name, h.alpha, 1 / h.bandwidth, gamma)
            origin = f"hypothetical: {h.label}; γ of this host"
        elif name in file:  # a tier of the file's own, with this host's γ
            link, origin = Link(name, math.nan, math.nan, gamma), ""
        else:
            known = ", ".join([*LOCAL, *HYPOTHETICAL, *(t for t in file if t not in LOCAL)])
            raise InvalidArgumentError(f"tensorwire plan: unknown tier {name!r} (known: {known}, local, all, "
                                       f"or NAME=ALPHA_US:GBPS)")
        if name in file:  # over the tier's constants
            done = overridden(name, link, file[name], origin)
            if done is None:
                raise InvalidArgumentError(f"tensorwire plan: tier {name!r} of {cfg.tuning_file} needs alpha "
                                           f"and beta (or alpha_us and bandwidth_GBps)")
            link, origin = done[0], from_file(done[1], cfg.tuning_file)
        direct = one_way = None
        if name in LOCAL:  # as the tuner prices it (tuning_file.apply_overrides)
            one_way_name = ONE_WAY[name]
            if one_way_name in file:
                base_link = local.get(one_way_name, (link, ""))[0]
                one_way = _with(replace(base_link, name=one_way_name), file[one_way_name])
            elif name not in file:
                one_way = local.get(one_way_name, (None, ""))[0]
        host: dict[str, Link | None] = {MEMORY: None, CMA: None, CMA_HUGE: None, CMA_FOLD: None}
        compiled: dict[str, Link] = {}
        # this host's memory, which its ranks share over either tier (tuner.host_of); on shared memory
        # the one shot's, single copy's and the compiled calls' constants: measured, else the defaults
        for entry in host if name == "shm" else (MEMORY,) if name in LOCAL else ():
            measured = local.get(entry, (DEFAULT_LINKS[entry], ""))[0]
            host[entry] = _with(measured, file[entry]) if entry in file else measured
        if name == "shm":
            direct = _with(local.get("direct", (DEFAULT_LINKS["direct"], ""))[0], file.get("direct", {}))
            if not cfg.huge_pages:  # as the tuner prices it (TENSORWIRE_HUGE_PAGES)
                host[CMA_HUGE] = None
            compiled = {e: _with(local.get(e, (DEFAULT_LINKS[e], ""))[0], file.get(e, {}))
                        for e in (DIRECT_COMPILED, CMA_COMPILED)} if _compiles(cfg) else {}
        probed = name in local and name not in file
        busy = [busy_link(b, name, local, file, cfg.tuning_file) for b in BUSY_LINKS] if name in LOCAL else \
            [(None, "")] * len(BUSY_LINKS)
        tier = Tier(name, link, origin, direct_ok=name == "shm", direct=direct,
                    memory=host[MEMORY], cma=host[CMA], cma_huge=host[CMA_HUGE], cma_fold=host[CMA_FOLD],
                    compiled=compiled, one_way=one_way, stream=None if name == "shm" or probed else stream,
                    cores=cores if name in LOCAL else 0, busy=tuple(b for b, _ in busy),  # type: ignore[arg-type]
                    busy_origin=tuple(o for _, o in busy), config=cfg)  # type: ignore[arg-type]
        if direct is not None and "direct" in local and "direct" not in file and \
                not local["direct"][1].endswith(DIRECT_SLOWER):
            tier.direct = tier.bounded_direct(n, cfg.single_copy != "0")
        out.append(tier)
    return out


def _with(link: Link, values: dict[str, float]) -> Link:
    """`link` under the tuning file's `values` for it (tuning_file.load_tuning_file)."""
    return replace(link, **values)  # type: ignore[arg-type]  # the file's keys name Link's float fields


def busy_link(name: str, tier: str, local: dict[str, tuple[Link, str]], file: dict[str, dict[str, float]],
              path: str) -> tuple[Link | None, str]:
    """A local tier's busy link `name` (BUSY_LINKS) and its origin, as a job over that tier prices
    it: as calibrated over the tier (cached_links), under the tuning file's constants; None where
    neither gives all three (a job then has none)."""
    link, origin = local.get(f"{name}@{tier}", (None, ""))
    if name not in file:
        return link, origin
    done = overridden(name, link, file[name], origin)
    return (None, "") if done is None else (done[0], from_file(done[1], path))


def from_file(source: str, path: str) -> str:
    """A link's origin, tuning_file.overridden's source, as plan names it: the file, over what
    the file left in place."""
    rest = source.removeprefix("file").removeprefix("+")
    return f"{path} over {rest}" if rest else path


def _compiles(cfg: Config) -> bool:
    """Whether a job would run its planned calls whole in C (the compiled caller): not with
    TENSORWIRE_NATIVE=0, nor where the module was not built."""
    try:
        return native.module(cfg.native) is not None
    except ImportError:  # TENSORWIRE_NATIVE=1 without the module: the job would not start
        return False


def _custom(name: str) -> Link | None:
    """'myfabric=5:12.5' -> α 5 us, 12.5 GB/s."""
    if "=" not in name:
        return None
    label, _, rest = name.partition("=")
    try:
        alpha_us, _, gbps = rest.partition(":")
        alpha, rate = float(alpha_us) * 1e-6, float(gbps) * 1e9
        if not label or not 0 <= alpha < math.inf or not 0 < rate < math.inf:  # NaN fails both
            raise ValueError
        return Link(label, alpha, 1 / rate, 0.0)
    except ValueError:
        raise InvalidArgumentError(f"tensorwire plan: cannot read tier {name!r} (use NAME=ALPHA_US:GBPS, "
                                   f"e.g. roce=4:23)") from None


# -- pricing ---------------------------------------------------------------------------------------

def why_not(alg: Algorithm, collective: str, n: int, m: int, tier: Tier, cfg: Config,
            direct_bytes: int, cores: int = 0) -> str:
    """'' if `alg` can run this call on this tier, else why not: policy.why_not, for n ranks of
    one host that share `cores` (0: not known) as a job there would see it."""
    crowded = 0 < cores < n
    return policy.why_not(alg, n, m, cfg, slot=direct_bytes if tier.direct_ok else None,
                          single_copy=cfg.single_copy != "0", crowded=crowded and cfg.single_copy == "1",
                          oversubscribed=crowded, force=forcing(cfg, collective, None))


def cheapest(algs: list[Algorithm], collective: str, n: int, m: int, tier: Tier, cfg: Config,
             direct_bytes: int, streams: Streams | None = None, cores: int = 0) -> str | None:
    """The algorithm of the lowest `Tier.cost` among those that can run the call (why_not)."""
    ok = [a for a in algs if not why_not(a, collective, n, m, tier, cfg, direct_bytes, cores)]
    return tier.price(ok, n, m, streams)[0][1] if ok else None


def crossovers(algs: list[Algorithm], collective: str, n: int, tier: Tier, cfg: Config,
               direct_bytes: int, streams: Streams | None = None,
               cores: int = 0) -> list[tuple[int, str | None, str | None]]:
    """(size, winner below, winner from there on) for every change of the cheapest algorithm."""
    return changes_of(lambda m: cheapest(algs, collective, n, m, tier, cfg, direct_bytes, streams, cores),
                      direct_bytes)


def changes_of(best: Callable[[int], str | None],
               direct_bytes: int = 0) -> list[tuple[int, str | None, str | None]]:
    """(size, `best` below, `best` from there on) for every change of `best` between 1 B and 1 TiB."""
    grid = {int(round(2 ** (k / 8))) for k in range(8 * 40 + 1)}  # 1 B .. 1 TiB, 8 steps per doubling
    samples = sorted(grid | {direct_bytes, direct_bytes + 1})
    out = []
    i, prev_m, prev = 1, samples[0], best(samples[0])
    while i < len(samples):
        m = samples[i]
        if best(m) == prev:
            prev_m, i = m, i + 1
            continue
        lo, hi = prev_m, m  # best(lo) == prev != best(hi): find the first size that differs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if best(mid) == prev:
                lo = mid
            else:
                hi = mid
        out.append((hi, prev, best(hi)))
        prev_m, prev = hi, best(hi)  # and look again at the same sample: another change may follow
    return out


# -- a cluster: hosts of several ranks -------------------------------------------------------------

def cluster_prices(collective: str, m: int, hosts: int, per_host: int, nics: int, local: Tier, net: Tier,
                   cfg: Config, streams: Streams | None = None) -> list[tuple[float, str, str]]:
    """(seconds, algorithm, '' or why it cannot run) of every algorithm for `hosts` hosts of
    `per_host` ranks: the flat ones with every step at the price of the slower tier (a step
    waits for its slowest hop: the network's, shared by the flows the algorithm puts on a host
    link at once as the tuner prices a group across hosts, or a host's where that is the
    slower, as this host's memory against InfiniBand NDR), the hierarchical ones by their
    phases, within a host on `local` and between hosts on `net`, `per_host / nics` flows
    sharing each host link; every connection between hosts at no more than its `streams` reach."""
    n = hosts * per_host
    within, across, shape = _cluster_phases(hosts, per_host, nics, local, net, cfg, streams)
    force = forcing(cfg, collective, shape)
    rows = []
    for alg in algorithms_for(collective).values():
        reason = "needs several hosts of several ranks" if alg.phases is not None and (
            per_host < 2 or hosts < 2) else policy.why_not(alg, n, m, cfg, shape=shape, force=force)
        if alg.phases is not None:
            t = alg.phases(shape, m, within, across, net.link) if not reason else math.inf
        else:
            flat = replace(net, direct_ok=False, one_way=None, memory=None)  # hosts apart: no memory shared
            t = math.inf
            if not reason:
                flowing = shared(net.link, host_link_flows(alg, hosts, per_host, nics))
                if streams is not None:
                    flowing = streams.link(flowing, m // n)
                t = replace(flat, link=Link(net.name, *(max(getattr(local.link, f), getattr(flowing, f))
                                                       for f in ("alpha", "beta", "gamma")))).cost(alg, n, m)
        rows.append((t, alg.name, reason))
    return sorted(rows)


def _cluster_phases(hosts: int, per_host: int, nics: int, local: Tier, net: Tier, cfg: Config,
                    streams: Streams | None = None) -> tuple[LocalPrice, RailPrice, Shape]:
    """How cluster_prices prices a hierarchical algorithm's phases, and the cluster's shape."""
    links = {local.name: local.link, net.name: net.link}
    if local.direct is not None:
        links["direct"] = local.direct
    within, across = phase_prices(LinkTable(links, {}), cfg, local.name, net.name, streams)
    return within, across, Shape(hosts, per_host, per_host / max(1, min(nics, per_host)))


def compressed_prices(m: int, hosts: int, per_host: int, nics: int, local: Tier, net: Tier,
                      cfg: Config, streams: Streams | None = None) -> list[tuple[str, float]]:
    """(dtype, seconds) of an all_reduce of m bytes with compress= ('bf16' and 'fp16' move the
    same bytes) of float32 and of float64, on the cluster cluster_prices prices."""
    within, across, shape = _cluster_phases(hosts, per_host, nics, local, net, cfg, streams)
    return [(name, compressed_cost(shape, m, within, across, net.link, size))
            for name, size in (("float32", 4), ("float64", 8))]


def host_link_flows(alg: Algorithm, hosts: int, per_host: int, nics: int) -> float:
    """The flows a flat algorithm puts on a host's link at once (crossing.py), ranks host by host."""
    return crossing.algorithm_share(alg, (per_host,) * hosts, (max(1, min(nics, per_host)),) * hosts)
