"""Which algorithm runs a call: the cheapest eligible one under the α-β-γ cost model.

Every algorithm in the registry declares its cost formula; the tuner prices them for the
group's link tier (shared memory within a host, TCP otherwise) and the call's size, and runs
the cheapest. TENSORWIRE_ALGO forces or excludes names, NCCL-style: `allreduce:ring`,
`broadcast:binomial,allreduce:^direct`, `^ring` (every collective). With
TENSORWIRE_DEBUG=INFO TENSORWIRE_DEBUG_SUBSYS=TUNING each new choice is logged with its table.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from . import log
from .algorithms.registry import Algorithm, Link, algorithms_for
from .config import Config

if TYPE_CHECKING:
    from .group import Group

_log = log.get("TUNING")

# Link constants until calibration measures them: round figures for this class of machine
# (shared-memory flag round trip ~1 µs from Python, memcpy ~9 GB/s, a += b ~7.5 GB/s; TCP
# loopback round trip ~25 µs, ~3 GB/s).
DEFAULT_LINKS = {
    "shm": Link("shm", alpha=2e-6, beta=1 / 9e9, gamma=1 / 7.5e9),
    "tcp": Link("tcp", alpha=30e-6, beta=1 / 3e9, gamma=1 / 7.5e9),
}


def _norm(name: str) -> str:
    return name.replace("_", "").lower()


@functools.lru_cache(maxsize=256)
def parse_algo(spec: str, collective: str) -> tuple[frozenset[str], frozenset[str]]:
    """(forced, excluded) algorithm names for one collective from an NCCL-style spec."""
    forced: set[str] = set()
    excluded: set[str] = set()
    for part in filter(None, (p.strip() for p in spec.replace(";", ",").split(","))):
        coll, _, names = part.rpartition(":")
        if coll and _norm(coll) != _norm(collective):
            continue
        for name in names.replace("+", "|").split("|"):
            name = name.strip().lower()
            if name.startswith("^"):
                excluded.add(_norm(name[1:]))
            elif name:
                forced.add(_norm(name))
    return frozenset(forced), frozenset(excluded)


def allowed(cfg: Config, collective: str, name: str) -> bool:
    forced, excluded = parse_algo(cfg.algo, collective)
    key = _norm(name)
    return key not in excluded and (not forced or key in forced)


def link_of(group: Group) -> Link:
    """The tier a group's collectives run over: its slowest link."""
    return DEFAULT_LINKS["shm" if group.all_local else "tcp"]


def candidates(group: Group, collective: str, nbytes: int, direct_ok: bool = True) -> list[Algorithm]:
    direct = group.direct
    out = []
    for alg in algorithms_for(collective).values():
        if alg.needs_direct and (not direct_ok or direct is None or nbytes > direct.slot_bytes):
            continue
        if alg.eligible(group.size, nbytes) and allowed(group.runtime.config, collective, alg.name):
            out.append(alg)
    return out


def select(group: Group, collective: str, nbytes: int, direct_ok: bool = True) -> Algorithm:
    """The cheapest eligible algorithm (cached per group, collective and size)."""
    key = (collective, nbytes, direct_ok)
    choice = group.choices.get(key)
    if choice is not None:
        return choice
    options = candidates(group, collective, nbytes, direct_ok)
    if not options:
        known = ", ".join(algorithms_for(collective))
        raise ValueError(f"TENSORWIRE_ALGO={group.runtime.config.algo!r} leaves no {collective} algorithm "
                         f"for {nbytes} bytes on {group.size} ranks (known: {known})")
    link = link_of(group)
    priced = sorted((alg.cost(group.size, nbytes, link), alg.name, alg) for alg in options)
    choice = priced[0][2]
    if _log.isEnabledFor(20):
        table = ", ".join(f"{name} {t * 1e6:.1f} us" for t, name, _ in priced)
        _log.info("%s %d B on %d ranks (%s link): %s -> %s", collective, nbytes, group.size, link.name,
                  table, choice.name)
    if len(group.choices) < 4096:
        group.choices[key] = choice
    return choice


def run(group: Group, call: Any, collective: str, nbytes: int, *args: Any, direct_ok: bool = True) -> None:
    select(group, collective, nbytes, direct_ok).run(call, *args)
