"""`tensorwire bench`: nccl-tests style sweep of one collective (or all of them).

    tensorwire bench all_reduce -b 8 -e 64M -f 4 --np 2
    tensorwire bench all --np 4 --tcp -d double -o max --json out.json

Flags, columns and conventions follow nccl-tests (`all_reduce_perf -b 8 -e 128M -f 2 ...`):

* `size` is nccl-tests' size: the buffer for all_reduce / broadcast / reduce / sendrecv, the
  gathered output for all_gather / gather, the input for reduce_scatter / scatter, each
  rank's whole send buffer for alltoall. The element count is `size // itemsize`, rounded
  down to a multiple of the number of ranks for the split collectives, exactly as nccl-tests'
  `getCollByteCount` does; `count` is the per-rank parameter count nccl-tests prints.
* algbw = size / time (GB/s, 1e9 B/s); busbw = algbw x nccl-tests' factor: all_reduce
  2(n-1)/n; all_gather, reduce_scatter, alltoall, gather, scatter (n-1)/n; broadcast, reduce,
  sendrecv 1.
* time is nccl-tests' time: the mean call, the slowest rank's (its `-a 3`). Per size, W
  warm-up calls, a barrier, then N calls each timed with perf_counter on every rank, so that
  the distribution shows beside the mean: p50 and p99 over the calls, a call counted at its
  slowest rank (`benchmarks.sweep.summarize`). Per-call times are gathered to rank 0 with
  tensorwire itself after the loop.
* #wrong: after the timed loop the inputs are re-initialised, one more call is made and its
  result is compared element by element with a numpy reference built from every rank's
  input (`tensorwire.ops.reference` for reductions). Inputs are small integers, exact in
  every dtype, so any summation order gives the same bits.

`--np N` starts N ranks through the launcher (`tensorwire run -n N -m tensorwire.bench ...`);
inside a launched job (tensorwire run, torchrun, mpirun, srun) the bench just runs.
`barrier` is not an nccl-tests collective: it is shown as one row of size 0.

`--compare gloo,mpi` runs the same sweep through Gloo (torch.distributed) and Open MPI
(mpi4py) too, interleaved over `--rounds` rounds, and prints one comparison table per
collective (`tensorwire.benchmarks.compare`). Cases, the timed loop and the statistics live
in `tensorwire.benchmarks.sweep`, inputs and the check in `tensorwire.benchmarks.check`: the
Gloo and MPI runners share them, so every library is measured the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .benchmarks import progress, report, sweep
from .benchmarks.compare import parse_libraries
from .benchmarks.loadmeter import job_meter
from .benchmarks.sweep import COLLECTIVES, Buffers, Case, Measured, measure, size_list
from .benchmarks.sweep import NO_INPLACE as _NO_INPLACE
from .benchmarks.sweep import REDUCING as _REDUCING
from .benchmarks.sweep import ROOTED as _ROOTED
from .benchmarks.sweep import busbw_factor as busbw_factor  # re-exported: `tensorwire.bench` API
from .benchmarks.sweep import summarize as summarize  # re-exported: `tensorwire.bench` API

DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
          "bfloat16")
OPS = ("sum", "prod", "max", "min", "avg")  # nccl-tests' order for -o all

EPILOG = """\
examples:
  tensorwire bench all_reduce -b 8 -e 64M -f 4 --np 2        8 B, 32 B, ... (x4) up to 64 MiB, 2 ranks
  tensorwire bench all_reduce -b 8 -e 64M -f 4 --np 2 --tcp  the same over TCP
  tensorwire bench all -b 8 -e 1M --np 4 --json out.json     every collective, results as JSON
  tensorwire run -n 2 -m tensorwire.bench broadcast -r 1      under the launcher explicitly
  tensorwire bench all_reduce --algo all -b 8 -e 64M -f 4 --np 4 --rounds 3
                                                    every algorithm against the tuner and the model
  tensorwire bench all -b 8 -e 256M -f 4 -n auto -w auto --np 2 --compare gloo,mpi --plot cmp.png
                                                    the same sweep in Gloo and Open MPI too, 3 rounds

columns (as nccl-tests): size (B), count (elements per rank parameter), type, redop, root,
then for out-of-place and in-place: time (us: the mean call, the slowest rank's, as nccl-tests
reports it), p50 and p99 (us: median and 99th percentile over the calls, each call at its
slowest rank), algbw = size/time and busbw = algbw x factor (GB/s), #wrong (elements that
differ from the numpy reference in one checked call; N/A with -c 0).

