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
whose phases run within hosts on the first tier and between hosts on the second, and what the
TCP streams between hosts (TENSORWIRE_NSOCKS, TENSORWIRE_SOCKET_THREADS) reach at the configured
settings and at more streams. The pricing itself is tuning/pricing.py.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace

from ..algorithms.prices import Link
from ..algorithms.registry import COLLECTIVES, algorithms_for
from ..config import Config, parse_size, size_text
from ..errors import InvalidArgumentError
from ..transport.pumps import pump_threads, streams_per_pair
from ..tuning import policy, pricing
from ..tuning.cache import cache_dir
from ..tuning.cost_model import (
    CMA_COMPILED,
    COMPILED_BYTES,
    DIRECT_COMPILED,
    STREAM,
    Streams,
    describe_link,
    describe_rate,
    format_seconds,
    shared,
)
from ..tuning.pricing import (
    HYPOTHETICAL,
    LOCAL,
    SWEEP,
    Tier,
    changes_of,
    cheapest,
    cluster_prices,
    crossovers,
    host_link_flows,
    why_not,
)
from ..tuning.tuner import IN_C
from ..tuning.tuning_file import load_tuning_file

# -- link constants ----------------------------------------------------------------------------

def local_links(cfg: Config, probe: bool, out: Callable[[str], None],
                n: int = 2) -> dict[str, tuple[Link, str]]:
    """The calibration of each local tier on this host alone by the rank count nearest `n`
    (pricing.cached_links), probing what is missing; none where TENSORWIRE_CALIBRATE=0 (a
    job then runs on the defaults)."""
    if cfg.calibrate == "0":
        out("# TENSORWIRE_CALIBRATE=0: the local tiers at their defaults, as a job prices them")
        return {}
    found = pricing.cached_links(cfg, n)
    missing = [t for t in LOCAL if t not in found]
    if "shm" not in missing and "direct" not in found and cfg.direct_slot(2) > 0:
        missing.append("shm")  # calibrated before the one-shot path had its own constants
    if missing and probe:
        out(f"# no calibration of {', '.join(missing)} on this host in {cache_dir(cfg.cache_dir)}; "
            f"probing with 2 local ranks ...")
        since = time.time()
        probe_locally(missing, cfg.cache_dir)
        found = pricing.cached_links(cfg, n, since)
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
            out: Callable[[str], None], n: int = 2, cores: int = 0,
            setting: str = "TENSORWIRE_TUNING_FILE") -> list[Tier]:
    """The tiers `names`, the local ones with the constants calibrated nearest `n` ranks
    (probed first where missing and `probe`) on `cores` cores; `setting`: what named the
    tuning file, as its errors say."""
    file = load_tuning_file(cfg.tuning_file, setting) if cfg.tuning_file else {}
    local = local_links(cfg, probe, out, n) if any(name in LOCAL for name in names) else {}
    return pricing.tiers(names, cfg, file, local, gamma, n, cores)


# -- streams over TCP ------------------------------------------------------------------------------

def streams_at(tier: Tier, ranks: int, cores: int, nsocks: int | None, threads: int | None,
               peers: int) -> Streams:
    """`tier`'s streams where `ranks` ranks share a host of `cores` cores, each with `peers` peers:
    the streams a pair `nsocks` gives (TENSORWIRE_NSOCKS) and the pump threads `threads` gives
    (TENSORWIRE_SOCKET_THREADS; None: `auto`, resolved as the transport does, transport/pumps.py)."""
    k = streams_per_pair(nsocks, cores, ranks, peers)
    return tier.streams(k, pump_threads(threads, cores, ranks, k), cores / max(1, ranks))


def describe_streams(streams: Streams, cfg: Config, cores: int, ranks: int) -> str:
    nsocks, threads = ("auto" if v is None else str(v) for v in (cfg.nsocks, cfg.socket_threads))
    return (f"TENSORWIRE_NSOCKS={nsocks} ({streams.nsocks} a pair), TENSORWIRE_SOCKET_THREADS={threads} "
            f"({streams.threads} a rank, {ranks} rank(s) on {cores} cores)")


