"""`tensorwire plan`: price a collective with the cost model, on this host's links or others.

    tensorwire plan all_reduce 64MiB --np 16 --tier shm,tcp,nvlink,ib-ndr
    tensorwire plan all_reduce 64MiB --hosts 64 --per-host 8 --tier shm,ib-ndr

For every tier asked for (default: the local ones, shared memory and TCP) it prints the link
constants and where they came from, the predicted time of every algorithm of the collective
and the message sizes at which the cheapest algorithm changes. Local tiers use this host's
calibration cache, running the probe (two local ranks per tier, about a second) when there is
none; the named hypothetical tiers use the latency and bandwidth commonly cited for that
hardware (docs/tuning.md gives the sources), so a collective can be priced on a machine one
does not have. Sizes count as in nccl-tests and `tensorwire bench`. With --hosts it prices a
cluster instead: the flat algorithms at the network's price against the hierarchical ones,
whose phases run within hosts on the first tier and between hosts on the second.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..algorithms.hierarchical import Shape
from ..algorithms.registry import COLLECTIVES, Algorithm, Link, algorithms_for, slot_bytes
from ..config import Config, parse_size
from ..errors import InvalidArgumentError
from ..tuning import calibrate, crossing, tuner


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
LOCAL = tuner.TIERS
SWEEP = (1, 1 << 40)  # sizes searched for crossovers


@dataclass
class Tier:
    name: str
    link: Link | None
    origin: str
    direct_ok: bool = False  # the one-shot shared-memory path exists on this tier
    direct: Link | None = None  # ... and its own constants, where they were measured
    memory: Link | None = None  # one host's memory beyond its cache (shared memory only)
    cma: Link | None = None  # ... and its reads across processes (single copy)
    cma_huge: Link | None = None  # ... out of huge pages (None: none expected, Config.huge_pages)
    one_way: Link | None = None  # messages one way, where measured (tuner.ONE_WAY)

    def host(self, n: int) -> tuner.Host | None:
        """The one host that n ranks on this tier share (its default rings), or None."""
        if self.memory is None:
            return None
        cma = self.cma or tuner.DEFAULT_LINKS[tuner.CMA]
        return tuner.Host(self.memory, n, Config().shm_ring_bytes, cma, self.cma_huge or cma,
                          huge=self.cma_huge is not None)

    def cost(self, alg: Algorithm, n: int, m: int) -> float:
        return tuner.predict(alg, n, m, self.link, self.direct, host=self.host(n),  # type: ignore[arg-type]
                             one_way=self.one_way)


# -- link constants ----------------------------------------------------------------------------

def local_links(cfg: Config, probe: bool, out: Callable[[str], None],
                n: int = 2) -> dict[str, tuple[Link, str]]:
    """The calibration of each local tier on this host alone by the rank count nearest `n` (the
    newest of those: where ranks outnumber cores the constants differ, 4 ranks on 2 cores
    measured the one-shot path's α at 33-53 against 4 us for 2), probing what is missing."""
    found = _from_cache(cfg, n)
    missing = [t for t in LOCAL if t not in found]
    if "shm" not in missing and "direct" not in found and cfg.direct_slot(2) > 0:
        missing.append("shm")  # calibrated before the one-shot path had its own constants
    if missing and probe:
        out(f"# no calibration of {', '.join(missing)} on this host in {calibrate.cache_dir(cfg.cache_dir)}; "
            f"probing with 2 local ranks ...")
        probe_locally(missing, cfg.cache_dir)
        found = _from_cache(cfg, n)
    return found


def _from_cache(cfg: Config, n: int = 2) -> dict[str, tuple[Link, str]]:
    me = format(calibrate.host_hash(), "016x")
    found: dict[str, tuple[Link, str]] = {}
    entries = calibrate.cached_entries(calibrate.cache_dir(cfg.cache_dir))  # newest first
    entries.sort(key=lambda e: abs(int(e.get("world_size") or 2) - n))  # stable: newest among equals
    for entry in entries:
        if entry.get("hosts") != [me]:
            continue
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.get("created", 0)))
        for tier, values in entry["links"].items():
            if tier in calibrate.LINKS and tier not in found and all(f in values for f in calibrate.REQUIRED):
                origin = f"cached {when}, {entry.get('world_size', '?')}-rank probe, {entry['path']}"
                found[tier] = (Link(tier, **values), origin)
    return found


