"""The job tests/test_multihost.py runs across emulated hosts for the compressed all_reduce
(`compress="bf16"` / `"fp16"`), and the error bound of docs/multihost.md#compressed-all_reduce
that it and tests/test_compress.py check element by element. A script of its own, importing
neither pytest nor hypothesis: every rank of the job loads it.

    python scripts/netns_cluster.py --hosts 2 -n 2 -- tests/compress_job.py
"""

from __future__ import annotations

import zlib

import numpy as np

import tensorwire as tw
from tensorwire.algorithms.hierarchical import pieces
from tensorwire.ops.compress import CODECS, Codec
from tensorwire.tuning import tuner


def rounding(codec: Codec, dtype: np.dtype) -> float:
    """What one crossing of a value may lose, relative to it: the codec's unit roundoff, and
    for float64 into bfloat16 the float32 step before it (two roundings)."""
    return codec.unit + (2.0 ** -24 if codec.name == "bf16" and dtype == np.float64 else 0.0)


def floor(codec: Codec, peak: float, dtype: np.dtype) -> float:
    """The absolute error a value near zero may take: half the spacing of the codec's
    subnormals, at the piece's scale (float16: the largest value lies in [2**14, 2**15);
    bfloat16: float32 unscaled, float64 scaled up to [2**126, 2**127) where the largest is
    below 2**-121 and down where it is beyond 2**127)."""
    if codec.name == "fp16":
        return 2.0 ** -39 * peak
    if dtype == np.float32 or peak >= 2.0 ** -121:
        return 2.0 ** -134 + 2.0 ** -260 * peak
    return 2.0 ** -260 * peak


def bound(codec: Codec, dtype: np.dtype, partials: np.ndarray, magnitude: np.ndarray,
          ranks: int) -> np.ndarray:
    """docs/multihost.md's bound per element for host partial sums `partials` (hosts x count):
    the partials that cross rounded once each, their sum rounded once more; plus what any sum
    of `ranks` inputs in their precision may lose (`magnitude`: the sum of their |values|),
    and the floor at the largest magnitude."""
    sums = np.abs(partials.sum(axis=0))
    spread = np.abs(partials).sum(axis=0)
    u = rounding(codec, dtype)
    peak = max(float(spread.max()), float(sums.max())) if partials.size else 0.0
    return (u * (1 + u) * (sums + spread) + ranks * float(np.finfo(dtype).eps) * magnitude
            + 3 * floor(codec, peak, dtype))


def _check(group: tw.Group, count: int, dtypes: tuple[type, ...], ops: tuple[tw.ReduceOp, ...],
           codecs: tuple[str, ...] = tuple(CODECS), tiles: int = 1) -> int:
    """Every (codec, dtype, op) of `count` random elements repeated `tiles` times (a size that
    runs in pieces, checked at the cost of one tile) on `group`: within the bound of every
    element, the same bits on every rank; the number of cases."""
    r, n = group.rank, group.size
    rng = np.random.default_rng(count + n)  # every member draws the same data
    hosts = tw.topology().layout(group.ranks).hosts
    # magnitudes over six decades, and a column where the hosts' partials cancel
    data = rng.standard_normal((n, count), dtype=np.float32) * 10.0 ** rng.integers(-3, 3, size=(n, 1))
    data[:, 0] = [1e4 if g in hosts[0] else -1e4 for g in range(n)]
    cases = 0
    for dtype in dtypes:
        inputs = data.astype(dtype)
        partials = np.stack([inputs[list(on)].sum(axis=0, dtype=np.float64) for on in hosts])
        exact = partials.sum(axis=0)
        magnitude = np.abs(inputs).sum(axis=0, dtype=np.float64)
        for name in codecs:
            codec = CODECS[name]
            limit = bound(codec, np.dtype(dtype), partials, magnitude, n)
            for op in ops:
                x = np.tile(inputs[r], tiles)
                group.all_reduce(x, op, compress=name)
                scale = n if op is tw.ReduceOp.AVG else 1
                error = np.abs(x.reshape(tiles, count) * scale - exact).max(axis=0)
                worst = int(np.argmax(error - limit))
                what = (group.name, name, dtype, op, count, worst)
                assert error[worst] <= limit[worst], (*what, error[worst], limit[worst])
                digests = np.zeros(n, np.int64)
                digests[r] = zlib.crc32(x.tobytes())
                group.all_reduce(digests)
                assert len(set(digests.tolist())) == 1, (*what, digests)
                cases += 1
    return cases


def bed_job() -> None:
    """On 2 hosts x 2 ranks: the world, every (codec, dtype, op) at a size of one piece with
    uneven blocks, and a bf16 float32 SUM in pieces (pipelined); the same small cases on a
    group of one rank per host and one of hosts holding 2 and 1 ranks."""
    world = tw.init()
    small = (1001, (np.float32, np.float64), (tw.ReduceOp.SUM, tw.ReduceOp.AVG))
    tiles = 8400  # 16 MiB of bfloat16 crosses: two pieces
    assert len(pieces(tiles * 1001, 2, 2, tuner.link_of(world))) == 2
    cases = _check(world, *small) + _check(world, 1001, (np.float32,), (tw.ReduceOp.SUM,), ("bf16",), tiles)
    for ranks in ([0, 2], [0, 1, 2]):
        group = tw.new_group(ranks)
        if group.rank >= 0:
            cases += _check(group, *small)
    print(f"COMPRESS OK rank {world.rank} cases {cases}", flush=True)
    tw.barrier()
    tw.destroy()


if __name__ == "__main__":
    bed_job()
