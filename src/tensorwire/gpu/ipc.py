"""Sharing device memory between the ranks of one host: what a rank publishes of a buffer
(its allocation's id and IPC handle, the offset in it), and a peer's buffers opened here.

A buffer is described per call (its allocation may have changed since: torch's allocator
hands the same address to the next tensor), but an allocation is opened once per peer and
kept: opening costs a driver round trip and a mapping (tens of µs to ms), a lookup by id
costs nothing. Allocations are few (torch's allocator carves tensors out of large
segments), and the cache is bounded: the least recently used are closed past `KEPT`.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from . import driver

RECORD = struct.Struct(f"<QQQQ{driver.HANDLE_BYTES}s")
"""A buffer as its peers see it: its allocation's id and size, its offset there and its
bytes, the allocation's handle."""
KEPT = 256
"""Peer allocations kept open per process."""

_exported: OrderedDict[int, bytes] = OrderedDict()  # allocation id -> its handle
_opened: OrderedDict[tuple[int, int], tuple[int, Any]] = OrderedDict()  # (peer, id) -> (base, view)
_kept: set[tuple[int, int]] = set()  # opened for good: never evicted
_lock = threading.Lock()


class _Range:
    """A device address range as `__cuda_array_interface__`, for torch.as_tensor (no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2}


def describe(t: Any) -> bytes:
    """`t`'s record (a contiguous CUDA tensor of this process)."""
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if not nbytes:
        return RECORD.pack(0, 0, 0, 0, b"")
    with driver.on_device(t.device.index):
        where = driver.allocation(ptr)
        if not where.ipc_capable:
            raise driver.CudaDriverError(
                "this tensor's memory cannot be shared with other processes through CUDA IPC (torch's "
                "expandable segments? unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or set "
                "TENSORWIRE_CUDA_IPC=0)")
        handle = _exported.get(where.buffer_id)
        if handle is None:
            handle = _exported[where.buffer_id] = driver.export_handle(where.base)
            if len(_exported) > KEPT:
                _exported.popitem(last=False)
    return RECORD.pack(where.buffer_id, where.size, ptr - where.base, nbytes, handle)


def peer_tensor(peer: int, record: bytes | np.ndarray, dtype: Any, device: int, keep: bool = False) -> Any:
    """The peer buffer `record` describes, as a torch tensor of `dtype` here (empty for an
    empty buffer). `keep`: its allocation stays open for good (a group's slots)."""
    import torch

    buffer_id, size, offset, nbytes, handle = RECORD.unpack(bytes(record[:RECORD.size]))
    if not nbytes:
        return torch.empty(0, dtype=dtype, device=device)
    key = (peer, buffer_id)
    with _lock:  # a point-to-point receive may open one on the progress thread (gpu/p2p.py)
        entry = _opened.get(key)
        if entry is None:
            with driver.on_device(device):
                base = driver.open_handle(handle)
            whole = torch.as_tensor(_Range(base, size))  # on the device the memory is on
            entry = _opened[key] = (base, whole)
            if len(_opened) > KEPT + len(_kept):
                _evict(device)
        else:
            _opened.move_to_end(key)
        if keep:
            _kept.add(key)
    return entry[1][offset:offset + nbytes].view(dtype)


def _evict(device: int) -> None:
    """Close the least recently used allocation that is not kept, once the GPU has run whatever
    was queued that might still read it."""
    victim = next((k for k in _opened if k not in _kept), None)
    if victim is None:
        return
    import torch

    torch.cuda.synchronize(device)
    with driver.on_device(device):
        _close(*_opened.pop(victim))


def _close(base: int, view: Any) -> None:
    del view
    try:
        driver.close_handle(base)
    except driver.CudaDriverError:
        pass  # a peer's allocation that is gone already: nothing to give back
