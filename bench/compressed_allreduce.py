#!/usr/bin/env python
"""The compressed all_reduce against the exact one, in one job across emulated hosts.

    python scripts/netns_cluster.py --hosts 2 -n 4 --rate 1gbit -- bench/compressed_allreduce.py

Every rank sums its own random float32 data (-s, default 64M bytes) with `tw.all_reduce`, exact
and with `compress=` (-c, default bf16), the two alternating call by call (-i rounds after -w
warm-ups), each call timed alone after a barrier; a call's time is the slowest rank's. Then
the error of each against the float64 sum of the same data (one more all_reduce), as the
largest |error| over the largest |sum|, and whether every rank's result is bit for bit the
same. Rank 0 prints one row per variant: mean, p50 and p99 of the call, the error, the ranks'
agreement; then the ratios of the means and of the medians (p50: steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import time
import zlib

import numpy as np

import tensorwire as tw
from tensorwire.config import parse_size


def timed(x: np.ndarray, data: np.ndarray, compress: str | None) -> float:
    np.copyto(x, data)
    tw.barrier()
    t0 = time.perf_counter()
    tw.all_reduce(x, compress=compress)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-s", "--size", default="64M", help="bytes per rank (float32)")
    p.add_argument("-c", "--compress", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("-i", "--iters", type=int, default=10)
    p.add_argument("-w", "--warmup", type=int, default=2)
    args = p.parse_args()
    tw.init()
    rank, n = tw.get_rank(), tw.get_world_size()
    data = np.random.default_rng(rank).standard_normal(parse_size(args.size) // 4).astype(np.float32)
    variants = (None, args.compress)
    x = np.empty_like(data)
    for _ in range(args.warmup):
        for c in variants:
            timed(x, data, c)
    times = np.zeros((len(variants), args.iters))
    for i in range(args.iters):
        for k, c in enumerate(variants):
            times[k, i] = timed(x, data, c)
    tw.all_reduce(times, op=tw.ReduceOp.MAX)
    exact = data.astype(np.float64)
    tw.all_reduce(exact)
    peak = float(np.abs(exact).max())
    rows = []
    for k, c in enumerate(variants):
        np.copyto(x, data)
        tw.all_reduce(x, compress=c)
        error = float(np.abs(x - exact).max()) / peak
        digests = np.zeros(n, np.int64)
        digests[rank] = zlib.crc32(x.tobytes())
        tw.all_reduce(digests)
        rows.append((c or "exact", times[k], error, len(set(digests.tolist())) == 1))
    if rank == 0:
        print(f"# {n} ranks, {x.nbytes} B float32, {args.iters} calls each (after {args.warmup} warm-ups), "
              f"a call's time the slowest rank's")
        print("| all_reduce | mean | p50 | p99 | max error / max abs(sum) | every rank identical |")
        print("|---|---|---|---|---|---|")
        for name, t, error, same in rows:
            print(f"| {name} | {t.mean() * 1e3:.1f} ms | {np.percentile(t, 50) * 1e3:.1f} ms | "
                  f"{np.percentile(t, 99) * 1e3:.1f} ms | {error:.2e} | {'yes' if same else 'NO'} |")
        exact, packed = rows[0][1], rows[1][1]
        print(f"exact / {args.compress}: {exact.mean() / packed.mean():.2f}x (means), "
              f"{np.median(exact) / np.median(packed):.2f}x (p50)")
    tw.barrier()
    tw.destroy()


if __name__ == "__main__":
    main()
