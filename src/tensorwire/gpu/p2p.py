"""Point-to-point calls device to device between ranks of one host, through CUDA IPC.

A send of a CUDA buffer to a rank joined by shared memory travels as a descriptor
(`wire.Mode.DEVICE`, ShmChannel.offer_device): the buffer's allocation handle and offset
(ipc.describe) and an interprocess event recorded on the sender's stream after its writes.
The receive that takes it queues, on its GPU's copy stream, a wait for that event and for the
receiver's own earlier work on its buffer, the copy, and a record of the copy stream's
interprocess event, whose handle goes back with the acknowledgement (`Mode.COPIED`). The send
completes on that acknowledgement (MPI's rendezvous), and its waiter's stream waits for the
receiver's copy before it may write the buffer again; the buffer's memory outlives that copy
even where nobody waits (Source). Where both processes take turns on one GPU (no MPS), the
receiver's host waits instead and acknowledges once its copy ran (Target.read). A receive into
host memory copies out of the device synchronously; a host or staged message into device memory
lands through pinned memory (staged.Landing). Each side chooses its buffers, as on the host.

Events are kept per stream and re-recorded by every send or copy on it: a wait covers the
last record made before it, this message's or a later one's on the same stream, so a later
record can only make a waiter wait longer, never too little (docs/design/gpu.md).
"""

from __future__ import annotations

import functools
import os
import struct
import threading
from typing import Any

import numpy as np

from ..transport import remote
from ..transport.wire import HEADER_SIZE
from . import device_flags, driver, ipc
from .tensors import torch_module

BODY = struct.Struct(f"<{ipc.RECORD.size}s{driver.HANDLE_BYTES}s")
"""A device message's descriptor: the buffer's record (ipc.RECORD) and the sender's event."""
assert remote.DEVICE_ID.size + BODY.size <= remote.DEVICE_UNITS * HEADER_SIZE  # fits the ring's records
TURNS_STAGED_BYTES = 1 << 20
"""Messages up to this size are staged where the ranks of a host take turns on its one GPU:
there they arrive sooner staged than device to device (docs/design/gpu.md#next-visit)."""
STREAMS = 64
"""Streams per process whose sends go device to device; a send from another stream is staged
(each needs an interprocess event of its own, kept for the process's life)."""

_lock = threading.Lock()
_written: dict[tuple[int, int], tuple[Any, bytes]] = {}  # (device, stream) -> (its event, handle)
_copies: dict[int, tuple[Any, Any, bytes]] = {}  # device -> (copy stream, its interprocess event, handle)
_holds: dict[int, Any] = {}  # device -> the stream sent buffers are recorded on (Source)
_home: list[int] = []  # the device this process sends and receives device buffers on (_home_device)
_opened: dict[tuple[int, bytes, int], Any] = {}  # (peer, handle, device) -> the peer's event opened here


def describe(t: Any, stream: Any) -> bytes | None:
    """`t`'s descriptor, with an event recorded on `stream` (the caller's) after its writes;
    None where it cannot go device to device (its memory is not shareable, too many streams):
    stage it."""
    torch = torch_module()
    _note_home(t.device.index)
    try:
        record = ipc.describe(t)
    except driver.CudaDriverError:
        return None
    key = (stream.device.index, stream.cuda_stream)  # every device's default stream is 0
    with _lock:
        entry = _written.get(key)
        if entry is None:
            if len(_written) >= STREAMS:
                return None
            with torch.cuda.device(stream.device):  # the event is made on the current device
                event = torch.cuda.Event(interprocess=True)
                entry = _written[key] = (event, bytes(event.ipc_handle()))
    entry[0].record(stream)
    return BODY.pack(record, entry[1])


