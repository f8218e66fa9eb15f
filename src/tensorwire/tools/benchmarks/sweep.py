"""How `tensorwire bench` measures any library: sizes, buffers, the timed loop, statistics.

tensorwire's own sweep (`tensorwire.tools.bench`) and the peer runners that time Gloo and Open MPI
(`gloo_runner`, `mpi_runner`) build their cases and take their figures here, so a time means
the same thing whichever library it belongs to: W warm-up calls, a barrier, then N calls each
timed with perf_counter on every rank (with `blocking`, each after a barrier of its own); the
figure is the mean call, as nccl-tests reports it, with the median and the 99th percentile
beside it (see `summarize`). Sizes, element counts and bus-bandwidth factors are nccl-tests'
(see `tensorwire.tools.bench`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ...buffers import huge_zeros
from . import check as checks
from .loadmeter import ForeignLoad, contaminated

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "alltoall",
               "gather", "scatter", "sendrecv", "barrier")
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})
NO_INPLACE = frozenset({"alltoall", "sendrecv", "barrier"})
"""In-place alltoall / sendrecv would send and receive through the same bytes at once."""
PLACEMENTS = ("out-of-place", "in-place")

_SCHEDULE = ((4 << 10, 20, 1000), (64 << 10, 10, 200), (1 << 20, 5, 50), (16 << 20, 3, 20), (64 << 20, 2, 10))
_SCHEDULE_LARGEST = (1, 5)


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


def schedule(nbytes: int) -> tuple[int, int]:
    """(warm-up calls, timed calls) of `-w auto` / `-n auto`: fewer calls at larger sizes.

    Fixed per size class rather than adaptive, so two runs time the same number of calls; at
    most a few seconds per size on a small machine, enough calls for a stable mean.
    """
    for limit, warmup, iters in _SCHEDULE:
        if nbytes <= limit:
            return warmup, iters
    return _SCHEDULE_LARGEST


def busbw_factor(coll: str, n: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth; pingpong's time is a round trip
    (tools/benchmarks/cuda.py), its bus bandwidth the rate one way."""
    if coll == "all_reduce":
        return 2.0 * (n - 1) / n
    if coll in ("all_gather", "reduce_scatter", "alltoall", "gather", "scatter"):
        return (n - 1) / n
    if coll in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    if coll == "pingpong":
        return 2.0
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


# ------------------------------------------------------------------------------------------
# Cases