--compare gloo,mpi: tensorwire, Gloo (torch.distributed, launched by torch.distributed.run) and
Open MPI (mpi4py, launched by mpiexec) each sweep the same collectives, sizes, placements and
schedule (float32 sum), one launch per library per round, rounds interleaved. One table per
collective: per size the median over rounds of each library's mean call (us) and the ratios
tw/gloo and tw/mpi (tensorwire time / other time: < 1 means tensorwire is faster). A row uses
the rounds in which none of its cells saw foreign CPU load (other processes on the machine); a
dagger marks the cells measured under it anyway, when every round saw some.
Peers need torch (pip install torch==2.13.0), mpi4py (pip install mpi4py) and mpiexec
(apt-get install -y openmpi-bin libopenmpi-dev); a missing one is skipped with that hint.
Plots need matplotlib and the progress bar uses rich: pip install 'tensorwire[bench]'.

--algo all: per size, one line per algorithm (auto:NAME is the tuner's own choice, the others
are forced in turn, * marks the fastest forced one): time as above, predicted (us, the cost
model with this job's calibrated constants), meas/pred, busbw and #wrong; then a comment line
with auto's time and prediction, the best forced algorithm and auto/best. --algo NAME forces
that one algorithm (sizes where it cannot run say so).
"""


# ------------------------------------------------------------------------------------------
# Argument parsing


def parse_size(text: str) -> int:
    """nccl-tests sizes: 8, 64K, 1M, 2G (binary multiples; a trailing B / iB is allowed)."""
    t = str(text).strip().upper()
    t = t.removesuffix("IB") if t.endswith("IB") else t.removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    try:
        value = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r} (use e.g. 8, 64K, 1M, 2G)") from None
    if value < 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"size {text!r} must be a non-negative number of bytes")
    return int(value * mult)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {v}")
    return v


def _count_or_auto(check: Callable[[str], int]) -> Callable[[str], int | None]:
    """-n / -w: a count, or `auto` (None) for the per-size schedule of `sweep.schedule`."""
    def parse(text: str) -> int | None:
        return None if text.strip().lower() == "auto" else check(text)
    return parse


def build_parser(prog: str = "tensorwire bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Measure collective time, algorithm bandwidth and bus bandwidth over a range "
                    "of message sizes, with the flags and columns of nccl-tests.")
    p.add_argument("collective", metavar="COLL", choices=(*COLLECTIVES, "all"),
                   help=f"one of {', '.join(COLLECTIVES)}, or all")
    p.add_argument("-b", "--minbytes", type=parse_size, default=8, metavar="SIZE",
                   help="smallest size (default 8); sizes read as nccl-tests: 8, 64K, 1M, 2G")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=32 << 20, metavar="SIZE",
                   help="largest size (default 32M)")
    p.add_argument("-f", "--stepfactor", type=_positive_int, default=2, metavar="F",
                   help="multiply the size by F each step (default 2); 1 means add --stepbytes")
    p.add_argument("-i", "--stepbytes", type=parse_size, default=1 << 20, metavar="SIZE",
                   help="increment between sizes when --stepfactor is 1 (default 1M)")
    p.add_argument("-n", "--iters", type=_count_or_auto(_positive_int), default=20, metavar="N",
                   help="timed iterations per size (default 20); auto: by size, from 100 for small "
                        "messages down to 5 above 64 MiB")
    p.add_argument("-w", "--warmup_iters", type=_count_or_auto(_nonneg_int), default=5, metavar="W",
                   help="warm-up iterations per size, not timed (default 5); auto: by size, 10 down to 1")
    p.add_argument("-z", "--blocking", type=int, choices=(0, 1), default=0, metavar="0|1",
                   help="1: a barrier (untimed) before every timed call, so that calls cannot overlap "
                        "(a rooted collective's next call otherwise starts where a rank has nothing "
                        "to wait for); the time of one isolated call, as the cost model prices it "
                        "(default 0)")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1, metavar="0|1",
                   help="check one call per size against a numpy reference (default 1)")
    p.add_argument("-d", "--datatype", default="float", metavar="TYPE",
                   help=f"{', '.join(DTYPES)} or all (default float)")
    p.add_argument("-o", "--op", default="sum", metavar="OP",
                   help=f"reduction for all_reduce / reduce / reduce_scatter: {', '.join(OPS)} or all "
                        "(default sum)")
    p.add_argument("-r", "--root", type=_nonneg_int, default=0, metavar="R",
                   help="root rank of broadcast, reduce, gather and scatter (default 0)")
    p.add_argument("-I", "--inplace-only", action="store_true",
                   help="measure only the in-place variant (default: out-of-place and in-place)")
    p.add_argument("--np", type=_positive_int, default=None, metavar="N", dest="nprocs",
                   help="start N ranks on this host with `tensorwire run -n N` (not needed, and checked "
                        "against the world size, inside a launched job)")
    p.add_argument("--tcp", action="store_true",
                   help="force the TCP transport (TENSORWIRE_TRANSPORT=tcp) even between local ranks")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write every row, with mean, p10/p50/p90/p99, min and max, as JSON to PATH "
                        "(rank 0)")
    p.add_argument("--algo", default=None, metavar="NAME|all",
                   help="force one algorithm (e.g. ring), or `all`: per size, the tuner's choice and every "
                        "eligible algorithm, each with the cost model's prediction (one placement: "
                        "out-of-place, or in-place with -I)")
    p.add_argument("--rounds", type=_positive_int, default=None, metavar="R",
                   help="with --algo: repeat the algorithms R times interleaved and pool the iterations "
                        "(default 1); with --compare: R interleaved rounds, medians reported (default 3)")
    p.add_argument("--compare", type=parse_libraries, default=None, metavar="gloo,mpi",
                   help="also run the sweep through Gloo and/or Open MPI, interleaved, and print "
                        "tensorwire/gloo and tensorwire/mpi time ratios per size (float32 sum; --np "
                        "defaults to 2)")
    p.add_argument("--compare-python", default=None, metavar="PATH",
                   help="the Python that runs the peers (default: this one if it has torch / mpi4py, "
                        "else /opt/anchors-venv/bin/python)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also plot time and busbw against size, one line per library and placement "
                        "(needs matplotlib)")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="also write the tables as markdown, with the command and the machine")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal and the table is "
                        "not; rich if installed)")
    p.add_argument("--compare-member", default=None, help=argparse.SUPPRESS)  # one launch of --compare
    return p


@dataclass
class Options:
    colls: list[str]
    sizes: list[int]
    dtypes: list[np.dtype]
    ops: list[str]
    root: int
    iters: int | None  # None: by size (sweep.schedule)
    warmup: int | None
    check: bool
    inplace_only: bool
    json_path: str | None
    blocking: bool = False
    argv: list[str] = field(default_factory=list)
    args: argparse.Namespace | None = None


def _dtype_list(text: str) -> list[np.dtype]:
    from .ops import dtype_from_name

    names = DTYPES if text.strip().lower() == "all" else [t for t in text.split(",") if t.strip()]
    out = []
    for name in names:
        try:
            out.append(dtype_from_name(name))
        except Exception as exc:
            if text.strip().lower() == "all":
                continue  # e.g. bfloat16 without ml_dtypes: -d all skips it
            raise ValueError(f"--datatype {name!r}: {exc}") from None
    return out


def _op_list(text: str) -> list[str]:
    if text.strip().lower() == "all":
        return list(OPS)
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in OPS:
            raise ValueError(f"--op {name!r}: expected one of {', '.join(OPS)} or all")
    return list(names)


def parse_options(argv: Sequence[str], prog: str = "tensorwire bench") -> Options:
    """Parse and validate; raises SystemExit (argparse) or ValueError with a user message."""
    args = build_parser(prog).parse_args(list(argv))
    if args.algo and (args.iters is None or args.warmup_iters is None):
        raise ValueError("--algo takes fixed -n and -w counts, not auto")
    if args.algo and args.compare:
        raise ValueError("--algo and --compare do not go together")
    if args.rounds is None:
        args.rounds = 3 if args.compare else 1
    colls = list(COLLECTIVES) if args.collective == "all" else [args.collective]
    sizes = size_list(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    return Options(colls=colls, sizes=sizes, dtypes=_dtype_list(args.datatype), ops=_op_list(args.op),
                   root=args.root, iters=args.iters, warmup=args.warmup_iters, check=bool(args.check),
                   inplace_only=args.inplace_only, blocking=bool(args.blocking), json_path=args.json,
                   argv=list(argv), args=args)


# ------------------------------------------------------------------------------------------
# One measured case


def make_case(tw: Any, coll: str, dtype: np.dtype, op: str | None, root: int, nominal: int,
              inplace: bool, bufs: Buffers) -> Case:
    return sweep.make_case(coll, dtype, op, root, nominal, inplace, bufs, tw.get_rank(), tw.get_world_size(),
                           lambda case: _tw_call(tw, case))


def _tw_call(tw: Any, case: Case) -> Callable[[], Any]:
    """tensorwire's call for a case (module-level API, as a user would write it)."""
    coll, send, recv, root, red, inplace = (case.coll, case.send, case.recv, case.root, case.reduction,
                                            case.inplace)
    rank, n = case.rank, case.n
    call: Callable[[], Any]
    if coll == "all_reduce":
        call = (lambda: tw.all_reduce(recv, red)) if inplace else (lambda: tw.all_reduce(send, red, out=recv))
    elif coll == "broadcast":
        call = (lambda: tw.broadcast(recv, root)) if inplace else (lambda: tw.broadcast(send, root, out=recv))
    elif coll == "reduce":
        call = ((lambda: tw.reduce(recv, root, red)) if inplace
                else (lambda: tw.reduce(send, root, red, out=recv)))
    elif coll == "all_gather":
        call = lambda: tw.all_gather_into_tensor(recv, send)  # noqa: E731
    elif coll == "reduce_scatter":
        call = lambda: tw.reduce_scatter_tensor(recv, send, red)  # noqa: E731
    elif coll == "alltoall":
        call = lambda: tw.all_to_all_single(recv, send)  # noqa: E731
    elif coll == "gather":
        glist = case.recv_blocks() if rank == root else None
        call = lambda: tw.gather(send, glist, root)  # noqa: E731
    elif coll == "scatter":
        slist = case.send_blocks() if rank == root else None
        call = lambda: tw.scatter(recv, slist, root)  # noqa: E731
    elif coll == "sendrecv":
        dst, src = (rank + 1) % n, (rank - 1) % n

        call = lambda: tw.sendrecv(send, dst, recv, src)  # noqa: E731
    elif coll == "barrier":
        call = tw.barrier
    else:
        raise ValueError(coll)
    return call


def collect(tw: Any, m: Measured) -> tuple[list[list[float]], int] | None:
    """Rank 0 gets every rank's per-call times and the total #wrong (None elsewhere)."""
    rank, n = tw.get_rank(), tw.get_world_size()
    mine = sweep.pack(m)
    glist = [np.empty_like(mine) for _ in range(n)] if rank == 0 else None
    tw.gather(mine, glist, 0)
    return None if glist is None else sweep.unpack(glist)


# ------------------------------------------------------------------------------------------
# Output


def _time_str(us: float) -> str:
    if us >= 10000.0:
        return f"{us:7.0f}"
    if us >= 100.0:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def _cells(result: dict[str, Any] | None) -> str:
    if result is None:
        return f"  {'N/A':>7}  {'N/A':>7}  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>6}"
    wrong = "N/A" if result["wrong"] < 0 else str(result["wrong"])
    return (f"  {_time_str(result['time_us'])}  {_time_str(result['p50_us'])}  {_time_str(result['p99_us'])}"
            f"  {result['algbw_GBps']:6.2f}  {result['busbw_GBps']:6.2f}  {wrong:>6}")


def _header_lines(inplace_only: bool) -> list[str]:
    left = f"#{'size':>11}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}"
    units = f"#{'(B)':>11}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}"
    cols = f"  {'time':>7}  {'p50':>7}  {'p99':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}"
    cunits = f"  {'(us)':>7}  {'(us)':>7}  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}"
    width = len(cols)
    if inplace_only:
        title = "#" + " " * (len(left) - 1) + f"{'in-place':^{width}}"
        return [title.rstrip(), left + cols, units + cunits]
    title = "#" + " " * (len(left) - 1) + f"{'out-of-place':^{width}}" + f"{'in-place':^{width}}"
    return [title.rstrip(), left + cols + cols, units + cunits + cunits]


def format_row(size: int, count: int, type_name: str, op_name: str, root: int,
               cells: Sequence[dict[str, Any] | None]) -> str:
    head = f"{size:12d}  {count:12d}  {type_name:>8}  {op_name:>6}  {root:6d}"
    return head + "".join(_cells(c) for c in cells)


def _transport_of(tw: Any) -> str:
    try:
        channels = tw.world().runtime.engine.channels.values()
        kinds = sorted({c.kind for c in channels if c.kind != "pending"})
        return "+".join(kinds) if kinds else "none (1 rank)"
    except Exception:
        return "?"


# ------------------------------------------------------------------------------------------
# Driver


def in_launched_job(env: dict[str, str] | None = None) -> bool:
    """True inside tensorwire run / torchrun / mpirun / srun (a world to join exists)."""
    from .rendezvous import bootstrap

    env = dict(os.environ if env is None else env)
    try:
        return bootstrap.detect(env=env).source != "single"
    except Exception:
        return True  # a launcher's environment, if a broken one: let init() explain


def relaunch(opts: Options) -> int:
    """`tensorwire run -n N [--tcp] -m tensorwire.bench ARGS` and its exit code."""
    from . import launcher

    assert opts.args is not None
    cmd = ["-n", str(opts.args.nprocs)]
    if opts.args.tcp:
        cmd.append("--tcp")
    cmd += ["-m", "tensorwire.bench", *opts.argv]
    return launcher.main(cmd, prog="tensorwire run")


def planned_cells(opts: Options) -> int:
    """Timed loops the sweep will run (for the progress bar; skipped op / dtype pairs count)."""
    places = ["in-place"] if opts.inplace_only else ["out-of-place", "in-place"]
    total = 0
    for coll in opts.colls:
        if coll == "barrier":
            total += 1
            continue
        variants = len(opts.dtypes) * (len(opts.ops) if coll in _REDUCING else 1)
        total += len(opts.sizes) * variants * sum(1 for p in places if p == "out-of-place"
                                                  or coll not in _NO_INPLACE)
    return total


def relaunch_with_progress(opts: Options) -> int:
    """relaunch(), with a progress bar on stderr fed by rank 0 (see `benchmarks.progress`).

    `--progress auto` shows it only when stderr is a terminal and stdout is not: the rows
    streaming to a terminal are progress enough, and the bar must not mix with them.
    """
    args = opts.args
    assert args is not None
    show = progress.wanted(args.progress) and not (args.progress == "auto" and sys.stdout.isatty())
    if not show or args.algo:
        return relaunch(opts)
    with tempfile.TemporaryDirectory(prefix="tw-bench-") as tmp:
        path = os.path.join(tmp, "progress")
        os.environ[progress.PROGRESS_ENV] = path
        try:
            with progress.Bar(planned_cells(opts), True) as bar, progress.Follower(path, bar):
                return relaunch(opts)
        finally:
            os.environ.pop(progress.PROGRESS_ENV, None)


def _count(value: int | None) -> str:
    return "auto" if value is None else str(value)


def _rank_banner(tw: Any, opts: Options) -> list[str]:
    n = tw.get_world_size()
    me = (tw.get_rank(), os.getpid(), socket.gethostname(), _transport_of(tw))
    everyone: list[Any] = [None] * n
    tw.all_gather_object(everyone, me)
    args = opts.args
    assert args is not None
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    lines = [
        f"# tensorwire bench {' '.join(opts.colls) if len(opts.colls) == 1 else 'all'}  nranks {n}  "
        f"minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} warmup iters: "
        f"{_count(opts.warmup)} iters: {_count(opts.iters)} validation: {int(opts.check)}",
        "#",
        f"# time = the mean of the {_count(opts.iters)} timed iterations on the slowest rank (nccl-tests' "
        "time); p50, p99 = median and",
        "# 99th percentile over the iterations of the slowest rank's time for each (every iteration timed",
        "# on every rank, after warm-up and a barrier"
        + ("; blocking: a barrier before each);" if opts.blocking else ");"),
        "# algbw = size / time, busbw = algbw x nccl-tests factor; 1 GB/s = 1e9 B/s",
        "#",
        "# Using ranks",
    ]
    for rank, pid, host, transport in everyone:
        lines.append(f"#  Rank {rank:2d} Pid {pid:7d} on {host:>12} transport {transport}")
    lines.append("#")
    return lines


def sweep_pairs(opts: Options, coll: str, rank: int, say: Callable[[str], None]
                ) -> Iterator[tuple[np.dtype, str | None]]:
    """(dtype, op) of every point of `coll` in the sweep; pairs the op cannot reduce are skipped
    with a note (shared by the plain sweep and --algo)."""
    from .ops import as_reduction, check_op_dtype, dtype_name

    for dt in (opts.dtypes if coll != "barrier" else opts.dtypes[:1]):
        for op in (opts.ops if coll in _REDUCING else [None]):
            if op is not None:
                try:
                    check_op_dtype(as_reduction(op), dt, rank=rank, collective=coll)
                except Exception as exc:
                    say(f"# skipped {coll} {dtype_name(dt)} {op}: {exc}")
                    continue
            yield dt, op


def run_benchmark(opts: Options, out: Callable[[str], None] = print) -> int:
    import tensorwire as tw

    args = opts.args
    if args is not None and args.tcp:
        os.environ["TENSORWIRE_TRANSPORT"] = "tcp"
    reports = args is not None and not args.compare_member and bool(args.plot or args.markdown)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        out(line)

    with tempfile.TemporaryDirectory(prefix="tw-bench-") as tmp:
        if reports and not opts.json_path:
            opts.json_path = os.path.join(tmp, "rows.json")
        tw.init()
        try:
            code = _run(tw, opts, say if reports else out)
            root = tw.get_rank() == 0
        finally:
            tw.destroy()
        if reports and root:
            _write_reports(opts, lines)
    return code


def _write_reports(opts: Options, lines: list[str]) -> None:
    """--plot / --markdown of a plain sweep (rank 0, from the rows it wrote as JSON)."""
    args = opts.args
    assert args is not None and opts.json_path is not None
    with open(opts.json_path) as f:
        doc = json.load(f)
    meta, cells = doc["meta"], report.cells(doc["rows"])
    info = report.machine()
    title = f"tensorwire, {meta['nranks']} ranks, transport {meta['transport']}, {info['host']}"
    if args.plot:
        report.plot(cells, args.plot, title)
    if args.markdown:
        described = {"tensorwire": f"tensorwire {meta['version']}, transport {meta['transport']}"}
        body = ["```", *lines, "```"]
        report.write_markdown(args.markdown, f"tensorwire bench: {meta['nranks']} ranks",
                              "tensorwire bench " + " ".join(opts.argv), report.PLAIN_METHOD, info, described,
                              [], args.plot, body)


def _run(tw: Any, opts: Options, out: Callable[[str], None]) -> int:
    from .ops import dtype_name

    rank, n = tw.get_rank(), tw.get_world_size()
    say = out if rank == 0 else (lambda _line: None)
    args = opts.args
    if args is not None and args.nprocs is not None and args.nprocs != n:
        raise SystemExit(f"tensorwire bench: --np {args.nprocs} but this job has {n} ranks")
    if opts.root >= n:
        raise SystemExit(f"tensorwire bench: --root {opts.root} is out of range for {n} ranks")
    if not opts.dtypes:
        raise SystemExit("tensorwire bench: no usable datatype")

    # One pair of buffers for the largest case (bytes; viewed as each dtype).
    bufs = Buffers.for_cases(opts.colls, opts.sizes, opts.dtypes, n)
    pids: list[Any] = [None] * n
    tw.all_gather_object(pids, os.getpid())
    meter = job_meter(pids) if rank == 0 else None

    for line in _rank_banner(tw, opts):
        say(line)
    meta = {
        "tool": "tensorwire bench", "version": getattr(tw, "__version__", "?"), "nranks": n,
        "transport": _transport_of(tw), "host": platform.node(), "python": platform.python_version(),
        "numpy": np.__version__, "argv": opts.argv, "warmup": opts.warmup or _count(opts.warmup),
        "iters": opts.iters or _count(opts.iters),
        "timing": "time: the slowest rank's mean iteration; p50/p99: over iterations, each at its "
                  "slowest rank",
    }
    if args is not None and args.algo:
        from .bench_algo import run_algos

        return exit_code(tw, run_algos(tw, opts, bufs, say, meta))
    rows: list[dict[str, Any]] = []
    total_wrong = 0
    bw_sum, bw_count = 0.0, 0
    for coll in opts.colls:
        c_sum, c_count = 0.0, 0
        say(f"# Collective: {coll}" + (f"  (root {opts.root})" if coll in _ROOTED else ""))
        for line in _header_lines(opts.inplace_only):
            say(line.rstrip())
        for dt, op in sweep_pairs(opts, coll, rank, say):
            for nominal in (opts.sizes if coll != "barrier" else [0]):
                placements = [True] if opts.inplace_only else [False, True]
                cells: list[dict[str, Any] | None] = []
                size = count = 0
                for inplace in placements:
                    if inplace and coll in _NO_INPLACE:
                        cells.append(None)
                        continue
                    case = make_case(tw, coll, dt, op, opts.root, nominal, inplace, bufs)
                    size, count = case.size, case.param
                    m = measure(tw, case, opts.warmup, opts.iters, opts.check, meter, opts.blocking)
                    got = collect(tw, m)
                    if got is None:
                        cells.append({})
                        continue
                    cell = sweep.cell(coll, n, size, *got)
                    cells.append(cell)
                    wrong, busbw = cell["wrong"], cell["busbw_GBps"]
                    if wrong > 0:
                        total_wrong += wrong
                    if coll != "barrier":
                        bw_sum, bw_count = bw_sum + busbw, bw_count + 1
                        c_sum, c_count = c_sum + busbw, c_count + 1
                    rows.append(sweep.row(case, nominal, cell, m))
                    progress.note(f"{coll} {size} B {rows[-1]['placement']}")
                if rank == 0:
                    say(format_row(size, count, dtype_name(dt) if coll != "barrier" else "none",
                                   op or "none", opts.root if coll in _ROOTED else -1, cells))
        if len(opts.colls) > 1 and coll != "barrier":
            say(f"# Avg bus bandwidth ({coll}) : {c_sum / c_count if c_count else 0.0:.6g}")
            say("#")
    say(wrong_line(total_wrong, opts.check))
    dirty = sum(1 for r in rows if r["contaminated"])
    if dirty:
        say(f"# Foreign CPU load     : {dirty} of {len(rows)} timed loops (other processes used the CPU; "
            "foreign_cpu_s in --json)")
    avg = bw_sum / bw_count if bw_count else 0.0
    say(f"# Avg bus bandwidth    : {avg:.6g}")
    say("#")
    if rank == 0 and opts.json_path:
        path = os.path.abspath(opts.json_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows, "avg_busbw_GBps": avg, "wrong_total": total_wrong}, f,
                      indent=1)
    return exit_code(tw, total_wrong)


