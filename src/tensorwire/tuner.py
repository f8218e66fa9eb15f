"""Which algorithm runs a call: for now a size threshold, with NCCL-style forcing.

TENSORWIRE_ALGO=allreduce:ring (or recursive_doubling, direct) forces a choice; '^ring' excludes
one; 'direct' also names the one-shot shared-memory path of every collective ('^direct' turns it off).
The calibrated cost model replaces the threshold later without touching callers.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from . import log
from .algorithms.base import P2P
from .algorithms.recursive_doubling import recursive_doubling_all_reduce
from .algorithms.ring import ring_all_reduce
from .algorithms.shm_direct import direct_all_reduce
from .config import Config
from .ops import ReduceOp

if TYPE_CHECKING:
    from .group import Group

_log = log.get("TUNING")
ALL_REDUCE = {"ring": ring_all_reduce, "recursive_doubling": recursive_doubling_all_reduce}


@functools.lru_cache(maxsize=64)
def parse_algo(spec: str, collective: str) -> tuple[set[str], set[str]]:
    """(forced, excluded) algorithm names for one collective from an NCCL-style spec."""
    forced: set[str] = set()
    excluded: set[str] = set()
    for part in filter(None, (p.strip() for p in spec.split(";" if ";" in spec else ","))):
        coll, _, names = part.rpartition(":")
        if coll and coll.replace("_", "").lower() != collective.replace("_", "").lower():
            continue
        for name in names.split("|" if "|" in names else "+"):
            name = name.strip().lower()
            if name.startswith("^"):
                excluded.add(name[1:])
            elif name:
                forced.add(name)
    return forced, excluded


def _allowed(cfg: Config, collective: str, algo: str) -> bool:
    forced, excluded = parse_algo(cfg.algo, collective)
    return algo not in excluded and (not forced or algo in forced)


def use_direct(group: Group, collective: str, nbytes: int) -> bool:
    """The one-shot shared-memory path: single-host groups, messages that fit a slot."""
    direct = group.direct
    return (direct is not None and nbytes <= direct.slot_bytes
            and _allowed(group.runtime.config, collective, "direct"))


def choose_all_reduce(cfg: Config, nbytes: int, size: int, direct_fits: bool = False) -> str:
    names = (["direct"] if direct_fits else []) + list(ALL_REDUCE)
    candidates = [a for a in names if _allowed(cfg, "all_reduce", a)]
    if not candidates:
        raise ValueError(f"TENSORWIRE_ALGO={cfg.algo!r} leaves no all_reduce algorithm "
                         f"(known: direct, {', '.join(ALL_REDUCE)})")
    preferred = "recursive_doubling" if nbytes < cfg.ring_threshold_bytes else "ring"
    choice = candidates[0] if candidates[0] == "direct" or preferred not in candidates else preferred
    _log.debug("all_reduce %d bytes over %d ranks: %s", nbytes, size, choice)
    return choice


def all_reduce(group: Group, p2p: P2P, data: np.ndarray, op: ReduceOp) -> None:
    direct = group.direct
    fits = direct is not None and data.nbytes <= direct.slot_bytes
    choice = choose_all_reduce(group.runtime.config, data.nbytes, p2p.size, fits)
    if choice == "direct":
        direct_all_reduce(direct, p2p, data, op)
    else:
        ALL_REDUCE[choice](p2p, data, op)
