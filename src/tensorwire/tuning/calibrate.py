"""Link calibration: α and β of every tier a job uses and γ of this host, measured at init.

`at_init(world)` runs collectively on the world group right after it exists, through internal
calls (they take sequence numbers like any collective, so every rank runs them at the same
point and under the same timeout):

1. agreement: every rank contributes its host, its lowest shared-memory and TCP peers, a
   digest of the settings that steer algorithm choice (ranks that disagree on TENSORWIRE_ALGO
   or TENSORWIRE_DETERMINISTIC would pick different schedules and hang; they fail here with
   a clear error instead), and a digest of what else changes its measurements (cores, kernel,
   Python, numpy, the settings of waiting and buffers: environment_digest);
2. verdict: rank 0 looks the topology up in its cache (an entry is read only if it is of
   this probe's version, trusted and younger than TENSORWIRE_CACHE_MAX_AGE) and reads its
   tuning file, and broadcasts either the final constants or "probe";
3. check (cache hit): every rank takes part in a short probe of the constants that settle the
   small calls (check_cached); an entry that it finds several times too slow is measured again;
4. probe (cache miss, or a failed check): for each tier present, the lowest pair of ranks
   joined by it runs a few small exchanges (α) and 1 MiB exchanges (β); then every rank does
   the same at once, with changing partners ("busy"), with a ring's fixed ones ("busy_ring")
   and in pairs ("busy_pairs"), and a numpy add: what a step costs when every rank works (on
   a host with more ranks than cores they take turns, which the lone pair never sees); on one
   host every rank takes part in a few all_reduces through the group's shared segment (α and
   β of the one-shot path), in rounds against recursive doubling spread over the probe; rank
   0 times a numpy add (γ). The maximum over ranks of what was measured becomes everybody's
   constants, and rank 0 (with the lowest rank of every other host) writes the cache: a
   trusted entry where the probe had the cores to itself, else one the next job ignores
   (foreign_cores).

Whatever its source, the one-shot path is then priced below the messages at 8 bytes unless
the probe found it slower in every round (bound_direct), and every rank installs the same
table. The cache lives in TENSORWIRE_CACHE_DIR (default $XDG_CACHE_HOME/tensorwire or
~/.cache/tensorwire), one JSON file per key (cache_key). TENSORWIRE_CALIBRATE=0 skips cache
and probe (defaults), 1 probes on a miss, force probes and rewrites. TENSORWIRE_TUNING_FILE
overrides any constant; see docs/tuning.md and, for the reasoning, docs/design/calibration.md.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import mmap
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import log
from ..algorithms.recursive_doubling import recursive_doubling_all_reduce
from ..algorithms.registry import Link, algorithms_for
from ..algorithms.tree import binomial_broadcast
from ..buffers import copy as copy_as_library
from ..buffers import huge_zeros
from ..errors import InvalidArgumentError
from ..ops import ReduceOp
from . import crossing, tuner
from .topo import machine_id
from .tuner import DEFAULT_LINKS, ONE_WAY, TIERS, LinkTable

LINKS = (*TIERS, *ONE_WAY.values(), "direct", tuner.CMA, tuner.CMA_HUGE, tuner.BUSY, tuner.BUSY_RING,
         tuner.BUSY_PAIRS, tuner.MEMORY)
"""What the probe measures: the message path of each tier (exchanges, and messages one way:
`shm_one_way`, `tcp_one_way`), the one-shot shared-memory path
(its α is a small all_reduce through the group segment, its β a memory copy), single copy's
reads out of a peer process (`cma`: its α a flag round of a small single-copy all_gather, its
β a byte read across processes; `cma_huge`: the same read out of huge pages), the world's
tier with every rank exchanging at once, with partners that change (`busy`), with a ring's
(`busy_ring`) and in pairs (`busy_pairs`, its α only): the tuner's bound on an algorithm's
work; and the host's memory beyond its
last-level cache (`memory`, see tuner.spill)."""

if TYPE_CHECKING:
    from ..group.group import CollectiveCall, Group

_log = log.get("TUNING")

PROBE_VERSION = 22
"""Bump when the probe changes what it measures: older cache entries are then ignored."""
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
GAMMA_BYTES, GAMMA_ROUNDS = 16 << 20, 5  # numpy add of 16 MiB float32 (out of cache): the best gives γ
DIRECT_CALLS, DIRECT_SERIES = 24, 3  # all_reduces through the shared segment, back to back, in
# this many series, the least series' mean call kept: the direct path
DIRECT_BYTES = 1 << 20  # ... at 8 bytes (α) and at this size, or the slot's if smaller (β)
DIRECT_WARM = 8  # ... after this many untimed: the first calls after init measured 1.4x the
# steady state at n=4 on 2 cores (median α over 10 launches 97 us cold, 69 us warm; 65-103 us
# in a benchmark's 8 B calls), enough to flip small all_reduces to the tree (2-8x slower)
DIRECT_ROUNDS = 3  # rounds of the one shot's 8 B calls against recursive doubling's, spread over
# the probe: the median round gives the one shot's α (see _probe, bound_direct)
DIRECT_BOUND = 0.9  # ... which is priced at most this share of the cheapest other all_reduce at
# 8 B, unless it was the slower in every round
CMA_BYTES = 1 << 20  # ... single copy's block a rank, for its β (see measure_cma)
CHECK_WARM, CHECK_SERIES, CHECK_CALLS, CHECK_BATCHES = 2, 3, 6, 3  # the check of a cache entry at init:
# the one shot as _typical (these counts), the busy α as measure_busy (this many batches)
CHECK_TOLERANCE = 3.0  # an entry whose α (or β) is this many times what the check measures is measured again
CHECK_BETA_BYTES, CHECK_BETA_WARM, CHECK_BETA_ROUNDS = 256 << 10, 6, 3  # ... β: ring rounds of this size,
# timed after this many untimed: a fresh ring's first 256 KiB rounds took 400-130 us at n=2 (its
# pages touched), the sixth on 35-45
LOAD_SLACK = 0.5  # cores of other processes' CPU beyond those a probe left idle that make its
# constants untrusted: used by the job that measured them, not cached for the next (foreign_cores)
FIELDS = ("alpha", "beta", "gamma", "cache")
REQUIRED = FIELDS[:3]  # every link has these; `cache` only the memory entry (else 0)
MEMORY_ARRAY_MAX = 64 << 20  # the memory probe's arrays: four times the cache's size, at most this
CACHED_ARRAY_MAX = 1 << 20  # ... and those it compares them with: a quarter of a core's reach, at most
KNEE = 1.6  # a copy this much slower per byte than a small one has left the cache (cache_in_reach)

_STATUS_PROBE, _STATUS_FINAL, _STATUS_ERROR = 0.0, 1.0, 2.0
_SOURCE_CODES = {"default": 0.0, "cached": 1.0, "calibrated": 2.0}
_SOURCE_NAMES = {v: k for k, v in _SOURCE_CODES.items()}


# -- the tuning file --------------------------------------------------------------------------------

_UNITS = {  # accepted key -> (field, factor to SI, is a rate)
    "alpha": ("alpha", 1.0, False), "alpha_us": ("alpha", 1e-6, False),
    "beta": ("beta", 1.0, False), "bandwidth_gbps": ("beta", 1e9, True),
    "gamma": ("gamma", 1.0, False), "reduce_gbps": ("gamma", 1e9, True),
    "cache": ("cache", 1.0, False), "cache_mib": ("cache", float(1 << 20), False),
}


def parse_tuning(doc: Any, where: str) -> dict[str, dict[str, float]]:
    """{tier: {field: SI value}} from a tuning document (see docs/tuning.md for the format)."""
    if isinstance(doc, Mapping) and "links" in doc:
        doc = doc["links"]  # a cache file works as a tuning file
    if not isinstance(doc, Mapping):
        raise InvalidArgumentError(f"{where}: expected a JSON object of tiers, e.g. "
                                   f'{{"tcp": {{"alpha_us": 50, "bandwidth_GBps": 1.2}}}}')
    out: dict[str, dict[str, float]] = {}
    for tier, fields in doc.items():
        if not isinstance(fields, Mapping):
            raise InvalidArgumentError(f"{where}: tier {tier!r} must map to an object of constants")
        values: dict[str, float] = {}
        for key, raw in fields.items():
            unit = _UNITS.get(str(key).lower())
            if unit is None:
                raise InvalidArgumentError(f"{where}: tier {tier!r}: unknown key {key!r} (known: alpha, "
                                           f"alpha_us, beta, bandwidth_GBps, gamma, reduce_GBps, "
                                           f"cache, cache_MiB)")
            name, factor, is_rate = unit
            number = isinstance(raw, (int, float)) and not isinstance(raw, bool)
            if not number or not math.isfinite(raw) or raw < 0 or (is_rate and raw == 0):
                raise InvalidArgumentError(f"{where}: tier {tier!r}: {key} must be a "
                                           f"{'positive' if is_rate else 'non-negative'} number, got {raw!r}")
            if name in values:
                raise InvalidArgumentError(f"{where}: tier {tier!r}: {name} given twice")
            values[name] = 1.0 / (raw * factor) if is_rate else raw * factor
        out[str(tier)] = values
    return out


def load_tuning_file(path: str) -> dict[str, dict[str, float]]:
    where = f"TENSORWIRE_TUNING_FILE={path!r}"
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise InvalidArgumentError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{where}: not valid JSON ({exc})") from None
    return parse_tuning(doc, where)


_TIER_OF_ONE_WAY = {one_way: tier for tier, one_way in ONE_WAY.items()}


def apply_overrides(table: LinkTable, overrides: Mapping[str, Mapping[str, float]]) -> LinkTable:
    """The table with the file's constants in place; tiers the file adds are kept too. A tier
    set by the file prices its one-way messages too, unless the file sets those as well (on top
    of the tier's constants where none were measured one way)."""
    links, sources = dict(table.links), dict(table.sources)
    for tier, values in overrides.items():
        of = _TIER_OF_ONE_WAY.get(tier, "")  # a one-way link the probe did not measure: its tier's
        base = (links.get(tier) or DEFAULT_LINKS.get(tier) or links.get(of) or DEFAULT_LINKS.get(of)
                or Link(tier, **{f: math.nan for f in REQUIRED}))
        merged = {f: values.get(f, getattr(base, f)) for f in FIELDS}
        if any(math.isnan(v) for v in merged.values()):
            continue  # a new tier needs all three constants; plan reports it as incomplete
        links[tier] = Link(tier, **merged)
        origin = sources.get(tier, "default")
        sources[tier] = "file" if all(f in values for f in REQUIRED) else f"file+{origin}"
    for tier in TIERS:  # a tier the file sets and whose messages one way it does not: its link prices all
        if tier in overrides and ONE_WAY[tier] not in overrides:
            links.pop(ONE_WAY[tier], None)
            sources.pop(ONE_WAY[tier], None)
    return LinkTable(links, sources, table.probe_s, table.setup_s, table.cache_path, dict(table.extra))


# -- the cache -----------------------------------------------------------------------------------

def cache_dir(configured: str = "") -> str:
    if configured:
        return os.path.expanduser(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tensorwire")


def host_hash(hostname: str | None = None) -> int:
    """63 bits of the host name: enough to tell hosts apart, and it fits an int64 slot."""
    raw = hashlib.sha256((hostname or socket.gethostname()).encode()).digest()
    return int.from_bytes(raw[:8], "little") >> 1


def environment_digest(cfg: Any, cores: int) -> int:
    """What changes a rank's measurements besides the topology: its usable cores, the kernel,
    the Python and numpy it runs (the interpreter and the kernels are most of every α and γ),
    and the settings that shape how it waits and what it moves (spinning, binding, ring and
    slot sizes)."""
    text = "|".join(map(str, (cores, platform.release(), *sys.version_info[:2],
                              ".".join(np.__version__.split(".")[:2]), cfg.spin_us, cfg.bind,
                              cfg.shm_ring_bytes, cfg.direct_bytes)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def cache_key(hosts: list[int], tiers: list[str], world_size: int,
              tcp: Mapping[str, object] | None = None, environments: list[int] | None = None) -> str:
    """Constants are cached per hosts, tiers and world size, per TCP setting that differs from
    the defaults (`tcp`: Config.tcp_changed; a TCP link's α and β are those settings'), and
    per environment of the ranks (environment_digest: a core more or less, another kernel,
    Python or numpy measures another machine)."""
    fields: dict[str, object] = {"v": PROBE_VERSION, "hosts": sorted(set(hosts)), "tiers": sorted(tiers),
                                 "world_size": world_size, **(tcp or {})}
    if environments:
        fields["env"] = sorted(set(environments))
    text = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path(directory: str, key: str) -> str:
    return os.path.join(directory, f"links-{key}.json")


def read_cache(path: str, tiers: list[str], max_age: float = math.inf) -> tuple[dict[str, Link], dict] | None:
    """The cached links of every tier in `tiers` and the entry they come from, or None: missing,
    unreadable, of another probe version, partial, older than `max_age` seconds, or measured
    under load (not trusted, see at_init); then it is measured again."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("version") != PROBE_VERSION:
            return None
        links = parse_tuning(doc["links"], path)
        out = {t: Link(t, **links[t]) for t in tiers}
        age = time.time() - float(doc["created"])
    except (OSError, ValueError, KeyError, TypeError, InvalidArgumentError):
        return None
    if not doc.get("trusted", False):
        _log.info("re-measuring: %s was measured under load (other processes took %s cores beyond those "
                  "the job left idle)", path, doc.get("foreign_cores", "?"))
        return None
    if not 0 <= age <= max_age:
        _log.info("re-measuring: %s is %.0f s old (TENSORWIRE_CACHE_MAX_AGE: %.0f s)", path, age, max_age)
        return None
    return out, doc


def write_cache(path: str, links: dict[str, Link], meta: dict[str, Any]) -> None:
    """Atomically (rename) write one entry; a cache that cannot be written is only logged."""
    doc = {"version": PROBE_VERSION, **meta,
           "links": {t: {f: getattr(link, f) for f in FIELDS if f != "cache" or link.cache}
                     for t, link in links.items()}}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".links-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        _log.info("cannot write the calibration cache %s: %s", path, exc)


def cached_entries(directory: str) -> list[dict[str, Any]]:
    """Every readable cache entry of `directory`, newest first (for `tensorwire plan`)."""
    out = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if not (name.startswith("links-") and name.endswith(".json")):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            if doc.get("version") == PROBE_VERSION:
                doc["links"] = parse_tuning(doc["links"], path)
                doc["path"] = path
                out.append(doc)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, InvalidArgumentError):
            continue
    return sorted(out, key=lambda d: d.get("created", 0), reverse=True)


# -- measuring --------------------------------------------------------------------------------------

def measure_gamma(nbytes: int = GAMMA_BYTES, rounds: int = GAMMA_ROUNDS) -> float:
    """Seconds per byte of an in-place float32 sum (the reduction kernel's bread and butter)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.full_like(a, 0.5)
    np.add(a, b, out=a)  # first touch
    return max(_best(lambda: np.add(a, b, out=a), rounds) / a.nbytes, 1e-13)


def _typical(world: Group, run: Callable[[], object], warm: int = DIRECT_WARM, series: int = DIRECT_SERIES,
             calls: int = DIRECT_CALLS) -> float:
    """Seconds of one call of `run` (collective over `world`) as the model is judged
    (`tensorwire bench --algo`, benchmarks.algos.JUDGED): after DIRECT_WARM untimed calls,
    DIRECT_CALLS back to back on every rank, the slowest rank's mean call; the least of
    DIRECT_SERIES series. The message algorithms' busy links are such means too (measure_busy),
    so the one shot and the messages are priced in one statistic. (From the shm-n4 sweep of
    2026-11-25 until PROBE_VERSION 16 this was the median over calls of each call's slowest
    rank, the plain bench's headline: where ranks outnumber cores it reads 1.3-1.5x a mean call
    for the one shot, and the model then priced the one shot in one statistic and the messages
    in another.)
    One series alone is not enough where a rank loses its core for a while: a launch of the
    shm-n2 sweep of 2026-11-26 measured the one shot's α at 160 µs (5 in every other launch),
    and every gather from 16 B to 1 MiB took the binomial tree, 2.3-5.4x slower."""
    for _ in range(warm):
        run()
    means = np.zeros(series)
    for s in range(series):
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        means[s] = (time.perf_counter() - t0) / calls
    recursive_doubling_all_reduce(world._internal_call("calibration probe"), means, ReduceOp.MAX)
    return float(means.min())


def small_all_reduces(world: Group, **counts: int) -> tuple[float, float]:
    """One round of evidence: the one shot's 8-byte all_reduce and recursive doubling's (the
    message algorithm such calls would otherwise take), each timed as _typical times it, back
    to back, so that both meet the same conditions (`counts`: _typical's)."""
    algs = algorithms_for("all_reduce")
    data = np.ones(2, dtype=np.float32)

    def typical(name: str) -> float:
        run = algs[name].run
        return max(_typical(world, lambda: run(world._internal_call("calibration probe"), data, ReduceOp.MAX),
                            **counts), 1e-8)

    return typical("direct"), typical("recursive_doubling")


def measure_direct(world: Group) -> tuple[float, float, float]:
    """(α, recursive doubling's 8-byte call, β) of the one-shot shared-memory path, from
    all_reduces through the group segment (every rank of the world takes part, see _typical):
    α is a call's time at 8 bytes, in the first round of small_all_reduces (at_init takes the
    median of DIRECT_ROUNDS); β is fitted to the time at DIRECT_BYTES (up to the slot),
    counting a reduced byte like a copied one, and never below a lone copy's.
    Every rank works in these calls, contention included, as for the busy link. Not
    a bare barrier, nor a copy timed alone: when ranks share cores the copy in and the fold
    cost as much as the flag round, and each rank copies while the others do."""
    run = algorithms_for("all_reduce")["direct"].run
    n = world.size
    big = np.ones(min(DIRECT_BYTES, world.direct.slot_bytes) // 4, dtype=np.float32)  # type: ignore[union-attr]
    alpha, messages = small_all_reduces(world)
    typical = _typical(world, lambda: run(world._internal_call("calibration probe"), big, ReduceOp.MAX))
    slope = (typical - alpha) / ((1 + n + n - 1) * big.nbytes)  # copy in, n reads, n-1 folds
    return alpha, messages, max(slope, measure_copy())  # never faster than a copy alone (noise can say so)


def measure_cma(world: Group) -> tuple[float, float, float]:
    """(α, β, β out of huge pages) of single copy, from its all_gather (every rank of the world
    takes part, as in measure_direct): α is half a call's time at 8 bytes a rank (two flag
    rounds), each β is fitted to the time at about CMA_BYTES read by each rank, in n-1 blocks
    out of its peers' memory (the block shrinks as n grows, so that n blocks stay near
    CMA_BYTES of memory a rank). A read across processes pins the source's pages and costs far
    more than a copy out of 4 KiB pages (1 MiB: 14-15 GB/s against 55-61 GB/s for memcpy on
    the project's machine), so the one-shot path's β does not price it; out of huge pages it
    ran at 48-53 GB/s (which sources are: tuner.PageDependent)."""
    run = algorithms_for("all_gather")["single_copy"].run
    n = world.size

    def typical(blocks: list[np.ndarray]) -> float:
        return _typical(world, lambda: run(world._internal_call("calibration probe"), blocks, None))

    small = typical([np.ones(8, dtype=np.uint8) for _ in range(n)])
    block = max(CMA_BYTES // (n - 1) // 4096 * 4096, 4096)

    def slope(blocks: list[np.ndarray]) -> float:
        return max((typical(blocks) - small) / ((n - 1) * block), measure_copy())

    whole = huge_zeros(n * block)
    whole[...] = 1  # the pages exist before the timing
    return (max(small / 2, 1e-8), slope([np.ones(block, dtype=np.uint8) for _ in range(n)]),
            slope([whole[r * block:(r + 1) * block] for r in range(n)]))


def measure_copy(nbytes: int = 1 << 20, rounds: int = GAMMA_ROUNDS) -> float:
    """Seconds per byte of a plain copy of a cached MiB: the floor of the direct path's β."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    return max(_best(lambda: copy_as_library(dst, src), rounds) / nbytes, 1e-13)


def last_level_cache(cpu: int | None = None) -> int:
    """Bytes of the largest data cache of the CPU this process runs on (sysfs), 0 if unknown."""
    if cpu is None:
        cpu = os.sched_getcpu() if hasattr(os, "sched_getcpu") else 0
    best = 0
    for index in glob.glob(f"/sys/devices/system/cpu/cpu{cpu}/cache/index*"):
        try:
            with open(os.path.join(index, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def cache_in_reach(limit: int) -> int:
    """Bytes of cache that one process's copies find, up to `limit`: the footprint (both
    arrays) of the largest copy that still ran within KNEE of the per-byte time of the
    smallest, doubling from 2 x 128 KiB. What sysfs calls the last-level cache may be
    neither near nor the process's: on the project's Intel VM it says 480 MiB, yet a copy ran
    at 38-48 GB/s up to 2 x 512 KiB, 26 at 2 x 1 MiB and 13-14 from 2 x 2 MiB to 2 x 16 MiB
    (L2 is 2 MiB a core), so every message was priced as if in cache: single copy's all_reduce
    measured 1.6-2.3x its price at 1-64 MiB (n=2)."""
    arrays = 128 << 10
    first = None
    while 2 * arrays <= limit:
        region = mmap.mmap(-1, 2 * arrays, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            both = np.frombuffer(region, dtype=np.uint8)
            src, dst = both[:arrays], both[arrays:]
            src.fill(1)
            dst.fill(0)  # first touch, untimed
            per_byte = _best(lambda d=dst, s=src: copy_as_library(d, s), GAMMA_ROUNDS) / arrays
            del both, src, dst
        finally:
            region.close()
        if first is None:
            first = per_byte
        elif per_byte > KNEE * first:
            return arrays  # the footprint of the last copy that stayed within reach
        arrays *= 2
    return limit


def measure_memory() -> tuple[float, float, float]:
    """(cache bytes, β, γ) of the memory entry: the cache the host's ranks reach (their cores'
    each, `cache_in_reach`, up to the last-level cache), and what a byte copied and a byte
    added cost beyond it, as tuner.spill charges them. A copy and an add of two arrays of four
    times the cache's size each (up to MEMORY_ARRAY_MAX) take longer per byte than on arrays
    that fit one core's reach; spill charges that difference to the share 1 - cache/footprint
    of the bytes (here 7/8), so it is divided by that share. Arrays of the cache's size had
    done on the AMD host (32 MiB shared), but on the Intel VM the cache in reach is a MiB, the
    size of the probe's cached arrays too: both copies ran alike, the entry said memory cost
    nothing more (+0), and every algorithm moving 1-64 MiB at n=4 measured 1.3-2.3x its price.
    The cached arrays are timed in batches: copied alone they took 22-46 GB/s from call to
    call, and the difference from them had swung the memory's β 5x from launch to launch
    (84-403 GB/s, against 22-32 so). The arrays are mapped for the probe and unmapped after,
    so the process does not keep them (see memory.py)."""
    llc = last_level_cache() or int(DEFAULT_LINKS[tuner.MEMORY].cache)
    reach = cache_in_reach(llc)
    cache = min(llc, reach * len(os.sched_getaffinity(0)))
    size = min(4 * cache, MEMORY_ARRAY_MAX)
    share = 1 - cache / (2 * size)
    if share <= 0.25:  # a cache this large hides most of what the probe would see
        default = DEFAULT_LINKS[tuner.MEMORY]
        return float(cache), default.beta, default.gamma
    maps = [mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(2)]
    try:
        copy, add = _copy_and_add(*(np.frombuffer(m, dtype=np.float32) for m in maps))
    finally:
        for m in maps:
            m.close()
    cached = min(reach // 4, CACHED_ARRAY_MAX) // 4  # float32 elements: half of a core's reach
    cached_copy, cached_add = _copy_and_add(*(np.empty(cached, dtype=np.float32) for _ in range(2)), batch=8)
    return float(cache), max(copy - cached_copy, 0.0) / share, max(add - cached_add, 0.0) / share


def _copy_and_add(a: np.ndarray, b: np.ndarray, batch: int = 1) -> tuple[float, float]:
    """Seconds per byte of the best copy of `a` into `b` (as the library copies: in pieces),
    and of the best a += b; each timed over `batch` in a row."""
    a.fill(1.0)
    b.fill(0.5)  # first touch, untimed

    def repeated(run: Callable[[], object]) -> float:
        return _best(lambda: [run() for _ in range(batch)], GAMMA_ROUNDS) / batch / a.nbytes

    return repeated(lambda: copy_as_library(b, a)), repeated(lambda: np.add(a, b, out=a))


def _best(run: Callable[[], object], rounds: int) -> float:
    """The fastest of `rounds` timed runs, in seconds."""
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def _exchange(call: CollectiveCall, peer: int, out: np.ndarray, into: np.ndarray, step: int) -> None:
    call.wait(call.isend(peer, out, step), call.irecv(peer, into, step))


def measure_busy(call: CollectiveCall, step0: int,
                 across_hosts: bool = False) -> tuple[float, float, float, float]:
    """(α, β, β in a ring, α in pairs) of a step when every rank works: all ranks at once,
    round k sending to rank r + d and receiving from r - d, d = 1, 2, 4, ... (a dissemination
    pattern: every rank takes part whatever n is, and the partners change from round to round
    as in pairwise exchange, recursive doubling or a tree); then the same with d = 1
    throughout, the fixed partners of a ring or a chain; then 8-byte rounds in pairs, each rank
    exchanging with rank r XOR d (where there is one), as the steps of recursive doubling,
    recursive halving, Rabenseifner and Bruck do (Algorithm.exchanges).

    The median 8-byte batch gives α; β is the mean of a few BUSY_BYTES rounds, slow ones
    included: contention is the point, and a long call meets the preempted rounds that a median
    would drop (medians of five rounds swung 5x from launch to launch on 4 ranks sharing 2
    cores; means of six stayed within 1.5x). On 4 emulated hosts at 1 Gbit/s the
    dissemination rounds had moved about half the bytes per second of the ring's: they were
    measured while the connections still ramped up (below; under BBR also its pacing, see
    tcp.tune_socket); warm, the two agree there as on one host. What a step in pairs costs beside
    the others depends on the host: on the AMD EPYC VM the n=4 sweeps measured 2-2.7x the busy
    α for such steps (a step waits for both partners to be scheduled), on the Intel Xeon VM
    about 1x (n=4, 8 bytes, median batches: 66 against 65 µs on shared memory, 92 against 91
    over loopback TCP, 114 against 136 on 4 emulated hosts), where a fixed factor of 2 made the
    tuner take pairwise exchange over Bruck's all_to_all and the ring reduce_scatter over
    recursive halving, 1.2-1.7x slower there.

    Each pattern is run untimed BUSY_WARM_ROUNDS per distance first. Across hosts the fresh TCP
    connections need more of them (BUSY_WARM_ROUNDS_ACROSS_HOSTS): on 4 emulated hosts at
    1 Gbit/s (cubic, 2026-11-26) the first 12-36 rounds of 2 MiB took 1-90 ms against a steady
    17-18, each new connection ramping its window up behind the queue the previous one had
    built in the shaper, no segment lost; warmed 2 rounds per distance the dissemination rounds
    measured 0.056-0.068 GB/s in 4 launches of 5 (0.12 in one; 0.12 too later in the same jobs,
    as the pairwise all_to_all moved), warmed 6, 0.11-0.12 in 6 of 7 (0.065 in one), warmed 8
    or 12 no better (5 of 7), for 0.25 s more at init with 6. Slow spells came back later too
    (rounds of 1 and 65-90 ms for a few rounds, in jobs that had run steady): the 17 launches
    of a netns4 sweep warmed 6 measured 0.106-0.119 GB/s in 12, 0.059-0.071 in 5. So across
    hosts the dissemination rounds are timed twice, before and after the ring's, and the
    faster kept: the collectives that follow run in the steady state."""
    rounds = _Rounds(call, step0)
    dists = rounds.dists
    big_out, big_in = np.ones(BUSY_BYTES, np.uint8), np.ones(BUSY_BYTES, np.uint8)  # pages touched

    def mean_round(distances: list[int], count: int) -> float:
        t0 = time.perf_counter()
        for i in range(count):
            rounds.shift(big_out, big_in, distances[i % len(distances)])
        return (time.perf_counter() - t0) / count

    for i in range(2):  # everyone is here
        rounds.small_shift(dists[i % len(dists)])
    # every ring written once around: its pages are touched (fresh pages cost ~1 ms per MiB
    # here), as in steady use
    warm = BUSY_WARM_ROUNDS_ACROSS_HOSTS if across_hosts else BUSY_WARM_ROUNDS
    mean_round(dists, warm * len(dists))
    alpha = rounds.alpha(rounds.small_shift)

    def beta(mean: float) -> float:  # at least half of a round is bandwidth, as in measure_pair
        return max((mean - alpha) / BUSY_BYTES, mean / BUSY_BYTES / 2, 1e-13)

    count = -(-BUSY_BETA_ROUNDS // len(dists)) * len(dists)  # every distance as often
    shifting = beta(mean_round(dists, count))
    # untimed: right after the change of pattern the shaped ring measured 0.07 GB/s, not 0.10-0.12
    mean_round([1], warm)
    ring = beta(mean_round([1], count))
    if across_hosts:
        shifting = min(shifting, beta(mean_round(dists, count)))
    for d in dists:  # the pairs once round, untimed: every rank is past the ring
        rounds.pair(d)
    return alpha, shifting, ring, rounds.alpha(rounds.pair)


class _Rounds:
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
    enough to write the ring once around, as the first touch of its pages costs ~1 ms per MiB
    here (the first four of eight 1 MiB exchanges took 0.9-1.6 ms, the next 0.1-0.5 ms, and
    β had come from one of those cold rounds whenever only two were left out)."""
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
    # the median, not the best: over TCP on loopback 1 MiB exchanges ran at 2.5-3.1 GB/s with
    # the odd one at 5-6, and the best of four had swung β 2.8-5.8 GB/s from launch to launch
    big = statistics.median(bigs[warm:])
    # at least half of a 1 MiB exchange is bandwidth: on a busy machine α comes out inflated,
    # and subtracting it whole would make the link look faster than memory
    beta = max((big - alpha) / BETA_BYTES, big / BETA_BYTES / 2, 1e-13)
    return alpha, beta, _one_way(call, peer, step, alpha, big_out, big_in)


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


def _one_way(call: CollectiveCall, peer: int, step: int, alpha: float, out: np.ndarray,
             into: np.ndarray) -> float:
    """β of a message that goes one way (the lower rank sends, the other acknowledges with 8
    bytes), as the steps of a tree or a linear rooted algorithm do: the median of
    ONE_WAY_TIMED after one untimed. Where the link is a copy by each side (shared memory, TCP
    on one host) the two copies run at once, and a byte costs about half what an exchange's
    does, whose ranks both copy in and out (n=2 on the Intel VM, 1 MiB: 9.8 against 6.5 GB/s
    one way through shared memory, 6.0 against 2.3 over loopback TCP); a wire of full duplex
    costs the same either way. Priced at the exchange's β, the trees' and linear reduce's,
    gather's and scatter's large calls measured 0.35-0.67x their price (sweeps of 2026-11-26)."""
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


# -- the collective setup at init ---------------------------------------------------------------

def settings_digest(cfg: Any) -> int:
    text = f"deterministic={bool(cfg.deterministic)}|algo={cfg.algo.strip()}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


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
# shot consistently slower than the messages at 8 bytes (1, else 0; see bound_direct).
_K = len(FIELDS)
_BASE, _SRC = 1, 1 + _K * len(LINKS)
_FILE = _SRC + len(LINKS)
_SLOWER = _FILE + _K * len(LINKS)
_VERDICT_LEN = _SLOWER + 1


def at_init(world: Group) -> LinkTable:
    """Agree on the settings, then install link constants (cached and checked, probed, from
    the file or defaults) that are the same on every rank. Collective over the world group."""
    t0 = time.perf_counter()
    cfg = world.runtime.config
    n, me = world.size, world.rank
    if n < 2:
        table = default_table_with_file(cfg)
        tuner.install(world.runtime, table)
        return table
    # 1. agreement and topology
    info = np.zeros((n, 8), dtype=np.uint64)
    shm_peer, tcp_peer = _lowest_peers(world)
    info[me] = (host_hash(), shm_peer + 1, tcp_peer + 1, settings_digest(cfg), int(cfg.huge_pages),
                world.engine.cores, environment_digest(cfg, world.engine.cores), host_hash(machine_id()))
    recursive_doubling_all_reduce(world._internal_call("tuning setup"), info.reshape(-1), ReduceOp.MAX)
    differ = [r for r in range(n) if info[r, 3] != info[0, 3]]
    if differ:
        raise InvalidArgumentError(
            f"rank {world.runtime.rank}: init: rank(s) {', '.join(map(str, differ))} run with other "
            f"TENSORWIRE_ALGO or TENSORWIRE_DETERMINISTIC settings than rank 0 (this rank has "
            f"algo={cfg.algo!r}, deterministic={cfg.deterministic}); every rank must use the same")
    pairs = _probe_pairs(info)
    direct = world.direct is not None  # the same on every rank: its setup was collective
    cma = direct and world.direct.single_copy  # type: ignore[union-attr]  # ... and so was this
    hosts = [int(h) for h in info[:, 0]]
    cores = int(min(info[r, 5] for r in range(n) if hosts[r] == hosts[me]))  # as the engine counts them
    one_host = [*(["direct"] if direct else []), *([tuner.CMA, tuner.CMA_HUGE] if cma else [])]
    links_used = sorted([*pairs, *(ONE_WAY[t] for t in pairs), *one_host, tuner.BUSY, tuner.BUSY_RING,
                         tuner.BUSY_PAIRS, tuner.MEMORY])
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
    binomial_broadcast(world._internal_call("tuning setup"), verdict, 0)
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
    if not probe and "cached" in sources.values():
        t1 = time.perf_counter()
        checked = check_cached(world, base, sources, overrides, pairs)
        check_s = time.perf_counter() - t1
        probe = bool(checked)
        if checked and me == 0:
            _log.info("re-measuring the cached %s: %s", path, checked)
    # 4. the probe
    probe_s = foreign = 0.0
    if probe:
        t1 = time.perf_counter()
        before = _cpu_seconds()
        with spread(world, hosts):
            measured = _probe(world, pairs, direct, cma, len(set(hosts)) > 1)
        probe_s = time.perf_counter() - t1
        foreign = foreign_cores(world, [int(m) for m in info[:, 7]], before, t1)
        slower = _install_measured(base, sources, measured, pairs, direct, cma)
        leaders = {hosts[r]: r for r in reversed(range(n))}  # the lowest rank of every host
        if leaders.get(hosts[me]) == me:
            rounds = [[round(t * 1e6, 2) for t in r] for r in measured["rounds"]] if direct else []
            write_cache(path, {t: base[t] for t in links_used},
                        {"created": time.time(), "world_size": n, "tiers": links_used,
                         "hosts": sorted({format(h, "016x") for h in hosts}),
                         "hostname": socket.gethostname(), "probe_seconds": round(probe_s, 6),
                         "trusted": foreign <= LOAD_SLACK, "foreign_cores": round(foreign, 2),
                         "direct_slower": slower,
                         "direct_rounds_us": rounds})
        if foreign > LOAD_SLACK and me == 0:
            _log.info("the probe ran under load (other processes took %.2f cores beyond those the job "
                      "left idle): its constants serve this job, and the next one measures again", foreign)
    table = apply_overrides(LinkTable(base, sources), overrides)
    used_cache = any(s.endswith(("cached", "calibrated")) for s in table.sources.values())
    table = LinkTable(table.links, table.sources, probe_s, time.perf_counter() - t0,
                      path if used_cache else "",
                      {"tiers": links_used, "key": key, "busy_tier": tuner.tier_of(world),
                       "huge_pages": bool(info[:, 4].all()), "cores": cores, "hosts": hosts,
                       "checked": checked, "check_s": check_s, "foreign_cores": foreign})
    table = tuner.per_flow(table, world.layout)
    table = bound_direct(world, table, slower, "alpha" in overrides.get("direct", {}))
    tuner.install(world.runtime, table)
    _log.info("link constants (setup %.1f ms%s%s): %s", table.setup_s * 1e3,
              f", check of the cache {check_s * 1e3:.2f} ms" if check_s else "",
              f", probe {probe_s * 1e3:.1f} ms" if probe_s else "",
              "; ".join(f"{t} {table.describe(t)}" + ("" if t in links_used else ", not used by this job")
                        for t in table.links))
    return table


def _install_measured(base: dict[str, Link], sources: dict[str, str], measured: dict[str, Any],
                      pairs: dict[str, tuple[int, int]], direct: bool, cma: bool) -> bool:
    """Put what the probe measured into `base` and `sources`; whether the one shot was slower
    than recursive doubling at 8 bytes in every round (bound_direct)."""
    gamma = float(measured["gamma"])
    for tier in TIERS:
        if tier in pairs:
            alpha, beta, one_way = measured[tier]
            base[tier] = Link(tier, alpha, beta, gamma)
            base[ONE_WAY[tier]] = Link(ONE_WAY[tier], alpha, one_way, gamma)
            sources[tier] = sources[ONE_WAY[tier]] = "calibrated"
        else:  # not in this job: its defaults, with this host's γ
            base[tier] = Link(tier, DEFAULT_LINKS[tier].alpha, DEFAULT_LINKS[tier].beta, gamma)
    for name, used in (("direct", direct), (tuner.CMA, cma), (tuner.CMA_HUGE, cma)):
        if used:
            base[name] = Link(name, *measured[name], gamma)
            sources[name] = "calibrated"
        else:
            base[name] = replace(DEFAULT_LINKS[name], gamma=gamma)
    alpha, beta, ring_beta, pairs_alpha, busy_gamma = measured[tuner.BUSY]
    base[tuner.BUSY] = Link(tuner.BUSY, alpha, beta, busy_gamma)
    base[tuner.BUSY_RING] = Link(tuner.BUSY_RING, alpha, ring_beta, busy_gamma)
    base[tuner.BUSY_PAIRS] = Link(tuner.BUSY_PAIRS, pairs_alpha, beta, busy_gamma)
    cache, beta, gamma = measured[tuner.MEMORY]
    base[tuner.MEMORY] = Link(tuner.MEMORY, 0.0, beta, gamma, cache)
    for name in (tuner.BUSY, tuner.BUSY_RING, tuner.BUSY_PAIRS, tuner.MEMORY):
        sources[name] = "calibrated"
    one_shot, messages = measured["rounds"]
    return direct and all(d > m for d, m in zip(one_shot, messages))


def default_table_with_file(cfg: Any) -> LinkTable:
    table = tuner.default_table()
    return apply_overrides(table, load_tuning_file(cfg.tuning_file)) if cfg.tuning_file else table


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
    hosts_own = [t for t in (cached or {})
                 if t not in (tuner.BUSY, tuner.BUSY_RING, tuner.BUSY_PAIRS, tuner.MEMORY)]
    gamma = cached[hosts_own[0]].gamma if cached and hosts_own else None
    for i, name in enumerate(LINKS):
        link = (cached or {}).get(name) or DEFAULT_LINKS.get(name)
        if link is not None and gamma is not None and name not in cached and name != tuner.MEMORY:
            link = Link(name, link.alpha, link.beta, gamma)
        if link is not None:
            verdict[_BASE + _K * i: _BASE + _K * (i + 1)] = [getattr(link, f) for f in FIELDS]
            verdict[_SRC + i] = _SOURCE_CODES["cached" if cached and name in cached else "default"]
        for j, f in enumerate(FIELDS):
            if f in overrides.get(name, {}):
                verdict[_FILE + _K * i + j] = overrides[name][f]
    if cached is not None and not probe:
        _log.info("link constants from the cache %s", path)


# -- what a measurement may change ------------------------------------------------------------------

def bound_direct(world: Group, table: LinkTable, slower: bool, from_file: bool) -> LinkTable:
    """The table with the one-shot path's measured (or cached) α priced below every other
    all_reduce at 8 bytes (DIRECT_BOUND of the cheapest: by messages, or single copy), unless
    the probe found the one shot slower than recursive doubling in every one of its
    DIRECT_ROUNDS (`slower`) or the tuning file sets that α (`from_file`); a default α is left
    as it is.

    The one shot exists to beat the rest at small sizes: one flag round where the messages
    take a round per step and single copy two flag rounds. A probe that says otherwise has
    usually met a preempted rank, and a cached price above the messages' made every later job
    on the host send small all_reduces by recursive doubling: 8 B in 29.6 us instead of 4.3,
    after one probe in three priced the one shot at 97 us instead of 7 (2 ranks, a quiet
    machine, issue 35). Only evidence that holds, measured against the messages under the
    same conditions, changes that choice."""
    link = table.links.get("direct")
    measured = table.sources.get("direct", "").removeprefix("file+") in ("calibrated", "cached")
    if world.direct is None or link is None or slower or from_file or not measured:
        return table
    bound = DIRECT_BOUND * tuner.Model.of(world, table).cheapest_besides("all_reduce", 8, "direct")
    if link.alpha <= bound:
        return table
    _log.info("the one-shot path's α %.3g us priced at %.3g us: below every other all_reduce at 8 B, as "
              "it was not slower than the messages in every round of its probe", link.alpha * 1e6,
              bound * 1e6)
    return replace(table, links={**table.links, "direct": replace(link, alpha=bound)})


def check_cached(world: Group, links: Mapping[str, Link], sources: Mapping[str, str],
                 overrides: Mapping[str, Mapping[str, float]], pairs: Mapping[str, tuple[int, int]]) -> str:
    """Why the cached constants do not hold now ('' where they do): a short probe of the
    one-shot path's α (where the world has it), the busy α and each tier's α on its probe pair
    (`pairs`), the constants that settle the small calls, CHECK_* of the probe's calls and rounds
    (a few hundred µs at 2 ranks; a tier's α, 14 exchanges: 2 ms over 1 Gbit/s), and of the busy
    ring's β where each rank has a core, which settles the large calls (nine 256 KiB rounds:
    about 2 ms at 2 ranks here, 20 ms over 1 Gbit/s). A tier's α is checked since an entry of a
    2 x 4 test bed had TCP's at 21 ms, where fresh probes measure 0.14 (its busy α matched):
    every flat algorithm across the hosts was priced at its rounds, Bruck's all_to_all taken
    over pairwise, 1.5x slower. An entry this VM's n=2 jobs read
    for a day had shared memory at 2.07 GB/s, the busy ring at 2.19 and the one shot at 6.9,
    where fresh probes measure 10-11, 11.8-12.9 and 21-27: a slow spell of the host the α check
    could not see, pricing every large message 5x too dear (a 16 MiB reduce at 10.7 ms against
    the 0.9 it took). The entry is measured again where any of them now comes out more than
    CHECK_TOLERANCE times faster than cached: a measurement can only be slowed down by what
    else runs, so a cached value that much above a fresh one was taken at a bad moment. Slower
    now is no such evidence on one host (it may be busy this instant) and keeps the entry; across
    hosts a busy ring that much slower than cached is measured again too: the path between
    the hosts is not what it was (another or a degraded link; the emulated hosts of
    scripts/netns_cluster.py keep their names whatever their links, and a 2 x 2 entry of one bed
    priced a 1 Gbit/s one's TCP at 2.27 GB/s), and its constants are the ones this job meets.
    Every rank judges the same numbers (the maximum over ranks)."""
    quick = np.zeros(3 + len(TIERS))
    if world.direct is not None:
        run = algorithms_for("all_reduce")["direct"].run
        data = np.ones(2, dtype=np.float32)
        quick[0] = _typical(world, lambda: run(world._internal_call("calibration check"), data, ReduceOp.MAX),
                            warm=CHECK_WARM, series=CHECK_SERIES, calls=CHECK_CALLS)
    rounds = _Rounds(world._internal_call("calibration check"), 0)
    for d in rounds.dists[:2]:  # everyone is here
        rounds.small_shift(d)
    quick[1] = rounds.alpha(rounds.small_shift, CHECK_BATCHES)
    if world.size > 1 and not world.engine.oversubscribed:
        # the ring's β: the fastest of a few rounds, once the rings' pages are touched. Not where
        # ranks outnumber cores: the probe's busy β is then a mean over preempted rounds (4 ranks
        # on 2 cores: 0.45-0.5 GB/s over loopback TCP, 1.9-2.3 through shared memory), which
        # the fastest of three rounds beat by 3-12x in every job, measuring each one again
        big_out, big_in = np.ones(CHECK_BETA_BYTES, np.uint8), np.ones(CHECK_BETA_BYTES, np.uint8)
        times = []
        for _ in range(CHECK_BETA_WARM + CHECK_BETA_ROUNDS):
            t0 = time.perf_counter()
            rounds.shift(big_out, big_in, 1)
            times.append(time.perf_counter() - t0)
        best = min(times[CHECK_BETA_WARM:])
        quick[2] = max((best - quick[1]) / CHECK_BETA_BYTES, best / CHECK_BETA_BYTES / 2)
    for i, tier in enumerate(TIERS):  # one pair at a time: the others go on to the reduction below
        pair = pairs.get(tier)
        if pair is not None and world.rank in pair:
            peer = pair[1] if world.rank == pair[0] else pair[0]
            quick[3 + i] = pair_alpha(rounds.call, peer, rounds.step + 1000 * (i + 1), CHECK_BATCHES)
    recursive_doubling_all_reduce(world._internal_call("calibration check"), quick, ReduceOp.MAX)
    across = world.layout is not None
    seen, reasons = [], []
    checks = (("direct", "alpha"), (tuner.BUSY, "alpha"), (tuner.BUSY_RING, "beta"),
              *((tier, "alpha") for tier in TIERS))
    for now, (name, field) in zip(quick, checks):
        cached = links.get(name)
        if now > 0 and cached is not None and sources.get(name) == "cached" and field not in overrides.get(
                name, {}):
            then = getattr(cached, field)
            shown = (f"α {now * 1e6:.3g} us now against {then * 1e6:.3g} us" if field == "alpha" else
                     f"β {1e-9 / now:.3g} GB/s now against {1e-9 / then:.3g} GB/s")
            seen.append(f"{name} {shown} cached")
            if now * CHECK_TOLERANCE < then or (across and field == "beta" and now > then * CHECK_TOLERANCE):
                reasons.append(seen[-1])
    if world.rank == 0:
        _log.info("check of the cache: %s", "; ".join(seen))
    return "; ".join(reasons)


def _cpu_seconds() -> tuple[float, float]:
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
    """On the busiest of the job's machines (ranks that share a kernel: topo.machine_id), the
    cores' worth of CPU that processes outside the job used since `before` (_cpu_seconds at
    perf_counter `t0`) beyond the cores the job left idle and /proc/stat's resolution (a tick
    per CPU at each end): above LOAD_SLACK the probe measured the neighbours as much as the
    links. Collective; 0 where /proc/stat cannot say."""
    machine, own = _cpu_seconds()
    rows = np.zeros((world.size, 4))
    rows[world.rank] = (machine - before[0], own - before[1], time.perf_counter() - t0, os.cpu_count() or 1)
    recursive_doubling_all_reduce(world._internal_call("calibration probe"), rows.reshape(-1), ReduceOp.SUM)
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


# -- the probe ----------------------------------------------------------------------------------------

def _probe(world: Group, pairs: dict[str, tuple[int, int]], direct: bool, cma: bool,
           across_hosts: bool) -> dict[str, Any]:
    """Measure the direct path and single copy on everyone, every tier on its pair, every rank
    at once (the busy link), and γ and memory on rank 0; the maximum over ranks of each, the
    same everywhere. The one shot's α is the median of DIRECT_ROUNDS rounds of
    small_all_reduces spread over the probe (at its start, after single copy, after the busy
    link), each against recursive doubling: a rank preempted for a whole round (every series
    of it) moves neither the median nor the evidence of bound_direct.

    Ranks with nothing (more) to measure wait politely, sleeping between polls, rather than
    spinning: on a host with more ranks than cores a spinning bystander would be measured
    along with the link."""
    me = world.rank
    # (α, β, β one way) per tier, busy (α, β, β in a ring, α in pairs, γ), direct (α, β), γ,
    # memory (cache, β, γ), cma (α, β, β out of huge pages), then the rounds: the one shot's
    # 8 B call and recursive doubling's, per round
    measured = np.zeros(3 * len(TIERS) + 14 + 2 * DIRECT_ROUNDS, dtype=np.float64)
    busy = slice(3 * len(TIERS), 3 * len(TIERS) + 5)
    own, gamma, memory = slice(busy.stop, busy.stop + 2), busy.stop + 2, slice(busy.stop + 3, busy.stop + 6)
    reads = slice(memory.stop, memory.stop + 3)
    rounds = measured[reads.stop:].reshape(2, DIRECT_ROUNDS)
    if direct:  # first: they need every rank anyway
        rounds[0, 0], rounds[1, 0], measured[own.stop - 1] = measure_direct(world)
    if cma:
        measured[reads] = measure_cma(world)
    if direct:
        rounds[:, 1] = small_all_reduces(world)
    call = world._internal_call("calibration probe")
    for i, tier in enumerate(TIERS):
        pair = pairs.get(tier)
        if pair is not None and me in pair:
            peer = pair[1] if me == pair[0] else pair[0]
            warm = 1 + world.runtime.config.shm_ring_bytes // BETA_BYTES if tier == "shm" else 2
            measured[3 * i: 3 * i + 3] = measure_pair(call, peer, i * 1000, warm)
    _sync_politely(world, call)  # the busy pairs start together, after the lone pairs are done
    measured[busy.start: busy.start + 4] = measure_busy(call, len(TIERS) * 1000, across_hosts)
    measured[busy.stop - 1] = measure_gamma()
    if direct:
        for r in range(2, DIRECT_ROUNDS):
            rounds[:, r] = small_all_reduces(world)
        measured[own.start] = statistics.median(rounds[0])
    if me == 0:
        measured[gamma] = measure_gamma()
        measured[memory] = measure_memory()
        parts = np.zeros((world.size, len(measured)))
        parts[0] = measured
        _wait_politely(world, call, [call.irecv(r, parts[r], _RESULTS) for r in range(1, world.size)])
        measured[:] = parts.max(axis=0)
        _wait_politely(world, call, [call.isend(r, measured, _RESULTS + 1) for r in range(1, world.size)])
    else:
        _wait_politely(world, call, [call.isend(0, measured, _RESULTS)])
        _wait_politely(world, call, [call.irecv(0, measured, _RESULTS + 1)])
    out: dict[str, Any] = {t: tuple(float(v) for v in measured[3 * i: 3 * i + 3])
                           for i, t in enumerate(TIERS)}
    out["direct"] = tuple(float(v) for v in measured[own])
    out["rounds"] = [[float(v) for v in row] for row in rounds]
    out[tuner.BUSY] = tuple(float(v) for v in measured[busy])
    out["gamma"] = float(measured[gamma])
    out[tuner.MEMORY] = tuple(float(v) for v in measured[memory])
    alpha, beta, huge_beta = (float(v) for v in measured[reads])
    out[tuner.CMA], out[tuner.CMA_HUGE] = (alpha, beta), (alpha, huge_beta)
    return out


@contextlib.contextmanager
def spread(world: Any, hosts: list[int]) -> Iterator[None]:
    """Within: where a host's ranks outnumber its cores, each runs on one core, the host's
    ranks dealt round the cores in rank order; as before after.

    The probe otherwise measured whichever placement the scheduler had picked, which differs
    from launch to launch: 4 ranks on 2 cores, six launches each, the lone pair's shm α came
    out at 9.5-35 us (10 on two cores, 34-39 sharing one), single copy's α at 30-68 and the
    busy α at 36-73; dealt round the cores, 10.1-10.9, 33-41 and 43-48 us. Every algorithm
    then priced from one launch to the next alike, and the shm-n4 sweep's choice came within
    10% of the best at 90-92 of 97 sizes (82-84 without; prediction within ±30% 25-28 of 48,
    22-24 without)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        yield
        return
    mine = [r for r in range(world.size) if hosts[r] == hosts[world.rank]]
    if len(mine) <= len(cores):
        yield
        return
    os.sched_setaffinity(0, {cores[mine.index(world.rank) % len(cores)]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)


def _sync_politely(world: Group, call: CollectiveCall) -> None:
    """Everyone arrives at rank 0, which then releases everyone; waiting without spinning."""
    token = np.zeros(1, dtype=np.uint8)
    others = range(1, world.size)
    if world.rank == 0:
        _wait_politely(world, call, [call.irecv(r, np.zeros(1, np.uint8), _SYNC) for r in others])
        _wait_politely(world, call, [call.isend(r, token, _SYNC + 1) for r in others])
    else:
        _wait_politely(world, call, [call.isend(0, token, _SYNC)])
        _wait_politely(world, call, [call.irecv(0, token, _SYNC + 1)])


_SYNC = 40_000
_RESULTS = 50_000  # message steps of the probe's results (the pairs use steps below)
_POLITE_SLEEP_S = 0.0005


def _wait_politely(world: Group, call: CollectiveCall, reqs: list) -> None:
    """call.wait without the busy phase: poll, then sleep on the sockets (which wake at once
    for TCP data or a peer that went away; shared-memory data is seen at the next poll)."""
    engine = world.engine
    while not all(r.done for r in reqs):
        with engine.lock:
            engine.progress()
        if all(r.done for r in reqs):
            break
        engine.check_group(world.ctx, call.seq, world.ranks)  # aborted, or a member crashed
        if time.perf_counter() > call.deadline:
            break  # call.wait raises the TimeoutError naming whom it waited for
        engine.sleep_on_sockets(_POLITE_SLEEP_S)
    call.wait(*reqs)
