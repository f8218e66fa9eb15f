"""Completing AVG and PREMUL_SUM once, after the last reduction step."""

from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgumentError
from .dtypes import lookup
from .reduce_op import ReduceOp, Reduction
from .torch_kernels import torch_scale


def finalize(buf: np.ndarray, red: Reduction, group_size: int) -> None:
    """Complete AVG (divide by the group size) and PREMUL_SUM (multiply by the factor) in place.

    Floats: AVG is a true division; float16/bfloat16/float8 apply the scalar in float32 so
    group sizes and factors that the narrow type cannot represent stay exact (carriers
    through torch, complex32 in complex64). Integers: AVG
    is floor division (-7 // 2 == -4); PREMUL_SUM with an integral factor that fits the
    dtype is an exact (wrapping) integer multiply, otherwise the product is computed in
    float64 and truncated toward zero when cast back (values beyond 2**53 lose precision,
    results outside the dtype's range are undefined).
    """
    op = red.op
    if op is not ReduceOp.AVG and op is not ReduceOp.PREMUL_SUM:
        return
    if group_size < 1:
        raise InvalidArgumentError(f"finalize: group_size must be >= 1, got {group_size}")
    entry = lookup(buf.dtype)
    if entry is None or entry.category == "b" or not entry.arithmetic:
        raise InvalidArgumentError(f"finalize: {op.name} is not defined for {buf.dtype}")
    try:  # inf and NaN are results whatever np.seterr says (as the kernels': kernels.py)
        cat = entry.category
        if op is ReduceOp.AVG:
            if group_size == 1:
                return
            if entry.carried is not None:
                entry.carried.scale(buf, group_size, None)
                return
            if cat in "iu":
                info = np.iinfo(buf.dtype)
                divisor = buf.dtype.type(group_size) if group_size <= info.max else (
                    np.int64(group_size) if cat == "i" else np.uint64(group_size))
                np.floor_divide(buf, divisor, out=buf, casting="unsafe")
            elif entry.low_precision:
                if not torch_scale(buf, group_size, None):
                    np.true_divide(buf, np.float32(group_size), out=buf, casting="unsafe")
            else:
                np.true_divide(buf, group_size, out=buf)
            return
        factor = red.factor
        assert factor is not None
        if entry.carried is not None:
            entry.carried.scale(buf, None, factor)
        elif cat in "iu":
            info = np.iinfo(buf.dtype)
            if math.isfinite(factor) and factor.is_integer() and info.min <= factor <= info.max:
                np.multiply(buf, buf.dtype.type(int(factor)), out=buf)
            else:
                with np.errstate(invalid="ignore", over="ignore"):
                    np.multiply(buf, factor, out=buf, casting="unsafe")
        elif entry.low_precision:
            if not torch_scale(buf, None, factor):
                np.multiply(buf, np.float32(factor), out=buf, casting="unsafe")
        else:
            np.multiply(buf, factor, out=buf)
    except (FloatingPointError, RuntimeWarning):  # numpy raises them once the output is whole
        pass