def streams_rows(collective: str, m: int, hosts: int, per_host: int, nics: int, local: Tier, net: Tier,
                 cfg: Config, cores: int) -> list[tuple[int, int, float, float, str]]:
    """(streams, threads, rate a rank's connection reaches while every rank of a host crosses,
    seconds of the cheapest algorithm, its name) at the configured settings and at 1, 2, 4 and 8
    streams, the threads as configured (and as `auto` gives them where they are set)."""
    crossing = shared(net.link, per_host / max(1, min(nics, per_host)))
    settings: list[tuple[int | None, int | None]] = [(cfg.nsocks, cfg.socket_threads)]
    for k in (1, 2, 4, 8):
        settings.append((k, cfg.socket_threads))
        if cfg.socket_threads is not None:
            settings.append((k, None))
    rows = {}
    for nsocks, threads in settings:
        streams = streams_at(net, per_host, cores, nsocks, threads, hosts * per_host - 1)
        key = (streams.nsocks, streams.threads)
        if key in rows:
            continue
        rate = 1 / streams.link(crossing, 1 << 40).beta  # type: ignore[union-attr]
        t, name, _ = cluster_prices(collective, m, hosts, per_host, nics, local, net, cfg, streams)[0]
        rows[key] = (*key, rate, t, name)
    return sorted(rows.values())


def report_streams(collective: str, m: int, hosts: int, per_host: int, nics: int, local: Tier, net: Tier,
                   cfg: Config, cores: int, out: Callable[[str], None]) -> None:
    """The streams between hosts at the configured settings and at 1, 2, 4 and 8 (streams_rows)."""
    configured = streams_at(net, per_host, cores, cfg.nsocks, cfg.socket_threads, hosts * per_host - 1)
    out(f"  streams between hosts: {describe_streams(configured, cfg, cores, per_host)}")
    if net.stream is None:
        out(f"  (the {net.name} link was measured through them: more are not priced; give the link's "
            f"rate, --tier {local.name},NAME=ALPHA_US:GBPS or the tuning file's {net.name} entry, to see "
            f"what they give)")
        return
    origin = "the tuning file's" if net.stream != pricing.DEFAULT_LINKS[STREAM] else "default"
    out(f"  (one stream moves at most {describe_rate(net.stream)}, {origin} {STREAM}; a rank reaches "
        f"min(its share of the link, streams moving x that), a message over a stream per MiB of it)")
    rows = streams_rows(collective, m, hosts, per_host, nics, local, net, cfg, cores)
    base = next(t for k, th, _, t, _ in rows if (k, th) == (configured.nsocks, configured.threads))
    for k, threads, rate, t, name in rows:
        mark = "  <- configured" if (k, threads) == (configured.nsocks, configured.threads) else (
            f"  x{t / base:.2f}" if base > 0 else "")
        out(f"  at NSOCKS={k} threads={threads}: {rate / 1e9:.3g} GB/s a rank, {format_seconds(t)} "
            f"({name}){mark}")


# -- the report ------------------------------------------------------------------------------------

BUSY_SHOWN = ("every rank at work at once (a call costs no less than its work at this)",
              "... with fixed partners (the rings, the chain)",
              "... in pairs (recursive doubling and halving, Rabenseifner, Bruck: their α)")
"""What each of Tier.busy prices (cost_model.predict)."""

