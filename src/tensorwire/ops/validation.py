"""Which (op, dtype) pairs mean something, checked before anything is sent."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, call_prefix
from .dtypes import check_dtype, lookup
from .kernels import TABLE
from .reduce_op import BITWISE, ReduceOp, Reduction


def op_undefined(op: ReduceOp, category: str) -> str:
    """Why `op` has no meaning for dtypes of `category` ('b', 'i', 'u', 'f', 'c'); '' if it has."""
    if op in BITWISE and category not in "biu":
        return "bitwise ops need integer or bool dtypes"
    if op in (ReduceOp.MIN, ReduceOp.MAX) and category == "c":
        return "complex numbers are not ordered"
    if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) and category == "b":
        return "use SUM for any, PRODUCT for all, or cast first"
    return ""


def check_op_dtype(red: Reduction, dtype: Any, *, rank: int, collective: str) -> None:
    """Reject (op, dtype) pairs that have no meaning, before anything is sent."""
    if isinstance(dtype, np.dtype) and dtype.isnative and dtype.num in TABLE[red.op]:
        return  # the kernel table holds exactly the valid pairs
    dt = check_dtype(dtype, rank=rank, collective=collective)
    entry = lookup(dt)
    assert entry is not None
    where = call_prefix(rank, collective)
    why = op_undefined(red.op, entry.category)
    if why:
        label = dt.name if entry.carried is None else str(entry.carried.tdtype)
        raise InvalidArgumentError(f"{where}{red.op.name} is not defined for {label} ({why})")
    if not entry.arithmetic:
        raise InvalidArgumentError(
            f"{where}{red.op.name} is not available for {dt.name}: the installed ml_dtypes has no ufunc "
            "loops for it (upgrade ml_dtypes, or reduce in a wider dtype)"
        )
