"""Device buffers as torch CUDA tensors over the same memory, and what a call needs to know
of them: dtype code, device, the caller's stream.

tensorwire computes on the GPU with torch's kernels, so every device buffer becomes a torch
tensor without a copy: torch tensors as they are, `__cuda_array_interface__` objects through
`torch.as_tensor` and other DLPack producers through `torch.from_dlpack`, both zero-copy.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError, call_prefix

# torch dtype name -> (tensorwire's wire code, category): the codes of ops/dtypes.py (_NUMPY_CODES/_ML_CODES)
_CODES: dict[str, tuple[int, str]] = {
    "bool": (0, "b"), "int8": (1, "i"), "uint8": (2, "u"), "int16": (3, "i"), "uint16": (4, "u"),
    "int32": (5, "i"), "uint32": (6, "u"), "int64": (7, "i"), "uint64": (8, "u"),
    "float16": (9, "f"), "float32": (10, "f"), "float64": (11, "f"),
    "complex64": (13, "c"), "complex128": (14, "c"), "bfloat16": (16, "f"),
    "float8_e4m3fn": (17, "f"), "float8_e5m2": (18, "f"), "float8_e4m3fnuz": (19, "f"),
    "float8_e5m2fnuz": (20, "f"), "float8_e8m0fnu": (21, "f"), "complex32": (25, "c"),
}


def torch_module() -> Any:
    try:
        import torch
    except ImportError:
        raise InvalidArgumentError("a CUDA buffer was passed, but tensorwire computes on the GPU with torch, "
                                   "which is not installed (pip install torch, a CUDA build)") from None
    return torch


def code_of(dtype: Any) -> tuple[int, str]:
    """(wire code, category) of a torch dtype; KeyError if tensorwire cannot carry it."""
    return _CODES[str(dtype).removeprefix("torch.")]


def as_device_tensor(obj: Any, *, rank: int, collective: str, name: str) -> Any:
    """A contiguous torch CUDA tensor sharing `obj`'s memory."""
    torch = torch_module()
    where = f"{call_prefix(rank, collective)}{name}"
    if isinstance(obj, torch.Tensor):
        t = obj
    else:
        try:
            t = torch.as_tensor(obj) if hasattr(obj, "__cuda_array_interface__") else torch.from_dlpack(obj)
        except (RuntimeError, TypeError, ValueError, BufferError) as exc:
            raise InvalidArgumentError(f"{where} ({type(obj).__name__}) cannot be viewed as a CUDA tensor: "
                                       f"{exc}") from None
    if not t.is_cuda:
        raise InvalidArgumentError(f"{where} is on {t.device} while the call's other buffers are on CUDA; "
                                   "one call takes buffers of one device")
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"{where} has layout {t.layout}; only dense tensors work")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{where} is not contiguous (shape {tuple(t.shape)}, stride "
                                   f"{t.stride()}); pass t.contiguous() and, for an output, copy the result "
                                   "back")
    if t.is_conj() or t.is_neg():
        raise InvalidArgumentError(f"{where} has a lazy conjugate/negative bit; pass "
                                   "t.resolve_conj().resolve_neg()")
    if str(t.dtype).removeprefix("torch.") not in _CODES:
        raise InvalidArgumentError(f"{where} has unsupported dtype {t.dtype}")
    return t.detach() if t.requires_grad else t


def same_device(tensors: list[Any], *, rank: int, collective: str) -> int:
    """The one CUDA device of a call's tensors (an error naming both where they differ)."""
    device = tensors[0].device.index
    for t in tensors[1:]:
        if t.device.index != device:
            raise InvalidArgumentError(f"{call_prefix(rank, collective)}buffers on cuda:{device} and "
                                       f"{t.device}; one call takes buffers of one device")
    return device


def caller_stream(obj: Any, device: int) -> Any:
    """The stream the caller's framework orders its work on: CuPy's current stream for CuPy
    arrays, torch's for everything else."""
    torch = torch_module()
    if (type(obj).__module__ or "").startswith("cupy"):
        import cupy

        ptr = cupy.cuda.get_current_stream().ptr
        return torch.cuda.ExternalStream(ptr, device=device) if ptr else torch.cuda.default_stream(device)
    return torch.cuda.current_stream(device)