def report(collective: str, m: int, n: int, tiers: list[Tier], cfg: Config, direct_bytes: int,
           out: Callable[[str], None], cores: int = 1) -> None:
    algs = list(algorithms_for(collective).values())
    mode = ", deterministic mode" if cfg.deterministic else ""
    out(f"{collective} of {size_text(m)} on {n} ranks{mode}: predicted time per algorithm (α-β-γ model)")
    for tier in tiers:
        out("")
        out(f"  tier {tier.name}: {describe_link(tier.link)}  [{tier.origin}]")
        if tier.one_way is not None:
            out(f"    messages one way (trees, linear rooted): {describe_link(tier.one_way)}")
        for what, link, origin in zip(BUSY_SHOWN, tier.busy, tier.busy_origin):
            if link is not None and tier.busy[0] is not None:  # (the others bound nothing without it)
                # and where it came from, unless that is where the tier's link did
                out(f"    {what}: {describe_link(link)}" + (f"  [{origin}]" if origin != tier.origin else ""))
        if tier.direct is not None:
            out(f"    one-shot shared-memory path: {describe_link(tier.direct)}")
        if tier.memory is not None:
            out(f"    memory of the one host: {describe_link(tier.memory)}")
        if tier.cma is not None:
            out(f"    single copy's reads across processes: {describe_link(tier.cma)}")
        if tier.cma_huge is not None:
            out(f"    ... out of huge pages (as priced here; a job prices the reads at the line above "
                f"once its sources are seen in 4 KiB pages): {describe_link(tier.cma_huge)}")
        if tier.cma is not None and tier.cma_fold is not None:
            out(f"    ... a reduction's flag round (its body folds in Python): "
                f"α {tier.cma_fold.alpha * 1e6:.3g} us")
        whole = tier.compiles(collective)
        if whole:  # the rows below price a job's calls as its compiled caller runs them
            one, reads = tier.compiled[DIRECT_COMPILED], tier.compiled.get(CMA_COMPILED)
            moves = "" if reads is None else f", single copy α {reads.alpha * 1e6:.3g} us"
            out(f"    {IN_C.strip(' ,')}, the rows below: run whole in C, one shot α "
                f"{one.alpha * 1e6:.3g} us (a reduction's up to {size_text(COMPILED_BYTES)}: β "
                f"{describe_rate(one)}){moves}")
        tcp = tier.name == "tcp"
        streams = streams_at(tier, n, cores, cfg.nsocks, cfg.socket_threads, n - 1) if tcp else None
        if streams is not None:
            bound = (f"one stream at most {describe_rate(tier.stream)}" if tier.stream is not None
                     else "measured through them")
            out(f"    streams: {describe_streams(streams, cfg, cores, n)}; {bound}")
        reasons = {alg.name: why_not(alg, collective, n, m, tier, cfg, direct_bytes, cores) for alg in algs}
        ok = [a for a in algs if not reasons[a.name]]
        rows = [(t, name, "") for t, name, _ in tier.price(ok, n, m, streams)]  # the tuner breaks ties so
        rows += sorted((math.inf, name, reason) for name, reason in reasons.items() if reason)
        width = max(len(a.name) for a in algs)
        for i, (t, name, reason) in enumerate(rows):
            if reason:
                out(f"    {name:<{width}}  {'-':>10}  ({reason})")
            else:
                mark = "  <- cheapest" if i == 0 else f"  x{t / rows[0][0]:.2f}" if rows[0][0] > 0 else ""
                out(f"    {name:<{width}}  {format_seconds(t):>10}{mark}")
        changes = crossovers(algs, collective, n, tier, cfg, direct_bytes, streams, cores)
        if changes:
            text = ", ".join(f"{a or 'none'} -> {b or 'none'} at {size_text(s)}" for s, a, b in changes)
            out(f"    crossover: {text}")
        else:
            only = cheapest(algs, collective, n, 1, tier, cfg, direct_bytes, streams, cores)
            out(f"    crossover: none between {size_text(SWEEP[0])} and {size_text(SWEEP[1])} "
                f"({only or 'no algorithm'} is cheapest throughout)")


def report_cluster(collective: str, m: int, hosts: int, per_host: int, nics: int, local: Tier, net: Tier,
                   cfg: Config, out: Callable[[str], None], cores: int = 1) -> None:
    n = hosts * per_host
    streams = streams_at(net, per_host, cores, cfg.nsocks, cfg.socket_threads, hosts * per_host - 1)
    out(f"{collective} of {size_text(m)} on {n} ranks: {hosts} hosts x {per_host} ranks, {local.name} "
        f"within a host, {net.name} between hosts ({per_host / max(1, min(nics, per_host)):g} rank(s) per "
        f"host link)")
    out(f"  within a host: {describe_link(local.link)}  [{local.origin}]")
    out(f"  between hosts: {describe_link(net.link)}  [{net.origin}]")
    rows = cluster_prices(collective, m, hosts, per_host, nics, local, net, cfg, streams)
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
                alg = algorithms_for(collective)[name]
                flows = 1.0 if phased else host_link_flows(alg, hosts, per_host, nics)
                if flows > 1 + 1e-9:
                    mark += f"  ({flows:.3g} flows a host link)"
                out(f"    {name:<{width}}  {format_seconds(t):>10}{mark}")
    if collective == "all_reduce" and hosts > 1 and best > 0:
        out("  compress='bf16' or 'fp16' (16 bits between hosts, exact within them):")
        for dtype, t in pricing.compressed_prices(m, hosts, per_host, nics, local, net, cfg, streams):
            out(f"    {dtype:<{width}}  {format_seconds(t):>10}  x{t / best:.2f}")

    def winner(size: int) -> str | None:
        t, name, reason = cluster_prices(collective, size, hosts, per_host, nics, local, net, cfg, streams)[0]
        return None if reason or math.isinf(t) else name

    changes = changes_of(winner)
    if changes:
        text = ", ".join(f"{a or 'none'} -> {b or 'none'} at {size_text(s)}" for s, a, b in changes)
        out(f"    crossover: {text}")
    else:
        out(f"    crossover: none ({winner(1) or 'no algorithm'} is cheapest throughout)")
    if hosts > 1 and m > 0:
        report_streams(collective, m, hosts, per_host, nics, local, net, cfg, cores, out)


