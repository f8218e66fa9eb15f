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


class CmaPayload:
    """A REMOTE message's payload in the peer's memory (requests.RemotePayload)."""

    __slots__ = ("channel", "where", "rid", "nbytes")

    def __init__(self, channel: ShmChannel, where: int, rid: int, nbytes: int) -> None:
        self.channel = channel
        self.where = where
        self.rid = rid
        self.nbytes = nbytes

    def read_into(self, req: RecvRequest) -> None:
        """Point-to-point receives only (REMOTE_BYTES): a plain copy, never a fold."""
        channel = self.channel
        peer = channel.peer
        try:
            channel.reader.read_into(req.dst_u8, channel.peer_pid, self.where)
        except OSError as exc:
            why = (f"rank {peer} exited before this rank read its message" if isinstance(exc, cma.ProcessGone)
                   else f"cannot read rank {peer}'s memory ({exc})")
            req.fail(PeerLostError(f"rank {channel.engine.rank}: {req.what}: {why}", peer=peer))
        else:
            req.received = self.nbytes
            req.finish()
        channel.acknowledge(self.rid)

    def read_all(self) -> np.ndarray | None:
        buf = np.empty(self.nbytes, dtype=np.uint8)
        channel = self.channel
        try:
            channel.reader.read_into(buf, channel.peer_pid, self.where)
        except OSError:
            return None  # the receive that takes it will say why
        channel.acknowledge(self.rid)
        return buf

    def discard(self) -> None:
        self.channel.acknowledge(self.rid)


class DevicePayload:
    """A DEVICE message: a CUDA buffer in the peer's process (requests.RemotePayload), which
    gpu/p2p.py reads through CUDA IPC."""

    __slots__ = ("channel", "body", "rid", "nbytes")

    def __init__(self, channel: ShmChannel, body: bytes, rid: int, nbytes: int) -> None:
        self.channel = channel
        self.body = body
        self.rid = rid
        self.nbytes = nbytes

    def read_into(self, req: RecvRequest) -> None:
        """Into device memory, queued on the GPU (the acknowledgement carries the event after
        the copy); into host memory, copied before it is acknowledged."""
        channel, copied = self.channel, None
        try:
            if req.device is not None:
                copied = req.device.read(self.body, channel.peer)
            else:
                self._to_host(req.dst_u8)
        except Exception as exc:  # noqa: BLE001 - the receive fails, naming why; the sender goes on
            req.fail(TensorwireError(f"rank {channel.engine.rank}: {req.what}: cannot read rank "
                                     f"{channel.peer}'s CUDA buffer ({type(exc).__name__}: {exc}); "
                                     "TENSORWIRE_CUDA_IPC=0 on the sender stages it through host memory"))
        else:
            req.received = self.nbytes
            req.finish()
        channel.acknowledge(self.rid, copied)

    def read_all(self) -> np.ndarray | None:
        buf = np.empty(self.nbytes, dtype=np.uint8)
        try:
            self._to_host(buf)
        except Exception:  # noqa: BLE001 - the receive that takes it will say why
            return None
        self.channel.acknowledge(self.rid)
        return buf

    def _to_host(self, out: np.ndarray) -> None:
        if requests.device_to_host is None:
            raise TensorwireError("tensorwire's GPU support is not loaded in this process")
        requests.device_to_host(self.body, self.channel.peer, out)

    def discard(self) -> None:
        self.channel.acknowledge(self.rid)
