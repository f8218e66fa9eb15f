"""The CUDA IPC path: ranks of one host move device buffers device to device.

Small calls go through every rank's two slots (a barrier says every share is there; each
rank reads what it needs out of its peers' slots); larger ones publish where each rank's
buffers are and read them in place, closed by a flag round that keeps a rank's buffers
untouched until its peers' reads have run. Every host round is a call of the group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import log
from ..transport.wire import Fingerprint
from ..tuning import tuner
from . import ipc
from .device_group import CallStream, DeviceGroup, DeviceWork
from .tensors import torch_module

if TYPE_CHECKING:
    from ..group.calls import CollectiveCall

_coll_log = log.get("COLL")
_ALIGN = 64  # elements per all_reduce block boundary (whole 256-byte lines for float32)


class Spec:
    """One device collective: what this rank shares, and what it does with every rank's share."""

    __slots__ = ("share", "nbytes", "dtype", "compute", "gather", "out", "outs", "result")

    def __init__(self, share: Any, nbytes: int, dtype: Any, compute: Callable[[list[Any]], None],
                 result: Any, gather: Callable[[list[Any]], None] | None = None, out: Any = None) -> None:
        self.share = share  # this rank's flat contribution (None: it contributes nothing)
        self.nbytes = nbytes  # of every rank's contribution (the small path's slot use)
        self.dtype = dtype
        self.compute = compute  # given every rank's contribution, flat (this rank's own included)
        self.result = result
        self.gather = gather  # the large all_reduce's second step, given every rank's output
        self.out = out  # the large all_reduce: this rank's flat output (its peers read it)
        self.outs: list[Any] = []


def small(dg: DeviceGroup, nbytes: int) -> bool:
    """Does a call whose every rank contributes `nbytes` take the slots?"""
    return dg.mode == "ipc" and nbytes <= dg.slot


def run(dg: DeviceGroup, what: str, fp: Fingerprint, spec: Spec, obj: Any, tensors: list[Any],
        async_op: bool, timeout: float | None) -> Any:
    """Submit the call's host rounds in order; each queues its part of the GPU work."""
    g = dg.group
    slots = small(dg, spec.nbytes)
    st = dg.begin(obj, tensors, async_op, slots)
    if dg.mode == "alone":
        bodies = [_alone]
    elif slots:
        bodies = [_slots]
    elif spec.gather is not None:
        bodies = [_publish, _gather, _close]
    else:
        bodies = [_publish, _close]
    if _coll_log.isEnabledFor(10):
        _coll_log.debug("%s on CUDA, group %s: %s", what, g.name,
                        dg.mode if dg.mode != "ipc" else "small (slots)" if slots else "large (in place)")
    work = None
    for body in bodies:
        work = g.queue.submit(fp, what, body, async_op, timeout, dg, st, spec)
    if not async_op:
        return spec.result
    return DeviceWork(work, st.end, st.stream, dg.device, spec.result)  # type: ignore[arg-type]


# -- the bodies: one host round each -------------------------------------------------------------
def _alone(call: CollectiveCall, dg: DeviceGroup, st: CallStream, spec: Spec) -> None:
    with dg.on(st):
        spec.compute([spec.share])
        if spec.gather is not None:
            spec.gather([spec.out])
        if st.end is not None:
            st.end.record(st.stream)


def _slots(call: CollectiveCall, dg: DeviceGroup, st: CallStream, spec: Spec) -> None:
    p, s = st.parity, st.stream
    with dg.on(st):
        dg.wait_peers(st, f"D{p}")  # their reads of this slot, two calls ago, have run,
        s.wait_event(dg.own[f"D{p}"])  # and this rank's own (that call may have gone on another stream)
        views = dg.slot_views(p, spec.nbytes, spec.dtype)
        if spec.share is not None and spec.nbytes:
            views[call.rank].copy_(spec.share)
        dg.own[f"R{p}"].record(s)
        tuner.select(call.group, "barrier", 0).run(call)
        dg.wait_peers(st, f"R{p}")
        spec.compute(views)
        dg.own[f"D{p}"].record(s)
        if st.end is not None:
            st.end.record(s)


def _publish(call: CollectiveCall, dg: DeviceGroup, st: CallStream, spec: Spec) -> None:
    g, s = call.group, st.stream
    with dg.on(st):
        dg.own["PUB"].record(s)
        mine = ipc.describe(spec.share) if spec.share is not None else ipc.RECORD.pack(0, 0, 0, 0, b"")
        if spec.out is not None:
            mine += ipc.describe(spec.out)
        size = len(mine)
        table = np.empty((g.size, size), dtype=np.uint8)
        src = np.frombuffer(mine, dtype=np.uint8)
        tuner.select(g, "all_gather", table.nbytes, True).run(call, list(table), src)
        dg.wait_peers(st, "PUB")
        shares = [spec.share if r == g.rank else
                  ipc.peer_tensor(g.ranks[r], table[r], spec.dtype, dg.device) for r in range(g.size)]
        if spec.out is not None:  # the large all_reduce: every rank's output too
            rec = ipc.RECORD.size
            spec.outs = [spec.out if r == g.rank else
                         ipc.peer_tensor(g.ranks[r], table[r, rec:], spec.dtype, dg.device)
                         for r in range(g.size)]
        spec.compute(shares)
        dg.own["MID"].record(s)


def _gather(call: CollectiveCall, dg: DeviceGroup, st: CallStream, spec: Spec) -> None:
    with dg.on(st):
        tuner.select(call.group, "barrier", 0).run(call)
        dg.wait_peers(st, "MID")
        spec.gather(spec.outs)  # type: ignore[misc]
        dg.own["FIN"].record(st.stream)


def _close(call: CollectiveCall, dg: DeviceGroup, st: CallStream, spec: Spec) -> None:
    with dg.on(st):
        tuner.select(call.group, "barrier", 0).run(call)
        dg.wait_peers(st, "FIN" if spec.gather is not None else "MID")
        if st.end is not None:
            st.end.record(st.stream)


def blocks(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each rank's block of an all_reduce of n elements (whole lines, the last short)."""
    size = -(-n // parts)
    size = -(-size // _ALIGN) * _ALIGN
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(parts)]


def joined(tensors: list[Any]) -> Any:
    """One flat tensor of `tensors` end to end (list forms: one copy on the GPU)."""
    return torch_module().cat([t.reshape(-1) for t in tensors])


def overlap(a: Any, b: Any) -> bool:
    """Do the two tensors' bytes meet?"""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size() \
        and a.numel() > 0 and b.numel() > 0
