"""torch's CPU loops for float16 and bfloat16, where the application has imported torch.

numpy's loops for these types are many times slower than torch's vectorised ones on the same
memory (docs/design/reductions.md#torch-kernels), so large buffers go through torch; the results
are bit-identical except for the sign of equal zeros in MIN/MAX and NaN payloads. torch is
never imported here: only used when `sys.modules` already holds it.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np

from .dtypes import entry_for_code
from .reduce_op import ReduceOp

TORCH_KERNEL_MIN_ELEMENTS = 1 << 14
"""Below this many elements the numpy ufunc is used even when torch could be (torch's call
overhead outweighs its faster loop)."""


# dtype.num -> (numpy view dtype accepted by torch.from_numpy, torch dtype); None until built.
_torch_kinds: dict[int, tuple[np.dtype, Any]] | None = None
_torch_state = {"failed": False}


def _torch_table(torch: Any) -> dict[int, tuple[np.dtype, Any]] | None:
    """float16/bfloat16 views for torch; built once, the first time torch is found loaded."""
    global _torch_kinds
    if _torch_kinds is not None or _torch_state["failed"]:
        return _torch_kinds
    try:
        table: dict[int, tuple[np.dtype, Any]] = {np.dtype(np.float16).num: (np.dtype(np.float16),
                                                                              torch.float16)}
        bf16 = entry_for_code(16)
        if bf16 is not None:
            table[bf16.dtype.num] = (np.dtype(np.int16), torch.bfloat16)
        spend_read_only_warning(torch)
        _torch_kinds = table
    except Exception:  # a half-initialised or unusual torch: keep the numpy path
        _torch_state["failed"] = True
    return _torch_kinds


def _as_torch(torch: Any, arr: np.ndarray, view_dtype: np.dtype, tdtype: Any) -> Any:
    t = torch.from_numpy(arr.view(view_dtype))
    return t if t.dtype == tdtype else t.view(tdtype)


def torch_reduce(dst: np.ndarray, src: np.ndarray, op: ReduceOp) -> bool:
    """`dst = dst (op) src` through torch; False where torch cannot (not loaded, another dtype,
    memory it cannot wrap as is)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    table = _torch_table(torch)
    if table is None:
        return False
    kinds = table.get(dst.dtype.num)
    if (kinds is None or src.dtype != dst.dtype or src.shape != dst.shape or not dst.dtype.isnative
            or not (dst.flags.c_contiguous and src.flags.c_contiguous and dst.flags.aligned
                    and src.flags.aligned and dst.flags.writeable)):
        return False
    d = _as_torch(torch, dst, *kinds)
    s = _as_torch(torch, src, *kinds)
    if op == ReduceOp.PRODUCT:
        d.mul_(s)
    elif op == ReduceOp.MIN:
        torch.minimum(d, s, out=d)
    elif op == ReduceOp.MAX:
        torch.maximum(d, s, out=d)
    else:
        d.add_(s)
    return True


def torch_scale(buf: np.ndarray, divide_by: int | None, multiply_by: float | None) -> bool:
    """`buf /= divide_by` or `buf *= multiply_by` through torch; False where torch is not used."""
    torch = sys.modules.get("torch")
    if torch is None or buf.size < TORCH_KERNEL_MIN_ELEMENTS:
        return False
    table = _torch_table(torch)
    kinds = None if table is None else table.get(buf.dtype.num)
    if kinds is None or not (buf.flags.c_contiguous and buf.flags.aligned and buf.flags.writeable):
        return False
    t = _as_torch(torch, buf, *kinds)
    if divide_by is not None:
        t.div_(divide_by)
    else:
        t.mul_(multiply_by)
    return True


def spend_read_only_warning(torch: Any) -> None:
    """torch warns once per process about wrapping read-only memory (received data is, and is
    only ever read by torch here); spend that warning now, silently."""
    probe = np.zeros(1, np.int16)
    probe.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.from_numpy(probe)
        torch.frombuffer(probe, dtype=torch.int16)
