"""Zero-copy numpy views of whatever the user hands a collective.

Collectives write their results into the user's memory, so every adapter here must return a
view that shares it; where that is impossible (non-contiguous, read-only, on a GPU) we raise
and say what to do instead rather than silently copying and losing the result.
torch and ml_dtypes are recognised without importing them; they are imported only when an
object of theirs is actually passed.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

import numpy as np

from . import limits
from .errors import InvalidArgumentError, call_prefix
from .ops.carriers import carrier
from .ops.dtypes import SUPPORTED_NUMS, check_dtype, is_supported_dtype

__all__ = ["as_array", "flat", "byte_view", "copy", "huge_zeros", "like_torch", "is_torch_tensor",
           "seen_torch_view", "torch_dtype_to_numpy"]


def as_array(obj: Any, *, writable: bool, rank: int, collective: str, name: str = "tensor") -> np.ndarray:
    """A C-contiguous numpy view of `obj`'s memory (any shape, 0-d and empty included).

    Accepts numpy arrays, CPU torch tensors, buffer-protocol objects (bytearray, memoryview,
    array.array, ...) and DLPack producers. `writable=True` is for outputs: read-only memory
    is refused there because the result could not reach the caller.
    """
    if type(obj) is np.ndarray:
        flags = obj.flags  # the hot path: a few attribute reads, no calls
        if flags.c_contiguous and (flags.writeable or not writable):
            dt = obj.dtype
            if dt.num in SUPPORTED_NUMS and dt.isnative:
                return obj
        arr = obj
    elif isinstance(obj, np.ndarray):
        arr = obj.view(np.ndarray)  # drop subclass behaviour (np.matrix, masked) without copying
    elif is_torch_tensor(obj):
        return _from_torch(obj, rank, collective, name)
    else:
        arr = _from_foreign(obj, writable, rank, collective, name)
    if not arr.flags.c_contiguous:
        how = "np.ascontiguousarray(x) and, for an output, copy the result back" + (
            " (or x.T, the same memory in C order, where its shape does not matter to the call)"
            if arr.flags.f_contiguous else "")
        raise InvalidArgumentError(f"{call_prefix(rank, collective)}{name} is not C-contiguous (shape "
                                   f"{arr.shape}, strides {arr.strides}); pass {how}")
    if writable and not arr.flags.writeable:
        raise InvalidArgumentError(
            f"{call_prefix(rank, collective)}{name} is read-only but {collective} writes its result into it; "
            "pass a writable array (e.g. x.copy())"
        )
    if not is_supported_dtype(arr.dtype):
        check_dtype(arr.dtype, rank=rank, collective=collective, name=name)
    return arr


def _from_foreign(obj: Any, writable: bool, rank: int, collective: str, name: str) -> np.ndarray:
    """Buffer protocol first (always host memory, exact format), then DLPack."""
    try:
        view = memoryview(obj)
    except TypeError:
        view = None
    if view is not None:
        if writable and view.readonly:
            raise InvalidArgumentError(
                f"{call_prefix(rank, collective)}{name} ({type(obj).__name__}) is read-only but {collective} "
                "writes its result into it; pass a bytearray or a writable array"
            )
        if not view.c_contiguous:
            raise InvalidArgumentError(
                f"{call_prefix(rank, collective)}{name} ({type(obj).__name__}) is not C-contiguous"
            )
        try:
            return np.asarray(view)
        except (TypeError, ValueError, NotImplementedError) as exc:
            raise InvalidArgumentError(
                f"{call_prefix(rank, collective)}{name} ({type(obj).__name__}) has buffer format "
                f"{view.format!r} that numpy cannot read: {exc}"
            ) from None
    if hasattr(obj, "__dlpack__"):
        try:
            arr = np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"{call_prefix(rank, collective)}{name} ({type(obj).__name__}) cannot be viewed through "
                f"DLPack as host memory ({exc}); move it to the CPU first"
            ) from None
        return arr
    raise InvalidArgumentError(
        f"{call_prefix(rank, collective)}{name} of type {type(obj).__module__}.{type(obj).__qualname__} "
        "is not supported (pass a numpy array, a CPU torch tensor, or an object with the buffer protocol "
        "or DLPack)"
    )


# --------------------------------------------------------------------------- torch

def is_torch_tensor(obj: Any) -> bool:
    """True for torch.Tensor and its subclasses (nn.Parameter, ...), without importing torch."""
    torch = sys.modules.get("torch")
    tensor_type = getattr(torch, "Tensor", None) if torch is not None else None
    return tensor_type is not None and isinstance(obj, tensor_type)


# torch dtype name -> (the integer dtype torch exports its bytes as, ml_dtypes' name for it or None)
_TORCH_VIA: dict[str, tuple[str, str | None]] = {
    "torch.bfloat16": ("int16", "bfloat16"),
    "torch.float8_e4m3fn": ("uint8", "float8_e4m3fn"),
    "torch.float8_e5m2": ("uint8", "float8_e5m2"),
    "torch.float8_e4m3fnuz": ("uint8", "float8_e4m3fnuz"),
    "torch.float8_e5m2fnuz": ("uint8", "float8_e5m2fnuz"),
    "torch.float8_e8m0fnu": ("uint8", "float8_e8m0fnu"),
    "torch.complex32": ("int32", None),
}
_TORCH_NATIVE = {
    "torch.bool", "torch.uint8", "torch.int8", "torch.int16", "torch.int32", "torch.int64",
    "torch.uint16", "torch.uint32", "torch.uint64", "torch.float16", "torch.float32", "torch.float64",
    "torch.complex64", "torch.complex128",
}


def _ml_dtype(name: str) -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:
        return None
    scalar = getattr(ml_dtypes, name, None)
    return None if scalar is None else np.dtype(scalar)


def torch_dtype_to_numpy(tdtype: Any) -> np.dtype | None:
    """The numpy dtype holding a torch dtype's values (ml_dtypes' where it has one, else a
    carrier: see ops.carriers.carrier), or None when there is none."""
    key = str(tdtype)
    if key in _TORCH_NATIVE:
        return np.dtype(key.removeprefix("torch."))
    via = _TORCH_VIA.get(key)
    if via is None:
        return None
    found = _ml_dtype(via[1]) if via[1] is not None else None
    return found if found is not None else carrier(key.removeprefix("torch."))


_VIEWS: dict[tuple[int, Any, Any], tuple[np.ndarray, bool, Any]] = {}
"""(data_ptr, dtype, shape) of a small CPU tensor -> (the view `as_array` made of it, whether
its dtype is complex, the tensor it holds). See `seen_torch_view`."""
_VIEWS_MAX = 64
VIEWED_BYTES = 64 << 10
"""Tensors up to this size keep their views (`_VIEWS`): adapting one costs as much as a whole
call at these sizes; a larger call takes long enough for that not to show
(docs/design/buffers.md#views)."""
_PLAIN_TENSORS: frozenset[type] = frozenset()  # torch.Tensor, nn.Parameter once torch is seen


def seen_torch_view(obj: Any) -> np.ndarray | None:
    """The view of `obj` that `as_array` made before, if `obj` is a plain CPU tensor of at most
    VIEWED_BYTES whose memory, dtype, shape and layout are what they were then; else None.

    The key is the memory (data_ptr), not the tensor object: `t.view(-1)` or `buf[:n]` are
    new objects every call and the same memory. The view holds the tensor it was made of, and
    a hit needs that tensor's memory where it was (its storage not resized away since): its
    bytes are then alive and lie exactly where `obj`'s do, whatever happened in between (set_,
    .data =), and a device tensor never has a kept host view's address (one address space).
    What the key cannot see is checked here: the layout (`x.t()` of a square x has x's key) and
    the lazy negative/conjugate bits (`z.conj()`, `z.conj().imag` of one element)."""
    if type(obj) not in _PLAIN_TENSORS:
        return None
    try:
        ptr = obj.data_ptr()
    except RuntimeError:  # no storage: sparse, or a tensor subclass that hides it
        return None
    hit = _VIEWS.get((ptr, obj.dtype, obj.shape))
    if hit is None or hit[2].data_ptr() != ptr or not obj.is_contiguous() or obj.is_neg() or \
            (hit[1] and obj.is_conj()):
        return None
    return hit[0]


def _from_torch(t: Any, rank: int, collective: str, name: str) -> np.ndarray:
    """Checks cheapest first, unless seen before."""
    seen = seen_torch_view(t)
    if seen is not None:
        return seen
    where = call_prefix(rank, collective)
    if not t.is_cpu:
        raise InvalidArgumentError(
            f"{where}{name} is on {t.device} while the call's other buffers are in host memory; one call "
            "takes buffers of one device"
        )
    if not t.is_contiguous():
        if str(t.layout) != "torch.strided":
            raise InvalidArgumentError(f"{where}{name} has layout {t.layout}; only dense tensors work")
        raise InvalidArgumentError(
            f"{where}{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); pass "
            "t.contiguous() and, for an output, copy the result back"
        )
    tdtype = t.dtype
    via = _torch_via_cache.get(tdtype, _MISSING)
    if via is _MISSING:
        via = _torch_via(tdtype)
        _torch_via_cache[tdtype] = via
    if isinstance(via, str):
        raise InvalidArgumentError(f"{where}{name} {via}")
    kept = type(t) in _PLAIN_TENSORS
    if t.is_conj() or t.is_neg():
        raise InvalidArgumentError(f"{where}{name} has a lazy conjugate/negative bit; pass "
                                   f"t.resolve_conj().resolve_neg()")
    t = t.detach()  # the view holds t, not its autograd graph
    try:
        arr = np.asarray(_Memory(t, via[0]))
    except (RuntimeError, TypeError, ValueError) as exc:
        dense = str(t.layout) == "torch.strided"
        why = f"({tdtype}) cannot be viewed as numpy: {exc}" if dense else \
            f"has layout {t.layout}; only dense (strided) tensors work"
        raise InvalidArgumentError(f"{where}{name} {why}") from None
    if via[1] is not None:
        arr = arr.view(via[1])
    if kept and 0 < arr.nbytes <= VIEWED_BYTES:  # an empty tensor's address (0) is any device's
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        _VIEWS[(t.data_ptr(), tdtype, t.shape)] = (arr, tdtype.is_complex, t)
    return arr


class _Memory:
    """A CPU tensor's memory as numpy sees it (`np.asarray`), holding the tensor. Not
    `t.numpy()`: torch marks a storage numpy viewed so unresizable for good, and FSDP (torch's
    first) frees its parameters by resizing theirs to 0 after the all-gather. Resizing a
    tensor while a call on it runs stays the caller's error, as with Gloo and NCCL."""

    def __init__(self, t: Any, typestr: str) -> None:
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                    "typestr": typestr, "version": 3}


