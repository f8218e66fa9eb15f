"""A repeated small blocking all_reduce on CUDA buffers, planned.

The slots' protocol is the general path's (ipc_path._slots: wait for the peers' reads of
this parity's slot, copy the share in, record, one host flag round, wait for the peers'
shares, fold, record), but a call of a signature seen before (dtype, shape, op, in place,
blocking) finds everything that protocol touches looked up already: the slots as views of
the call's shape, the raw handles of the events, the fold's function, the barrier's body and
the call object of the host path's planned calls (group/planned.py, Plans.submit). The
stream work goes straight to the driver (driver.stream_calls), a microsecond a call, where
torch's Python wrappers cost several; the fold stays torch's kernel. What a call still
checks: its tensor is a plain contiguous CUDA tensor of the plan's device, the thread's
current one, that needs no grad, and the group has nothing queued (the body runs on the
calling thread, on its current stream).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ..ops import ReduceOp, Reduction
from ..transport.wire import Fingerprint
from ..tuning import tuner
from . import driver, kernels
from .tensors import torch_module

if TYPE_CHECKING:
    from ..group.calls import CollectiveCall
    from ..group.group import Group
    from .device_group import DeviceGroup


class SmallAllReduce:
    """One signature's plan; calling it runs one call."""

    __slots__ = ("group", "dg", "device", "call", "barrier", "direct", "nbytes", "fn", "signed", "red",
                 "parts", "own", "ready", "done", "peer_ready", "slot_read", "cuda", "stream_of", "threads",
                 "current_device", "capturing")

    def __init__(self, group: Group, dg: DeviceGroup, t: Any, red: Reduction, fp: Fingerprint) -> None:
        torch = torch_module()
        self.group, self.dg, self.device, self.red = group, dg, dg.device, red
        self.call = group.plans.call(fp, "all_reduce")
        alg = tuner.select(group, "barrier", 0)
        self.barrier, self.direct = alg.run, alg.needs_direct
        self.nbytes = t.numel() * t.element_size()
        self.fn = kernels.binary(red.op)
        signed = kernels.on_signed(t, red.op).dtype
        self.signed = None if signed == t.dtype else signed
        self.parts = [[kernels.on_signed(v, red.op).view(t.shape)
                       for v in dg.slot_views(p, self.nbytes, t.dtype)] for p in (0, 1)]
        self.own = [dg.slots[group.rank].data_ptr() + p * dg.slot for p in (0, 1)]
        self.ready = [dg.own[f"R{p}"].cuda_event for p in (0, 1)]
        self.done = [dg.own[f"D{p}"].cuda_event for p in (0, 1)]
        self.peer_ready = [[e.cuda_event for e in dg.peer[f"R{p}"] if e is not None] for p in (0, 1)]
        # what must have run before this rank's slot is written again: every rank's reads of it
        # two calls ago, its own too (that call may have gone on another stream)
        self.slot_read = [[e.cuda_event for e in dg.peer[f"D{p}"] if e is not None] + [self.done[p]]
                          for p in (0, 1)]
        self.cuda = driver.stream_calls()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self.stream_of = raw if raw is not None else lambda d: torch.cuda.current_stream(d).cuda_stream
        self.current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
        self.capturing = torch.cuda.is_current_stream_capturing  # a capture takes the general path's error
        self.threads = threading.local()  # .ready: this plan made sure of the thread's current context

    def runs(self, t: Any) -> bool:
        """Can this call take the plan? (The signature matched already.) Its tensor must be a
        plain contiguous one needing no grad, on the plan's device, which must be the calling
        thread's current one: the driver's calls on a default stream go to the current
        context's."""
        return t.is_contiguous() and not t.requires_grad and not t.is_neg() \
            and t.get_device() == self.device == self.current_device() and not self.capturing()

    def __call__(self, t: Any, timeout: float | None) -> Any:
        dg = self.dg
        parity = dg.calls & 1
        dg.calls += 1
        if not getattr(self.threads, "ready", False):  # a thread with no CUDA runtime call yet has
            driver.use_device(self.device)  # no current context
            self.threads.ready = True
        return self.group.plans.submit(self.call, self._body, self.direct, False, timeout, t, t, parity)

    def _body(self, call: CollectiveCall, t: Any, p: int) -> Any:
        cuda, s = self.cuda, self.stream_of(self.device)
        for event in self.slot_read[p]:
            driver.check(cuda.wait(s, event, 0), "cuStreamWaitEvent")
        driver.check(cuda.copy(self.own[p], t.data_ptr(), self.nbytes, s), "cuMemcpyDtoDAsync")
        driver.check(cuda.record(self.ready[p], s), "cuEventRecord")
        self.barrier(call)
        for event in self.peer_ready[p]:
            driver.check(cuda.wait(s, event, 0), "cuStreamWaitEvent")
        kernels.chain(t if self.signed is None else t.view(self.signed), self.parts[p], self.fn)
        if self.red.op is ReduceOp.AVG:
            kernels.finalize(t, self.red, self.group.size)
        driver.check(cuda.record(self.done[p], s), "cuEventRecord")
        return t