# -- the command -------------------------------------------------------------------------------

PROG = "tensorwire plan"
"""How the command names itself, as its errors start."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
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
    p.add_argument("--per-host", type=int, default=None, metavar="L",
                   help="ranks per host with --hosts (default 8)")
    p.add_argument("--nics", type=int, default=None, metavar="K",
                   help="network interfaces per host with --hosts: a host's ranks share them (default 1)")
    p.add_argument("--cores", type=int, default=None, metavar="C",
                   help="cores of a host, for what TENSORWIRE_SOCKET_THREADS=auto gives its ranks (default: "
                        "this host's)")
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
        setting = "TENSORWIRE_TUNING_FILE"
        if args.tuning_file is not None:
            cfg, setting = replace(cfg, tuning_file=args.tuning_file), "--tuning-file"
        policy.check_algo(cfg.algo, cfg.deterministic)
        name = args.collective.strip().lower()
        if name == "all":
            colls = [c for c in COLLECTIVES if c != "barrier"]
        else:
            coll = {c.replace("_", ""): c for c in COLLECTIVES}.get(name.replace("_", "").replace("-", ""))
            if coll is None:
                raise InvalidArgumentError(f"tensorwire plan: unknown collective {args.collective!r} "
                                           f"(known: {', '.join(COLLECTIVES)}, all)")
            colls = [coll]
        m = parse_size(args.size, "tensorwire plan: SIZE")
        if args.np < 1:
            raise InvalidArgumentError("tensorwire plan: --np must be >= 1")
        if args.gamma is not None and not 0 < args.gamma < float("inf"):
            raise InvalidArgumentError(f"tensorwire plan: --gamma must be a positive rate in GB/s, got "
                                       f"{args.gamma}")
        gamma = 1 / (args.gamma * 1e9) if args.gamma else None
        cluster = {"--per-host": args.per_host, "--nics": args.nics, "--cores": args.cores}
        if args.hosts is None and any(v is not None for v in cluster.values()):
            given = ", ".join(k for k, v in cluster.items() if v is not None)
            raise InvalidArgumentError(f"tensorwire plan: {given} describe the hosts of --hosts H: give "
                                       f"it too")
        args.per_host, args.nics, args.cores = (8 if args.per_host is None else args.per_host,
                                                1 if args.nics is None else args.nics,
                                                0 if args.cores is None else args.cores)
        cores = args.cores or len(os.sched_getaffinity(0))
        if args.hosts is not None:
            if args.hosts < 1 or args.per_host < 1 or args.nics < 1 or args.cores < 0:
                raise InvalidArgumentError("tensorwire plan: --hosts, --per-host and --nics must be >= 1, "
                                           "--cores >= 0")
            names = parse_tiers(args.tier or ["shm,tcp"])
            if len(names) != 2:
                raise InvalidArgumentError(f"tensorwire plan: --hosts takes two tiers, within a host and "
                                           f"between hosts (e.g. --tier shm,ib-ndr), got {', '.join(names)}")
            local, net = resolve(names, cfg, not args.no_probe, gamma, out, args.per_host, setting=setting)
        else:
            tiers = resolve(parse_tiers(args.tier), cfg, not args.no_probe, gamma, out, args.np, cores,
                            setting)
    except (InvalidArgumentError, ValueError) as exc:
        print(f"{PROG}: {str(exc).removeprefix(f'{PROG}: ')}", file=sys.stderr)
        return 2
    if args.hosts is not None:
        for i, coll in enumerate(colls):
            if i:
                out("")
            report_cluster(coll, 0 if coll == "barrier" else m, args.hosts, args.per_host, args.nics, local,
                           net, cfg, out, cores)
        return 0
    for i, coll in enumerate(colls):
        if i:
            out("")
        report(coll, 0 if coll == "barrier" else m, args.np, tiers, cfg, cfg.direct_slot(args.np), out, cores)
    return 0
