"""tensorwire in the anchors' table: the same sweep as bench_mpi.py / bench_torch.py.

Launch (one rank per process, like the anchors' mpiexec / torchrun launches):
  tensorwire run -n 2 bench/anchor_tensorwire.py --latency --out out/tw_n2.json
  tensorwire run -n 2 --tcp bench/anchor_tensorwire.py --latency --out out/tw_tcp_n2.json

Sizes, iteration schedule, statistics (time = max over ranks per op, median over ops),
busbw factors, row layout and JSON are those of the anchors' `common.py`, imported from
--anchors-dir (default: ../shared/anchors relative to the repository root) and not copied,
so every figure is taken exactly like the Gloo and Open MPI ones. Only the ops differ:
tensorwire's module-level API on numpy float32 buffers. As in bench_mpi.py, all_reduce is
out of place (`all_reduce(send, out=recv)`) unless --inplace; all_gather, reduce_scatter and
alltoall use the single-tensor forms (all_gather_into_tensor, reduce_scatter_tensor,
all_to_all_single) that bench_torch.py times for Gloo.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time
from pathlib import Path

import numpy as np

import tensorwire as tw

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ANCHORS = REPO.parent / "shared" / "anchors"
perf = time.perf_counter


def load_common(anchors_dir: Path):
    """The anchors' common.py as a module (by path; nothing copied)."""
    path = anchors_dir / "common.py"
    if not path.is_file():
        raise SystemExit(f"anchor_tensorwire: {path} not found (pass --anchors-dir)")
    spec = importlib.util.spec_from_file_location("anchors_common", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_op(coll: str, count: int, n: int, rank: int, inplace: bool):
    """(op, check) over float32 buffers of `count` total elements (size conventions: common.py).

    Each op returns once the collective is complete on this rank; check() validates the result
    of the op that ran just before it.
    """
    f32 = np.float32
    expected_sum = n * (n + 1) / 2
    if coll == "all_reduce":
        send = np.full(count, rank + 1, dtype=f32)
        recv = np.empty(count, dtype=f32)
        if inplace:
            recv[:] = send

            def op():
                tw.all_reduce(recv)

            def check():
                ok = bool(np.all(recv == expected_sum))
                recv[:] = 0  # constant, finite values while timing (as bench_mpi.py)
                return ok
        else:
            def op():
                tw.all_reduce(send, out=recv)

            def check():
                return bool(np.all(recv == expected_sum))
    elif coll == "broadcast":
        buf = np.full(count, rank + 1, dtype=f32)

        def op():
            tw.broadcast(buf, 0)

        def check():
            return bool(np.all(buf == 1.0))
    elif coll == "all_gather":
        part = count // n
        send = np.full(part, rank, dtype=f32)
        recv = np.empty(count, dtype=f32)

        def op():
            tw.all_gather_into_tensor(recv, send)

        def check():
            return bool(np.array_equal(recv, np.repeat(np.arange(n, dtype=f32), part)))
    elif coll == "reduce_scatter":
        send = np.full(count, rank + 1, dtype=f32)
        recv = np.empty(count // n, dtype=f32)

        def op():
            tw.reduce_scatter_tensor(recv, send)

        def check():
            return bool(np.all(recv == expected_sum))
    elif coll == "alltoall":
        part = count // n
        send = np.repeat(rank * n + np.arange(n, dtype=f32), part)  # block j goes to rank j
        recv = np.empty(count, dtype=f32)

        def op():
            tw.all_to_all_single(recv, send)

        def check():
            return bool(np.array_equal(recv, np.repeat(np.arange(n, dtype=f32) * n + rank, part)))
    elif coll == "barrier":
        def op():
            tw.barrier()

        def check():
            return True
    else:
        raise ValueError(coll)
    return op, check


def gather_times(samples: list[float], n: int) -> list[list[float]]:
    """Every rank's per-op times, gathered with tensorwire itself (on all ranks, as the anchors)."""
    mine = np.asarray(samples, dtype=np.float64)
    out = np.empty(mine.size * n, dtype=np.float64)
    tw.all_gather_into_tensor(out, mine)
    return out.reshape(n, -1).tolist()


class Bench:
    def __init__(self, common, rank: int, n: int, inplace: bool, transport: str, fm) -> None:
        self.c, self.rank, self.n, self.inplace = common, rank, n, inplace
        self.transport, self.fm = transport, fm

    def one(self, coll: str, nominal: int, wn: tuple[int, int] | None = None) -> dict | None:
        c, n, rank = self.c, self.n, self.rank
        count = 0 if coll == "barrier" else c.elems(coll, nominal, n)
        nbytes = count * 4
        op, check = make_op(coll, count, n, rank, self.inplace)
        op()
        oks: list = [None] * n
        tw.all_gather_object(oks, check())
        if not all(oks):
            raise RuntimeError(f"validation failed: {coll} {nominal} {oks}")
        w, nops = wn if wn else c.schedule(nbytes, c.iter_scale())
        for _ in range(w):
            op()
        times = [0.0] * nops
        if self.fm:
            self.fm.start()  # before the barrier: the /proc scan takes a few ms
        tw.barrier()
        wall = perf()
        for i in range(nops):
            t0 = perf()
            op()
            times[i] = perf() - t0
        wall = perf() - wall
        foreign = self.fm.stop() if self.fm else None
        per_rank = gather_times(times, n)
        if rank != 0:
            return None
        d = c.row("tensorwire", coll, n, nominal, nbytes, w, c.summarize(per_rank),
                  inplace=self.inplace if coll == "all_reduce" else None, transport=self.transport,
                  timed_wall_s=wall, foreign_cpu_s=foreign, foreign_top=self.fm.top if self.fm else None)
        c.print_row(d)
        return d


def transport_name() -> str:
    try:
        kinds = {type(ch).__name__.replace("Channel", "").lower()
                 for ch in tw.world().runtime.engine.channels.values()}
        return "+".join(sorted(kinds)) or "none"
    except Exception:
        return tw.config().transport


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--colls", default=None, help="comma list (default: the anchors' COLLECTIVES)")
    ap.add_argument("--min-bytes", type=int, default=8)
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--step", type=int, default=2)
    ap.add_argument("--sizes", default="", help="comma list of byte sizes (overrides min/max)")
    ap.add_argument("--latency", action="store_true", help="also 8-byte all_reduce and barrier, W=500 N=5000")
    ap.add_argument("--only-latency", action="store_true")
    ap.add_argument("--inplace", action="store_true", help="all_reduce in place (default: out of place)")
    ap.add_argument("--out", default="")
    ap.add_argument("--anchors-dir", default=str(DEFAULT_ANCHORS),
                    help=f"folder holding the anchors' common.py (default {DEFAULT_ANCHORS})")
    a = ap.parse_args()
    anchors = Path(a.anchors_dir)
    if not anchors.is_absolute():
        anchors = (Path(__file__).resolve().parent / anchors).resolve()
    common = load_common(anchors)

    tw.init()
    rank, n = tw.get_rank(), tw.get_world_size()
    pid_aff: list = [None] * n
    tw.all_gather_object(pid_aff, (os.getpid(), sorted(os.sched_getaffinity(0))))
    transports: list = [None] * n
    tw.all_gather_object(transports, transport_name())
    transport = "+".join(sorted(set(transports)))
    fm = common.ForeignMeter([x[0] for x in pid_aff]) if rank == 0 else None
    meta = {
        "lib": "tensorwire",
        "tensorwire": tw.__version__,
        "transport": transport,
        "transport_setting": tw.config().transport,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "affinity_per_rank": [x[1] for x in pid_aff],
        "world_size": n,
        "ncpu": os.cpu_count(),
        "host": platform.node(),
        "tensorwire_env": {k: v for k, v in os.environ.items() if k.startswith("TENSORWIRE_")
                           and k not in ("TENSORWIRE_JOB_ID", "TENSORWIRE_STORE_HOSTED")},
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "iter_scale": common.iter_scale(),
        "inplace_allreduce": a.inplace,
        "anchors_dir": str(anchors),
    }
    if rank == 0:
        print(meta, flush=True)
    bench = Bench(common, rank, n, a.inplace, transport, fm)
    rows = []
    if not a.only_latency:
        if a.sizes:
            sizes = [int(s) for s in a.sizes.split(",")]
        else:
            sizes = common.sizes(a.min_bytes, a.max_bytes, a.step)
        colls = a.colls.split(",") if a.colls else list(common.COLLECTIVES)
        for coll in colls:
            for s in sizes:
                d = bench.one(coll, s)
                if d:
                    rows.append(d)
    lat = []
    if a.latency or a.only_latency:
        for coll in ("all_reduce", "barrier"):
            d = bench.one(coll, 8, wn=common.LATENCY_SCHEDULE)
            if d:
                lat.append(d)
    if rank == 0 and a.out:
        common.write_json(a.out, {"meta": meta, "rows": rows, "latency": lat})
    tw.barrier()
    tw.destroy()


if __name__ == "__main__":
    main()