def _probe_child(rank: int, ports: dict[str, int], tiers: list[str], cache_dir: str) -> None:
    os.environ["TENSORWIRE_CALIBRATE"] = "1"
    if cache_dir:
        os.environ["TENSORWIRE_CACHE_DIR"] = cache_dir
    import tensorwire as tw

    for tier in tiers:
        tw.init(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{ports[tier]}",
                transport="tcp" if tier == "tcp" else "auto", timeout=60)
        tw.destroy()


def probe_locally(tiers: list[str], cache_dir: str = "", timeout: float = 120.0) -> None:
    """Start two local ranks per tier whose init calibrates it and writes the cache."""
    import socket

    ports = {}
    for tier in tiers:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports[tier] = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_probe_child, args=(r, ports, tiers, cache_dir), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def parse_tiers(specs: list[str]) -> list[str]:
    names: list[str] = []
    for spec in specs or ["local"]:
        for name in filter(None, (s.strip().lower() for s in spec.split(","))):
            if name == "local":
                names.extend(LOCAL)
            elif name == "all":
                names.extend([*LOCAL, *HYPOTHETICAL])
            else:
                names.append(name)
    return list(dict.fromkeys(names))


def resolve(names: list[str], cfg: Config, probe: bool, gamma: float | None,
            out: Callable[[str], None], n: int = 2) -> list[Tier]:
    """The tiers `names`, the local ones with the constants calibrated nearest `n` ranks."""
    file = calibrate.load_tuning_file(cfg.tuning_file) if cfg.tuning_file else {}
    local = local_links(cfg, probe, out, n) if any(name in LOCAL for name in names) else {}
    if gamma is None:
        gamma = next((link.gamma for link, _ in local.values()), None)
        if gamma is None:
            gamma = _from_cache(cfg, n).get("shm", (tuner.DEFAULT_LINKS["shm"], ""))[0].gamma
    tiers = []
    for name in names:
        custom = _custom(name)
        if custom is not None:
            tiers.append(Tier(custom.name, Link(custom.name, custom.alpha, custom.beta, gamma),
                              "given on the command line"))
            continue
        if name in LOCAL:
            link, origin = local.get(name, (tuner.DEFAULT_LINKS[name], "default: no calibration found"))
        elif name in HYPOTHETICAL:
            h = HYPOTHETICAL[name]
            link = Link(name, h.alpha, 1 / h.bandwidth, gamma)
            origin = f"hypothetical: {h.label}; γ of this host"
        elif name in file:
            link, origin = None, ""
        else:
            known = ", ".join([*LOCAL, *HYPOTHETICAL, *(t for t in file if t not in LOCAL)])
            raise InvalidArgumentError(f"tensorwire plan: unknown tier {name!r} (known: {known}, local, all, "
                                       f"or NAME=ALPHA_US:GBPS)")
        if name in file:
            values = file[name]
            base = {f: getattr(link, f) if link else values.get(f, gamma if f == "gamma" else math.nan)
                    for f in calibrate.REQUIRED}
            base.update(values)
            if any(math.isnan(v) for v in base.values()):
                raise InvalidArgumentError(f"tensorwire plan: tier {name!r} of {cfg.tuning_file} needs alpha "
                                           f"and beta (or alpha_us and bandwidth_GBps)")
            link = Link(name, **base)
            origin = f"{cfg.tuning_file}" + (f" over {origin}" if origin else "")
        direct = one_way = None
        if name in LOCAL:  # as the tuner prices it (calibrate.apply_overrides)
            one_way_name = tuner.ONE_WAY[name]
            if one_way_name in file:
                base_link = local.get(one_way_name, (link, ""))[0]
                one_way = replace(base_link, name=one_way_name, **file[one_way_name])
            elif name not in file:
                one_way = local.get(one_way_name, (None, ""))[0]
        host: dict[str, Link | None] = {tuner.MEMORY: None, tuner.CMA: None, tuner.CMA_HUGE: None}
        if name == "shm":
            direct = local.get("direct", (None, ""))[0]
            if "direct" in file and direct is not None:
                direct = replace(direct, **file["direct"])
            for entry in host:
                measured = local.get(entry, (tuner.DEFAULT_LINKS[entry], ""))[0]
                host[entry] = replace(measured, **file[entry]) if entry in file else measured
            if not cfg.huge_pages:  # as the tuner prices it (TENSORWIRE_HUGE_PAGES)
                host[tuner.CMA_HUGE] = None
        tiers.append(Tier(name, link, origin, direct_ok=name == "shm", direct=direct,
                          memory=host[tuner.MEMORY], cma=host[tuner.CMA], cma_huge=host[tuner.CMA_HUGE],
                          one_way=one_way))
    return tiers