@dataclass
class Buffers:
    """Allocated once for the largest size; every case uses views (as nccl-tests does).

    In huge pages throughout (buffers.huge_zeros), for every library alike: where a peer reads
    them across processes (tensorwire's single copy, Open MPI's CMA), the speed depends on it
    (docs/design/memory.md), and numpy's own arrays would leave it to malloc's alignment (the
    edges in 4 KiB pages)."""

    send: np.ndarray
    recv: np.ndarray

    @classmethod
    def for_cases(cls, colls: Iterable[str], sizes: Sequence[int], dtypes: Sequence[np.dtype],
                  n: int) -> Buffers:
        max_send = max_recv = 0
        for coll in colls:
            for s in sizes:
                for dt in dtypes:
                    snd, rcv, _ = coll_counts(coll, s // dt.itemsize, n)
                    max_send = max(max_send, snd * dt.itemsize)
                    max_recv = max(max_recv, max(snd, rcv) * dt.itemsize)
        # Bytes, viewed as each dtype: round up to a multiple of 16 so every itemsize divides them.
        return cls(huge_zeros(-(-max_send // 16) * 16), huge_zeros(-(-max_recv // 16) * 16))


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

    def recv_blocks(self) -> list[np.ndarray]:
        return [self.recv[r * self.param:(r + 1) * self.param] for r in range(self.n)]

    def send_blocks(self) -> list[np.ndarray]:
        return [self.send[r * self.param:(r + 1) * self.param] for r in range(self.n)]

    def init_inputs(self, sentinel: bool) -> None:
        checks.fill(self.send, self.patterns[self.rank], 0)
        if sentinel and not self.inplace and self.recv.size:
            self.recv[...] = 77  # not a value the collective can produce for small n

    def wrong(self) -> int:
        pieces = checks.expected_pieces(self.coll, self.rank, self.n, self.root, self.param)
        return checks.check_result(self.recv, pieces, self.patterns, self.reduction)


def _unbound() -> None:
    raise RuntimeError("case used before its library bound a call to it")


def make_case(coll: str, dtype: np.dtype, op: str | None, root: int, nominal: int, inplace: bool,
              bufs: Buffers, rank: int, n: int, bind: Callable[[Case], Callable[[], Any]]) -> Case:
    """The send and receive views of one case, with `bind(case)` as the library's call.

    In place means nccl-tests' in place, whatever the library: all_gather / gather read the
    rank's input from its block of the output, reduce_scatter / scatter write the rank's
    output into its block of the input, every other collective uses one buffer.
    """
    from ...ops.reduce_op import as_reduction

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
    patterns = [checks.pattern(dtype, op or "none", r) for r in range(n)]
    case = Case(coll, dtype, op, root, rank, n, size, send_count, recv_count, param, inplace, send, recv,
                _unbound, patterns, as_reduction(op) if op else None)
    case.call = bind(case)
    return case


# ------------------------------------------------------------------------------------------
# The timed loop and its statistics


class Barrier(Protocol):
    def barrier(self) -> Any: ...


@dataclass
class Measured:
    times: list[float]  # seconds per timed call on this rank
    wrong: int  # -1: not checked
    warmup: int = 0
    wall_s: float = 0.0  # the whole timed loop on this rank
    foreign_s: float | None = None  # CPU used by other processes meanwhile (where metered)
    foreign_top: list[tuple[int, float, str]] | None = None  # the biggest of them: pid, CPU s, command


def measure(comm: Barrier, case: Case, warmup: int | None, iters: int | None, check: bool,
            meter: ForeignLoad | None = None, blocking: bool = False) -> Measured:
    """W warm-up calls, a barrier, N individually timed calls, then one checked call.

    Back to back (nccl-tests' default), a call may overlap the next where a rank has nothing to
    wait for (a broadcast's root and leaves, a gather's senders): its time is then the pipeline's
    rate. `blocking` (nccl-tests' `-z 1`) puts an untimed barrier before each call, so that each
    is timed on its own, as one whose result is used at once, and as the cost model prices it.

    `warmup` / `iters` None: `schedule(case.size)`. `comm` is anything with a barrier(): the
    tensorwire module or a peer library. The meter (on one rank) starts before the barrier,
    as its /proc scan takes a few milliseconds, and stops after the loop.
    """
    auto_w, auto_n = schedule(case.size)
    warmup = auto_w if warmup is None else warmup
    iters = auto_n if iters is None else iters
    perf = time.perf_counter
    call = case.call
    case.init_inputs(sentinel=False)
    # In-place reductions feed each result into the next call: values may overflow to inf
    # or wrap. That is expected here and costs nothing; keep numpy quiet about it.
    with np.errstate(all="ignore"):
        for _ in range(warmup):
            call()
        times = [0.0] * iters
        if meter is not None:
            meter.start()
        comm.barrier()
        wall = perf()
        for i in range(iters):
            if blocking:
                comm.barrier()
            t0 = perf()
            call()
            times[i] = perf() - t0
        wall = perf() - wall
    foreign = meter.stop() if meter is not None else None
    top = meter.top if meter is not None else None
    wrong = -1
    if check and case.coll != "barrier":
        case.init_inputs(sentinel=True)
        call()
        wrong = case.wrong()
    elif check:
        wrong = 0
    return Measured(times, wrong, warmup, wall, foreign, top)


def pack(m: Measured) -> np.ndarray:
    """What each rank sends to rank 0 after a case: its per-call times, then its #wrong."""
    return np.array([*m.times, float(m.wrong)], dtype=np.float64)


def unpack(gathered: Sequence[np.ndarray]) -> tuple[list[list[float]], int]:
    """(per-rank times, total #wrong; -1 when any rank did not check) from every rank's pack()."""
    per_rank = [np.asarray(g)[:-1].tolist() for g in gathered]
    wrongs = [int(np.asarray(g)[-1]) for g in gathered]
    return per_rank, (-1 if any(w < 0 for w in wrongs) else sum(wrongs))


def summarize(per_rank: Sequence[Sequence[float]]) -> dict[str, float]:
    """The figures of one timed loop, in microseconds.

    `time_us` (the headline, also as `mean_us`) is the mean call: the slowest rank's time over
    its calls, stalls included, as nccl-tests reports it (its `-a 3`: the maximum over ranks of
    each rank's mean); what a loop of such calls costs, and what the cost model prices. Beside
    it the distribution of the calls, each call counted at its slowest rank (where it has
    finished everywhere): `p50_us` (the median, the headline before), `p99_us` (nearest rank:
    the slowest call when there are fewer than 100), and `p10_us`, `p90_us`, `min_us`, `max_us`.
    A mean far above the median is a tail; one below it is a loop whose calls overlap, each
    rank slow in other calls (rooted collectives back to back, ranks that outnumber cores)."""
    nops = len(per_rank[0])
    worst = sorted(max(rs[i] for rs in per_rank) for i in range(nops))
    mean = max(sum(rs) / nops for rs in per_rank) * 1e6

    def nearest_rank(p: float) -> float:
        return worst[min(nops - 1, max(0, math.ceil(p * nops) - 1))] * 1e6

    return {
        "time_us": mean,
        "mean_us": mean,
        "p50_us": statistics.median(worst) * 1e6,
        "p99_us": nearest_rank(0.99),
        "p10_us": worst[nops // 10] * 1e6,
        "p90_us": worst[min(nops - 1, (nops * 9) // 10)] * 1e6,
        "min_us": worst[0] * 1e6,
        "max_us": worst[-1] * 1e6,
    }


def cell(coll: str, n: int, size: int, per_rank: Sequence[Sequence[float]], wrong: int) -> dict[str, Any]:
    """One measured cell: #wrong, algbw and busbw (GB/s, from the mean call) and the time statistics."""
    stats = summarize(per_rank)
    algbw = size / (stats["time_us"] * 1e-6) / 1e9 if stats["time_us"] > 0 else 0.0
    return {"wrong": wrong, "algbw_GBps": algbw, "busbw_GBps": algbw * busbw_factor(coll, n), **stats}


def row(case: Case, nominal: int, result: dict[str, Any], m: Measured) -> dict[str, Any]:
    """A JSON row (rank 0): the case, its cell, its schedule and the foreign load meanwhile."""
    from ...ops.dtypes import dtype_name

    barrier = case.coll == "barrier"
    return {
        "coll": case.coll, "nranks": case.n, "nominal": nominal, "size": case.size, "count": case.param,
        "type": "none" if barrier else dtype_name(case.dtype), "redop": case.op or "none",
        "root": case.root if case.coll in ROOTED else -1,
        "placement": "in-place" if case.inplace else "out-of-place",
        "warmup": m.warmup, "iters": len(m.times), **result,
        "timed_wall_s": m.wall_s, "foreign_cpu_s": m.foreign_s, "foreign_top": m.foreign_top,
        "contaminated": m.foreign_s is not None and contaminated(m.foreign_s, m.wall_s),
    }
