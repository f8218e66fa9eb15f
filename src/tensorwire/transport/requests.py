"""Send and receive requests, and the sinks a channel writes arriving payload into.

A channel never knows what a payload is for: it asks the engine for a sink when a header
arrives and then hands it byte ranges, either as a writable view of the final destination
(zero copy, for TCP `recv_into`) or as chunks to copy or reduce (shared-memory rings, staging).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from ..errors import AbortedError
from ..ops import ReduceOp
from ..ops.kernels import reduce_into, reduce_to
from .wire import Header

_U8 = np.dtype(np.uint8)
P2P_SEQ = 1 << 62
"""A point-to-point message belongs to no call: its requests' `seq` is P2P_SEQ plus the last
call its group had made when it was posted (Failures.covers); P2P_SEQ alone, any abort of its
group covers it."""


class Request:
    """One point-to-point transfer; `done` flips once, `error` is set if it failed. `seq`: where
    a point-to-point message stands among its group's calls (P2P_SEQ); a collective's call is
    its header's."""

    void = False  # a receive's message: see Sink.void

    def __init__(self, peer: int, header: Header, label: object, seq: int = P2P_SEQ) -> None:
        self.peer = peer
        self.header = header
        self.seq = seq
        self.done = False
        self.error: BaseException | None = None
        self.label = label  # a str, or an object whose str() is the label (built only for errors)

    @property
    def what(self) -> str:
        return str(self.label)

    def fail(self, exc: BaseException) -> None:
        if not self.done:
            self.error = exc
            self.done = True

    def progress_text(self) -> str:
        """How far it got, for a timeout's message (a send's or a receive's: only those wait)."""
        raise NotImplementedError


def _sent() -> Request:
    req = Request(-1, None, "a message sent as it was posted")  # type: ignore[arg-type]
    req.done = True
    return req


SENT = _sent()
"""What a send handed whole to its ring or socket at once returns (Engine.send_now): done,
never failed, shared."""


class SendRequest(Request):
    descriptor: bytes | None = None  # set where the receiver reads the payload itself (shm REMOTE)
    device_body: bytes | None = None  # a CUDA buffer's descriptor (Engine.isend_device)
    holds: DeviceSource | None = None  # what the receiver reads in place of `payload`: kept alive
    copied: bytes | None = None  # the receiver's event after its copy of a CUDA buffer (Mode.COPIED)

    def __init__(self, peer: int, header: Header, payload: np.ndarray, what: object,
                 wire_header: bytes | None = None, seq: int = P2P_SEQ) -> None:
        super().__init__(peer, header, what, seq)
        self.wire_header = header.pack() if wire_header is None else wire_header  # given: cached
        self.payload = payload  # uint8, flat, contiguous
        self.sent = 0  # payload bytes handed to the channel

    def progress_text(self) -> str:
        return f"sent {self.sent}/{self.header.nbytes} bytes to rank {self.peer}"


class RemotePayload(Protocol):
    """A message whose payload is still in its sender's memory (shared memory's REMOTE mode).
    Each method tells the sender once, after which it may reuse its buffer."""

    def read_into(self, req: RecvRequest) -> None:
        """Fill `req` straight from the sender's memory and finish it (only point-to-point
        messages go so, and their receives never fold)."""

    def read_all(self) -> np.ndarray | None:
        """The whole payload in a fresh buffer; None, telling nobody, where the sender's memory
        cannot be read (the receive that takes it then says why)."""

    def discard(self) -> None:
        """Read nothing (the receive failed)."""


class DeviceSource(Protocol):
    """A CUDA buffer sent device to device (gpu/p2p.Source), kept by its send's request."""

    def copied(self, handle: bytes, peer: int) -> None:
        """`peer` queued its copy out of the buffer, followed by its event `handle`: the buffer
        must outlive that copy, whether or not anybody waits for the send."""


class DeviceTarget(Protocol):
    """Device memory a receive lands in (gpu/p2p.Target)."""

    def read(self, body: bytes, peer: int) -> bytes | None:
        """Queue the copy of `peer`'s CUDA buffer that `body` describes; the handle of the event
        recorded after it, or None where the copy has run already."""


device_to_host: Callable[[bytes, int, np.ndarray], None] | None = None
"""Copies a device message (`body`, from world rank `peer`) into host memory and waits for it;
set by tensorwire.gpu as it loads (gpu/p2p.read_to_host)."""


class Sink:
    """Destination of one arriving message."""

    void = False
    """Its sender's group was aborted while it was on its way: its bytes are not what was sent (tcp.py)."""
    trailers = 0  # TCP streams whose trailer word for it has yet to come (tcp.py)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.received = 0

    def direct_at(self, offset: int, nbytes: int) -> memoryview | None:
        """A writable view of `nbytes` of the destination from `offset`, if it can take raw bytes."""
        return None

    def write(self, data: np.ndarray) -> None:
        """Consume the next len(data) payload bytes (uint8 view, may alias a ring)."""
        self.received += len(data)

    def write_at(self, offset: int, data: np.ndarray) -> None:
        """Consume payload bytes [offset, offset + len(data)): the parts of a message split over
        several TCP streams arrive side by side (offsets are multiples of 64 but at its end)."""
        self.received += len(data)

    def advance(self, nbytes: int) -> None:
        """Account for bytes that were written through `direct`."""
        self.received += nbytes

    @property
    def complete(self) -> bool:
        """Every byte in, and every trailer word (tcp.py): only then is it known not void."""
        return self.received >= self.nbytes and not self.trailers

    def finish(self) -> None:
        """Called once when the last byte arrived."""

    def fetch(self, source: RemotePayload) -> None:
        """Take a message whose payload is in its sender's memory (instead of write/finish)."""
        source.discard()
        self.received = self.nbytes
        self.finish()


