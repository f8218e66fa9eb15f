"""The command line of `tensorwire bench`: its parser and the options a sweep runs with."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ...config import parse_size
from .sweep import COLLECTIVES, NO_INPLACE, REDUCING, size_list

DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
          "bfloat16")


OPS = ("sum", "prod", "max", "min", "avg")  # nccl-tests' order for -o all


EPILOG = """\
examples:
  tensorwire bench all_reduce -b 8 -e 64M -f 4 --np 2        8 B, 32 B, ... (x4) up to 64 MiB, 2 ranks
  tensorwire bench all_reduce -b 8 -e 64M -f 4 --np 2 --tcp  the same over TCP
  tensorwire bench all -b 8 -e 1M --np 4 --json out.json     every collective, results as JSON
  tensorwire run -n 2 -m tensorwire.tools.bench broadcast -r 1      under the launcher explicitly
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
Peers need torch (pip install 'tensorwire[torch]'), mpi4py (pip install mpi4py) and mpiexec
(apt-get install -y openmpi-bin libopenmpi-dev); a missing one is skipped with that hint.
Plots need matplotlib and the progress bar uses rich: pip install 'tensorwire[bench]'.

--algo all: per size, one line per algorithm (auto:NAME is the tuner's own choice, the others
are forced in turn, * marks the fastest forced one): time (the median call), mean call (by
which the fastest is found), predicted (us, the cost model with this job's calibrated
constants), mean/pred, busbw and #wrong; then a comment line
with auto's time and prediction, the best forced algorithm and auto/best. --algo NAME forces
that one algorithm (sizes where it cannot run say so).
"""


LIBRARIES = ("gloo", "mpi")  # what --compare runs beside tensorwire


def size_argument(text: str) -> int:
    """An option's size (config.parse_size), its error as argparse shows it: after the option."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {v}")
        return v
    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _count_or_auto(check: Callable[[str], int]) -> Callable[[str], int | None]:
    """-n / -w: a count, or `auto` (None) for the per-size schedule of `sweep.schedule`."""
    def parse(text: str) -> int | None:
        return None if text.strip().lower() == "auto" else check(text)
    return parse


def parse_libraries(text: str) -> list[str]:
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [x for x in names if x not in LIBRARIES]
    if bad or not names:
        raise ValueError(f"--compare {text!r}: expected gloo, mpi or gloo,mpi")
    return list(dict.fromkeys(names))


def _collective(name: str) -> str:
    """The sweep's name of a collective, as `tensorwire plan` and TENSORWIRE_ALGO read names (case,
    `_` and `-` ignored: allreduce, AllReduce); all_to_all is nccl-tests' alltoall."""
    key = name.replace("_", "").replace("-", "").lower()
    return {c.replace("_", ""): c for c in (*COLLECTIVES, "all")}.get(key, name)


