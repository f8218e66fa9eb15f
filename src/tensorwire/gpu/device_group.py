"""One group's device state on this rank: its path, interprocess events, slots and stream.

Set up by the group's first call on CUDA buffers, collectively: every rank tells what its GPU
is and, where all are on one host, the IPC handles of its events and slots; they agree on the
path (gpu/collectives.py describes the paths).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import log
from ..errors import TensorwireWarning
from ..ops import ReduceOp
from ..transport.wire import Fingerprint
from ..tuning import tuner
from ..work import Work
from . import device_flags, driver, ipc
from .tensors import caller_stream, torch_module

if TYPE_CHECKING:
    from ..group.calls import CollectiveCall
    from ..group.group import Group

_log = log.get("INIT")

_EVENTS = ("R0", "R1", "D0", "D1", "PUB", "MID", "FIN")
"""A rank's interprocess events: the small path's share-ready (R) and reads-done (D) per slot
parity; the large path's buffers-ready (PUB), own-part-done (MID) and all_reduce's
gathered (FIN)."""
_INFO = struct.Struct("<48s24sqB")  # GPU uuid, PCI bus id, device index, offers IPC
_SETUP_BYTES = _INFO.size + ipc.RECORD.size + len(_EVENTS) * driver.HANDLE_BYTES


class CallStream:
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
        inner.add_done_callback(lambda w: self.finish(result, w.exception()))

    def wait(self, timeout: float | None = None) -> bool:
        super().wait(timeout)
        torch_module().cuda.current_stream(self.device).wait_event(self.end)
        return True

    def is_completed(self) -> bool:
        """True once the GPU work itself has run (NCCL's meaning)."""
        return super().is_completed() and (self.exception() is not None or self.end.query())


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
        self.flags: device_flags.DeviceFlags | None = None  # small calls with device-side flags
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
        no_flags = why or self._no_flags()
        if not why:
            try:
                with torch.cuda.device(dev):
                    self.own = {name: torch.cuda.Event(interprocess=True) for name in _EVENTS}
                    handles = b"".join(bytes(self.own[name].ipc_handle()) for name in _EVENTS)
                    extra = 0 if no_flags else device_flags.area_bytes(self.slot)
                    mine = torch.empty(2 * self.slot + extra, dtype=torch.uint8, device=dev)
                    if extra:  # the flags start at zero, before any peer can read them
                        mine[2 * self.slot:].zero_()
                        torch.cuda.current_stream(dev).synchronize()
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
        g.queue.submit(fp, what, _exchange, False, timeout, record, table)
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
        gpus = len({info[0] for info in infos})
        flags = None
        if ok and not no_flags:
            if any(s.numel() < 2 * self.slot + device_flags.area_bytes(self.slot) for s in self.slots):
                no_flags = "a rank keeps no flags (TENSORWIRE_CUDA_DEVICE_FLAGS=0 or no Triton there)"
            elif cfg.cuda_device_flags == "auto" and gpus < g.size and not device_flags.mps_running():
                no_flags = (f"rank {g.rank}: ranks share a GPU without MPS, where their kernels take turns "
                            "(TENSORWIRE_CUDA_DEVICE_FLAGS=1 forces it)")
            else:
                try:  # before the agreement: a rank that cannot make it says so there
                    areas = [s.data_ptr() + 2 * self.slot for s in self.slots]
                    flags = device_flags.DeviceFlags(g, areas, dev)
                except Exception as exc:
                    no_flags = f"rank {g.rank}: {exc}"
        verdict = np.array([ok, ok and flags is not None], dtype=np.uint8)
        g.queue.submit(fp, what, _agree, False, timeout, verdict)
        self.mode = "ipc" if verdict[0] else "staged"
        self.one_gpu = gpus == 1
        self.host_below = cfg.cuda_host_below
        if self.mode == "staged":
            self.own, self.peer, self.slots = {}, {}, []
        if verdict[1]:
            self.flags = flags
        elif flags is not None:  # a peer could not
            g.engine.alarms.pop(g.ctx, None)
            no_flags = "a peer cannot run them"
        if no_flags and cfg.cuda_device_flags == "1" and verdict[0]:
            log.warn(f"group {g.name}: TENSORWIRE_CUDA_DEVICE_FLAGS=1, but small CUDA calls take the "
                     f"host-flag path: {no_flags}", TensorwireWarning)
        self._describe(infos, why, no_flags)

    def _no_flags(self) -> str:
        """Why this rank cannot take the device-flag path ('' where it can)."""
        cfg = self.group.runtime.config
        if cfg.cuda_device_flags == "0":
            return "TENSORWIRE_CUDA_DEVICE_FLAGS=0"
        if not self.slot:
            return "TENSORWIRE_CUDA_SLOT=0"
        return device_flags.available()

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

    def _describe(self, infos: list[tuple], why: str, no_flags: str) -> None:
        if not _log.isEnabledFor(20):
            return
        g = self.group
        gpus = "; ".join(f"rank {r}: cuda:{info[2]} {info[0].decode().rstrip(chr(0))} "
                         f"({info[1].decode().rstrip(chr(0))})" for r, info in enumerate(infos))
        sharing: dict[bytes, list[int]] = {}
        for r, info in enumerate(infos):
            sharing.setdefault(info[0], []).append(r)
        shared = [ranks for ranks in sharing.values() if len(ranks) > 1]
        small = ""
        if self.mode == "ipc":
            small = "; small calls: " + ("device flags (one Triton kernel a call)"
                                               if self.flags is not None else f"host flags ({no_flags})")
        _log.info("group %s on CUDA: %s; %s; %s; path: %s%s%s", g.name, gpus,
                  "one host" if g.one_host else "several hosts",
                  "ranks sharing a GPU: " + ", ".join(map(str, shared)) if shared else "one GPU per rank",
                  "device to device (CUDA IPC)" if self.mode == "ipc" else "staged through pinned memory",
                  f" ({why})" if why and self.mode != "ipc" else "", small)

    # -- calls -------------------------------------------------------------------------------
    def begin(self, obj: Any, tensors: Sequence[Any], async_op: bool, small: bool) -> CallStream:
        """The call's stream: the caller's current one, or for an async call the group's own,
        after everything queued on the caller's so far."""
        torch = torch_module()
        caller = caller_stream(obj, self.device)
        parity = 0
        if small:
            parity, self.calls = self.calls & 1, self.calls + 1
        if not async_op:
            own = caller == torch.cuda.current_stream(self.device)
            return CallStream(caller, threading.get_ident() if own else 0, None, parity)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(caller)
        for t in tensors:  # the caller may free them before the GPU work ran: torch must not reuse them
            if t.numel():
                t.record_stream(self.stream)
        return CallStream(self.stream, 0, torch.cuda.Event(), parity)

    def on(self, st: CallStream) -> Any:
        """Where the call's GPU work is queued from this thread: its stream made current here
        unless it is already."""
        if st.thread == threading.get_ident():
            return nullcontext()
        return torch_module().cuda.stream(st.stream)

    def wait_peers(self, st: CallStream, name: str) -> None:
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


def _exchange(call: CollectiveCall, record: np.ndarray, table: np.ndarray) -> None:
    tuner.select(call.group, "all_gather", table.nbytes, True).run(call, list(table), record)


def _agree(call: CollectiveCall, verdict: np.ndarray) -> None:
    tuner.select(call.group, "all_reduce", verdict.nbytes).run(call, verdict, ReduceOp.MIN, None)