_MISSING: Any = object()
# torch dtype -> (the typestr its memory is read as, the numpy dtype that is then viewed as or
# None), or an error text.
_torch_via_cache: dict[Any, Any] = {}


def _torch_via(tdtype: Any) -> tuple[str, np.dtype | None] | str:
    """First sight of a torch dtype (and, the first time, of torch itself)."""
    global _PLAIN_TENSORS
    import torch

    _PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
    key = str(tdtype)
    np_dtype = torch_dtype_to_numpy(tdtype)
    if np_dtype is None:
        return (f"is {key}, which tensorwire can neither reduce nor carry (torch has no CPU kernels for "
                "it); to move its bytes, pass t.view(torch.uint8)")
    if np_dtype.isbuiltin == 1:  # numpy's own: its typestr reads back
        return np_dtype.str, None
    return f"|V{np_dtype.itemsize}", np_dtype  # ml_dtypes' types and carriers: bytes, then viewed


def like_torch(template: Any, array: np.ndarray) -> Any:
    """`array` as a CPU torch tensor of `template`'s dtype, sharing memory (for out-of-place results)."""
    import torch

    key = str(template.dtype)
    expected = torch_dtype_to_numpy(template.dtype)
    if expected is None or array.dtype != expected:
        raise InvalidArgumentError(
            f"like_torch: cannot wrap a {array.dtype} array as {key} without a copy"
        )
    via = _TORCH_VIA.get(key)
    if via is None:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(via[0])).view(template.dtype)