def build_parser(prog: str = "tensorwire bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Measure collective time, algorithm bandwidth and bus bandwidth over a range "
                    "of message sizes, with the flags and columns of nccl-tests.")
    p.add_argument("collective", metavar="COLL", type=_collective, choices=(*COLLECTIVES, "all"),
                   help=f"one of {', '.join(COLLECTIVES)} (all_to_all is alltoall), or all")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: CUDA tensors, ranks round robin over the GPUs, with Gloo and NCCL beside "
                        "(its options: tensorwire bench --device cuda --help); default cpu")
    p.add_argument("-b", "--minbytes", type=size_argument, default=8, metavar="SIZE",
                   help="smallest size (default 8); sizes read as nccl-tests: 8, 64K, 1M, 2G")
    p.add_argument("-e", "--maxbytes", type=size_argument, default=32 << 20, metavar="SIZE",
                   help="largest size (default 32M)")
    p.add_argument("-f", "--stepfactor", type=_positive_int, default=2, metavar="F",
                   help="multiply the size by F each step (default 2); 1 means add --stepbytes")
    p.add_argument("-i", "--stepbytes", type=size_argument, default=1 << 20, metavar="SIZE",
                   help="increment between sizes when --stepfactor is 1 (default 1M)")
    p.add_argument("-n", "--iters", type=_count_or_auto(_positive_int), default=20, metavar="N",
                   help="timed iterations per size (default 20); auto: by size, 1000 up to 4 KiB "
                        "down to 5 above 64 MiB")
    p.add_argument("-w", "--warmup_iters", type=_count_or_auto(_nonneg_int), default=5, metavar="W",
                   help="warm-up iterations per size, not timed (default 5); auto: by size, 20 down to 1")
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
    p.add_argument("--tcp-ceiling", action="store_true",
                   help="first measure what raw sockets move between two processes of this machine "
                        "(64 MiB over 1, 2, 4 and 8 sockets, a thread each) and print it above the "
                        "tables, with sendrecv's bandwidth as a fraction of it")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write every row, with mean, p10/p50/p90/p99, min and max, as JSON to PATH "
                        "(rank 0); after Ctrl-C, the rows measured before it, meta.partial set")
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
                        "else a known one that has them)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also plot time and busbw against size, one line per library and placement "
                        "(needs matplotlib)")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="also write the tables as markdown, with the command and the machine (after "
                        "Ctrl-C, what was measured before it, titled partial)")
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
    from ...ops.dtypes import dtype_from_name

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


def _writable(path: str, option: str) -> None:
    """An output path the sweep can write once it is done (its missing folders are made then):
    a folder, or a place nobody may write, is said before any rank starts."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise ValueError(f"{option} {path!r} is a directory; give a file name")
    place = os.path.dirname(full)
    while not os.path.exists(place):
        place = os.path.dirname(place)
    try:
        with tempfile.TemporaryFile(dir=place):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {path!r}: cannot write in {place} ({exc.strerror})") from None


def parse_options(argv: Sequence[str], prog: str = "tensorwire bench") -> Options:
    """Parse and validate; raises SystemExit (argparse) or ValueError with a user message."""
    args = build_parser(prog).parse_args(list(argv))
    if args.algo and (args.iters is None or args.warmup_iters is None):
        raise ValueError("--algo takes fixed -n and -w counts, not auto")
    if args.algo and args.compare:
        raise ValueError("--algo and --compare do not go together")
    if args.rounds is not None and not (args.algo or args.compare):
        raise ValueError("--rounds repeats an --algo or --compare sweep; a plain sweep runs once "
                         "(-n sets its calls)")
    if args.algo and args.plot:
        raise ValueError("--plot draws a plain or --compare sweep; with --algo use --markdown or --json")
    if args.rounds is None:
        args.rounds = 3 if args.compare else 1
    for option, path in (("--json", args.json), ("--plot", args.plot), ("--markdown", args.markdown)):
        if path:
            _writable(path, option)
    colls = list(COLLECTIVES) if args.collective == "all" else [args.collective]
    sizes = size_list(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    return Options(colls=colls, sizes=sizes, dtypes=_dtype_list(args.datatype), ops=_op_list(args.op),
                   root=args.root, iters=args.iters, warmup=args.warmup_iters, check=bool(args.check),
                   inplace_only=args.inplace_only, blocking=bool(args.blocking), json_path=args.json,
                   argv=list(argv), args=args)


def planned_cells(opts: Options) -> int:
    """Timed loops the sweep will run (for the progress bar; skipped op / dtype pairs count)."""
    places = ["in-place"] if opts.inplace_only else ["out-of-place", "in-place"]
    total = 0
    for coll in opts.colls:
        if coll == "barrier":
            total += 1
            continue
        variants = len(opts.dtypes) * (len(opts.ops) if coll in REDUCING else 1)
        total += len(opts.sizes) * variants * sum(1 for p in places if p == "out-of-place"
                                                  or coll not in NO_INPLACE)
    return total
