#!/usr/bin/env python
"""A large all_reduce across emulated hosts with block and cyclic rank placement, and Gloo.

    python scripts/netns_cluster.py --hosts 2 -n 4 --rate 1gbit \\
        --env TENSORWIRE_TCP_CONGESTION=cubic -- bench/placement.py --size 64M --rounds 8 --calls 2 --gloo

Runs as the job of the multi-host test bed. Block placement is the world as the launcher
numbers it (host i holds ranks i*N .. i*N+N-1); cyclic is a group over the same processes
whose rank r lies on host r mod K (what Slurm's cyclic distribution gives), so both run in one
job and alternate round by round; with --gloo, so do Gloo and tensorwire's torch backend, both
through torch.distributed (block placement). A call's time is the slowest rank's; each round
times --calls calls of each; rank 0 prints one line per call (`TIME <case> <round> <seconds>`)
and a summary (mean, p50, p99, min, max per case, and the ratios of the means), with the CPU
time (user + system, every thread, summed over the ranks) a call took: where the ranks
outnumber the cores, a case that needs more CPU is slower whatever its link traffic.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import numpy as np

import tensorwire as tw
from tensorwire.algorithms import hierarchical
from tensorwire.config import parse_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="64M", help="bytes of the all_reduce (float32)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=2, help="timed calls per case and round")
    p.add_argument("--gloo", action="store_true",
                   help="also Gloo and tensorwire through torch.distributed (block placement)")
    p.add_argument("--cases", default="block,cyclic", help="comma list of block, cyclic")
    p.add_argument("--piece-bytes", default="", metavar="LIST",
                   help="comma list of sizes: each case once per size of the hierarchical all_reduce's "
                        "pieces (hierarchical.PIECE_BYTES; 0: one piece), interleaved like the cases")
    args = p.parse_args()
    world = tw.init()
    n, r = world.size, world.rank
    nodes = n // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    per = n // nodes
    cyclic_order = [(i % nodes) * per + i // nodes for i in range(n)]  # group rank i -> world rank
    groups = {"block": world, "cyclic": tw.new_group(cyclic_order, name="cyclic")}
    cases = [c for c in args.cases.split(",") if c]
    count = parse_size(args.size) // 4
    x = np.ones(count, dtype=np.float32)
    ops = {c: (lambda g=groups[c]: tw.all_reduce(x, group=g)) for c in cases}
    if args.piece_bytes:
        def with_pieces(g: tw.Group, piece: int) -> None:
            hierarchical.PIECE_BYTES = piece or 1 << 62
            tw.all_reduce(x, group=g)

        sizes = [parse_size(v) for v in args.piece_bytes.split(",")]
        ops = {f"{c}/{v >> 20}M": (lambda g=groups[c], v=v: with_pieces(g, v)) for c in cases for v in sizes}
    if args.gloo:
        import torch
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:"
                                f"{int(os.environ['MASTER_PORT']) + 1}", rank=r, world_size=n)
        import tensorwire.torch  # noqa: F401 - registers the backend

        t = torch.ones(count, dtype=torch.float32)
        ops["gloo"] = lambda: dist.all_reduce(t)
        through = dist.new_group(list(range(n)), backend="tensorwire")  # tensorwire's world, via c10d
        ops["torch-tw"] = lambda: dist.all_reduce(t, group=through)
    for op in ops.values():  # warm: connections ramped, algorithms chosen, pages touched
        op()
    times: dict[str, list[float]] = {c: [] for c in ops}
    cpu: dict[str, list[float]] = {c: [] for c in ops}
    slowest, spent = np.zeros(1), np.zeros(1)
    for rnd in range(args.rounds):
        order = list(ops) if rnd % 2 == 0 else list(reversed(ops))
        for case in order:
            for _ in range(args.calls):
                x.fill(1)
                if args.gloo:
                    t.fill_(1)
                world.barrier()
                c0, t0 = _cpu(), time.perf_counter()
                ops[case]()
                slowest[0] = time.perf_counter() - t0
                spent[0] = _cpu() - c0
                world.all_reduce(slowest, op=tw.ReduceOp.MAX)
                world.all_reduce(spent)
                times[case].append(float(slowest[0]))
                cpu[case].append(float(spent[0]))
                got = t[:8].numpy() if case in ("gloo", "torch-tw") else x[:8]
                if not np.all(got == n):
                    raise SystemExit(f"rank {r}: {case}: wrong result {x[:4]} (expected {n})")
                if r == 0:
                    print(f"TIME {case} {rnd} {slowest[0]:.4f}", flush=True)
    if r == 0:
        means = {c: statistics.fmean(v) for c, v in times.items()}
        for c, v in times.items():
            q = statistics.quantiles(v, n=100) if len(v) > 1 else v * 99
            print(f"SUMMARY {c}: mean {means[c]:.3f} s, p50 {statistics.median(v):.3f}, p99 {q[98]:.3f}, "
                  f"min {min(v):.3f}, max {max(v):.3f} over {len(v)} calls; "
                  f"CPU {statistics.fmean(cpu[c]):.3f} s a call (all ranks)", flush=True)
        base = means.get("block") or next(iter(means.values()))
        if base:
            first = "block" if "block" in means else next(iter(means))
            print("RATIO " + ", ".join(f"{c}/{first} {m / base:.2f}" for c, m in means.items() if c != first),
                  flush=True)
    world.barrier()


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


if __name__ == "__main__":
    main()