def _custom(name: str) -> Link | None:
    """'myfabric=5:12.5' -> α 5 us, 12.5 GB/s."""
    if "=" not in name:
        return None
    label, _, rest = name.partition("=")
    try:
        alpha_us, _, gbps = rest.partition(":")
        alpha, rate = float(alpha_us) * 1e-6, float(gbps) * 1e9
        if not label or alpha < 0 or rate <= 0 or math.isinf(rate):
            raise ValueError
        return Link(label, alpha, 1 / rate, 0.0)
    except ValueError:
        raise InvalidArgumentError(f"tensorwire plan: cannot read tier {name!r} (use NAME=ALPHA_US:GBPS, "
                                   f"e.g. roce=4:23)") from None


# -- pricing ---------------------------------------------------------------------------------------

def why_not(alg: Algorithm, collective: str, n: int, m: int, tier: Tier, cfg: Config,
            direct_bytes: int) -> str:
    """'' if `alg` can run this call on this tier, else the reason it cannot."""
    if alg.phases is not None:
        return "groups across hosts only (--hosts, --per-host)"
    if alg.needs_direct:
        if not tier.direct_ok:
            return "one-host shared-memory path only"
        if slot_bytes(alg, n, m) > direct_bytes:
            return f"shared-memory path holds <= {_size(direct_bytes)}"
    if not alg.eligible(n, m):
        return f"not for {n} ranks at this size"
    if cfg.algo and not tuner.allowed(replace(cfg, deterministic=False), collective, alg.name):
        return "excluded by TENSORWIRE_ALGO"
    if cfg.deterministic and collective in tuner.REDUCTIONS and not tuner.is_deterministic(alg):
        return "not rank-ordered (deterministic mode)"
    return ""


def cheapest(algs: list[Algorithm], collective: str, n: int, m: int, tier: Tier, cfg: Config,
             direct_bytes: int) -> str | None:
    ok = [a for a in algs if not why_not(a, collective, n, m, tier, cfg, direct_bytes)]
    return tuner.price(ok, n, m, tier.link, tier.direct, host=tier.host(n))[0][1] if ok else None


def crossovers(algs: list[Algorithm], collective: str, n: int, tier: Tier, cfg: Config,
               direct_bytes: int) -> list[tuple[int, str | None, str | None]]:
    """(size, winner below, winner from there on) for every change of the cheapest algorithm."""
    return changes_of(lambda m: cheapest(algs, collective, n, m, tier, cfg, direct_bytes), direct_bytes)


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


