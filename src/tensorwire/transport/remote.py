"""Point-to-point payloads that stay in their sender's memory until the receive reads them
(shared-memory channels only): a host buffer read across processes (cross-memory attach,
`Mode.REMOTE`, shm.REMOTE_BYTES) and a CUDA buffer copied on the receiver's GPU
(`Mode.DEVICE`, gpu/p2p.py). The ring carries a descriptor; the reader acknowledges it
(ShmChannel.acknowledge), which completes the send."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PeerLostError, TensorwireError
from . import cma, requests

if TYPE_CHECKING:
    from .requests import RecvRequest
    from .shm import ShmChannel

CMA_DESCRIPTOR = struct.Struct("<QQ")  # a REMOTE message's payload address and the sender's id for it
DEVICE_ID = struct.Struct("<Q")  # a DEVICE message's id, before the body gpu/p2p.py describes its buffer with
DEVICE_UNITS = 3
"""Records (of HEADER_SIZE bytes) of a DEVICE message's descriptor: its id, the buffer's
allocation record and the sender's event (gpu/p2p.BODY)."""


class _HeldPayload:
    """A message whose payload is still in the peer's memory (requests.RemotePayload): `where`
    says where (an address, or a CUDA buffer's descriptor); the subclass reads it there. Every
    way it ends acknowledges it, which completes the send."""

    __slots__ = ("channel", "where", "rid", "nbytes")
    unreadable: type[Exception] = OSError  # what a read that failed raises

    def __init__(self, channel: ShmChannel, where: int | bytes, rid: int, nbytes: int) -> None:
        self.channel = channel
        self.where = where
        self.rid = rid
        self.nbytes = nbytes

    def read_into(self, req: RecvRequest) -> None:
        copied = None
        try:
            copied = self._copy(req)
        except self.unreadable as exc:
            req.fail(self._error(req, exc))
        else:
            req.received = self.nbytes
            req.finish()
        self.channel.acknowledge(self.rid, copied)

    def read_all(self) -> np.ndarray | None:
        buf = np.empty(self.nbytes, dtype=np.uint8)
        try:
            self._to_host(buf)
        except self.unreadable:
            return None  # the receive that takes it will say why
        self.channel.acknowledge(self.rid)
        return buf

    def discard(self) -> None:
        self.channel.acknowledge(self.rid)

    def _copy(self, req: RecvRequest) -> bytes | None:
        """Fill `req`; what the acknowledgement carries back (gpu/p2p.Target.read's event)."""
        self._to_host(req.dst_u8)
        return None

    def _to_host(self, out: np.ndarray) -> None:
        raise NotImplementedError

    def _error(self, req: RecvRequest, exc: Exception) -> Exception:
        raise NotImplementedError


class CmaPayload(_HeldPayload):
    """A REMOTE message: a host buffer in the peer's memory, read across processes (point-to-
    point receives only, REMOTE_BYTES: a plain copy, never a fold)."""

    __slots__ = ()
    where: int  # the payload's address in the peer's memory

    def _to_host(self, out: np.ndarray) -> None:
        channel = self.channel
        channel.reader.read_into(out, channel.peer_pid, self.where)

    def _error(self, req: RecvRequest, exc: Exception) -> Exception:
        return read_failed(self.channel, req.what, exc)


def read_failed(channel: ShmChannel, what: str, exc: Exception) -> PeerLostError:
    """The error of a receive (`what`) whose message could not be read out of its sender."""
    peer = channel.peer
    why = (f"rank {peer} exited before this rank read its message" if isinstance(exc, cma.ProcessGone)
           else f"cannot read rank {peer}'s memory ({exc})")
    return PeerLostError(f"rank {channel.engine.rank}: {what}: {why}", peer=peer)


class DevicePayload(_HeldPayload):
    """A DEVICE message: a CUDA buffer in the peer's process, which gpu/p2p.py reads through
    CUDA IPC: into device memory queued on the GPU (the acknowledgement carries the event after
    the copy), into host memory copied before it is acknowledged."""

    __slots__ = ()
    where: bytes  # the CUDA buffer's descriptor (gpu/p2p.BODY)
    unreadable = Exception  # whatever CUDA or torch raised: the receive fails naming it, the sender goes on

    def _copy(self, req: RecvRequest) -> bytes | None:
        if req.device is not None:
            return req.device.read(self.where, self.channel.peer)
        return super()._copy(req)

    def _to_host(self, out: np.ndarray) -> None:
        if requests.device_to_host is None:
            raise TensorwireError("tensorwire's GPU support is not loaded in this process")
        requests.device_to_host(self.where, self.channel.peer, out)

    def _error(self, req: RecvRequest, exc: Exception) -> Exception:
        channel = self.channel
        return TensorwireError(f"rank {channel.engine.rank}: {req.what}: cannot read rank {channel.peer}'s "
                               f"CUDA buffer ({type(exc).__name__}: {exc}); TENSORWIRE_CUDA_IPC=0 on the "
                               "sender stages it through host memory")