def wrong_line(total_wrong: int, checked: bool) -> str:
    return (f"# Wrong values         : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}"
            if checked else "# Wrong values         : not checked (-c 0)")


def exit_code(tw: Any, total_wrong: int) -> int:
    """Every rank exits with the same code: 1 when any element was wrong (as nccl-tests)."""
    verdict = np.array([total_wrong], dtype=np.int64)
    tw.broadcast(verdict, 0)
    if tw.get_rank() == 0 and verdict[0]:
        print(f"tensorwire bench: {int(verdict[0])} wrong value(s), see the #wrong columns",
              file=sys.stderr, flush=True)
    return 1 if verdict[0] else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of `tensorwire bench` (and of `python -m tensorwire.bench` in every rank)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts = parse_options(argv)
    except SystemExit as exc:  # --help or a usage error: argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    except ValueError as exc:
        print(f"tensorwire bench: error: {exc}", file=sys.stderr)
        return 2
    assert opts.args is not None
    if opts.args.compare_member:
        opts.json_path = opts.args.compare_member  # one launch of --compare: its rows, nothing else
    elif opts.args.compare:
        return _compare(opts)
    elif opts.args.plot:
        try:
            report.check_plotting()
        except RuntimeError as exc:
            print(f"tensorwire bench: error: {exc}", file=sys.stderr)
            return 2
    if opts.args.nprocs is not None and not in_launched_job():
        if opts.args.nprocs > 1:
            return relaunch_with_progress(opts)
    elif not in_launched_job():
        print("# tensorwire bench: 1 rank (pass --np N for more, or start it under a launcher)",
              file=sys.stderr)
    try:
        return run_benchmark(opts)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        return int(exc.code or 0)


def _compare(opts: Options) -> int:
    from .benchmarks import compare

    if in_launched_job():
        print("tensorwire bench: error: --compare starts every library's job itself; run it outside a "
              "launcher (with --np N)", file=sys.stderr)
        return 2
    try:
        compare.validate(opts)
        return compare.run(opts)
    except (ValueError, RuntimeError) as exc:
        print(f"tensorwire bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
