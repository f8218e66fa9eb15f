"""tensorwire's side of a sweep: each case as a call of the module-level API, and the results gathered."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import sweep
from .options import Options
from .sweep import REDUCING, Buffers, Case, Measured


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


def time_str(us: float) -> str:
    if us >= 10000.0:
        return f"{us:7.0f}"
    if us >= 100.0:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def sweep_pairs(opts: Options, coll: str, rank: int, say: Callable[[str], None]
                ) -> Iterator[tuple[np.dtype, str | None]]:
    """(dtype, op) of every point of `coll` in the sweep; pairs the op cannot reduce are skipped
    with a note (shared by the plain sweep and --algo)."""
    from ...ops.dtypes import dtype_name
    from ...ops.reduce_op import as_reduction
    from ...ops.validation import check_op_dtype

    for dt in (opts.dtypes if coll != "barrier" else opts.dtypes[:1]):
        for op in (opts.ops if coll in REDUCING else [None]):
            if op is not None:
                try:
                    check_op_dtype(as_reduction(op), dt, rank=rank, collective=coll)
                except Exception as exc:
                    say(f"# skipped {coll} {dtype_name(dt)} {op}: {exc}")
                    continue
            yield dt, op


def wrong_line(total_wrong: int, checked: bool) -> str:
    return (f"# Wrong values         : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}"
            if checked else "# Wrong values         : not checked (-c 0)")
