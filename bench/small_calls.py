#!/usr/bin/env python
"""Small-call latency layer by layer, interleaved in one job: where a tiny collective's time goes.

    .venv/bin/python bench/small_calls.py                  # 2 ranks, 8 B, 5 rounds x 3000 calls
    .venv/bin/python bench/small_calls.py --layers np,torch,dist --rounds 3 --profile torch

Layers (every one 8 B = 2 float32 where it carries data, all on the same world):

  flag      a raw ping-pong of one 8-byte flag per rank through shared memory, polled from
            Python as the direct path polls its flags: the floor of any call that must hear
            from every peer
  minimal   the same ping-pong carrying 8 B each way, and their sum: each rank copies its
            array into its own slot, bumps its flag, waits, adds the two slots into its
            output (numpy, as the direct path) -- the protocol in Python, no bookkeeping
  run       the planned all_reduce's body alone (AllReducePlan.run: enter the slot, copy in,
            publish, wait, fold), called as Plans.submit calls it: the data path
  submit    the same through Plans.submit: the data path and the group's queue
  np        tensorwire's native API on a numpy array: group.all_reduce(a)
  torch     the same call on a CPU torch tensor: group.all_reduce(t)
  dist      torch.distributed on the tensorwire backend: dist.all_reduce(t)
  dgroup    the same on a torch group of both ranks: dist.all_reduce(t, group=g)
  dnull     torch's own dispatch, on a group of both ranks whose backend returns a completed
            Work at once (the floor under `dgroup`: torch's wrapper, its pybind and our Work)
  brun      the planned barrier's body alone (as `run`)
  barrier   group.barrier()
  dbarrier  dist.barrier()

Each round runs every layer (the order rotating from round to round, so a shared machine's
drifts hit all alike): a warm-up, a barrier, then every call timed alone with perf_counter_ns
(~0.05 us of the figures is the timer itself). Rank 0's per-call times, pooled over rounds,
give mean, p50 and p99. `--profile LAYER` then runs that layer under cProfile on both ranks
and prints rank 0's top functions by own time (cProfile multiplies a small call's time several
times over; read it for the shape, not the figures).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

from selflaunch import run_workers

LAYERS = ("flag", "minimal", "run", "submit", "np", "torch", "dist", "dgroup", "dnull", "brun", "barrier",
          "dbarrier")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, of {','.join(LAYERS)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3000, help="timed calls per layer and round")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--dtype", default="float32", help="torch dtype name of the 2-element tensors")
    p.add_argument("--profile", choices=LAYERS, help="then profile this layer with cProfile")
    p.add_argument("--pin", action="store_true",
                   help="bind rank r to CPU r (mod the CPUs it may use), as Open MPI does at 2 ranks")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return run_workers(str(Path(__file__).resolve()), args.nproc, argv,
                       TW_BENCH_FLAGS=f"/tw-bench-flags-{os.getpid()}")


class Flags:
    """Per rank, one 64-byte line for its flag and one for its data, in a shared file under
    /dev/shm. A round: bump my flag, wait until every other rank's reached it (the direct
    path's publish-and-wait, nothing else); `reduce` carries data too."""

    def __init__(self, name: str, rank: int, size: int) -> None:
        import numpy as np

        path = Path("/dev/shm") / name.lstrip("/")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 128 * size)
            self.mm = mmap.mmap(fd, 128 * size)
        finally:
            os.close(fd)
        self.path, self.words, self.rank, self.size = path, memoryview(self.mm).cast("Q"), rank, size
        self.mine = 8 * rank
        self.others = tuple(8 * r for r in range(size) if r != rank)
        self.seq = self.words[self.mine]
        data = np.frombuffer(self.mm, np.float32)
        self.slots = [data[16 * (size + r):16 * (size + r) + 2] for r in range(size)]
        self.out = np.zeros(2, np.float32)

    def round(self) -> None:
        words = self.words
        self.seq = seq = self.seq + 1
        words[self.mine] = seq
        for line in self.others:
            while words[line] < seq:
                pass

    def reduce(self, a) -> None:
        import numpy as np

        self.slots[self.rank][...] = a
        self.round()
        np.add(self.slots[0], self.slots[1], self.out)
        for v in self.slots[2:]:
            np.add(self.out, v, self.out)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401

    dist.init_process_group("tensorwire")
    rank, size = dist.get_rank(), dist.get_world_size()
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    group = dist.distributed_c10d._get_default_group().tensorwire_group
    tdtype = getattr(torch, args.dtype)
    t = torch.zeros(2, dtype=tdtype)  # zeros: sums that never overflow however many calls
    a = np.zeros(2, dtype=np.float32)
    flags = Flags(os.environ["TW_BENCH_FLAGS"], rank, size)
    group.barrier()
    if rank == 0:
        flags.path.unlink()  # both mapped it: nothing is left behind however the job ends
    both = dist.new_group(backend="tensorwire")
    null = dist.new_group(backend=_null_backend())
    ops = {"flag": flags.round, "minimal": lambda: flags.reduce(a), **_internal_layers(group, a),
           "np": lambda: group.all_reduce(a), "torch": lambda: group.all_reduce(t),
           "dist": lambda: dist.all_reduce(t), "dgroup": lambda: dist.all_reduce(t, group=both),
           "dnull": lambda: dist.all_reduce(t, group=null), "barrier": group.barrier,
           "dbarrier": dist.barrier}
    layers = [x for x in args.layers.split(",") if x]
    unknown = set(layers) - set(ops)
    if unknown:
        raise SystemExit(f"unknown layers {sorted(unknown)}; known: {', '.join(LAYERS)}")
    times: dict[str, list[int]] = {x: [] for x in layers}
    clock = time.perf_counter_ns
    for r in range(args.rounds):
        for layer in layers[r % len(layers):] + layers[:r % len(layers)]:
            op = ops[layer]
            for _ in range(args.warmup):
                op()
            group.barrier()
            out = times[layer]
            for _ in range(args.iters):
                t0 = clock()
                op()
                out.append(clock() - t0)
    if rank == 0:
        print(f"{size} ranks, {args.dtype} x 2, {args.rounds} interleaved rounds x {args.iters} calls, "
              f"torch {torch.__version__}, numpy {np.__version__}; rank 0's per-call times (us)")
        print(f"{'layer':10s} {'mean':>8s} {'p50':>8s} {'p99':>8s}")
        for layer in layers:
            us = sorted(x / 1000 for x in times[layer])
            p50, p99 = us[len(us) // 2], us[int(len(us) * .99)]
            print(f"{layer:10s} {statistics.fmean(us):8.2f} {p50:8.2f} {p99:8.2f}")
    if args.profile:
        _profile(ops[args.profile], args.iters, rank, group)
    group.barrier()
    dist.destroy_process_group()


def _null_backend() -> str:
    """A backend whose all_reduce returns its completed Work at once, registered; its name."""
    import torch.distributed as dist

    from tensorwire.torch.work import CompletedWork

    class Null(dist.ProcessGroup):
        done = CompletedWork(None)  # one Work, as ProcessGroupTensorwire keeps

        def allreduce(self, tensors, opts=None):
            self.done.outputs = tensors
            return self.done

        def getBackendName(self) -> str:  # noqa: N802 - torch's virtual
            return "twnull"

    if "TWNULL" not in dist.Backend._plugins:
        dist.Backend.register_backend("twnull", lambda opts, pg_options=None: Null(opts.group_rank,
                                                                                   opts.group_size),
                                      extended_api=True, devices=["cpu"])
    return "twnull"


def _internal_layers(group, a) -> dict:
    """The planned all_reduce's and barrier's bodies, without the API above them (reaching into
    Group's plans: a measurement, not an interface)."""
    from tensorwire.ops import ReduceOp

    group.all_reduce(a)
    group.barrier()  # both signatures planned now
    call, run, _ = group.plans[("all_reduce", a.dtype, a.size, ReduceOp.SUM, True)]
    bcall, brun, _ = group.plans["barrier"]
    assert run is not None, "8 B all_reduce is not on the direct path here"

    def body(c, f, *args):
        def once() -> None:
            group.queue.seq = c.seq = group.queue.seq + 1  # what Plans.submit does before the body
            c.deadline = 0.0
            f(c, *args)
        return once

    return {"run": body(call, run, a, a), "brun": body(bcall, brun),
            "submit": lambda: group.plans.submit(call, run, True, False, None, a, a)}


def _profile(op, iters: int, rank: int, group) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    group.barrier()
    profiler.enable()
    for _ in range(iters):
        op()
    profiler.disable()
    if rank == 0:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    sys.exit(main())