def _size(m: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if m >= 1 << shift:
            v = m / (1 << shift)
            return f"{v:.3g} {unit}" if v != int(v) else f"{int(v)} {unit}"
    return f"{m} B"


def report(collective: str, m: int, n: int, tiers: list[Tier], cfg: Config, direct_bytes: int,
           out: Callable[[str], None]) -> None:
    algs = list(algorithms_for(collective).values())
    mode = ", deterministic mode" if cfg.deterministic else ""
    out(f"{collective} of {_size(m)} on {n} ranks{mode}: predicted time per algorithm (α-β-γ model)")
    for tier in tiers:
        if tier.link is None:
            continue
        out("")
        out(f"  tier {tier.name}: {tuner.describe_link(tier.link)}  [{tier.origin}]")
        if tier.one_way is not None:
            out(f"    messages one way (trees, linear rooted): {tuner.describe_link(tier.one_way)}")
        if tier.direct is not None:
            out(f"    one-shot shared-memory path: {tuner.describe_link(tier.direct)}")
        if tier.memory is not None:
            out(f"    memory of the one host: {tuner.describe_link(tier.memory)}")
        if tier.cma is not None:
            out(f"    single copy's reads across processes: {tuner.describe_link(tier.cma)}")
        if tier.cma_huge is not None:
            out(f"    ... out of huge pages (as priced here; a job prices the reads at the line above "
                f"once its sources are seen in 4 KiB pages): {tuner.describe_link(tier.cma_huge)}")
        rows = []
        for alg in algs:
            reason = why_not(alg, collective, n, m, tier, cfg, direct_bytes)
            rows.append((tier.cost(alg, n, m) if not reason else math.inf, alg.name, reason))
        rows.sort()
        width = max(len(a.name) for a in algs)
        for i, (t, name, reason) in enumerate(rows):
            if reason:
                out(f"    {name:<{width}}  {'-':>10}  ({reason})")
            else:
                mark = "  <- cheapest" if i == 0 else f"  x{t / rows[0][0]:.2f}" if rows[0][0] > 0 else ""
                out(f"    {name:<{width}}  {tuner.format_seconds(t):>10}{mark}")
        changes = crossovers(algs, collective, n, tier, cfg, direct_bytes)
        if changes:
            text = ", ".join(f"{a or 'none'} -> {b or 'none'} at {_size(s)}" for s, a, b in changes)
            out(f"    crossover: {text}")
        else:
            only = cheapest(algs, collective, n, 1, tier, cfg, direct_bytes)
            out(f"    crossover: none between {_size(SWEEP[0])} and {_size(SWEEP[1])} "
                f"({only or 'no algorithm'} is cheapest throughout)")


# -- a cluster: hosts of several ranks -------------------------------------------------------------

def cluster_prices(collective: str, m: int, hosts: int, per_host: int, nics: int, local: Tier, net: Tier,
                   cfg: Config) -> list[tuple[float, str, str]]:
    """(seconds, algorithm, '' or why it cannot run) of every algorithm for `hosts` hosts of
    `per_host` ranks: the flat ones with every step at the price of the slower tier (a step
    waits for its slowest hop: the network's, shared by the flows the algorithm puts on a host
    link at once as the tuner prices a group across hosts, or a host's where that is the
    slower, as this host's memory against InfiniBand NDR), the hierarchical ones by their
    phases, within a host on `local` and between hosts on `net`, `per_host / nics` flows
    sharing each host link."""
    n = hosts * per_host
    links = {local.name: local.link, net.name: net.link}
    if local.direct is not None:
        links["direct"] = local.direct
    within, across = tuner.phase_prices(tuner.LinkTable(links, {}), cfg, local.name, net.name)
    shape = Shape(hosts, per_host, per_host / max(1, min(nics, per_host)))
    rows = []
    for alg in algorithms_for(collective).values():
        if alg.phases is not None:
            reason = "" if per_host > 1 and hosts > 1 else "needs several hosts of several ranks"
            if not reason and not alg.uniform:
                reason = "for hosts of different numbers of ranks"
            if not reason and not alg.eligible(n, m):
                reason = f"not for {n} ranks at this size"
            if not reason and cfg.algo and not tuner.allowed(replace(cfg, deterministic=False), collective,
                                                            alg.name):
                reason = "excluded by TENSORWIRE_ALGO"
            if not reason and cfg.deterministic and collective in tuner.REDUCTIONS:
                reason = "not rank-ordered (deterministic mode)"
            t = alg.phases(shape, m, within, across, net.link) if not reason else math.inf
        else:
            flat = replace(net, direct_ok=False, one_way=None)
            reason = why_not(alg, collective, n, m, flat, cfg, 0)
            t = math.inf
            if not reason:
                shared = tuner.shared(net.link, _flows(alg, hosts, per_host, nics))
                t = replace(flat, link=Link(net.name, *(max(getattr(local.link, f), getattr(shared, f))
                                                       for f in ("alpha", "beta", "gamma")))).cost(alg, n, m)
        rows.append((t, alg.name, reason))
    return sorted(rows)


def _flows(alg: Algorithm, hosts: int, per_host: int, nics: int) -> float:
    """The flows a flat algorithm puts on a host's link at once (crossing.py), ranks host by host."""
    return crossing.algorithm_share(alg, (per_host,) * hosts, (max(1, min(nics, per_host)),) * hosts)


def report_cluster(collective: str, m: int, hosts: int, per_host: int, nics: int, local: Tier, net: Tier,
                   cfg: Config, out: Callable[[str], None]) -> None:
    n = hosts * per_host
    out(f"{collective} of {_size(m)} on {n} ranks: {hosts} hosts x {per_host} ranks, {local.name} within a "
        f"host, {net.name} between hosts ({per_host / max(1, min(nics, per_host)):g} rank(s) per host link)")
    out(f"  within a host: {tuner.describe_link(local.link)}  [{local.origin}]")
    out(f"  between hosts: {tuner.describe_link(net.link)}  [{net.origin}]")
    rows = cluster_prices(collective, m, hosts, per_host, nics, local, net, cfg)
    width = max(len(name) for _, name, _ in rows)
    best = rows[0][0]
    for kind, phased in (("flat, every step at the slower tier's price, a host link shared by the flows "
                          "the step puts on it", False),
                         ("hierarchical, phases within and between hosts", True)):
        out(f"  {kind}:")
        for t, name, reason in rows:
            if (algorithms_for(collective)[name].phases is not None) != phased:
                continue
            if reason:
                out(f"    {name:<{width}}  {'-':>10}  ({reason})")
            else:
                mark = "  <- cheapest" if t == best else f"  x{t / best:.2f}" if best > 0 else ""
                flows = 1.0 if phased else _flows(algorithms_for(collective)[name], hosts, per_host, nics)
                if flows > 1 + 1e-9:
                    mark += f"  ({flows:.3g} flows a host link)"
                out(f"    {name:<{width}}  {tuner.format_seconds(t):>10}{mark}")

    def winner(size: int) -> str | None:
        t, name, reason = cluster_prices(collective, size, hosts, per_host, nics, local, net, cfg)[0]
        return None if reason or math.isinf(t) else name

    changes = changes_of(winner)
    if changes:
        text = ", ".join(f"{a or 'none'} -> {b or 'none'} at {_size(s)}" for s, a, b in changes)
        out(f"    crossover: {text}")
    else:
        out(f"    crossover: none ({winner(1) or 'no algorithm'} is cheapest throughout)")


# -- the command -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tensorwire plan",
        description="Predict the time of every algorithm of a collective with the α-β-γ cost model, "
                    "and the sizes where the cheapest one changes, on this host's measured links "
                    "(shm, tcp) or on hypothetical ones (nvlink, pcie, ib-ndr, eth25g).",
        epilog="examples:\n  tensorwire plan all_reduce 64MiB --np 16\n"
               "  tensorwire plan all_reduce 64MiB --hosts 64 --per-host 8 --tier shm,ib-ndr\n"
               "  tensorwire plan all_reduce 1M --np 64 --tier ib-ndr,eth25g\n"
               "  tensorwire plan broadcast 4K --np 8 --tier all\n"
               "  tensorwire plan all_gather 256M --np 8 --tier roce=4:23",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("collective", metavar="COLL", help=f"one of {', '.join(COLLECTIVES)}, or all")
    p.add_argument("size", metavar="SIZE", nargs="?", default="64M",
                   help="message size as nccl-tests counts it: 8, 64K, 64MiB, 1G (default 64M)")
    p.add_argument("--np", type=int, default=8, metavar="N", help="number of ranks (default 8)")
    p.add_argument("--tier", action="append", default=[], metavar="TIER",
                   help="shm, tcp (this host, measured), nvlink, pcie, ib-ndr, eth25g (hypothetical), "
                        "local, all, NAME=ALPHA_US:GBPS, or a tier of the tuning file; repeat or use "
                        "commas (default: local)")
    p.add_argument("--hosts", type=int, metavar="H",
                   help="price a cluster of H hosts of --per-host ranks: flat against hierarchical; the "
                        "first --tier is within a host, the second between hosts (default shm,tcp)")
    p.add_argument("--per-host", type=int, default=8, metavar="L",
                   help="ranks per host with --hosts (default 8)")
    p.add_argument("--nics", type=int, default=1, metavar="K",
                   help="network interfaces per host with --hosts: a host's ranks share them (default 1)")
    p.add_argument("--deterministic", action="store_true",
                   help="only the rank-ordered reductions (as TENSORWIRE_DETERMINISTIC=1)")
    p.add_argument("--gamma", type=float, metavar="GBPS",
                   help="reduction rate for hypothetical tiers in GB/s (default: this host's)")
    p.add_argument("--no-probe", action="store_true",
                   help="do not probe missing local tiers; use the defaults")
    p.add_argument("--tuning-file", metavar="PATH", help="constants that override (default: "
                   "TENSORWIRE_TUNING_FILE)")
    return p


def main(argv: list[str], out: Callable[[str], None] = print) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = Config.from_env()
        if args.deterministic:
            cfg = replace(cfg, deterministic=True)
        if args.tuning_file is not None:
            cfg = replace(cfg, tuning_file=args.tuning_file)
        tuner.check_algo(cfg.algo, cfg.deterministic)
        name = args.collective.strip().lower()
        if name == "all":
            colls = [c for c in COLLECTIVES if c != "barrier"]
        else:
            coll = {c.replace("_", ""): c for c in COLLECTIVES}.get(name.replace("_", "").replace("-", ""))
            if coll is None:
                raise InvalidArgumentError(f"tensorwire plan: unknown collective {args.collective!r} "
                                           f"(known: {', '.join(COLLECTIVES)}, all)")
            colls = [coll]
        m = parse_size(args.size)
        if args.np < 1 or m < 0:
            raise InvalidArgumentError("tensorwire plan: --np must be >= 1 and SIZE >= 0")
        gamma = 1 / (args.gamma * 1e9) if args.gamma else None
        if args.hosts is not None:
            if args.hosts < 1 or args.per_host < 1 or args.nics < 1:
                raise InvalidArgumentError("tensorwire plan: --hosts, --per-host and --nics must be >= 1")
            names = parse_tiers(args.tier or ["shm,tcp"])
            if len(names) != 2:
                raise InvalidArgumentError(f"tensorwire plan: --hosts takes two tiers, within a host and "
                                           f"between hosts (e.g. --tier shm,ib-ndr), got {', '.join(names)}")
            local, net = resolve(names, cfg, not args.no_probe, gamma, out, args.per_host)
        else:
            tiers = resolve(parse_tiers(args.tier), cfg, not args.no_probe, gamma, out, args.np)
    except (InvalidArgumentError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.hosts is not None:
        for i, coll in enumerate(colls):
            if i:
                out("")
            report_cluster(coll, 0 if coll == "barrier" else m, args.hosts, args.per_host, args.nics, local,
                           net, cfg, out)
        return 0
    for i, coll in enumerate(colls):
        if i:
            out("")
        report(coll, 0 if coll == "barrier" else m, args.np, tiers, cfg, cfg.direct_slot(args.np), out)
    return 0
