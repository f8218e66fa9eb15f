"""Collectives on CUDA buffers.

A group's device path is chosen at its first call on CUDA buffers, collectively:

- `ipc`: every rank on one host, and every rank could open every peer's memory and events
  through CUDA IPC. Calls move data device to device:
  - small calls (a rank's share fits `TENSORWIRE_CUDA_SLOT`): each rank owns two slots of
    device memory that its peers opened at setup. A call copies the rank's share into the
    slot of its parity, one host flag round (a barrier) says every share is there, and each
    rank reads what it needs straight out of its peers' slots. As on the host's one-shot
    path, a slot is refilled only once every peer's reads of it two calls ago have run.
  - larger calls: each rank publishes where its buffers are (allocation handle and offset,
    an all_gather of small records) and reads its peers' buffers in place, one copy per byte
    at device speed; all_reduce is a reduce-scatter (rank r folds block r of every input)
    then an all-gather of the folded blocks. A closing flag round keeps a rank's buffers
    untouched until its peers' reads of them have run.
- `staged`: through pinned host buffers and the host collective (ranks on several hosts,
  `TENSORWIRE_TRANSPORT=tcp`, `TENSORWIRE_CUDA_IPC=0`, or IPC refused); all_reduces and
  broadcasts pipeline the copy to the host, the wire and the copy back in pieces.
- `alone`: a group of one rank.

Ordering is by CUDA events, never a device-wide synchronize. A rank's GPU work waits for its
peers' through interprocess events (cudaStreamWaitEvent); the host flag rounds only say that
those events were recorded. A blocking call queues its GPU work on the caller's current
stream and returns without waiting for the GPU (as NCCL does); `async_op=True` queues it on
the group's own stream after the caller's work, and `Work.wait()` makes the caller's current
stream wait for it. Reductions that torch's CUDA kernels lack (most of uint16/32/64, float8)
are staged and reduced on the host.

Every host round runs as a call of the group (its own sequence number, the call's
fingerprint with `wire.ON_DEVICE` set), so mismatches, lost peers and timeouts are the
host path's, on every rank.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import log
from ..buffers import as_array
from ..errors import InvalidArgumentError
from ..ops import ReduceOp, Reduction, as_reduction, op_undefined
from ..transport.wire import ON_DEVICE, Coll, Fingerprint
from ..tuning import tuner
from ..work import Work
from . import driver, ipc, kernels, staging
from .planned import SmallAllReduce
from .tensors import as_device_tensor, caller_stream, code_of, same_device, torch_module

if TYPE_CHECKING:
    from ..group.group import CollectiveCall, Group

_log = log.get("INIT")
_coll_log = log.get("COLL")

_EVENTS = ("R0", "R1", "D0", "D1", "PUB", "MID", "FIN")
"""A rank's interprocess events: the small path's share-ready (R) and reads-done (D) per slot
parity; the large path's buffers-ready (PUB), own-part-done (MID) and all_reduce's
gathered (FIN)."""
_INFO = struct.Struct("<48s24sqB")  # GPU uuid, PCI bus id, device index, offers IPC
_SETUP_BYTES = _INFO.size + ipc.RECORD.size + len(_EVENTS) * driver.HANDLE_BYTES
_ALIGN = 64  # elements per all_reduce block boundary (whole 256-byte lines for float32)
_LEAN = 1 << 20  # blocking all_reduces up to this size keep their pinned buffer (host_plans)
_PLANS = 64  # planned small all_reduce signatures per group


class _Call:
    """The stream one call's GPU work goes on, and what the host needs to get there."""

    __slots__ = ("stream", "thread", "end", "parity")

    def __init__(self, stream: Any, thread: int, end: Any, parity: int) -> None:
        self.stream = stream
        self.thread = thread  # the thread whose current stream `stream` is; 0 for none
        self.end = end  # recorded after the call's GPU work (async calls: Work.wait waits for it)
        self.parity = parity


class DeviceWork(Work):
    """An async device call: done on the host once its GPU work is queued; `wait()` also makes
    the caller's current stream wait for that work."""

    def __init__(self, inner: Work, end: Any, stream: Any, device: int, result: Any) -> None:
        super().__init__(inner.what, inner.rank)
        self.end = end
        self.stream = stream  # where the GPU work went (the torch backend's futures record on it)
        self.device = device
        inner.add_done_callback(lambda w: self._finish(result, w.exception()))

    def wait(self, timeout: float | None = None) -> bool:
        super().wait(timeout)
        torch_module().cuda.current_stream(self.device).wait_event(self.end)
        return True

    def is_completed(self) -> bool:
        """True once the GPU work itself has run (NCCL's meaning)."""
        return super().is_completed() and (self._exc is not None or self.end.query())


