"""Link calibration at init: every rank agrees on the settings and installs the same link
constants, cached and checked, probed, from the tuning file or the defaults.

`at_init(world)` runs collectively on the world group right after it exists, through the group's
own calls (CallQueue.run_internal: they take sequence numbers like any collective, so every
rank runs them at the same point and under the same timeout, and fail on every rank as any
call does):

1. agreement: every rank contributes its host, its lowest shared-memory and TCP peers, a
   digest of the settings that steer algorithm choice (ranks that disagree on TENSORWIRE_ALGO
   or TENSORWIRE_DETERMINISTIC would pick different schedules and hang; they fail here with
   a clear error instead), and a digest of what else changes its measurements (cores, kernel,
   Python, numpy, the settings of waiting and buffers: cache.environment_digest);
2. verdict: rank 0 looks the topology up in its cache (cache.py) and reads its tuning file
   (tuning_file.py), and broadcasts either the final constants or "probe";
3. check (cache hit): every rank takes part in a short probe of the constants that settle the
   small calls (check_cached); an entry that it finds several times too slow is measured again;
4. probe (cache miss, or a failed check): probes.probe measures every link the job uses; rank
   0 (with the lowest rank of every other host) writes the cache: a trusted entry where the
   probe had the cores to itself, else one the next job ignores (probes.foreign_cores).

Whatever its source, the one-shot path is then priced below the messages at 8 bytes unless
the probe found it slower in every round (with_direct_bound), and every rank installs the same
table (tuner.install). TENSORWIRE_CALIBRATE=0 skips cache and probe (defaults), 1 probes on a
miss, force probes and rewrites. TENSORWIRE_TUNING_FILE overrides any constant; see
docs/tuning.md and, for the reasoning, docs/design/calibration.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import log, memory
from ..algorithms.prices import Link
from ..algorithms.registry import algorithms_for
from ..algorithms.tree import binomial_broadcast
from ..errors import InvalidArgumentError, TimeoutError, rank_spans, retold
from ..ops import ReduceOp
from . import probes, tuner
from .cache import cache_dir, cache_key, cache_path, environment_digest, host_hash, read_cache, write_cache
from .cost_model import (
    BUSY,
    BUSY_PAIRS,
    BUSY_RING,
    CMA,
    CMA_COMPILED,
    CMA_FOLD,
    CMA_HUGE,
    DEFAULT_LINKS,
    DIRECT_COMPILED,
    LINKS,
    MEMORY,
    ONE_WAY,
    TIERS,
    LinkTable,
    bound_direct,
    per_flow,
)
from .topology import machine_id
from .tuning_file import FIELDS, REQUIRED, apply_overrides, defaults_with_file, load_tuning_file

if TYPE_CHECKING:
    from ..group.calls import CollectiveCall
    from ..group.group import Group

_log = log.get("TUNING")

CHECK_WARM, CHECK_SERIES, CHECK_CALLS, CHECK_BATCHES = 2, 3, 6, 3  # the check of a cache entry at init:
# the one shot as probes.typical (these counts), the busy α as probes.measure_busy (this many batches)
CHECK_TOLERANCE = 3.0  # an entry whose α (or β) is this many times what the check measures is measured again
CHECK_BETA_BYTES, CHECK_BETA_WARM, CHECK_BETA_ROUNDS = 256 << 10, 6, 3  # ... β: ring rounds of this size,
# timed after this many untimed (a fresh ring's first rounds touch its pages)

_STATUS_PROBE, _STATUS_FINAL, _STATUS_ERROR = 0.0, 1.0, 2.0
_SOURCE_CODES = {"default": 0.0, "cached": 1.0, "calibrated": 2.0}
_SOURCE_NAMES = {v: k for k, v in _SOURCE_CODES.items()}


# -- the collective setup at init ---------------------------------------------------------------

def agreed_settings(cfg: Any) -> dict[str, str]:
    """The settings every rank must share, by name, as text: the tuner prices calls with them,
    and picks the same algorithm on every rank only where all price alike."""
    return {"TENSORWIRE_ALGO": repr(cfg.algo.strip()) if cfg.algo.strip() else "unset",
            "TENSORWIRE_COMPRESS": cfg.compress or "unset",
            "TENSORWIRE_DETERMINISTIC (or init's deterministic=)": str(bool(cfg.deterministic)),
            "TENSORWIRE_NSOCKS": "auto" if cfg.nsocks is None else str(cfg.nsocks),
            "TENSORWIRE_SOCKET_THREADS": "auto" if cfg.socket_threads is None else str(cfg.socket_threads)}


def _disagreement(rank: int, settings: list[dict[str, str]]) -> str:
    """The error where ranks' agreed settings differ: each setting that differs, its values and
    the ranks that have each."""
    parts = []
    for name in settings[0]:
        holders: dict[str, list[int]] = {}
        for r, theirs in enumerate(settings):
            holders.setdefault(theirs[name], []).append(r)
        if len(holders) > 1:
            parts.append(f"{name} is " + ", ".join(
                f"{value} on rank{'s' if len(ranks) > 1 else ''} {rank_spans(ranks, most=12)}"
                for value, ranks in holders.items()))
    return (f"rank {rank}: init: ranks run with different settings that every rank must share (else "
            f"they choose different algorithms or formats, and hang): {'; '.join(parts)}; give every rank "
            f"the same")


def _all_settings(world: Group, info: np.ndarray, mine: bytes) -> list[dict[str, str]]:
    """Every rank's agreed settings (the agreement's rows hold the lengths): a second exchange,
    made only where the digests differ, and by every rank alike."""
    rows = np.zeros((world.size, int(info[:, 11].max())), dtype=np.uint8)
    rows[world.rank, :len(mine)] = np.frombuffer(mine, dtype=np.uint8)
    probes.over_ranks(world, rows, "tuning setup")
    return [json.loads(rows[r, :int(info[r, 11])].tobytes()) for r in range(world.size)]


def _lowest_peers(group: Group) -> tuple[int, int]:
    """(lowest shared-memory peer, lowest TCP peer) of this rank, -1 where there is none."""
    me = group.runtime.rank
    shm = tcp = -1
    for peer in range(group.runtime.world_size):
        if peer == me:
            continue
        if group.engine.planned_kind(peer) == "shm":
            shm = peer if shm < 0 else shm
        else:
            tcp = peer if tcp < 0 else tcp
        if shm >= 0 and tcp >= 0:
            break
    return shm, tcp


def _crowding(info: np.ndarray) -> float:
    """The most ranks per usable core of any machine of the job (the agreement's rows)."""
    machines = [int(m) for m in info[:, 7]]
    return max(machines.count(m) / max(1, int(min(info[r, 5] for r in range(len(info)) if machines[r] == m)))
               for m in set(machines))


def _streams(info: np.ndarray) -> list[tuple[int, int, float]]:
    """Per rank (the agreement's rows): the TCP streams it offers a pair, its pump threads, and
    the cores (as its engine counts them) a rank of its machine has: what tuner.streams_for
    prices a group's TCP calls with."""
    machines = [int(m) for m in info[:, 7]]
    return [(int(info[r, 9]), int(info[r, 10]), int(info[r, 5]) / machines.count(machines[r]))
            for r in range(len(info))]


def _probe_pairs(info: np.ndarray) -> dict[str, tuple[int, int]]:
    """tier -> (a, b): the lowest rank joined to a peer by that tier, and its lowest such peer."""
    pairs = {}
    for col, tier in ((1, "shm"), (2, "tcp")):
        for r in range(len(info)):
            if info[r, col]:
                pairs[tier] = (r, int(info[r, col]) - 1)
                break
    return pairs


# The verdict rank 0 broadcasts: status, then per link of LINKS its constants, the source of
# each, the tuning file's overrides (NaN: not set), and whether the cache entry found the one
# shot consistently slower than the messages at 8 bytes (1, else 0; see with_direct_bound).
_K = len(FIELDS)
_BASE, _SRC = 1, 1 + _K * len(LINKS)
_FILE = _SRC + len(LINKS)
_SLOWER = _FILE + _K * len(LINKS)
_VERDICT_LEN = _SLOWER + 1


def at_init(world: Group) -> LinkTable:
    """Agree on the settings, then install link constants (cached and checked, probed, from
    the file or defaults) that are the same on every rank. Collective over the world group.
    TENSORWIRE_HELD_BYTES bounds the application's messages: the probes' own, which come early
    as the peer goes on, do not count against it."""
    engine = world.engine
    limit, engine.held_limit = engine.held_limit, 0
    try:
        return _at_init(world)
    finally:
        engine.held_limit = limit


def _at_init(world: Group) -> LinkTable:
    t0 = time.perf_counter()
    cfg = world.runtime.config
    n, me = world.size, world.rank
    if n < 2:
        table = defaults_with_file(cfg.tuning_file)
        tuner.install(world.runtime, table)
        return table
    # 1. agreement and topology
    info = np.zeros((n, 12), dtype=np.uint64)
    shm_peer, tcp_peer = _lowest_peers(world)
    engine = world.engine
    settings = json.dumps(agreed_settings(cfg)).encode()
    digest = int.from_bytes(hashlib.sha256(settings).digest()[:8], "little") >> 1
    info[me] = (host_hash(), shm_peer + 1, tcp_peer + 1, digest, int(cfg.huge_pages),
                engine.cores, environment_digest(cfg, engine.cores), host_hash(machine_id()),
                int(world.plans.caller is not None), engine.nsocks,
                0 if engine.pumps is None else engine.pumps.threads, len(settings))
    probes.over_ranks(world, info, "tuning setup")
    if any(info[r, 3] != info[0, 3] for r in range(n)):  # every rank sees it, and says what differs
        raise InvalidArgumentError(_disagreement(world.runtime.rank, _all_settings(world, info, settings)))
    pairs = _probe_pairs(info)
    direct = world.direct is not None  # the same on every rank: its setup was collective
    cma = direct and world.direct.single_copy  # type: ignore[union-attr]  # ... and so was this
    hosts = [int(h) for h in info[:, 0]]
    cores = int(min(info[r, 5] for r in range(n) if hosts[r] == hosts[me]))  # as the engine counts them
    compiled = direct and bool(info[:, 8].all())  # every rank's calls run whole in C where planned
    one_host = [*(["direct"] if direct else []), *([CMA, CMA_HUGE, CMA_FOLD] if cma else []),
                *([DIRECT_COMPILED] if compiled else []), *([CMA_COMPILED] if compiled and cma else [])]
    links_used = sorted([*pairs, *(ONE_WAY[t] for t in pairs), *one_host, BUSY, BUSY_RING,
                         BUSY_PAIRS, MEMORY])
    key = cache_key(hosts, links_used, n, cfg.tcp_changed(), [int(e) for e in info[:, 6]])
    path = cache_path(cache_dir(cfg.cache_dir), key)
    # 2. rank 0's verdict: final constants, or probe; and its tuning file's overrides
    verdict = np.full(_VERDICT_LEN, math.nan)
    error: BaseException | None = None
    if me == 0:
        try:
            _verdict(verdict, cfg, path, links_used)
        except InvalidArgumentError as exc:
            verdict[0], error = _STATUS_ERROR, exc
    world.queue.run_internal("tuning setup", lambda call: binomial_broadcast(call, verdict, 0))
    if verdict[0] == _STATUS_ERROR:
        raise error if error is not None else InvalidArgumentError(
            f"rank {world.runtime.rank}: init: rank 0 could not read its tuning file "
            f"(TENSORWIRE_TUNING_FILE={cfg.tuning_file!r}); see rank 0's error")
    base: dict[str, Link] = {}
    sources: dict[str, str] = {}
    overrides: dict[str, dict[str, float]] = {}
    for i, name in enumerate(LINKS):
        values = [float(v) for v in verdict[_BASE + _K * i: _BASE + _K * (i + 1)]]
        if not math.isnan(values[0]):
            base[name] = Link(name, *values)
            sources[name] = _SOURCE_NAMES.get(float(verdict[_SRC + i]), "default")
        vals = {f: float(v) for f, v in zip(FIELDS, verdict[_FILE + _K * i: _FILE + _K * (i + 1)])
                if not math.isnan(v)}
        if vals:
            overrides[name] = vals
    slower = verdict[_SLOWER] == 1.0
    probe = verdict[0] == _STATUS_PROBE
    # 3. a cache hit is checked against a short probe of its constants
    checked, check_s = "", 0.0
    due = _checks_due(base, sources, overrides)
    if not probe and any(due):
        t1 = time.perf_counter()
        with _slow_link_hint():
            checked = check_cached(world, base, due, pairs)
        check_s = time.perf_counter() - t1
        probe = bool(checked)
        if checked and me == 0:
            _log.info("re-measuring the cached %s: %s", path, checked)
    # 4. the probe
    probe_s = foreign = 0.0
    if probe:
        t1 = time.perf_counter()
        before = probes.cpu_seconds()
        with probes.spread(world, hosts) as own_core, _slow_link_hint():
            measured = probes.probe(world, pairs, direct, cma, len(set(hosts)) > 1, _crowding(info),
                                    own_core)
        probe_s = time.perf_counter() - t1
        foreign = round(probes.foreign_cores(world, [int(m) for m in info[:, 7]], before, t1), 2)  # as cached
        slower = _install_measured(base, sources, measured, pairs, direct, cma)
        if compiled:  # through the API, planned on the tuner's provisional constants
            tuner.install(world.runtime, LinkTable(base, sources))
            counts = probes.series_counts(_crowding(info))
            long = probes.long_counts(counts, _crowding(info))
            _install_compiled(base, sources, probes.measure_compiled(world, cma, long, **counts), cma)
        leaders = {hosts[r]: r for r in reversed(range(n))}  # the lowest rank of every host
        if leaders.get(hosts[me]) == me:
            rounds = [[round(t * 1e6, 2) for t in r] for r in measured["rounds"]] if direct else []
            write_cache(path, {t: base[t] for t in links_used},
                        {"created": time.time(), "world_size": n, "tiers": links_used,
                         "hosts": sorted({format(h, "016x") for h in hosts}),
                         "hostname": socket.gethostname(), "probe_seconds": round(probe_s, 6),
                         "trusted": foreign <= probes.LOAD_SLACK, "foreign_cores": round(foreign, 2),
                         "direct_slower": slower,
                         "direct_rounds_us": rounds})
        if foreign > probes.LOAD_SLACK and me == 0:
            _log.info("the probe ran under load (other processes took %.2f cores beyond those the job "
                      "left idle): its constants serve this job, and the next one measures again", foreign)
    if probe_s or check_s:
        give_back(world)
    table = apply_overrides(LinkTable(base, sources), overrides)
    used_cache = any(s.endswith(("cached", "calibrated")) for s in table.sources.values())
    table = LinkTable(table.links, table.sources, probe_s, time.perf_counter() - t0,
                      path if used_cache else "",
                      {"tiers": links_used, "key": key, "busy_tier": tuner.tier_of(world),
                       "huge_pages": bool(info[:, 4].all()), "cores": cores, "hosts": hosts,
                       "streams": _streams(info),
                       "checked": checked, "check_s": check_s, "foreign_cores": foreign})
    table = per_flow(table, world.layout)
    table = with_direct_bound(world, table, slower, "alpha" in overrides.get("direct", {}))
    tuner.install(world.runtime, table)
    _log.info("link constants (setup %.1f ms%s%s): %s", table.setup_s * 1e3,
              f", check of the cache {check_s * 1e3:.2f} ms" if check_s else "",
              f", probe {probe_s * 1e3:.1f} ms" if probe_s else "",
              "; ".join(f"{t} {table.describe(t)}" + ("" if t in links_used else ", not used by this job")
                        for t in table.links))
    return table


def give_back(world: Group) -> None:
    """Give back what the probe's (or the check's) large messages and arrays took, so that a
    job that measured holds what one that found its constants cached does: every rank's rings
    back to their first size (the old ones unmapped by their readers once every rank has
    passed a barrier and read its peers' moves) and the heap's free pages. Collective."""
    if world.engine.wiring is not None:
        world.engine.wiring.shrink_rings()
    probes.over_ranks(world, np.zeros(1), "calibration")
    world.engine.poll_peers()  # every peer's move is in its ring by now: follow it
    memory.give_back()


def _install_measured(base: dict[str, Link], sources: dict[str, str], measured: dict[str, Any],
                      pairs: dict[str, tuple[int, int]], direct: bool, cma: bool) -> bool:
    """Put what the probe measured into `base` and `sources`; whether the one shot was slower
    than recursive doubling at 8 bytes in every round (with_direct_bound)."""
    gamma = float(measured["gamma"])
    for tier in TIERS:
        if tier in pairs:
            alpha, beta, one_way = measured[tier]
            base[tier] = Link(tier, alpha, beta, gamma)
            base[ONE_WAY[tier]] = Link(ONE_WAY[tier], alpha, one_way, gamma)
            sources[tier] = sources[ONE_WAY[tier]] = "calibrated"
        else:  # not in this job: its defaults, with this host's γ
            base[tier] = Link(tier, DEFAULT_LINKS[tier].alpha, DEFAULT_LINKS[tier].beta, gamma)
    for name, used in (("direct", direct), (CMA, cma), (CMA_HUGE, cma), (CMA_FOLD, cma)):
        if used:
            alpha, beta = measured[name]
            base[name] = Link(name, alpha, beta, gamma)
            sources[name] = "calibrated"
        else:
            base[name] = replace(DEFAULT_LINKS[name], gamma=gamma)
    alpha, beta, ring_beta, pairs_alpha, busy_gamma = measured[BUSY]
    base[BUSY] = Link(BUSY, alpha, beta, busy_gamma)
    base[BUSY_RING] = Link(BUSY_RING, alpha, ring_beta, busy_gamma)
    base[BUSY_PAIRS] = Link(BUSY_PAIRS, pairs_alpha, beta, busy_gamma)
    cache, beta, gamma = measured[MEMORY]
    base[MEMORY] = Link(MEMORY, 0.0, beta, gamma, cache)
    for name in (BUSY, BUSY_RING, BUSY_PAIRS, MEMORY):
        sources[name] = "calibrated"
    one_shot, messages = measured["rounds"]
    return direct and all(d > m for d, m in zip(one_shot, messages))


def _install_compiled(base: dict[str, Link], sources: dict[str, str], measured: tuple[float, float, float],
                      cma: bool) -> None:
    """Put the α's (and the one shot's β) of the calls the compiled caller runs whole
    (probes.measure_compiled) into `base`, the rest as the Python path's links; those links'
    own where a call could not be measured."""
    alpha, beta, reads = measured
    plain = base["direct"]
    base[DIRECT_COMPILED] = replace(plain, name=DIRECT_COMPILED, alpha=alpha or plain.alpha,
                                    beta=beta or plain.beta)
    sources[DIRECT_COMPILED] = "calibrated"
    if cma:
        base[CMA_COMPILED] = replace(base[CMA], name=CMA_COMPILED, alpha=reads or base[CMA].alpha)
        sources[CMA_COMPILED] = "calibrated"


def _verdict(verdict: np.ndarray, cfg: Any, path: str, links_used: list[str]) -> None:
    """Rank 0 fills the verdict: status, base constants with their sources, file overrides."""
    overrides = load_tuning_file(cfg.tuning_file) if cfg.tuning_file else {}
    entry = read_cache(path, links_used, cfg.cache_max_age) if cfg.calibrate == "1" else None
    cached = entry[0] if entry else None
    probe = cfg.calibrate == "force" or (cfg.calibrate == "1" and cached is None)
    # a file that sets every constant of every link in use makes the probe pointless
    if probe and all(all(f in overrides.get(t, {}) for f in REQUIRED) for t in links_used):
        probe = False
    verdict[0] = _STATUS_PROBE if probe else _STATUS_FINAL
    verdict[_SLOWER] = 1.0 if entry and entry[1].get("direct_slower") is True else 0.0
    # this host's γ, as a probe would give it (the busy link's is measured under contention;
    # the memory entry's is what a reduced byte costs beyond the cache)
    known = cached or {}
    hosts_own = [t for t in known if t not in (BUSY, BUSY_RING, BUSY_PAIRS, MEMORY)]
    gamma = known[hosts_own[0]].gamma if hosts_own else None
    for i, name in enumerate(LINKS):
        link = known.get(name) or DEFAULT_LINKS.get(name)
        if link is not None and gamma is not None and name not in known and name != MEMORY:
            link = Link(name, link.alpha, link.beta, gamma)
        if link is not None:
            verdict[_BASE + _K * i: _BASE + _K * (i + 1)] = [getattr(link, f) for f in FIELDS]
            verdict[_SRC + i] = _SOURCE_CODES["cached" if name in known else "default"]
        for j, f in enumerate(FIELDS):
            if f in overrides.get(name, {}):
                verdict[_FILE + _K * i + j] = overrides[name][f]
    if cached is not None and not probe:
        _log.info("link constants from the cache %s", path)


# -- what a measurement may change ------------------------------------------------------------------

def with_direct_bound(world: Group, table: LinkTable, slower: bool, from_file: bool) -> LinkTable:
    """The table with the one-shot path's measured (or cached) α priced below every other
    all_reduce at 8 bytes (DIRECT_BOUND of the cheapest: by messages, or single copy), unless
    the probe found the one shot slower than recursive doubling in every one of its
    DIRECT_ROUNDS (`slower`) or the tuning file sets that α (`from_file`); a default α is left
    as it is.

    The one shot exists to beat the rest at small sizes: one flag round where the messages
    take a round per step and single copy two flag rounds. A probe that says otherwise has
    usually met a preempted rank; only evidence that holds, measured against the messages
    under the same conditions, changes that choice (docs/design/calibration.md)."""
    link = table.links.get("direct")
    measured = table.sources.get("direct", "").removeprefix("file+") in ("calibrated", "cached")
    if world.direct is None or link is None or slower or from_file or not measured:
        return table
    model = tuner.Model.of(world, table)
    bounded = bound_direct(link, model.links, model.n, model.single_copy)
    if bounded is link:
        return table
    _log.info("the one-shot path's α %.3g us priced at %.3g us: below every other all_reduce at 8 B, as "
              "it was not slower than the messages in every round of its probe", link.alpha * 1e6,
              bounded.alpha * 1e6)
    return replace(table, links={**table.links, "direct": bounded})


@contextlib.contextmanager
def _slow_link_hint() -> Iterator[None]:
    """A probe that timed out says how to start without one (a link too slow for the timeout)."""
    try:
        yield
    except TimeoutError as exc:
        raise retold(exc, f"{str(exc).rstrip('.')}; init's calibration measures every link the job "
                          f"uses: where one is too slow for the timeout, TENSORWIRE_CALIBRATE=0 starts on "
                          f"the defaults (docs/tuning.md)") from exc


_CHECKS = (("direct", "alpha"), (BUSY, "alpha"), (BUSY_RING, "beta"), *((tier, "alpha") for tier in TIERS))
"""What the check of the cache measures, in the order of its measurements."""


def _checks_due(links: Mapping[str, Link], sources: Mapping[str, str],
                overrides: Mapping[str, Mapping[str, float]]) -> list[bool]:
    """Per _CHECKS, whether the constant came from the cache (not from a tuning file)."""
    return [sources.get(name) == "cached" and name in links and field not in overrides.get(name, {})
            for name, field in _CHECKS]


def check_cached(world: Group, links: Mapping[str, Link], due: list[bool],
                 pairs: Mapping[str, tuple[int, int]]) -> str:
    """Why the cached constants do not hold now ('' where they do): a short probe of the one-shot
    path's α (where the world has it), the busy α and each tier's α on its probe pair (`pairs`;
    `due`: which of _CHECKS came from the cache), the constants that settle the small calls, CHECK_*
    of the probe's calls and rounds (a few hundred µs at 2 ranks), and of the busy ring's β where
    each rank has a core, which settles the large calls. The entry is measured again where any of
    them now comes out more than CHECK_TOLERANCE times faster than cached: a measurement can only be
    slowed down by what else runs, so a cached value that much above a fresh one was taken at a bad
    moment. Slower now is no such evidence on one host (it may be busy this instant) and keeps the
    entry; across hosts a busy ring that much slower than cached is measured again too: the path
    between the hosts is not what it was. Every rank judges the same numbers (the maximum over
    ranks). The entries that made each check necessary: docs/design/calibration.md#the-check.
    """
    quick = np.zeros(3 + len(TIERS))
    if world.direct is not None:
        run = algorithms_for("all_reduce")["direct"].run
        data = np.ones(2, dtype=np.float32)
        quick[0] = probes.typical(world, lambda: run(world.queue.internal_call("calibration check"), data,
                                                     ReduceOp.MAX),
                                  "calibration check", CHECK_WARM, CHECK_SERIES, CHECK_CALLS)
    world.queue.run_internal("calibration check", lambda call: _check_rounds(call, quick, pairs))
    probes.over_ranks(world, quick, "calibration check")
    across = world.layout is not None
    seen, reasons = [], []
    for now, (name, field), checked in zip(quick, _CHECKS, due):
        if now > 0 and checked:
            then = getattr(links[name], field)
            shown = (f"α {now * 1e6:.3g} us now against {then * 1e6:.3g} us" if field == "alpha" else
                     f"β {1e-9 / now:.3g} GB/s now against {1e-9 / then:.3g} GB/s")
            seen.append(f"{name} {shown} cached")
            if now * CHECK_TOLERANCE < then or (across and field == "beta" and now > then * CHECK_TOLERANCE):
                reasons.append(seen[-1])
    if world.rank == 0:
        _log.info("check of the cache: %s", "; ".join(seen))
    return "; ".join(reasons)


def _check_rounds(call: CollectiveCall, quick: np.ndarray, pairs: Mapping[str, tuple[int, int]]) -> None:
    """check_cached's rounds, in `call`: the busy α into quick[1], the busy ring's β into
    quick[2] (not where ranks outnumber cores) and each tier's α on its pair into quick[3:]."""
    group = call.group
    rounds = probes.Rounds(call, 0)
    for d in rounds.dists[:2]:  # everyone is here
        rounds.small_shift(d)
    quick[1] = rounds.alpha(rounds.small_shift, CHECK_BATCHES)
    if group.size > 1 and not group.engine.oversubscribed:
        # the ring's β: the fastest of a few rounds, once the rings' pages are touched. Not where
        # ranks outnumber cores: the probe's busy β is then a mean over preempted rounds, which
        # the fastest of a few rounds would beat in every job, measuring each one again
        big_out, big_in = np.ones(CHECK_BETA_BYTES, np.uint8), np.ones(CHECK_BETA_BYTES, np.uint8)
        times = []
        for _ in range(CHECK_BETA_WARM + CHECK_BETA_ROUNDS):
            t0 = time.perf_counter()
            rounds.shift(big_out, big_in, 1)
            times.append(time.perf_counter() - t0)
        best = min(times[CHECK_BETA_WARM:])
        quick[2] = max((best - quick[1]) / CHECK_BETA_BYTES, best / CHECK_BETA_BYTES / 2)
    for i, tier in enumerate(TIERS):  # one pair at a time: the others go on to the reduction after
        pair = pairs.get(tier)
        if pair is not None and group.rank in pair:
            peer = pair[1] if group.rank == pair[0] else pair[0]
            quick[3 + i] = probes.pair_alpha(call, peer, rounds.step + 1000 * (i + 1), CHECK_BATCHES)
