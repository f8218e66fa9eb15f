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
* Timing differs from nccl-tests on purpose (it matches the project's anchor harness): per
  size, W warm-up calls, a barrier, then N calls each timed with perf_counter on every rank;
  the time of call i is the maximum over ranks, and the reported time is the median over
  the N calls. Per-call times are gathered to rank 0 with tensorwire itself after the loop.
* #wrong: after the timed loop the inputs are re-initialised, one more call is made and its
  result is compared element by element with a numpy reference built from every rank's
  input (`tensorwire.ops.reference` for reductions). Inputs are small integers, exact in
  every dtype, so any summation order gives the same bits.

`--np N` starts N ranks through the launcher (`tensorwire run -n N -m tensorwire.bench ...`);
inside a launched job (tensorwire run, torchrun, mpirun, srun) the bench just runs.
`barrier` is not an nccl-tests collective: it is shown as one row of size 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "alltoall",
               "gather", "scatter", "sendrecv", "barrier")
DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
          "bfloat16")
OPS = ("sum", "prod", "max", "min", "avg")  # nccl-tests' order for -o all
_REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})
_ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})
_NO_INPLACE = frozenset({"alltoall", "sendrecv", "barrier"})
"""In-place alltoall / sendrecv would send and receive through the same bytes at once."""

PATTERN_LEN = 1021
"""Inputs repeat with this (prime) period, so blocks at power-of-two offsets hold different data."""
CHECK_CHUNK = 1 << 20
"""Elements compared per step: the reference never needs more than a few chunks of memory."""

