"""The few CUDA driver calls that torch does not expose: what allocation a device pointer lies
in, and CUDA IPC memory handles to share it with another process of the host.

torch shares CUDA memory between processes only through `torch.multiprocessing`, which
rewrites the shared storage's deleter and reference-counts it through a file: right for
handing tensors to workers, wrong for a collective that reads a peer's buffer for the
length of one call. The driver's own calls are few, every CUDA process has the driver
(libcuda) loaded already, and a binding of them costs no dependency. A planned call's stream
work (event waits and records, one copy) goes through the driver too: about a microsecond
each through ctypes, where torch's Python wrappers cost several.

An allocation is named by its buffer id (CU_POINTER_ATTRIBUTE_BUFFER_ID), unique within the
process for its lifetime: an address freed and allocated again gets a new id, so a peer's
cache of opened handles, keyed by id, never maps stale memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from ..errors import CudaDriverError

_BUFFER_ID = 7  # CU_POINTER_ATTRIBUTE_*
_IPC_CAPABLE = 10
_RANGE_START = 11
_RANGE_SIZE = 12
_LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
HANDLE_BYTES = 64


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


class Allocation(NamedTuple):
    """Where a device pointer lies: its allocation's id, start and size."""

    buffer_id: int
    base: int
    size: int
    ipc_capable: bool


_lib: ctypes.CDLL | None = None
_lock = threading.Lock()
_contexts: dict[int, int] = {}  # device ordinal -> its primary context


def _cuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                name = ctypes.util.find_library("cuda") or "libcuda.so.1"
                try:
                    lib = ctypes.CDLL(name)
                except OSError as exc:
                    raise CudaDriverError(f"the CUDA driver (libcuda) cannot be loaded: {exc}") from None
                _check(lib, lib.cuInit(0), "cuInit")
                _lib = lib
    return _lib


def _check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status:
        text = ctypes.c_char_p()
        lib.cuGetErrorName(status, ctypes.byref(text))
        name = text.value.decode() if text.value else f"CUresult {status}"
        raise CudaDriverError(f"{what} failed: {name}")


def check(status: int, what: str) -> None:
    """Raise the driver's error where call `what` returned a nonzero CUresult `status`."""
    if status:
        _check(_cuda(), status, what)


def use_device(device: int) -> None:
    """Make `device`'s primary context (the one torch uses) current on this thread; a thread
    that never made a CUDA runtime call (a group's worker) has none. For a thread whose
    current device is `device` (planned.py): elsewhere, `on_device`."""
    lib = _cuda()
    ctx = _primary(lib, device)
    if _current(lib) != ctx:
        _check(lib, lib.cuCtxSetCurrent(ctypes.c_void_p(ctx)), "cuCtxSetCurrent")


@contextmanager
def on_device(device: int) -> Iterator[None]:
    """Run the enclosed driver calls in `device`'s primary context, then give the thread its
    own back: a buffer on another device than the caller's current one leaves the caller's
    current device as it was."""
    lib = _cuda()
    ctx = _primary(lib, device)
    if _current(lib) == ctx:
        yield
        return
    # the _v2 entry points, as cuda.h maps these names (the v1 ones refuse a context current elsewhere)
    _check(lib, lib.cuCtxPushCurrent_v2(ctypes.c_void_p(ctx)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        _check(lib, lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")


def _current(lib: ctypes.CDLL) -> int:
    current = ctypes.c_void_p()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    return current.value or 0


def _primary(lib: ctypes.CDLL, device: int) -> int:
    """`device`'s primary context (retained once: torch's own)."""
    ctx = _contexts.get(device)
    if ctx is None:
        dev = ctypes.c_int()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        primary = ctypes.c_void_p()
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev), "cuDevicePrimaryCtxRetain")
        ctx = _contexts[device] = primary.value or 0
    return ctx


def allocation(ptr: int) -> Allocation:
    """The allocation holding device address `ptr` (one driver call for all four facts)."""
    lib = _cuda()
    attrs = (ctypes.c_int * 4)(_BUFFER_ID, _RANGE_START, _RANGE_SIZE, _IPC_CAPABLE)
    buffer_id, start, size = ctypes.c_ulonglong(), ctypes.c_ulonglong(), ctypes.c_size_t()
    capable = ctypes.c_int()
    data = (ctypes.c_void_p * 4)(ctypes.cast(ctypes.byref(buffer_id), ctypes.c_void_p),
                                 ctypes.cast(ctypes.byref(start), ctypes.c_void_p),
                                 ctypes.cast(ctypes.byref(size), ctypes.c_void_p),
                                 ctypes.cast(ctypes.byref(capable), ctypes.c_void_p))
    _check(lib, lib.cuPointerGetAttributes(4, attrs, data, ctypes.c_ulonglong(ptr)), "cuPointerGetAttributes")
    return Allocation(buffer_id.value, start.value, size.value, bool(capable.value))


def export_handle(base: int) -> bytes:
    """The IPC handle of the allocation starting at `base` (cudaMalloc'd: torch's allocator's
    segments are; its expandable segments are not)."""
    lib = _cuda()
    handle = _Handle()
    _check(lib, lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_ulonglong(base)), "cuIpcGetMemHandle")
    return bytes(handle.reserved)


def open_handle(handle: bytes) -> int:
    """Map a peer's allocation into this process; its base address here."""
    lib = _cuda()
    raw = _Handle.from_buffer_copy(handle[:HANDLE_BYTES])
    ptr = ctypes.c_ulonglong()
    fn = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
    fn.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), _Handle, ctypes.c_uint]  # the handle by value
    _check(lib, fn(ctypes.byref(ptr), raw, _LAZY_PEER_ACCESS), "cuIpcOpenMemHandle")
    return ptr.value


def close_handle(base: int) -> None:
    lib = _cuda()
    _check(lib, lib.cuIpcCloseMemHandle(ctypes.c_ulonglong(base)), "cuIpcCloseMemHandle")


class StreamCalls(NamedTuple):
    """The driver's stream calls with their argument types set, each returning a CUresult:
    wait(stream, event, 0), record(event, stream), copy(dst, src, nbytes, stream)."""

    wait: Callable[..., int]
    record: Callable[..., int]
    copy: Callable[..., int]


def stream_calls() -> StreamCalls:
    """cuStreamWaitEvent, cuEventRecord and cuMemcpyDtoDAsync (torch's events and streams are
    the driver's handles: `Event.cuda_event`, `Stream.cuda_stream`)."""
    lib = _cuda()
    wait, record, copy = lib.cuStreamWaitEvent, lib.cuEventRecord, lib.cuMemcpyDtoDAsync_v2
    wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    copy.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p]
    for fn in (wait, record, copy):
        fn.restype = ctypes.c_int
    return StreamCalls(wait, record, copy)
