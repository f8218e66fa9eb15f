"""What this host's memory costs, measured by one process alone: γ (a float32 add), a copy's
β, the cache a process's copies find, and what a byte costs beyond it (the `memory` entry).

Part of the probe at init (probes.py); the arrays are mapped for a measurement and unmapped
after, so the process keeps none of them (see memory.py). The evidence behind the choices:
docs/design/calibration.md#the-hosts-memory.
"""

from __future__ import annotations

import functools
import glob
import math
import mmap
import os
import time
from collections.abc import Callable

import numpy as np

from ..buffers import copy as copy_as_library
from .cost_model import DEFAULT_LINKS, MEMORY

GAMMA_BYTES, GAMMA_ROUNDS = 16 << 20, 5  # numpy add of 16 MiB float32 (out of cache): the best gives γ
MEMORY_ARRAY_MAX = 64 << 20  # the memory probe's arrays: four times the cache's size, at most this
CACHED_ARRAY_MAX = 1 << 20  # ... and those it compares them with: a quarter of a core's reach, at most
KNEE = 1.6  # a copy this much slower per byte than a small one has left the cache (cache_in_reach)


def measure_gamma(nbytes: int = GAMMA_BYTES, rounds: int = GAMMA_ROUNDS) -> float:
    """Seconds per byte of an in-place float32 sum (the reduction kernel's bread and butter)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.full_like(a, 0.5)
    np.add(a, b, out=a)  # first touch
    return max(_best(lambda: np.add(a, b, out=a), rounds) / a.nbytes, 1e-13)


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
    neither near nor the process's (docs/design/cost-model.md#the-cache-in-reach)."""
    arrays = 128 << 10
    first = None
    while 2 * arrays <= limit:
        region = mmap.mmap(-1, 2 * arrays, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            both = np.frombuffer(region, dtype=np.uint8)
            src, dst = both[:arrays], both[arrays:]
            src.fill(1)
            dst.fill(0)  # first touch, untimed
            per_byte = _best(functools.partial(copy_as_library, dst, src), GAMMA_ROUNDS) / arrays
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
    added cost beyond it, as cost_model.spill charges them. A copy and an add of two arrays of
    four times the cache's size each (up to MEMORY_ARRAY_MAX) take longer per byte than on
    arrays that fit one core's reach; spill charges that difference to the share
    1 - cache/footprint of the bytes (here 7/8), so it is divided by that share. The cached
    arrays are timed in batches: copied alone their time swung too much from call to call."""
    llc = last_level_cache() or int(DEFAULT_LINKS[MEMORY].cache)
    reach = cache_in_reach(llc)
    cache = min(llc, reach * len(os.sched_getaffinity(0)))
    size = min(4 * cache, MEMORY_ARRAY_MAX)
    share = 1 - cache / (2 * size)
    if share <= 0.25:  # a cache this large hides most of what the probe would see
        default = DEFAULT_LINKS[MEMORY]
        return float(cache), default.beta, default.gamma
    maps = [mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(2)]
    try:
        copy, add = _copy_and_add(np.frombuffer(maps[0], dtype=np.float32),
                                  np.frombuffer(maps[1], dtype=np.float32))
    finally:
        for m in maps:
            m.close()
    cached = min(reach // 4, CACHED_ARRAY_MAX) // 4  # float32 elements: half of a core's reach
    cached_copy, cached_add = _copy_and_add(np.empty(cached, dtype=np.float32),
                                            np.empty(cached, dtype=np.float32), batch=8)
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