class DeviceGroup:
    """One group's device state on this rank: its path, events, slots and stream."""

    def __init__(self, group: Group, device: int, fp: Fingerprint, what: str, timeout: float | None) -> None:
        self.group = group
        self.device = device
        self.mode = "alone"
        self.slot = group.runtime.config.cuda_slot
        self.own: dict[str, Any] = {}
        self.peer: dict[str, list[Any]] = {}  # event name -> peers' events (None at own rank)
        self.slots: list[Any] = []  # every rank's two slots (own: allocated here; peers': opened)
        self.stream: Any = None  # for async calls, made on first use
        self.calls = 0  # small-path calls so far: their parity
        self._views: dict[tuple, list[Any]] = {}
        self.one_gpu = True  # every rank on the same GPU (set up: from their UUIDs)
        self.host_below = 0  # calls whose share is smaller go through host memory (see _setup)
        self.host_plans: dict[tuple, tuple] = {}  # small blocking all_reduces: their pinned buffers
        if group.size > 1:
            self._setup(fp, what, timeout)

    # -- setup -----------------------------------------------------------------------------
    def _setup(self, fp: Fingerprint, what: str, timeout: float | None) -> None:
        """Collectively: exchange what each rank's GPU is and, where every rank is on this host,
        the IPC handles of its events and slots; agree on the path. Two host rounds of the
        first device call (its fingerprint: a rank that called something else is told so)."""
        torch = torch_module()
        g, cfg, dev = self.group, self.group.runtime.config, self.device
        props = torch.cuda.get_device_properties(dev)
        uuid = str(getattr(props, "uuid", ""))
        pci = "{:04x}:{:02x}:{:02x}.0".format(*(int(getattr(props, f"pci_{k}_id", 0))
                                                for k in ("domain", "bus", "device")))
        why = ""
        if not g.one_host:
            why = "ranks on several hosts"
        elif cfg.transport == "tcp":
            why = "TENSORWIRE_TRANSPORT=tcp"
        elif not cfg.cuda_ipc:
            why = "TENSORWIRE_CUDA_IPC=0"
        handles, area = b"", ipc.RECORD.pack(0, 0, 0, 0, b"")
        if not why:
            try:
                with torch.cuda.device(dev):
                    self.own = {name: torch.cuda.Event(interprocess=True) for name in _EVENTS}
                    handles = b"".join(bytes(self.own[name].ipc_handle()) for name in _EVENTS)
                    mine = torch.empty(2 * self.slot, dtype=torch.uint8, device=dev)
                    if self.slot:
                        area = ipc.describe(mine)
            except Exception as exc:  # expandable segments, no IPC on this platform, ...
                why = f"rank {g.rank}: {exc}"
        record = np.zeros(_SETUP_BYTES, dtype=np.uint8)
        record[:_INFO.size] = np.frombuffer(_INFO.pack(uuid.encode(), pci.encode(), dev, not why), np.uint8)
        if not why:
            tail = area + handles
            record[_INFO.size:_INFO.size + len(tail)] = np.frombuffer(tail, np.uint8)
        table = np.empty((g.size, _SETUP_BYTES), dtype=np.uint8)
        g._submit(fp, what, _exchange, False, timeout, record, table)
        infos = [_INFO.unpack(bytes(row[:_INFO.size])) for row in table]
        ok = all(info[3] for info in infos)
        if ok:
            try:
                self._open_peers(table, mine)
            except Exception as exc:
                why, ok = f"rank {g.rank} cannot open its peers' memory: {exc}", False
        elif not why:
            refused = ", ".join(str(r) for r, info in enumerate(infos) if not info[3])
            why = f"rank {refused} cannot use IPC"
        verdict = np.array([ok], dtype=np.uint8)
        g._submit(fp, what, _agree, False, timeout, verdict)
        self.mode = "ipc" if verdict[0] else "staged"
        self.one_gpu = len({info[0] for info in infos}) == 1
        self.host_below = cfg.cuda_host_below
        if self.mode == "staged":
            self.own, self.peer, self.slots = {}, {}, []
        self._describe(infos, why)

    def _open_peers(self, table: np.ndarray, mine: Any) -> None:
        torch = torch_module()
        g, dev = self.group, self.device
        at = _INFO.size + ipc.RECORD.size
        for name in _EVENTS:
            self.peer[name] = []
        for r, row in enumerate(table):
            for i, name in enumerate(_EVENTS):
                if r == g.rank:
                    self.peer[name].append(None)
                    continue
                handle = bytes(row[at + i * driver.HANDLE_BYTES:at + (i + 1) * driver.HANDLE_BYTES])
                self.peer[name].append(torch.cuda.Event.from_ipc_handle(dev, handle))
            area = mine if r == g.rank else ipc.peer_tensor(g.ranks[r], row[_INFO.size:at], torch.uint8, dev,
                                                            keep=True)
            self.slots.append(area)

    def _describe(self, infos: list[tuple], why: str) -> None:
        if not _log.isEnabledFor(20):
            return
        g = self.group
        gpus = "; ".join(f"rank {r}: cuda:{info[2]} {info[0].decode().rstrip(chr(0))} "
                         f"({info[1].decode().rstrip(chr(0))})" for r, info in enumerate(infos))
        sharing: dict[bytes, list[int]] = {}
        for r, info in enumerate(infos):
            sharing.setdefault(info[0], []).append(r)
        shared = [ranks for ranks in sharing.values() if len(ranks) > 1]
        _log.info("group %s on CUDA: %s; %s; %s; path: %s%s", g.name, gpus,
                  "one host" if g.one_host else "several hosts",
                  "ranks sharing a GPU: " + ", ".join(map(str, shared)) if shared else "one GPU per rank",
                  "device to device (CUDA IPC)" if self.mode == "ipc" else "staged through pinned memory",
                  f" ({why})" if why and self.mode != "ipc" else "")

    # -- calls -------------------------------------------------------------------------------
    def begin(self, obj: Any, tensors: Sequence[Any], async_op: bool, small: bool) -> _Call:
        """The call's stream: the caller's current one, or for an async call the group's own,
        after everything queued on the caller's so far."""
        torch = torch_module()
        caller = caller_stream(obj, self.device)
        parity = 0
        if small:
            parity, self.calls = self.calls & 1, self.calls + 1
        if not async_op:
            own = caller == torch.cuda.current_stream(self.device)
            return _Call(caller, threading.get_ident() if own else 0, None, parity)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(caller)
        for t in tensors:  # the caller may free them before the GPU work ran: torch must not reuse them
            if t.numel():
                t.record_stream(self.stream)
        return _Call(self.stream, 0, torch.cuda.Event(), parity)

    def on(self, st: _Call) -> Any:
        """Where the call's GPU work is queued from this thread: its stream made current here
        unless it is already."""
        if st.thread == threading.get_ident():
            return nullcontext()
        return torch_module().cuda.stream(st.stream)

    def wait_peers(self, st: _Call, name: str) -> None:
        wait = st.stream.wait_event
        for event in self.peer[name]:
            if event is not None:
                wait(event)

    def slot_views(self, parity: int, nbytes: int, dtype: Any) -> list[Any]:
        """Every rank's slot of `parity`, its first `nbytes` as `dtype` (kept per shape)."""
        key = (parity, nbytes, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 256:
                self._views.clear()
            base = parity * self.slot
            views = self._views[key] = [s[base:base + nbytes].view(dtype) for s in self.slots]
        return views

    def own_stream(self) -> Any:
        if self.stream is None:
            self.stream = torch_module().cuda.Stream(self.device)
        return self.stream


class _Spec:
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


class DeviceCollectives:
    """The collectives of one Group on CUDA buffers (Group.device)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.state: DeviceGroup | None = None
        self.plans: dict[tuple, SmallAllReduce] = {}  # small blocking all_reduces seen: (dtype, shape, op)
        self.tensor_type: type | None = None  # torch.Tensor, once a plan exists

    # -- common -----------------------------------------------------------------------------
    def _tensor(self, obj: Any, what: str, name: str = "tensor") -> Any:
        try:
            return as_device_tensor(obj, rank=self.group.runtime.rank, collective=what, name=name)
        except InvalidArgumentError as exc:
            self.group.fail_fast(exc)
            raise

    def _tensors(self, objs: Sequence[Any] | None, what: str, name: str, like: Any) -> list[Any]:
        g = self.group
        if objs is None or len(objs) != g.size:
            got = "None" if objs is None else str(len(objs))
            g._invalid(what, f"{name} must hold one tensor per rank ({g.size}), got {got}")
        out = [self._tensor(o, what, f"{name}[{i}]") for i, o in enumerate(objs)]  # type: ignore[union-attr]
        for i, t in enumerate(out):
            if t.dtype != like.dtype or t.numel() != like.numel():
                g._invalid(what, f"{name}[{i}] is {t.numel()} x {t.dtype}, expected {like.numel()} x "
                                 f"{like.dtype}")
        return out

    def _device(self, tensors: list[Any], what: str, coll: Coll, timeout: float | None) -> DeviceGroup:
        """The group's device state, set up by the first device call (`coll`, `what`)."""
        g = self.group
        try:
            dev = same_device(tensors, rank=g.runtime.rank, collective=what)
        except InvalidArgumentError as exc:
            g.fail_fast(exc)
        state = self.state
        if state is None:
            fp = Fingerprint(coll | ON_DEVICE, code_of(tensors[0].dtype)[0])
            state = self.state = DeviceGroup(g, dev, fp, what, timeout)
        elif state.device != dev:
            g._invalid(what, f"group {g.name} moves CUDA buffers of cuda:{state.device} (its first device "
                             f"call's); this call passed cuda:{dev}: make one group per device")
        return state

    def _fp(self, coll: Coll, dtype: Any, red: Reduction | None = None, root: int = -1,
            count: int = -1) -> Fingerprint:
        code = code_of(dtype)[0]
        if red is None:
            return Fingerprint(coll | ON_DEVICE, code, 0, root, count, 0)
        aux = 0 if red.factor is None else struct.unpack("<Q", struct.pack("<d", red.factor))[0]
        return Fingerprint(coll | ON_DEVICE, code, red.op, root, count, aux)

    def _reduction(self, op: Any, dtype: Any, what: str) -> Reduction:
        g = self.group
        try:
            red = as_reduction(op, rank=g.runtime.rank, collective=what)
        except InvalidArgumentError as exc:
            g.fail_fast(exc)
        why = op_undefined(red.op, code_of(dtype)[1])
        if why:
            g._invalid(what, f"{red.op.name} is not defined for {dtype} ({why})")
        return red

    def _on_device(self, dg: DeviceGroup, red: Reduction | None, dtype: Any, nbytes: int) -> bool:
        """Does this call move device to device (else: staged)? Every rank finds the same: the
        path, the size (every rank's share) and torch's kernels are alike everywhere."""
        if dg.mode == "staged" or (nbytes < dg.host_below and dg.mode == "ipc"):
            return False
        return red is None or kernels.runs_on_device(red, dtype, dg.device)

    @staticmethod
    def _small(dg: DeviceGroup, nbytes: int) -> bool:
        """Does a call whose every rank contributes `nbytes` take the slots?"""
        return dg.mode == "ipc" and nbytes <= dg.slot

    def _run(self, dg: DeviceGroup, what: str, fp: Fingerprint, spec: _Spec, obj: Any, tensors: list[Any],
             async_op: bool, timeout: float | None) -> Any:
        """Submit the call's host rounds in order; each queues its part of the GPU work."""
        g = self.group
        small = self._small(dg, spec.nbytes)
        st = dg.begin(obj, tensors, async_op, small)
        if dg.mode == "alone":
            bodies = [self._alone]
        elif small:
            bodies = [self._slots]
        elif spec.gather is not None:
            bodies = [self._publish, self._gather, self._close]
        else:
            bodies = [self._publish, self._close]
        if _coll_log.isEnabledFor(10):
            _coll_log.debug("%s on CUDA, group %s: %s", what, g.name,
                            dg.mode if dg.mode != "ipc" else "small (slots)" if small else "large (in place)")
        work = None
        for body in bodies:
            work = g._submit(fp, what, body, async_op, timeout, dg, st, spec)
        if not async_op:
            return spec.result
        return DeviceWork(work, st.end, st.stream, dg.device, spec.result)  # type: ignore[arg-type]

    # -- the bodies: one host round each ------------------------------------------------------
    @staticmethod
    def _alone(call: CollectiveCall, dg: DeviceGroup, st: _Call, spec: _Spec) -> None:
        with dg.on(st):
            spec.compute([spec.share])
            if spec.gather is not None:
                spec.gather([spec.out])
            if st.end is not None:
                st.end.record(st.stream)

    @staticmethod
    def _slots(call: CollectiveCall, dg: DeviceGroup, st: _Call, spec: _Spec) -> None:
        p, s = st.parity, st.stream
        with dg.on(st):
            dg.wait_peers(st, f"D{p}")  # their reads of this slot, two calls ago, have run
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

    @staticmethod
    def _publish(call: CollectiveCall, dg: DeviceGroup, st: _Call, spec: _Spec) -> None:
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

    @staticmethod
    def _gather(call: CollectiveCall, dg: DeviceGroup, st: _Call, spec: _Spec) -> None:
        with dg.on(st):
            tuner.select(call.group, "barrier", 0).run(call)
            dg.wait_peers(st, "MID")
            spec.gather(spec.outs)  # type: ignore[misc]
            dg.own["FIN"].record(st.stream)

    @staticmethod
    def _close(call: CollectiveCall, dg: DeviceGroup, st: _Call, spec: _Spec) -> None:
        with dg.on(st):
            tuner.select(call.group, "barrier", 0).run(call)
            dg.wait_peers(st, "FIN" if spec.gather is not None else "MID")
            if st.end is not None:
                st.end.record(st.stream)

    # -- staged through pinned host memory ------------------------------------------------------
    def _host_all_reduce(self, dg: DeviceGroup, obj: Any, sf: Any, df: Any, red: Reduction,
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
                view = as_array(host, writable=True, rank=self.group.runtime.rank, collective="all_reduce")
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
            self.group.all_reduce(view, red, timeout=timeout)
            df.copy_(host, non_blocking=True)
            done.record(stream)
        return result

    def _stage(self, dg: DeviceGroup, obj: Any, pieces: list[_Piece], bufs: list[Any], async_op: bool,
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

        def back(piece: _Piece, last: bool) -> None:
            with torch.cuda.stream(stream):
                for d, h in piece.writes:
                    d.copy_(h, non_blocking=True)
                if last:
                    done = end if end is not None else torch.cuda.Event()
                    done.record(stream)
                    for buf in bufs:
                        staging.give_back(buf, done)

        work = None
        for k, (ready, piece) in enumerate(zip(arrived, pieces)):
            last = k == len(pieces) - 1
            if not async_op:
                ready.synchronize()
                piece.invoke(False)
                back(piece, last)
                continue
            with self.group.wrapping(_around(ready, lambda p=piece, last=last: back(p, last))):
                work = piece.invoke(True)
        if not async_op:
            return result
        return DeviceWork(work, end, stream, dg.device, result)  # type: ignore[arg-type]

    def _whole(self, dg: DeviceGroup, obj: Any, reads: list[Any], writes: list[Any],
               invoke: Callable[[Callable[[Any], Any], bool], Any], async_op: bool, result: Any) -> Any:
        """A staged call in one piece: `invoke(host, async_op)` runs the host collective, where
        `host(t)` is device tensor t's pinned mirror."""
        mirrors, bufs = _mirrors([*reads, *writes])
        piece = _Piece([(t, mirrors[id(t)]) for t in reads], [(t, mirrors[id(t)]) for t in writes],
                       lambda a: invoke(lambda t: mirrors[id(t)], a))
        return self._stage(dg, obj, [piece], bufs, async_op, result)

    def _pieces(self, dg: DeviceGroup, obj: Any, src: Any, dst: Any, read: bool,
                invoke: Callable[[Any, Any, bool], Any], async_op: bool, result: Any) -> Any:
        """A staged call on flat `src` and `dst` in pieces of TENSORWIRE_CUDA_CHUNK, one host call
        each: `invoke(host_src_piece, host_dst_piece, async_op)`. `read`: copy `src` in."""
        mirrors, bufs = _mirrors([src, dst])
        hs, hd = mirrors[id(src)], mirrors[id(dst)]
        step = max(1, self.group.runtime.config.cuda_chunk // max(src.element_size(), 1))
        pieces = []
        for lo in range(0, max(src.numel(), 1), step):
            hi = min(lo + step, src.numel())
            pieces.append(_Piece([(src[lo:hi], hs[lo:hi])] if read else [], [(dst[lo:hi], hd[lo:hi])],
                                 lambda a, s=hs[lo:hi], d=hd[lo:hi]: invoke(s, d, a)))
        return self._stage(dg, obj, pieces, bufs, async_op, result)

    # -- reductions -------------------------------------------------------------------------------
    def all_reduce(self, tensor: Any, op: Any, out: Any, async_op: bool, timeout: float | None) -> Any:
        what, g = "all_reduce", self.group
        if type(tensor) is self.tensor_type and out is None and not async_op and type(op) is ReduceOp:
            plan = self.plans.get((tensor.dtype, tensor.shape, op))
            if plan is not None and not g._busy and not g._queue and plan.runs(tensor):
                return plan(tensor, timeout)
        g._check_member(what)
        src = self._tensor(tensor, what)
        dst = src if out is None else self._tensor(out, what, "out")
        if dst is not src and (dst.dtype != src.dtype or dst.numel() != src.numel()):
            g._invalid(what, f"out has {dst.numel()} x {dst.dtype}, tensor {src.numel()} x {src.dtype}")
        dg = self._device([src, dst], what, Coll.ALL_REDUCE, timeout)
        red = self._reduction(op, src.dtype, what)
        result = tensor if out is None else out
        sf = src.reshape(-1)
        df = sf if dst is src else dst.reshape(-1)  # one object where one memory: staged, one mirror
        n, nbytes = sf.numel(), sf.numel() * sf.element_size()
        if not self._on_device(dg, red, src.dtype, nbytes):
            if not async_op and dg.mode != "alone" and nbytes <= _LEAN:
                return self._host_all_reduce(dg, tensor, sf, df, red, timeout, result)
            return self._pieces(dg, tensor, sf, df, True, lambda s, d, a: g.all_reduce(
                s, red, out=None if d is s else d, async_op=a, timeout=timeout), async_op, result)
        fp = self._fp(Coll.ALL_REDUCE, src.dtype, red, count=n)
        small = self._small(dg, nbytes)
        key = (src.dtype, src.shape, op)
        if small and n and src is tensor and type(src) is torch_module().Tensor and out is None \
                and not async_op and type(op) is ReduceOp and not src.is_complex() \
                and key not in self.plans and len(self.plans) < _PLANS:  # repeats: gpu/planned.py
            self.plans[key] = SmallAllReduce(g, dg, src, red, fp)
            self.tensor_type = type(src)
        if small or dg.mode == "alone":
            def fold_all(shares: list[Any]) -> None:
                kernels.fold(df, shares, red.op)
                kernels.finalize(df, red, g.size)

            spec = _Spec(sf, nbytes, src.dtype, fold_all, result)
        elif dg.one_gpu:
            def lead(shares: list[Any]) -> None:
                if g.rank == 0:  # one process computes for all: no kernel of one waits for another's
                    kernels.fold(df, shares, red.op)
                    kernels.finalize(df, red, g.size)
                    for r in range(1, g.size):
                        spec.outs[r].copy_(df)

            spec = _Spec(sf, nbytes, src.dtype, lead, result, out=df)
        else:
            bounds = _blocks(n, g.size)
            lo, hi = bounds[g.rank]

            def fold_mine(shares: list[Any]) -> None:
                mine = df[lo:hi]
                kernels.fold(mine, [s[lo:hi] for s in shares], red.op)
                kernels.finalize(mine, red, g.size)

            def gather(outs: list[Any]) -> None:
                for r, (a, b) in enumerate(bounds):
                    if r != g.rank and b > a:
                        df[a:b].copy_(outs[r][a:b])

            spec = _Spec(sf, nbytes, src.dtype, fold_mine, result, gather, df)
        return self._run(dg, what, fp, spec, tensor, [src, dst], async_op, timeout)

    def reduce(self, tensor: Any, dst: int, op: Any, out: Any, async_op: bool, timeout: float | None) -> Any:
        what, g = "reduce", self.group
        root = g._root(dst, what, "dst")
        src = self._tensor(tensor, what)
        target = src
        if g.rank == root and out is not None:
            target = self._tensor(out, what, "out")
            if target.dtype != src.dtype or target.numel() != src.numel():
                g._invalid(what, f"out has {target.numel()} x {target.dtype}, tensor {src.numel()} x "
                                 f"{src.dtype}")
        dg = self._device([src, target], what, Coll.REDUCE, timeout)
        red = self._reduction(op, src.dtype, what)
        result = out if (out is not None and g.rank == root) else tensor
        sf = src.reshape(-1)
        tf = sf if target is src else target.reshape(-1)
        if not self._on_device(dg, red, src.dtype, sf.numel() * sf.element_size()):
            mine = g.rank == root
            return self._pieces(dg, tensor, sf, tf, True, lambda s, d, a: g.reduce(
                s, root, red, out=d if mine and d is not s else None, async_op=a, timeout=timeout),
                async_op, result)

        def fold_at_root(shares: list[Any]) -> None:
            if g.rank == root:
                kernels.fold(tf, shares, red.op)
                kernels.finalize(tf, red, g.size)

        spec = _Spec(sf, sf.numel() * sf.element_size(), src.dtype, fold_at_root, result)
        return self._run(dg, what, self._fp(Coll.REDUCE, src.dtype, red, root, sf.numel()), spec, tensor,
                         [src, target], async_op, timeout)

    def reduce_scatter(self, output: Any, input_list: Sequence[Any], op: Any, async_op: bool,
                       timeout: float | None) -> Any:
        what, g = "reduce_scatter", self.group
        g._check_member(what)
        out = self._tensor(output, what, "output")
        ins = self._tensors(input_list, what, "input_list", out)
        return self._reduce_scatter(what, output, out, ins, op, async_op, timeout)

    def reduce_scatter_tensor(self, output: Any, input: Any, op: Any, async_op: bool,
                              timeout: float | None) -> Any:
        what, g = "reduce_scatter_tensor", self.group
        g._check_member(what)
        out = self._tensor(output, what, "output")
        inp = self._tensor(input, what, "input")
        if inp.dtype != out.dtype or inp.numel() != out.numel() * g.size:
            g._invalid(what, f"input is {inp.numel()} x {inp.dtype}, expected {g.size} x output "
                             f"({out.numel()} x {out.dtype})")
        return self._reduce_scatter(what, output, out, list(inp.reshape(-1).chunk(g.size)) if out.numel()
                                    else [inp.reshape(-1)] * g.size, op, async_op, timeout, inp)

    def _reduce_scatter(self, what: str, result: Any, out: Any, ins: list[Any], op: Any, async_op: bool,
                        timeout: float | None, whole: Any = None) -> Any:
        g = self.group
        dg = self._device([out, *ins], what, Coll.REDUCE_SCATTER, timeout)
        red = self._reduction(op, out.dtype, what)
        of, m = out.reshape(-1), out.numel()
        if not self._on_device(dg, red, out.dtype, m * g.size * out.element_size()):
            return self._whole(dg, result, ins, [out], lambda h, a: g.reduce_scatter(
                h(out), [h(t) for t in ins], red, async_op=a, timeout=timeout), async_op, result)
        flat = whole.reshape(-1) if whole is not None else _joined(ins)
        if _overlap(flat, of) and not (whole is not None and of.data_ptr() == ins[g.rank].data_ptr()):
            flat = flat.clone()  # peers read every block of it while this rank writes its output
        me = g.rank

        def fold_mine(shares: list[Any]) -> None:
            kernels.fold(of, [s[me * m:(me + 1) * m] for s in shares], red.op)
            kernels.finalize(of, red, g.size)

        spec = _Spec(flat, flat.numel() * flat.element_size(), out.dtype, fold_mine, result)
        return self._run(dg, what, self._fp(Coll.REDUCE_SCATTER, out.dtype, red, count=m * g.size), spec,
                         result, [out, flat], async_op, timeout)

    def reduce_scatterv(self, output: Any, input: Any, counts: Sequence[int], op: Any, async_op: bool,
                        timeout: float | None) -> Any:
        what, g = "reduce_scatterv", self.group
        out, inp = self._tensor(output, what, "output"), self._tensor(input, what, "input")
        dg = self._device([out, inp], what, Coll.REDUCE_SCATTERV, timeout)
        return self._whole(dg, output, [inp], [out], lambda h, a: g.reduce_scatterv(
            h(out), h(inp), counts, op, async_op=a, timeout=timeout), async_op, output)

    # -- data movement ----------------------------------------------------------------------------
    def broadcast(self, tensor: Any, src: int, out: Any, async_op: bool, timeout: float | None) -> Any:
        what, g = "broadcast", self.group
        root = g._root(src, what, "src")
        data = self._tensor(tensor, what)
        target = data if out is None else self._tensor(out, what, "out")
        if target is not data and (target.dtype != data.dtype or target.numel() != data.numel()):
            g._invalid(what, f"out has {target.numel()} x {target.dtype}, tensor {data.numel()} x "
                             f"{data.dtype}")
        dg = self._device([data, target], what, Coll.BROADCAST, timeout)
        result = tensor if out is None else out
        df = data.reshape(-1)
        tf = df if target is data else target.reshape(-1)
        mine = g.rank == root
        if not self._on_device(dg, None, data.dtype, df.numel() * df.element_size()):
            return self._pieces(dg, tensor, df, tf, mine, lambda s, d, a: g.broadcast(
                s, root, out=None if d is s else d, async_op=a, timeout=timeout), async_op, result)

        def take(shares: list[Any]) -> None:
            if not mine:
                tf.copy_(shares[root])
            elif tf.data_ptr() != df.data_ptr():
                tf.copy_(df)

        spec = _Spec(df if mine else None, df.numel() * df.element_size(), data.dtype, take, result)
        return self._run(dg, what, self._fp(Coll.BROADCAST, data.dtype, root=root, count=df.numel()), spec,
                         tensor, [data, target], async_op, timeout)

    def all_gather(self, tensor_list: Sequence[Any], tensor: Any, async_op: bool,
                   timeout: float | None) -> Any:
        what, g = "all_gather", self.group
        g._check_member(what)
        inp = self._tensor(tensor, what)
        outs = self._tensors(tensor_list, what, "tensor_list", inp)
        return self._all_gather(what, tensor_list, inp, [o.reshape(-1) for o in outs], async_op, timeout)

    def all_gather_into_tensor(self, output: Any, input: Any, async_op: bool, timeout: float | None) -> Any:
        what, g = "all_gather_into_tensor", self.group
        g._check_member(what)
        out, inp = self._tensor(output, what, "output"), self._tensor(input, what, "input")
        if out.dtype != inp.dtype or out.numel() != inp.numel() * g.size:
            g._invalid(what, f"output is {out.numel()} x {out.dtype}, expected {g.size} x input "
                             f"({inp.numel()} x {inp.dtype})")
        of, m = out.reshape(-1), inp.numel()
        return self._all_gather(what, output, inp, [of[r * m:(r + 1) * m] for r in range(g.size)],
                                async_op, timeout)

    def _all_gather(self, what: str, result: Any, inp: Any, outs: list[Any], async_op: bool,
                    timeout: float | None) -> Any:
        g = self.group
        dg = self._device([inp, *outs], what, Coll.ALL_GATHER, timeout)
        flat = inp.reshape(-1)
        if not self._on_device(dg, None, inp.dtype, flat.numel() * flat.element_size()):
            return self._whole(dg, result, [flat], outs, lambda h, a: g.all_gather(
                [h(o) for o in outs], h(flat), async_op=a, timeout=timeout), async_op, result)
        me = g.rank
        if any(_overlap(flat, o) for r, o in enumerate(outs) if r != me):
            flat = flat.clone()

        def take(shares: list[Any]) -> None:
            for r, o in enumerate(outs):
                if r != me:
                    o.copy_(shares[r])
                elif o.data_ptr() != flat.data_ptr():
                    o.copy_(flat)

        spec = _Spec(flat, flat.numel() * flat.element_size(), inp.dtype, take, result)
        return self._run(dg, what, self._fp(Coll.ALL_GATHER, inp.dtype, count=flat.numel()), spec, result,
                         [flat, *outs], async_op, timeout)

    def all_to_all(self, output_list: Sequence[Any], input_list: Sequence[Any], async_op: bool,
                   timeout: float | None) -> Any:
        what, g = "all_to_all", self.group
        g._check_member(what)
        if len(output_list) != g.size or len(input_list) != g.size:
            g._invalid(what, f"output_list and input_list must hold one tensor per rank ({g.size}), got "
                             f"{len(output_list)} and {len(input_list)}")
        outs = [self._tensor(o, what, f"output_list[{i}]") for i, o in enumerate(output_list)]
        ins = [self._tensor(t, what, f"input_list[{i}]") for i, t in enumerate(input_list)]
        if len({(t.numel(), t.dtype) for t in outs + ins}) > 1:  # uneven blocks: through the host
            dg = self._device([*outs, *ins], what, Coll.ALL_TO_ALLV, timeout)
            return self._whole(dg, output_list, ins, outs, lambda h, a: g.all_to_all(
                [h(o) for o in outs], [h(t) for t in ins], async_op=a, timeout=timeout),
                async_op, output_list)
        return self._all_to_all(what, output_list, [o.reshape(-1) for o in outs], ins, None, async_op,
                                timeout)

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Sequence[int] | None,
                          input_split_sizes: Sequence[int] | None, async_op: bool,
                          timeout: float | None) -> Any:
        what, g = "all_to_all_single", self.group
        g._check_member(what)
        out, inp = self._tensor(output, what, "output"), self._tensor(input, what, "input")
        even = all(s is None or len(set(s)) <= 1 for s in (output_split_sizes, input_split_sizes))
        if out.dtype != inp.dtype:
            g._invalid(what, f"output is {out.dtype}, input {inp.dtype}")
        if not even or inp.numel() % g.size or out.numel() != inp.numel():
            dg = self._device([out, inp], what, Coll.ALL_TO_ALLV, timeout)
            return self._whole(dg, output, [inp], [out], lambda h, a: g.all_to_all_single(
                h(out), h(inp), output_split_sizes, input_split_sizes, async_op=a, timeout=timeout),
                async_op, output)
        m = out.numel() // g.size
        of = out.reshape(-1)
        return self._all_to_all(what, output, [of[r * m:(r + 1) * m] for r in range(g.size)], None,
                                inp.reshape(-1), async_op, timeout)

    def _all_to_all(self, what: str, result: Any, outs: list[Any], ins: list[Any] | None, whole: Any,
                    async_op: bool, timeout: float | None) -> Any:
        g = self.group
        dg = self._device([*outs, *(ins or [whole])], what, Coll.ALL_TO_ALL, timeout)
        flat = whole if whole is not None else _joined(ins)  # type: ignore[arg-type]
        dtype, m = flat.dtype, outs[0].numel()
        if not self._on_device(dg, None, dtype, flat.numel() * flat.element_size()):
            return self._whole(dg, result, [flat], outs, lambda h, a: g.all_to_all(
                [h(o) for o in outs], list(h(flat).chunk(g.size)) if m else [h(flat)] * g.size,
                async_op=a, timeout=timeout), async_op, result)
        if any(_overlap(flat, o) for o in outs):
            flat = flat.clone()  # peers read its blocks while this rank writes its outputs
        me = g.rank

        def take(shares: list[Any]) -> None:
            for r, o in enumerate(outs):
                o.copy_(shares[r][me * m:(me + 1) * m])

        spec = _Spec(flat, flat.numel() * flat.element_size(), dtype, take, result)
        return self._run(dg, what, self._fp(Coll.ALL_TO_ALL, dtype, count=flat.numel()), spec, result,
                         [flat, *outs], async_op, timeout)

    # -- staged only: rooted, vector and point-to-point calls -----------------------------------
    def gather(self, tensor: Any, gather_list: Sequence[Any] | None, dst: int, async_op: bool,
               timeout: float | None) -> Any:
        what, g = "gather", self.group
        root = g._root(dst, what, "dst")
        inp = self._tensor(tensor, what)
        outs = self._tensors(gather_list, what, "gather_list", inp) if g.rank == root else []
        dg = self._device([inp, *outs], what, Coll.GATHER, timeout)
        return self._whole(dg, tensor, [inp], outs, lambda h, a: g.gather(
            h(inp), [h(o) for o in outs] if outs else None, root, async_op=a, timeout=timeout),
            async_op, gather_list)

    def scatter(self, tensor: Any, scatter_list: Sequence[Any] | None, src: int, async_op: bool,
                timeout: float | None) -> Any:
        what, g = "scatter", self.group
        root = g._root(src, what, "src")
        out = self._tensor(tensor, what)
        ins = self._tensors(scatter_list, what, "scatter_list", out) if g.rank == root else []
        dg = self._device([out, *ins], what, Coll.SCATTER, timeout)
        return self._whole(dg, tensor, ins, [out], lambda h, a: g.scatter(
            h(out), [h(t) for t in ins] if ins else None, root, async_op=a, timeout=timeout),
            async_op, tensor)

    def all_gatherv(self, output: Any, input: Any, counts: Sequence[int], async_op: bool,
                    timeout: float | None) -> Any:
        what, g = "all_gatherv", self.group
        out, inp = self._tensor(output, what, "output"), self._tensor(input, what, "input")
        dg = self._device([out, inp], what, Coll.ALL_GATHERV, timeout)
        return self._whole(dg, output, [inp], [out], lambda h, a: g.all_gatherv(
            h(out), h(inp), counts, async_op=a, timeout=timeout), async_op, output)

    def gatherv(self, output: Any, input: Any, counts: Sequence[int], dst: int, async_op: bool,
                timeout: float | None) -> Any:
        what, g = "gatherv", self.group
        inp = self._tensor(input, what, "input")
        out = self._tensor(output, what, "output") if g.rank == dst and output is not None else None
        dg = self._device([inp] + ([out] if out is not None else []), what, Coll.GATHERV, timeout)
        return self._whole(dg, input, [inp], [out] if out is not None else [], lambda h, a: g.gatherv(
            h(out) if out is not None else None, h(inp), counts, dst, async_op=a, timeout=timeout),
            async_op, output)

    def scatterv(self, output: Any, input: Any, counts: Sequence[int], src: int, async_op: bool,
                 timeout: float | None) -> Any:
        what, g = "scatterv", self.group
        out = self._tensor(output, what, "output")
        inp = self._tensor(input, what, "input") if g.rank == src and input is not None else None
        dg = self._device([out] + ([inp] if inp is not None else []), what, Coll.SCATTERV, timeout)
        return self._whole(dg, output, [inp] if inp is not None else [], [out], lambda h, a: g.scatterv(
            h(out), h(inp) if inp is not None else None, counts, src, async_op=a, timeout=timeout),
            async_op, output)

    def isend(self, tensor: Any, dst: int, tag: int) -> Work:
        t = self.check_p2p(tensor, "send")
        torch = torch_module()
        buf = staging.take(t.numel() * t.element_size())
        host = staging.mirror(buf, t)
        with torch.cuda.stream(caller_stream(tensor, t.device.index)):
            host.copy_(t, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record()
        arrived.synchronize()
        work = self.group.isend(host, dst, tag)
        work.add_done_callback(lambda _w: staging.give_back(buf))
        return work

    def irecv(self, tensor: Any, src: int, tag: int) -> Work:
        t = self.check_p2p(tensor, "recv")
        buf = staging.take(t.numel() * t.element_size())
        host = staging.mirror(buf, t)
        return _Landing(self.group.irecv(host, src, tag), t, host, buf, caller_stream(tensor, t.device.index))

    def irecv_any(self, tensor: Any, tag: int, timeout: float | None) -> Work:
        t = self.check_p2p(tensor, "recv")
        buf = staging.take(t.numel() * t.element_size())
        host = staging.mirror(buf, t)
        return _Landing(self.group.irecv_any(host, tag, timeout), t, host, buf,
                        caller_stream(tensor, t.device.index))

    def check_p2p(self, tensor: Any, what: str) -> Any:
        """A bad buffer fails this rank's call only: nobody else waits on a point-to-point call."""
        return as_device_tensor(tensor, rank=self.group.runtime.rank, collective=what, name="tensor")


def _exchange(call: CollectiveCall, record: np.ndarray, table: np.ndarray) -> None:
    tuner.select(call.group, "all_gather", table.nbytes, True).run(call, list(table), record)


def _agree(call: CollectiveCall, verdict: np.ndarray) -> None:
    tuner.select(call.group, "all_reduce", verdict.nbytes).run(call, verdict, ReduceOp.MIN, None)


class _Piece:
    """One host call of a staged collective and its copies: (device, host) pairs."""

    __slots__ = ("reads", "writes", "invoke")

    def __init__(self, reads: list[tuple[Any, Any]], writes: list[tuple[Any, Any]],
                 invoke: Callable[[bool], Any]) -> None:
        self.reads, self.writes, self.invoke = reads, writes, invoke


class _Landing(Work):
    """A receive into device memory, staged: its copy to the device is queued, once the message
    has arrived on the host (on wait, or when a poll sees it), on the stream that was current
    where the receive was posted, whichever thread lands it (`stream`: what a torch Work orders
    its waiters after)."""

    progresses = False

    def __init__(self, inner: Work, target: Any, host: Any, buf: Any, stream: Any) -> None:
        super().__init__(inner.what, inner.rank)
        self.inner, self.target, self.host, self.buf, self.stream = inner, target, host, buf, stream

    def _land(self) -> None:
        if self._done:
            return
        torch = torch_module()
        with torch.cuda.device(self.target.device), torch.cuda.stream(self.stream):
            self.target.copy_(self.host, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        staging.give_back(self.buf, done)
        self._finish(self.inner._result)

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self.inner.wait(timeout)
        except BaseException as exc:
            if self.inner.is_completed() and not self._done:
                self._finish(exc=exc)
            raise
        self._land()
        return True

    def is_completed(self) -> bool:
        if not self._done and self.inner.is_completed():
            if self.inner.exception() is None:
                self._land()
            else:
                self._finish(exc=self.inner.exception())
        return self._done

    def result(self) -> Any:
        self.wait()
        return self._result


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


def _blocks(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each rank's block of an all_reduce of n elements (whole lines, the last short)."""
    size = -(-n // parts)
    size = -(-size // _ALIGN) * _ALIGN
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(parts)]


def _joined(tensors: list[Any]) -> Any:
    """One flat tensor of `tensors` end to end (list forms: one copy on the GPU)."""
    return torch_module().cat([t.reshape(-1) for t in tensors])


def _overlap(a: Any, b: Any) -> bool:
    """Do the two tensors' bytes meet?"""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size() \
        and a.numel() > 0 and b.numel() > 0
