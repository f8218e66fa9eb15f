"""Carriers: how torch tensors of dtypes numpy cannot compute travel through tensorwire.

bfloat16 and float8_* without ml_dtypes, and complex32, travel as a structured numpy dtype
of the same size: numpy moves them as bytes and torch's own kernels reduce them, so torch
alone is enough.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .dtypes import DType, add_carrier, carrier_by_code
from .kernels import KIND_UFUNCS
from .reduce_op import ReduceOp
from .torch_kernels import spend_read_only_warning

_CARRIED: dict[str, tuple[int, str, str, str | None]] = {
    # torch dtype: (wire code, name, category, the torch dtype its arithmetic runs in where torch
    # has no CPU kernels for the dtype itself; torch 2.13 adds float8 only through float32)
    "bfloat16": (16, "bfloat16", "f", None),
    "float8_e4m3fn": (17, "f8e4m3", "f", "float32"),
    "float8_e5m2": (18, "f8e5m2", "f", "float32"),
    "float8_e4m3fnuz": (19, "float8_e4m3fnuz", "f", "float32"),
    "float8_e5m2fnuz": (20, "float8_e5m2fnuz", "f", "float32"),
    "float8_e8m0fnu": (21, "float8_e8m0fnu", "f", "float32"),
    "complex32": (25, "complex32", "c", "complex64"),
}
"""The torch dtypes that have carriers; codes 16-21 are ml_dtypes' (the same bytes on the wire,
so a rank with ml_dtypes and one without agree)."""
_lock = threading.Lock()
"""Serialises building carriers."""


class Carried:
    """A carrier's torch side: its torch dtype, and the wider one torch computes it in where
    torch has no CPU kernels for it (None: its own). Every carrier array is a torch tensor's
    memory, so torch is loaded whenever one exists."""

    __slots__ = ("tdtype", "compute", "kernels")

    def __init__(self, torch_name: str, compute: str | None) -> None:
        import torch

        self.tdtype = getattr(torch, torch_name)
        self.compute = None if compute is None else getattr(torch, compute)
        # Its reduction kernels, called as kernel(a, b, out) like the numpy ones.
        self.kernels: dict[ReduceOp, Callable[..., None]] = {}

    def tensor(self, arr: np.ndarray) -> Any:
        """arr's memory as a tensor, no copy: flat through torch.frombuffer where arr is
        contiguous (the cheapest way in), else with arr's shape and strides."""
        torch = sys.modules["torch"]
        if arr.flags.c_contiguous:
            return torch.frombuffer(arr, dtype=self.tdtype)
        return torch.from_numpy(arr.view(_SAME_SIZE_INT[arr.itemsize])).view(self.tdtype)

    def combine(self, fn: Any, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """out = fn(a, b) elementwise (`out` may be `a` or `b`)."""
        if not out.size:
            return
        ta, tb, to = self.tensor(a), self.tensor(b), self.tensor(out)
        if self.compute is None:
            fn(ta, tb, out=to)
        else:
            to.copy_(fn(ta.to(self.compute), tb.to(self.compute)))

    def scale(self, buf: np.ndarray, divide_by: int | None, multiply_by: float | None) -> None:
        """buf /= divide_by or buf *= multiply_by, in place, the scalar applied in float32 at
        least (torch's own rule for its 16-bit floats, and what finalize does for the rest)."""
        if not buf.size:
            return
        t = self.tensor(buf)
        wide = t if self.compute is None else t.to(self.compute)
        if divide_by is not None:
            wide.div_(divide_by)
        else:
            wide.mul_(multiply_by)
        if wide is not t:
            t.copy_(wide)


_SAME_SIZE_INT: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.int16), 4: np.dtype(np.int32)}


def carrier(torch_name: str) -> np.dtype | None:
    """The numpy dtype that carries torch tensors of `torch_name` ('bfloat16', 'float8_e4m3fn',
    'complex32', ...) where numpy has none: a structured dtype of one unsigned integer field
    of the same size, named after the torch dtype. numpy copies, slices and sends it as any
    other dtype but has no arithmetic for it: every reduction and finalisation of a carrier
    runs through torch on the same memory (`Carried`). None: no carrier for that dtype."""
    spec = _CARRIED.get(torch_name)
    if spec is None:
        return None
    code, name, category, compute = spec
    existing = carrier_by_code(code)
    if existing is not None:
        return existing.dtype
    with _lock:
        carried = Carried(torch_name, compute)
        itemsize = carried.tdtype.itemsize
        dt = np.dtype([(f"torch.{torch_name}", f"=u{itemsize}")])
        entry = DType(code, name, category, dt, low_precision=True, carried=carried)
        for op, ufunc in KIND_UFUNCS[category].items():  # torch's function of numpy's name
            fn = getattr(sys.modules["torch"], ufunc.__name__)
            carried.kernels[op] = functools.partial(carried.combine, fn)
        spend_read_only_warning(sys.modules["torch"])
        add_carrier(entry)
    return dt