class Source:
    """A CUDA buffer sent device to device (the engine's SendRequest.holds). Its memory goes back
    to torch's allocator only after the receiver's copy out of it has run, as the allocator
    waits for the hold stream, which waits for that copy: a Work dropped unwaited, and its
    tensor freed, cannot hand the block to another tensor while the peer still reads it."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        tensor.record_stream(_hold_stream(tensor.device.index))

    def copied(self, handle: bytes, peer: int) -> None:
        device = self.tensor.device.index
        _hold_stream(device).wait_event(_peer_event(peer, handle, device))


class Target:
    """A receive into device memory: where a device message goes, once one comes (the engine's
    RecvRequest.device; a host message lands in the receive's pinned buffer instead)."""

    __slots__ = ("tensor", "ready", "copied")

    def __init__(self, tensor: Any, stream: Any) -> None:
        torch = torch_module()
        _note_home(tensor.device.index)
        self.tensor = tensor
        self.ready = torch.cuda.Event()  # the receiver's earlier work on its buffer
        self.ready.record(stream)
        self.copied: Any = None  # the copy stream's event once the copy was queued

    def read(self, body: bytes, peer: int) -> bytes | None:
        """Queue the copy of `peer`'s buffer into the tensor; the handle of the event recorded
        after it, which the acknowledgement carries to the sender, or None where the copy has
        run already. Where both processes' work takes turns on one GPU (no MPS), a stream that
        waits for the other process's event holds the GPU until its time slice ends: there the
        host waits for the sender's writes, and for the copy before it
        acknowledges, so neither process's GPU ever waits for the other's."""
        torch = torch_module()
        t = self.tensor
        device = t.device.index
        stream, event, handle = _copy_stream(device)
        with torch.cuda.device(device):  # this thread's (the progress thread's, maybe) current device
            src = _source(body, peer, device)
            sent = _peer_event(peer, BODY.unpack(body[:BODY.size])[1], device)
            turns = src.device == t.device and not _concurrent()
            if turns:
                sent.synchronize()
            else:
                stream.wait_event(sent)
            stream.wait_event(self.ready)
            with torch.cuda.stream(stream):
                t.reshape(-1).view(torch.uint8).copy_(src, non_blocking=True)
            event.record(stream)
            if turns:
                event.synchronize()
        t.record_stream(stream)
        self.copied = event
        return None if turns else handle


def read_to_host(body: bytes, peer: int, out: np.ndarray) -> None:
    """Copy `peer`'s device message into host memory `out` (flat uint8) and wait for it: a
    receive of a host buffer, or a message staged before its receive was posted."""
    torch = torch_module()
    device = _home_device()
    stream, _event, _handle = _copy_stream(device)
    with torch.cuda.device(device):
        src = _source(body, peer, device)
        _peer_event(peer, BODY.unpack(body[:BODY.size])[1], device).synchronize()  # no GPU wait (Target.read)
        with torch.cuda.stream(stream):
            torch.from_numpy(out).copy_(src)
        stream.synchronize()


def wait_copied(handle: bytes, peer: int, stream: Any) -> None:
    """Make `stream` (a sender's) wait for the receiver's copy out of its buffer."""
    stream.wait_event(_peer_event(peer, handle, stream.device.index))


def staged_faster(nbytes: int) -> bool:
    """Is a message of `nbytes` to a rank of this host faster staged than device to device?"""
    return nbytes <= TURNS_STAGED_BYTES and _sharing_one_gpu() and not _concurrent()


@functools.cache
def _sharing_one_gpu() -> bool:
    """Does every rank of this host use the same GPU: the machine's only one, none hidden by
    CUDA_VISIBLE_DEVICES (which may give each rank a GPU of its own)?"""
    return "CUDA_VISIBLE_DEVICES" not in os.environ and torch_module().cuda.device_count() == 1


@functools.cache
def _concurrent() -> bool:
    """Do processes sharing a GPU run their work at once (an MPS daemon serves them)? Asked
    once: a process is a client of MPS, or not, from its first CUDA call on."""
    return device_flags.mps_running()


def _source(body: bytes, peer: int, device: int) -> Any:
    record = BODY.unpack(body[:BODY.size])[0]
    return ipc.peer_tensor(peer, record, torch_module().uint8, device)


def _home_device() -> int:
    """The device a message read into host memory is opened on: the first this process sent or
    received a device buffer on (a thread of its own, such as the progress thread, has device 0
    current whatever the program set), else the current one."""
    return _home[0] if _home else torch_module().cuda.current_device()


def _note_home(device: int) -> None:
    if not _home:
        _home.append(device)


def _hold_stream(device: int) -> Any:
    """The stream that waits for receivers' copies out of this process's sent buffers (Source)."""
    stream = _holds.get(device)
    if stream is None:
        with _lock:
            stream = _holds.get(device)
            if stream is None:
                stream = _holds[device] = torch_module().cuda.Stream(device)
    return stream


def _copy_stream(device: int) -> tuple[Any, Any, bytes]:
    """The stream receives copy on (one per device: its event's last record covers every
    copy queued before) and its interprocess event."""
    entry = _copies.get(device)
    if entry is None:
        torch = torch_module()
        with _lock, torch.cuda.device(device):
            entry = _copies.get(device)
            if entry is None:
                event = torch.cuda.Event(interprocess=True)
                entry = _copies[device] = (torch.cuda.Stream(device), event, bytes(event.ipc_handle()))
    return entry


def _peer_event(peer: int, handle: bytes, device: int) -> Any:
    """A peer's interprocess event, opened here once."""
    key = (peer, handle, device)
    event = _opened.get(key)
    if event is None:
        with _lock:
            event = _opened.get(key)
            if event is None:
                event = _opened[key] = torch_module().cuda.Event.from_ipc_handle(device, handle)
    return event