# --------------------------------------------------------------------------- views

def flat(arr: np.ndarray) -> np.ndarray:
    """1-D view of a C-contiguous array (0-d becomes length 1); never a copy."""
    if not arr.flags.c_contiguous:  # reshape would silently copy
        raise InvalidArgumentError(f"flat: array with strides {arr.strides} is not C-contiguous")
    return arr if arr.ndim == 1 else arr.reshape(-1)


_U8 = np.dtype(np.uint8)  # viewing with a dtype object is cheaper than with the type


def address(arr: np.ndarray) -> int:
    """The address of arr's first byte. Through ctypes where numpy lends the buffer writable
    and contiguous: several times cheaper than `arr.ctypes.data`, which a large single-copy
    call reads several times (docs/design/buffers.md#address)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(arr))  # type: ignore[arg-type, unused-ignore]  # numpy's stubs: ndarray a buffer from Python 3.12 only
    except (TypeError, ValueError, BufferError):  # read-only, empty or strided
        return arr.ctypes.data


def byte_view(arr: np.ndarray) -> np.ndarray:
    """uint8 1-D view of the same memory, which is all a transport needs to see."""
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(f"byte_view: array with strides {arr.strides} is not C-contiguous")
    f = arr if arr.ndim == 1 else arr.reshape(-1)
    return f if f.dtype is _U8 else f.view(_U8)


_ALIASED = 32
"""glibc copies 4-512 KiB with `rep movsb`, which runs many times slower when the destination
lies 1-31 bytes past the source modulo 4096; numpy's buffers meet that window as a rule, not by
chance (docs/design/buffers.md#aliasing)."""
_CHECKED = 16 << 10  # below, reading the two addresses costs more than the window can
PIECE = 512 << 10
"""Contiguous copies larger than this run in pieces of this size: from 1 MiB glibc's memcpy
leaves `rep movsb` for a vector loop that is slower, most of all into shared memory the peer
has just read (docs/design/buffers.md#pieces)."""


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """np.copyto(dst, src); a same-dtype contiguous copy in the slow window (`_ALIASED`) runs as
    a vector loop instead (bitwise or with 0: no `rep movsb`, memcpy's speed elsewhere), and
    a larger one than `PIECE` in pieces of it (unless the two overlap: numpy's own copy
    handles that)."""
    nbytes = dst.nbytes
    if (nbytes >= _CHECKED and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.flags.c_contiguous and src.flags.c_contiguous):
        d, s = byte_view(dst), byte_view(src)
        if 0 < (address(d) - address(s)) % 4096 < _ALIASED:
            np.bitwise_or(s, 0, out=d)
            return
        if nbytes > PIECE and not np.may_share_memory(d, s):  # pieces of overlapping arrays
            for lo in range(0, nbytes, PIECE):  # would read what an earlier piece overwrote
                np.copyto(d[lo:lo + PIECE], s[lo:lo + PIECE])
            return
    np.copyto(dst, src)


HUGE_PAGE = 2 << 20


def huge_zeros(nbytes: int) -> np.ndarray:
    """nbytes of zeros (uint8), aligned to 2 MiB and advised for transparent huge pages.

    Where a peer reads a buffer straight out of this process (single copy), the kernel pins
    its pages one by one, far faster out of huge pages than out of 4 KiB ones
    (docs/design/buffers.md#huge-pages). numpy advises huge pages only for arrays from
    4 MiB and leaves the alignment to malloc, so the edges of an array stay in small pages;
    buffers from here are huge throughout, where the kernel allows it (THP not `never`)."""
    # Private (a shared anonymous mapping is shmem, whose huge pages are another setting,
    # shmem_enabled, `never` by default), zero pages faulted on first touch, and whole huge
    # pages: one whose 2 MiB reached past the mapping's end would stay in 4 KiB pages.
    whole_pages = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    try:
        mapping = mmap.mmap(-1, whole_pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError) as exc:  # ENOMEM, or a size past what a mapping can have
        raise limits.memory_error(exc, f"a buffer of {nbytes} bytes") from exc
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive
    start = -whole.ctypes.data % HUGE_PAGE
    return whole[start:start + nbytes]
