"""The COLL and P2P logs' line per call, at TRACE (log.PER_CALL), as NCCL prints one per
collective under NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL.

A collective's line comes from CallQueue._run once the call ran. Where it is on, every call takes
that path (Plans.submit, and the compiled caller, defer to it: CallQueue.logged): the algorithm
the planned and compiled paths would run runs there, and notes its name on the call
(tuner.noting), a few microseconds slower. A point-to-point call's line comes from the group's
methods, wrapped where the P2P log has it on (`log_p2p`). Where the lines are off, nothing on a
call's way looks at them but one flag (CallQueue.logged, which the planned path and the compiled
caller read).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import log
from ..ops.dtypes import dtype_from_code
from ..transport.wire import ON_DEVICE, Coll, dtype_label, op_label
from ..tuning import tuner
from ..tuning.cost_model import format_seconds

if TYPE_CHECKING:
    from .calls import CollectiveCall
    from .group import Group

_coll = log.get("COLL")
_p2p = log.get("P2P")
_REDUCING = frozenset({Coll.ALL_REDUCE, Coll.REDUCE, Coll.REDUCE_SCATTER, Coll.REDUCE_SCATTERV})
P2P_CALLS = ("send", "recv", "isend", "irecv", "irecv_any", "sendrecv")
_POSTS = frozenset({"isend", "irecv", "irecv_any"})


def ran(call: CollectiveCall) -> None:
    """The line of a collective that ran: 'all_reduce #3 on group world (2 ranks): count 262144
    float32 (1048576 B), op SUM, algo ring over shm, 1.2 ms' (its time from its start in
    CallQueue._run); none for the group's own setup exchanges (CallQueue.run_internal)."""
    fp, group = call.fp, call.group
    if fp.coll == Coll.SETUP:
        return
    elapsed = time.perf_counter() - (call.deadline - call.timeout)
    said = []
    if fp.count >= 0 and fp.dtype:
        try:
            size = f" ({fp.count * dtype_from_code(fp.dtype).itemsize} B)"
        except Exception:  # noqa: BLE001 - a code no dtype has: the line says so through its label
            size = ""
        per_peer = f", {fp.count // group.size} a peer" if fp.coll & ~ON_DEVICE == Coll.ALL_TO_ALL else ""
        said.append(f"count {fp.count} {dtype_label(fp.dtype)}{size}{per_peer}")
    if fp.coll & ~ON_DEVICE in _REDUCING:
        said.append(f"op {op_label(fp.op)}")
    if fp.root >= 0:
        said.append(f"root {fp.root}")
    said.append(f"algo {call.algo or '-'} over {tuner.tier_of(group)}")
    _coll.debug("%s (%d ranks): %s, %s", call.what, group.size, ", ".join(said), format_seconds(elapsed))


def log_p2p(group: Group) -> None:
    """Where the P2P log has a line per call, the group's point-to-point methods log theirs."""
    if log.per_call(_p2p):
        for name in P2P_CALLS:
            setattr(group, name, _logging(group, name, getattr(type(group), name)))


def _logging(group: Group, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a point-to-point method's function) of `group`, logging each call that returns:
    its arguments (a buffer as its bytes and dtype) and how long it took (to post, for the
    non-blocking ones)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def logged(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = fn(group, *args, **kwargs)
        took = format_seconds(time.perf_counter() - started)
        given = list(signature.bind(group, *args, **kwargs).arguments.items())[1:]
        said = ", ".join(f"{key} {_shown(value)}" for key, value in given if value is not None)
        _p2p.debug("%s on group %s: %s, %s %s", name, group.name, said,
                   "posted in" if name in _POSTS else "took", took)
        return result
    return logged


def _shown(value: Any) -> str:
    """A buffer as its bytes and dtype; anything else as it is."""
    nbytes, dtype = getattr(value, "nbytes", None), getattr(value, "dtype", None)
    return f"{nbytes} B {dtype}" if isinstance(nbytes, int) and dtype is not None else repr(value)
