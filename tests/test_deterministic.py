"""Deterministic reductions: bitwise the same float32 results whatever algorithm, transport and
segment size ran, and equal to a numpy fold in rank order, ((x0 + x1) + x2) + ...

The inputs span twelve orders of magnitude with mixed signs, so any other order of the sums
changes low bits (the ring is shown to, as a check that the data can tell). Each world returns
digests of its results; worlds of the same size must agree with each other and with the fold.
Functions named `rank_*` run inside the ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os

import numpy as np
import pytest

import tensorwire as tw
from cluster import Cluster, free_port
from tensorwire.algorithms.registry import algorithms_for
from tensorwire.errors import InvalidArgumentError
from tensorwire.tuning import policy

pytestmark = pytest.mark.timeout(120)

# float32 element counts: tiny, fewer than the ranks, around the 64 KiB shared-memory slot,
# several TCP chunks / ring segments, and a few MiB
SIZES = [1, 2, 3, 7, 1000, 16383, 16384, 16385, 100_003, 1_000_003]


@functools.lru_cache(maxsize=64)
def _data(rank: int, count: int) -> np.ndarray:
    rng = np.random.default_rng([7, rank, count])
    return (rng.standard_normal(count) * 10.0 ** rng.uniform(-6, 6, count)).astype(np.float32)


def data(rank: int, count: int) -> np.ndarray:
    """Rank `rank`'s input: magnitudes from 1e-6 to 1e6, both signs (a fresh, writable copy)."""
    return _data(rank, count).copy()


def complex_data(rank: int, count: int) -> np.ndarray:
    """Complex inputs near the unit circle (their products stay in range)."""
    rng = np.random.default_rng([11, rank, count])
    angles = rng.uniform(0, 2 * np.pi, count)
    return (rng.uniform(0.5, 1.5, count) * np.exp(1j * angles)).astype(np.complex128)


def complex_fold(n: int, count: int) -> np.ndarray:
    """Their product in rank order by Python's complex multiply, element by element (a formula
    with no fused steps)."""
    acc = [complex(v) for v in complex_data(0, count)]
    for r in range(1, n):
        acc = [a * complex(b) for a, b in zip(acc, complex_data(r, count))]
    return np.array(acc, np.complex128)


