"""The staged path: device buffers through pinned host memory and the host collective.

Ranks on several hosts, TCP forced, CUDA IPC off or refused, and the reductions torch's CUDA
kernels lack: each piece of a call is copied to the host, runs the host collective, and is
copied back, pipelined so that a piece's host call starts once its own copy has arrived.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from ..buffers import as_array
from ..errors import InvalidArgumentError
from ..ops import Reduction
from ..work import Work
from . import staging
from .device_group import DeviceGroup, DeviceWork
from .tensors import caller_stream, torch_module

if TYPE_CHECKING:
    from ..group.calls import CollectiveCall


def host_all_reduce(dg: DeviceGroup, obj: Any, sf: Any, df: Any, red: Reduction,
                    timeout: float | None, result: Any) -> Any:
    """A small blocking all_reduce through host memory, with nothing set up per call: a
    pinned buffer kept for its shape, one copy to the host, the host's planned one-shot
    all_reduce on it, one copy back, all on the caller's stream."""
    torch = torch_module()
    key = (sf.dtype, sf.numel())
    plan = dg.host_plans.get(key)
    if plan is None:
        if len(dg.host_plans) >= 64:
            dg.host_plans.clear()
        host = torch.empty(sf.numel(), dtype=sf.dtype, pin_memory=True)
        try:
            view = as_array(host, writable=True, rank=dg.group.runtime.rank, collective="all_reduce")
        except InvalidArgumentError:  # a dtype numpy cannot hold here: the host path takes the tensor
            view = host
        plan = dg.host_plans[key] = (host, view, torch.cuda.Event(), torch.cuda.Event())
    host, view, arrived, done = plan
    stream = caller_stream(obj, dg.device)
    done.synchronize()  # the last call's copy back out of the buffer (long done, as a rule)
    with nullcontext() if stream == torch.cuda.current_stream(dg.device) else torch.cuda.stream(stream):
        host.copy_(sf, non_blocking=True)
        arrived.record(stream)
        arrived.synchronize()  # this process's own stream, up to this call's input
        dg.group.all_reduce(view, red, timeout=timeout)
        df.copy_(host, non_blocking=True)
        done.record(stream)
    return result


def _stage(dg: DeviceGroup, obj: Any, pieces: list[Piece], bufs: list[Any], async_op: bool,
           result: Any) -> Any:
    """Run each piece's host call between its copies to the host and back, pipelined: every
    piece's copy to the host is queued at once, each host call starts as its piece has
    arrived, and each copy back is queued as its host call ends."""
    torch = torch_module()
    caller = caller_stream(obj, dg.device)
    stream, end = caller, None
    if async_op:
        stream, end = dg.own_stream(), torch.cuda.Event()
        stream.wait_stream(caller)
        for piece in pieces:
            for d, _h in piece.reads + piece.writes:
                if d.numel():
                    d.record_stream(stream)
    arrived = []
    with torch.cuda.stream(stream):
        for piece in pieces:
            for d, h in piece.reads:
                h.copy_(d, non_blocking=True)
            arrived.append(torch.cuda.Event())
            arrived[-1].record(stream)

    def give_back(done: Any) -> None:
        """The pinned buffers back to the pool, free once `done` (recorded on `stream`) is."""
        done.record(stream)
        for buf in bufs:
            staging.give_back(buf, done)

    def back(piece: Piece, last: bool) -> None:
        with torch.cuda.stream(stream):
            for d, h in piece.writes:
                d.copy_(h, non_blocking=True)
            if last:
                give_back(end if end is not None else torch.cuda.Event())

    work = None
    for k, (ready, piece) in enumerate(zip(arrived, pieces)):
        last = k == len(pieces) - 1
        try:
            if not async_op:
                ready.synchronize()
                piece.invoke(False)
            else:
                with dg.group.queue.wrapping(_around(ready, functools.partial(back, piece, last))):
                    work = piece.invoke(True)
        except BaseException:  # the host call failed before its copy back: the buffers go back now
            if k == 0 or not async_op:  # (not under the host calls already queued: left to them)
                with torch.cuda.stream(stream):
                    give_back(torch.cuda.Event())
            raise
        if not async_op:
            back(piece, last)
    if not async_op:
        return result
    return DeviceWork(work, end, stream, dg.device, result)  # type: ignore[arg-type]


def whole(dg: DeviceGroup, obj: Any, reads: list[Any], writes: list[Any],
          invoke: Callable[[Callable[[Any], Any], bool], Any], async_op: bool, result: Any) -> Any:
    """A staged call in one piece: `invoke(host, async_op)` runs the host collective, where
    `host(t)` is device tensor t's pinned mirror."""
    mirrors, bufs = _mirrors([*reads, *writes])
    piece = Piece([(t, mirrors[id(t)]) for t in reads], [(t, mirrors[id(t)]) for t in writes],
                  lambda a: invoke(lambda t: mirrors[id(t)], a))
    return _stage(dg, obj, [piece], bufs, async_op, result)