EPILOG = """\
examples:
  tensorwire bench all_reduce -b 8 -e 64M -f 4 --np 2        8 B, 32 B, ... (x4) up to 64 MiB, 2 ranks
  tensorwire bench all_reduce -b 8 -e 64M -f 4 --np 2 --tcp  the same over TCP
  tensorwire bench all -b 8 -e 1M --np 4 --json out.json     every collective, results as JSON
  tensorwire run -n 2 -m tensorwire.bench broadcast -r 1      under the launcher explicitly

columns (as nccl-tests): size (B), count (elements per rank parameter), type, redop, root,
then for out-of-place and in-place: time (us, median over iterations of the slowest rank),
algbw = size/time and busbw = algbw x factor (GB/s), #wrong (elements that differ from the
numpy reference in one checked call; N/A with -c 0).
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
    p.add_argument("-n", "--iters", type=_positive_int, default=20, metavar="N",
                   help="timed iterations per size (default 20)")
    p.add_argument("-w", "--warmup_iters", type=_nonneg_int, default=5, metavar="W",
                   help="warm-up iterations per size, not timed (default 5)")
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
                   help="also write every row, with p10/p90/mean, as JSON to PATH (rank 0)")
    p.add_argument("--algo", default=None, metavar="NAME|all",
                   help="force one algorithm (e.g. ring), or `all`: per size, the tuner's choice and every "
                        "eligible algorithm, each with the cost model's prediction (one placement: "
                        "out-of-place, or in-place with -I)")
    p.add_argument("--rounds", type=_positive_int, default=1, metavar="R",
                   help="with --algo: repeat the algorithms R times interleaved and pool the iterations "
                        "(default 1)")
    return p


@dataclass
class Options:
    colls: list[str]
    sizes: list[int]
    dtypes: list[np.dtype]
    ops: list[str]
    root: int
    iters: int
    warmup: int
    check: bool
    inplace_only: bool
    json_path: str | None
    argv: list[str] = field(default_factory=list)
    args: argparse.Namespace | None = None


def size_list(minbytes: int, maxbytes: int, stepfactor: int, stepbytes: int) -> list[int]:
    """nccl-tests' loop: multiply by the factor, or add stepbytes when the factor is 1."""
    if maxbytes < minbytes:
        raise ValueError(f"maxbytes {maxbytes} is smaller than minbytes {minbytes}")
    if stepfactor <= 1 and stepbytes <= 0:
        raise ValueError("with --stepfactor 1, --stepbytes must be positive")
    out, s = [], minbytes
    while s <= maxbytes:
        out.append(s)
        if stepfactor > 1:
            if s == 0:
                s = 1  # 0 * factor would never end; nccl-tests has the same corner
                continue
            s *= stepfactor
        else:
            s += stepbytes
    return out


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
    colls = list(COLLECTIVES) if args.collective == "all" else [args.collective]
    sizes = size_list(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    return Options(colls=colls, sizes=sizes, dtypes=_dtype_list(args.datatype), ops=_op_list(args.op),
                   root=args.root, iters=args.iters, warmup=args.warmup_iters, check=bool(args.check),
                   inplace_only=args.inplace_only, json_path=args.json, argv=list(argv), args=args)


# ------------------------------------------------------------------------------------------
# Sizes and bandwidth, as nccl-tests


def busbw_factor(coll: str, n: int) -> float:
    if coll == "all_reduce":
        return 2.0 * (n - 1) / n
    if coll in ("all_gather", "reduce_scatter", "alltoall", "gather", "scatter"):
        return (n - 1) / n
    if coll in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    if coll == "barrier":
        return 0.0
    raise ValueError(f"unknown collective {coll!r}")


def coll_counts(coll: str, count: int, n: int) -> tuple[int, int, int]:
    """(send count, receive count, parameter count) for `count` = size // itemsize elements."""
    if coll in ("all_reduce", "broadcast", "reduce", "sendrecv"):
        return count, count, count
    per = count // n
    if coll in ("all_gather", "gather"):
        return per, per * n, per
    if coll in ("reduce_scatter", "scatter"):
        return per * n, per, per
    if coll == "alltoall":
        return per * n, per * n, per
    if coll == "barrier":
        return 0, 0, 0
    raise ValueError(f"unknown collective {coll!r}")


def effective_bytes(coll: str, nominal: int, itemsize: int, n: int) -> tuple[int, int]:
    """(size in bytes as printed, per-rank count) after nccl-tests' rounding."""
    send, recv, param = coll_counts(coll, nominal // itemsize, n)
    return max(send, recv) * itemsize, param


# ------------------------------------------------------------------------------------------
# Inputs, reference and checking


def pattern(dtype: np.dtype, op: str, rank: int) -> np.ndarray:
    """One period of rank `rank`'s input: small integers, exact in every supported dtype.

    Sums stay within +-4n and products are powers of two, so the reduction result does not
    depend on the order in which ranks are combined, and every dtype can hold it.
    """
    k = np.arange(PATTERN_LEN, dtype=np.int64)
    if op == "prod":
        v = 1 + ((k + 3 * rank) % 7 == 0).astype(np.int64)
    else:
        v = (5 * k + 3 * rank) % 9
        if dtype.kind != "u":
            v = v - 4
    if dtype.kind in "iu":
        return v.astype(dtype)
    return v.astype(np.float64).astype(dtype)


def fill(buf: np.ndarray, pat: np.ndarray, start: int = 0) -> None:
    """buf[j] = pat[(start + j) % len(pat)], without temporaries of buf's size."""
    size = buf.size
    if size == 0:
        return
    period = pat.size
    rolled = np.roll(pat, -(start % period))
    whole = size // period
    if whole:
        buf[:whole * period].reshape(whole, period)[...] = rolled
    rest = size - whole * period
    if rest:
        buf[whole * period:] = rolled[:rest]


def segment(pat: np.ndarray, start: int, length: int) -> np.ndarray:
    out = np.empty(length, dtype=pat.dtype)
    fill(out, pat, start)
    return out


def count_wrong(actual: np.ndarray, expected: np.ndarray) -> int:
    """Elements of `actual` that differ from `expected` (NaN equals NaN; -0.0 equals 0.0)."""
    a, e = np.asarray(actual).reshape(-1), np.asarray(expected).reshape(-1)
    if a.size != e.size:
        raise ValueError(f"count_wrong: {a.size} elements against {e.size} expected")
    if a.dtype.kind in "iub":
        return int(np.count_nonzero(a != e))
    if a.dtype.itemsize < 4 or a.dtype.kind == "V" or a.dtype.type.__module__.startswith("ml_dtypes"):
        a, e = a.astype(np.float32), e.astype(np.float32)  # half, bfloat16: exact in float32
    differ = a != e
    if a.dtype.kind in "fc":
        differ &= ~(np.isnan(a) & np.isnan(e))
    return int(np.count_nonzero(differ))


@dataclass(frozen=True)
class Piece:
    """Part of the expected output: out[at:at+length] = input_src[start:start+length] of one rank,
    or the reduction over all ranks when `src` is None."""

    at: int
    length: int
    src: int | None
    start: int


def expected_pieces(coll: str, rank: int, n: int, root: int, param: int) -> list[Piece]:
    """What this rank's receive buffer must hold after the collective (nothing for non-roots
    of reduce and gather, whose receive buffers nccl-tests does not check either)."""
    c = param
    if coll == "all_reduce":
        return [Piece(0, c, None, 0)]
    if coll == "broadcast":
        return [Piece(0, c, root, 0)]
    if coll == "reduce":
        return [Piece(0, c, None, 0)] if rank == root else []
    if coll == "all_gather" or (coll == "gather" and rank == root):
        return [Piece(r * c, c, r, 0) for r in range(n)]
    if coll == "gather":
        return []
    if coll == "reduce_scatter":
        return [Piece(0, c, None, rank * c)]
    if coll == "alltoall":
        return [Piece(r * c, c, r, rank * c) for r in range(n)]
    if coll == "scatter":
        return [Piece(0, c, root, rank * c)]
    if coll == "sendrecv":
        return [Piece(0, c, (rank - 1) % n, 0)]
    return []


def check_result(out: np.ndarray, pieces: Sequence[Piece], patterns: Sequence[np.ndarray],
                 reduction: Any) -> int:
    """Wrong elements of `out` against the pieces, built chunk by chunk (bounded memory)."""
    from .ops import reference

    wrong = 0
    for piece in pieces:
        for off in range(0, piece.length, CHECK_CHUNK):
            m = min(CHECK_CHUNK, piece.length - off)
            if piece.src is None:
                want = reference([segment(p, piece.start + off, m) for p in patterns], reduction)
            else:
                want = segment(patterns[piece.src], piece.start + off, m)
            wrong += count_wrong(out[piece.at + off:piece.at + off + m], want)
    return wrong


# ------------------------------------------------------------------------------------------
# One measured case


@dataclass
class Buffers:
    """Allocated once for the largest size; every case uses views (as nccl-tests does)."""

    send: np.ndarray
    recv: np.ndarray


@dataclass
class Case:
    coll: str
    dtype: np.dtype
    op: str | None
    root: int
    rank: int
    n: int
    size: int  # bytes, after rounding
    send_count: int
    recv_count: int
    param: int
    inplace: bool
    send: np.ndarray
    recv: np.ndarray
    call: Callable[[], Any]
    patterns: list[np.ndarray]
    reduction: Any

    def init_inputs(self, sentinel: bool) -> None:
        fill(self.send, self.patterns[self.rank], 0)
        if sentinel and not self.inplace and self.recv.size:
            self.recv[...] = 77  # not a value the collective can produce for small n

    def wrong(self) -> int:
        pieces = expected_pieces(self.coll, self.rank, self.n, self.root, self.param)
        return check_result(self.recv, pieces, self.patterns, self.reduction)


def make_case(tw: Any, coll: str, dtype: np.dtype, op: str | None, root: int, nominal: int,
              inplace: bool, bufs: Buffers) -> Case:
    from .ops import as_reduction

    rank, n = tw.get_rank(), tw.get_world_size()
    send_count, recv_count, param = coll_counts(coll, nominal // dtype.itemsize, n)
    size = max(send_count, recv_count) * dtype.itemsize
    sbuf = bufs.send.view(dtype)
    rbuf = bufs.recv.view(dtype)
    if inplace:
        if coll in ("all_gather", "gather"):
            recv = rbuf[:recv_count]
            send = recv[rank * param:(rank + 1) * param]
        elif coll in ("reduce_scatter", "scatter"):
            send = rbuf[:send_count]
            recv = send[rank * param:(rank + 1) * param]
        else:
            send = recv = rbuf[:send_count]
    else:
        send, recv = sbuf[:send_count], rbuf[:recv_count]
    red = as_reduction(op) if op else None
    blocks = [recv[r * param:(r + 1) * param] for r in range(n)]
    sblocks = [send[r * param:(r + 1) * param] for r in range(n)]
    world = tw.world()
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
        glist = blocks if rank == root else None
        call = lambda: tw.gather(send, glist, root)  # noqa: E731
    elif coll == "scatter":
        slist = sblocks if rank == root else None
        call = lambda: tw.scatter(recv, slist, root)  # noqa: E731
    elif coll == "sendrecv":
        dst, src = (rank + 1) % n, (rank - 1) % n

        def call() -> None:
            reqs = [world.isend(send, dst), world.irecv(recv, src)]
            for req in reqs:
                req.wait()
    elif coll == "barrier":
        call = tw.barrier
    else:
        raise ValueError(coll)
    patterns = [pattern(dtype, op or "none", r) for r in range(n)]
    return Case(coll, dtype, op, root, rank, n, size, send_count, recv_count, param, inplace, send, recv,
                call, patterns, red)


@dataclass
class Measured:
    times: list[float]  # seconds per timed call on this rank
    wrong: int  # -1: not checked


def measure(tw: Any, case: Case, warmup: int, iters: int, check: bool) -> Measured:
    """W warm-up calls, a barrier, N individually timed calls, then one checked call."""
    perf = time.perf_counter
    call = case.call
    case.init_inputs(sentinel=False)
    # In-place reductions feed each result into the next call: values may overflow to inf
    # or wrap. That is expected here and costs nothing; keep numpy quiet about it.
    with np.errstate(all="ignore"):
        for _ in range(warmup):
            call()
        times = [0.0] * iters
        tw.barrier()
        for i in range(iters):
            t0 = perf()
            call()
            times[i] = perf() - t0
    wrong = -1
    if check and case.coll != "barrier":
        case.init_inputs(sentinel=True)
        call()
        wrong = case.wrong()
    elif check:
        wrong = 0
    return Measured(times, wrong)


def collect(tw: Any, m: Measured) -> tuple[list[list[float]], int] | None:
    """Rank 0 gets every rank's per-call times and the total #wrong (None elsewhere)."""
    rank, n = tw.get_rank(), tw.get_world_size()
    mine = np.array([*m.times, float(m.wrong)], dtype=np.float64)
    glist = [np.empty_like(mine) for _ in range(n)] if rank == 0 else None
    tw.gather(mine, glist, 0)
    if glist is None:
        return None
    per_rank = [g[:-1].tolist() for g in glist]
    wrongs = [int(g[-1]) for g in glist]
    return per_rank, (-1 if any(w < 0 for w in wrongs) else sum(wrongs))


def summarize(per_rank: Sequence[Sequence[float]]) -> dict[str, float]:
    """Call i's time = max over ranks; median (the headline), p10, p90, min, max over calls;
    mean = the slowest rank's loop time / N (back-to-back view, includes tails)."""
    nops = len(per_rank[0])
    worst = sorted(max(rs[i] for rs in per_rank) for i in range(nops))
    return {
        "time_us": statistics.median(worst) * 1e6,
        "p10_us": worst[nops // 10] * 1e6,
        "p90_us": worst[min(nops - 1, (nops * 9) // 10)] * 1e6,
        "min_us": worst[0] * 1e6,
        "max_us": worst[-1] * 1e6,
        "mean_us": max(sum(rs) / nops for rs in per_rank) * 1e6,
    }


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
        return f"  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>6}"
    wrong = "N/A" if result["wrong"] < 0 else str(result["wrong"])
    return (f"  {_time_str(result['time_us'])}  {result['algbw_GBps']:6.2f}  {result['busbw_GBps']:6.2f}"
            f"  {wrong:>6}")


def _header_lines(inplace_only: bool) -> list[str]:
    left = f"#{'size':>11}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}"
    units = f"#{'(B)':>11}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}"
    cols = f"  {'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}"
    cunits = f"  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}"
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
        kinds = sorted({type(c).__name__.replace("Channel", "").lower() for c in channels})
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
        f"minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} warmup iters: {opts.warmup} "
        f"iters: {opts.iters} validation: {int(opts.check)}",
        "#",
        f"# time = median over the {opts.iters} timed iterations of the slowest rank's time for that "
        "iteration",
        "# (every iteration timed separately on every rank, after warm-up and a barrier);",
        "# algbw = size / time, busbw = algbw x nccl-tests factor; 1 GB/s = 1e9 B/s",
        "#",
        "# Using ranks",
    ]
    for rank, pid, host, transport in everyone:
        lines.append(f"#  Rank {rank:2d} Pid {pid:7d} on {host:>12} transport {transport}")
    lines.append("#")
    return lines


def run_benchmark(opts: Options, out: Callable[[str], None] = print) -> int:
    import tensorwire as tw

    if opts.args is not None and opts.args.tcp:
        os.environ["TENSORWIRE_TRANSPORT"] = "tcp"
    tw.init()
    try:
        return _run(tw, opts, out)
    finally:
        tw.destroy()


def _run(tw: Any, opts: Options, out: Callable[[str], None]) -> int:
    from .ops import as_reduction, check_op_dtype, dtype_name

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
    max_send = max_recv = 0
    for coll in opts.colls:
        for s in opts.sizes:
            for dt in opts.dtypes:
                snd, rcv, _ = coll_counts(coll, s // dt.itemsize, n)
                max_send = max(max_send, snd * dt.itemsize)
                max_recv = max(max_recv, max(snd, rcv) * dt.itemsize)
    # Bytes, viewed as each dtype: round up to a multiple of 16 so every itemsize divides them.
    bufs = Buffers(np.zeros(-(-max_send // 16) * 16, dtype=np.uint8),
                   np.zeros(-(-max_recv // 16) * 16, dtype=np.uint8))

    for line in _rank_banner(tw, opts):
        say(line)
    meta = {
        "tool": "tensorwire bench", "version": getattr(tw, "__version__", "?"), "nranks": n,
        "transport": _transport_of(tw), "host": platform.node(), "python": platform.python_version(),
        "numpy": np.__version__, "argv": opts.argv, "warmup": opts.warmup, "iters": opts.iters,
        "timing": "per-iteration max over ranks, median over iterations",
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
        dtypes = opts.dtypes if coll != "barrier" else opts.dtypes[:1]
        for dt in dtypes:
            ops_ = opts.ops if coll in _REDUCING else [None]
            for op in ops_:
                if op is not None:
                    try:
                        check_op_dtype(as_reduction(op), dt, rank=rank, collective=coll)
                    except Exception as exc:
                        say(f"# skipped {coll} {dtype_name(dt)} {op}: {exc}")
                        continue
                sizes = opts.sizes if coll != "barrier" else [0]
                for nominal in sizes:
                    placements = [True] if opts.inplace_only else [False, True]
                    cells: list[dict[str, Any] | None] = []
                    size = count = 0
                    for inplace in placements:
                        if inplace and coll in _NO_INPLACE:
                            cells.append(None)
                            continue
                        case = make_case(tw, coll, dt, op, opts.root, nominal, inplace, bufs)
                        size, count = case.size, case.param
                        got = collect(tw, measure(tw, case, opts.warmup, opts.iters, opts.check))
                        if got is None:
                            cells.append({})
                            continue
                        per_rank, wrong = got
                        stats = summarize(per_rank)
                        algbw = size / (stats["time_us"] * 1e-6) / 1e9 if stats["time_us"] > 0 else 0.0
                        busbw = algbw * busbw_factor(coll, n)
                        cell = {"wrong": wrong, "algbw_GBps": algbw, "busbw_GBps": busbw, **stats}
                        cells.append(cell)
                        if wrong > 0:
                            total_wrong += wrong
                        if coll != "barrier":
                            bw_sum, bw_count = bw_sum + busbw, bw_count + 1
                            c_sum, c_count = c_sum + busbw, c_count + 1
                        rows.append({
                            "coll": coll, "nranks": n, "nominal": nominal, "size": size, "count": count,
                            "type": dtype_name(dt) if coll != "barrier" else "none",
                            "redop": op or "none", "root": opts.root if coll in _ROOTED else -1,
                            "placement": "in-place" if inplace else "out-of-place",
                            "warmup": opts.warmup, "iters": opts.iters, **cell,
                        })
                    if rank == 0:
                        say(format_row(size, count, dtype_name(dt) if coll != "barrier" else "none",
                                       op or "none", opts.root if coll in _ROOTED else -1, cells))
        if len(opts.colls) > 1 and coll != "barrier":
            say(f"# Avg bus bandwidth ({coll}) : {c_sum / c_count if c_count else 0.0:.6g}")
            say("#")
    say(wrong_line(total_wrong, opts.check))
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
    if opts.args.nprocs is not None and not in_launched_job():
        if opts.args.nprocs > 1:
            return relaunch(opts)
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


if __name__ == "__main__":
    raise SystemExit(main())
