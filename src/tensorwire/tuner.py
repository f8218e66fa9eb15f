"""Which algorithm runs a call: for now a size threshold, with NCCL-style forcing.

TENSORWIRE_ALGO=allreduce:ring (or recursive_doubling) forces a choice; '^ring' excludes one.
The calibrated cost model replaces the threshold later without touching callers.
"""

from __future__ import annotations

import functools

import numpy as np

from . import log
from .algorithms.base import P2P
from .algorithms.recursive_doubling import recursive_doubling_all_reduce
from .algorithms.ring import ring_all_reduce
from .config import Config
from .ops import ReduceOp

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


def choose_all_reduce(cfg: Config, nbytes: int, size: int) -> str:
    forced, excluded = parse_algo(cfg.algo, "allreduce")
    candidates = [a for a in ALL_REDUCE if a not in excluded and (not forced or a in forced)]
    if not candidates:
        raise ValueError(f"TENSORWIRE_ALGO={cfg.algo!r} leaves no all_reduce algorithm "
                         f"(known: {', '.join(ALL_REDUCE)})")
    preferred = "recursive_doubling" if nbytes < cfg.ring_threshold_bytes else "ring"
    choice = preferred if preferred in candidates else candidates[0]
    _log.debug("all_reduce %d bytes over %d ranks: %s", nbytes, size, choice)
    return choice


def all_reduce(cfg: Config, p2p: P2P, data: np.ndarray, op: ReduceOp) -> None:
    ALL_REDUCE[choose_all_reduce(cfg, data.nbytes, p2p.size)](p2p, data, op)