class RecvRequest(Request, Sink):
    """A posted receive: plain copy into `dst`, or reduce into it as the payload arrives
    (`dst op= payload`, or with `base`, `dst = base op payload`: no copy of base first)."""

    device: DeviceTarget | None = None
    """A receive into device memory: where a device message (Mode.DEVICE) goes; any other
    message lands in `dst`, its host buffer (gpu/p2p.py)."""


    def __init__(self, peer: int, header: Header, dst: np.ndarray, reduce_op: ReduceOp | None,
                 what: object, base: np.ndarray | None = None, seq: int = P2P_SEQ) -> None:
        Request.__init__(self, peer, header, what, seq)
        Sink.__init__(self, header.nbytes)
        dst = dst if dst.ndim == 1 else dst.reshape(-1)  # callers mostly pass flat views already
        self.dst = dst
        self.dst_u8 = dst if dst.dtype is _U8 else dst.view(_U8)
        self.reduce_op = reduce_op
        self.base = None if base is None else base.reshape(-1)
        self.itemsize = dst.itemsize

    def direct_at(self, offset: int, nbytes: int) -> memoryview | None:
        if self.reduce_op is not None:
            return None
        return self.dst_u8[offset:offset + nbytes].data

    def write(self, data: np.ndarray) -> None:
        self.write_at(self.received, data)

    def write_at(self, offset: int, data: np.ndarray) -> None:
        self.place_at(offset, data)
        self.received += len(data)

    def place_at(self, offset: int, data: np.ndarray) -> None:
        """Copy or reduce payload bytes [offset, offset + len(data)) into place, counting
        nothing: a pump thread's part, counted once it is all in (tcp.SocketStream)."""
        n = len(data)
        if self.reduce_op is None:
            self.dst_u8[offset:offset + n] = data
        else:
            i, j = offset // self.itemsize, (offset + n) // self.itemsize
            if self.base is None:
                reduce_into(self.dst[i:j], data.view(self.dst.dtype), self.reduce_op)
            else:
                reduce_to(self.dst[i:j], self.base[i:j], data.view(self.dst.dtype), self.reduce_op)

    def finish(self) -> None:
        if self.void:  # Engine.wait raises the sender's abort in its place once it has come
            self.fail(AbortedError(
                f"{self.what}: rank {self.peer}'s group was aborted while this message was on its "
                f"way: what arrived is not what it sent; the group is aborted"))
        self.done = True

    def fetch(self, source: RemotePayload) -> None:
        source.read_into(self)

    def progress_text(self) -> str:
        return f"received {self.received}/{self.nbytes} bytes from rank {self.peer}"


class Unexpected(Sink):
    """A message that arrived before its receive was posted; buffered until it is, or, where
    its payload stays in the sender's memory (`remote`), read only once it is."""


    def __init__(self, header: Header, remote: bool = False) -> None:
        super().__init__(header.nbytes)
        self.header = header
        self.buf = None if remote else np.empty(header.nbytes, dtype=np.uint8)
        """The payload; None while it stays in the sender's memory (`remote`, until `stage`).
        Only an in-band message is written here, and only one staged or in-band is delivered
        from it (`deliver`): a remote one is read through `source`."""
        self.source: RemotePayload | None = None
        self.waiter: RecvRequest | None = None

    def direct_at(self, offset: int, nbytes: int) -> memoryview | None:
        return self.buf[offset:offset + nbytes].data  # type: ignore[index]  # see buf

    def write(self, data: np.ndarray) -> None:
        self.write_at(self.received, data)

    def write_at(self, offset: int, data: np.ndarray) -> None:
        self.buf[offset:offset + len(data)] = data  # type: ignore[index]  # see buf
        self.received += len(data)

    def finish(self) -> None:
        if self.waiter is not None:
            deliver(self, self.waiter)

    def fetch(self, source: RemotePayload) -> None:
        self.source = source
        self.received = self.nbytes

    def stage(self) -> int:
        """Copy a remote payload here and release its sender; the bytes staged."""
        buf = None if self.source is None else self.source.read_all()
        if buf is None:
            return 0
        self.buf, self.source = buf, None
        return self.nbytes


def deliver(msg: Unexpected, req: RecvRequest) -> None:
    """Hand an unexpected message that has fully arrived to the receive that matched it."""
    if msg.source is not None:
        source, msg.source = msg.source, None
        source.read_into(req)
        return
    req.write(msg.buf)  # type: ignore[arg-type]  # see Unexpected.buf
    req.void = msg.void
    req.finish()


class Discard(Sink):
    """Drains the payload of a message whose receive failed (e.g. a mismatch)."""



class ControlSink(Sink):
    """Collects a small control payload and calls back when it is complete."""


    def __init__(self, nbytes: int, callback) -> None:
        super().__init__(nbytes)
        self.buf = bytearray()
        self.callback = callback

    def write(self, data: np.ndarray) -> None:
        self.buf += data.tobytes()
        self.received += len(data)

    def write_at(self, offset: int, data: np.ndarray) -> None:
        self.write(data)  # never split (control messages are small): in order, as written

    def finish(self) -> None:
        self.callback(bytes(self.buf))