def fold(n: int, count: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """The reference: every element reduced in rank order, in float32."""
    acc = data(0, count)[lo:hi].copy()
    for r in range(1, n):
        acc += _data(r, count)[lo:hi]
    return acc


def _digest(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()[:16]


def _recording(collectives: tuple[str, ...]):
    """Wrap the registry so every algorithm that runs is recorded; returns (used, restore)."""
    used: list[tuple[str, str]] = []
    saved = {c: dict(algorithms_for(c)) for c in collectives}

    def wrap(alg):
        def run(*args):
            used.append((alg.collective, alg.name))
            return alg.run(*args)
        return dataclasses.replace(alg, run=run)

    for c in collectives:
        algorithms_for(c).update({k: wrap(a) for k, a in saved[c].items()})
    tw.world().choices.clear()

    def restore() -> None:
        for c in collectives:
            algorithms_for(c).update(saved[c])
        tw.world().choices.clear()

    return used, restore


def rank_reductions(sizes: list[int]) -> dict:
    """all_reduce, reduce, reduce_scatter_tensor and reduce_scatterv of the adversarial data;
    per case: bitwise equal to the fold?, the result's digest, and the algorithms that ran."""
    g = tw.world()
    n, me = g.size, g.rank
    used, restore = _recording(("all_reduce", "reduce", "reduce_scatter"))
    out: dict = {"equal": {}, "digest": {}, "deterministic": tw.config().deterministic}
    try:
        for count in sizes:
            x = data(me, count)
            tw.all_reduce(x)
            want = fold(n, count)
            out["equal"][f"all_reduce {count}"] = bool(np.array_equal(x.view(np.uint32),
                                                                       want.view(np.uint32)))
            out["digest"][f"all_reduce {count}"] = _digest(x)
        for count in (1, 7, 1000):  # numpy's complex multiply rounds by loop (length, alignment)
            z = complex_data(me, count)
            tw.all_reduce(z, tw.ReduceOp.PRODUCT)
            out["equal"][f"all_reduce complex product {count}"] = bool(
                np.array_equal(z.view(np.uint64), complex_fold(n, count).view(np.uint64)))
            out["digest"][f"all_reduce complex product {count}"] = _digest(z)
        count = 100_003
        x = data(me, count)
        tw.all_reduce(x, tw.ReduceOp.AVG)
        want = fold(n, count) / np.float32(n)
        out["equal"]["all_reduce avg"] = bool(np.array_equal(x, want))
        for count in (1000, 100_003):
            x = data(me, count)
            res = np.empty_like(x)
            tw.reduce(x, 1 % n, out=res)
            if me == 1 % n:
                out["equal"][f"reduce {count}"] = bool(np.array_equal(res, fold(n, count)))
            block = count // n
            x = data(me, block * n)
            res = np.empty(block, np.float32)
            tw.reduce_scatter_tensor(res, x)
            out["equal"][f"reduce_scatter {count}"] = bool(
                np.array_equal(res, fold(n, block * n, me * block, (me + 1) * block)))
            counts = [(count // n) + 7 * r for r in range(n)]
            lo = sum(counts[:me])
            x = data(me, sum(counts))
            res = np.empty(counts[me], np.float32)
            tw.reduce_scatterv(res, x, counts)
            out["equal"][f"reduce_scatterv {count}"] = bool(
                np.array_equal(res, fold(n, sum(counts), lo, lo + counts[me])))
    finally:
        restore()
    out["used"] = sorted(set(used))
    return out


def _check_world(results: list[dict], n: int, deterministic: bool = True) -> dict[str, str]:
    for r, res in enumerate(results):
        assert res["deterministic"] is deterministic
        bad = [case for case, ok in res["equal"].items() if not ok]
        assert not bad, f"rank {r}: differs from the rank-ordered fold: {bad}"
        for coll, name in res["used"]:
            assert policy.is_deterministic(algorithms_for(coll)[name]), f"{coll} ran {name}"
    digests = results[0]["digest"]
    assert all(res["digest"] == digests for res in results), "ranks disagree"
    return digests


WORLDS = {  # name: (ranks, environment)
    "shm": (3, {"TENSORWIRE_TRANSPORT": "auto"}),
    "shm-no-direct-small-ring": (3, {"TENSORWIRE_TRANSPORT": "auto", "TENSORWIRE_SHM_DIRECT": "0",
                                     "TENSORWIRE_SHM_RING": "64K"}),
    "tcp-small-chunks": (3, {"TENSORWIRE_TRANSPORT": "tcp", "TENSORWIRE_TCP_CHUNK": "16K"}),
    "shm-forced-rank-ordered": (3, {"TENSORWIRE_TRANSPORT": "auto",
                                    "TENSORWIRE_ALGO": "allreduce:rank_ordered"}),
    "shm-4-big-direct": (4, {"TENSORWIRE_TRANSPORT": "auto", "TENSORWIRE_SHM_DIRECT": "1M"}),
    "shm-single-copy": (3, {"TENSORWIRE_TRANSPORT": "auto",
                            "TENSORWIRE_ALGO": "allreduce:single_copy,rank_ordered"}),
    "tcp-4": (4, {"TENSORWIRE_TRANSPORT": "tcp"}),
}
_seen: dict[int, dict[str, str]] = {}  # ranks -> digests of the first world of that size


@pytest.mark.parametrize("world", list(WORLDS))
def test_bitwise_identical_across_algorithms_transports_and_segments(world: str, tmp_path) -> None:
    n, env = WORLDS[world]
    cluster = Cluster(n, {**env, "TENSORWIRE_DETERMINISTIC": "1", "TENSORWIRE_CACHE_DIR": str(tmp_path)})
    try:
        results = cluster.run(rank_reductions, SIZES, timeout=100)
    finally:
        cluster.close()
    digests = _check_world(results, n)
    used = {name for _, name in results[0]["used"]}
    if world == "shm":
        assert {"direct", "rank_ordered"} <= used, used  # both paths ran, and agree with the fold
    if world == "shm-single-copy":
        assert "single_copy" in used, used
    if world in ("shm-no-direct-small-ring", "tcp-small-chunks", "tcp-4"):
        assert "direct" not in used
    first = _seen.setdefault(n, digests)
    assert digests == first, f"{world} differs from another world of {n} ranks"


def rank_ring_then_deterministic(port: int) -> dict:
    """The ring (forced) reorders the sums; then the same ranks re-join with
    init(deterministic=True) and get the fold's bits."""
    g = tw.world()
    n, me = g.size, g.rank
    count = 1_000_003
    x = data(me, count)
    tw.all_reduce(x)
    ring_equal = bool(np.array_equal(x, fold(n, count)))
    tw.destroy()
    try:  # forcing the ring contradicts deterministic mode: refused before connecting
        tw.init(rank=me, world_size=n, init_method=f"tcp://127.0.0.1:{port}", deterministic=True)
        refused = ""
    except InvalidArgumentError as exc:
        refused = str(exc)
    os.environ.pop("TENSORWIRE_ALGO")
    tw.init(rank=me, world_size=n, init_method=f"tcp://127.0.0.1:{port}", deterministic=True)
    x = data(me, count)
    tw.all_reduce(x)
    return {"ring_equal": ring_equal, "refused": refused, "deterministic": tw.config().deterministic,
            "equal": bool(np.array_equal(x, fold(n, count)))}


def test_the_ring_differs_and_init_keyword_turns_deterministic_on(tmp_path) -> None:
    cluster = Cluster(3, {"TENSORWIRE_ALGO": "allreduce:ring", "TENSORWIRE_CACHE_DIR": str(tmp_path)})
    try:
        results = cluster.run(rank_ring_then_deterministic, free_port(), timeout=100)
    finally:
        cluster.close()
    for res in results:
        assert not res["ring_equal"], "the ring summed in rank order: the data cannot tell orders apart"
        assert "leaves deterministic mode no all_reduce algorithm" in res["refused"], res["refused"]
        assert res["deterministic"] and res["equal"]