PIECE_BYTES = 4 << 20
"""A staged piece where the host collective goes through shared memory."""
PIECE_BYTES_TCP = 16 << 20
"""A staged piece where it crosses TCP, where each piece's host call costs more to start
(docs/design/gpu.md#next-visit)."""


def piece_bytes(group: Any) -> int:
    """TENSORWIRE_CUDA_CHUNK, or by the wire the group's host calls take."""
    cfg = group.runtime.config
    if cfg.cuda_chunk is not None:
        return cfg.cuda_chunk
    return PIECE_BYTES_TCP if cfg.transport == "tcp" or not group.one_host else PIECE_BYTES


def chunked(dg: DeviceGroup, obj: Any, src: Any, dst: Any, read: bool,
            invoke: Callable[[Any, Any, bool], Any], async_op: bool, result: Any) -> Any:
    """A staged call on flat `src` and `dst` in pieces of TENSORWIRE_CUDA_CHUNK, one host call
    each: `invoke(host_src_piece, host_dst_piece, async_op)`. `read`: copy `src` in."""
    mirrors, bufs = _mirrors([src, dst])
    hs, hd = mirrors[id(src)], mirrors[id(dst)]
    step = max(1, piece_bytes(dg.group) // max(src.element_size(), 1))
    pieces = []
    for lo in range(0, max(src.numel(), 1), step):
        hi = min(lo + step, src.numel())
        pieces.append(Piece([(src[lo:hi], hs[lo:hi])] if read else [], [(dst[lo:hi], hd[lo:hi])],
                            functools.partial(invoke, hs[lo:hi], hd[lo:hi])))
    return _stage(dg, obj, pieces, bufs, async_op, result)


class Piece:
    """One host call of a staged collective and its copies: (device, host) pairs."""

    __slots__ = ("reads", "writes", "invoke")

    def __init__(self, reads: list[tuple[Any, Any]], writes: list[tuple[Any, Any]],
                 invoke: Callable[[bool], Any]) -> None:
        self.reads, self.writes, self.invoke = reads, writes, invoke


class Landing(Work):
    """A receive into device memory: a message staged through host memory is copied to the
    device once it has arrived (on wait, or when a poll sees it), on the stream that was
    current where the receive was posted, whichever thread lands it (`stream`: what a torch
    Work orders its waiters after); one that came device to device (`device`, gpu/p2p.py)
    only orders that stream after its copy."""

    progresses = False

    def __init__(self, inner: Work, target: Any, host: Any, buf: Any, stream: Any,
                 device: Any = None) -> None:
        super().__init__(inner.what, inner.rank)
        self.inner, self.target, self.host, self.buf, self.stream = inner, target, host, buf, stream
        self.device = device

    def _land(self) -> None:
        if self.done:
            return
        if self.device is not None and self.device.copied is not None:
            self.stream.wait_event(self.device.copied)
            staging.give_back(self.buf)
            self.finish(self.inner.result())
            return
        torch = torch_module()
        with torch.cuda.device(self.target.device), torch.cuda.stream(self.stream):
            self.target.copy_(self.host, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        staging.give_back(self.buf, done)
        self.finish(self.inner.result())

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self.inner.wait(timeout)
        except BaseException as exc:
            if self.inner.is_completed() and not self.done:
                self.finish(exc=exc)
            raise
        self._land()
        return True

    def is_completed(self) -> bool:
        if not self.done and self.inner.is_completed():
            if self.inner.exception() is None:
                self._land()
            else:
                self.finish(exc=self.inner.exception())
        return self.done


def _around(ready: Any, after: Callable[[], None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a staged piece's host body: it starts once its copy to the host has arrived, and
    queues the copy back as it ends."""
    def wrap(body: Callable[..., Any]) -> Callable[..., Any]:
        def staged_body(call: CollectiveCall, *args: Any) -> Any:
            ready.synchronize()
            result = body(call, *args)
            after()
            return result
        return staged_body
    return wrap


def _mirrors(tensors: list[Any]) -> tuple[dict[int, Any], list[Any]]:
    """A pinned host mirror per distinct tensor, and the pinned buffers to give back."""
    mirrors: dict[int, Any] = {}
    bufs = []
    for t in tensors:
        if id(t) not in mirrors:
            buf = staging.take(t.numel() * t.element_size())
            bufs.append(buf)
            mirrors[id(t)] = staging.mirror(buf, t)
    return mirrors, bufs
