"""The in-place reduction kernels: one numpy ufunc with an output, found in a table.

Every reduction a collective performs goes through `reduction_kernel` (or `reduce_into`,
`reduce_to`), so the data path never loops per element in Python and never allocates
(but for float8_e8m0fnu products, which need float64, and complex products: one formula).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from . import torch_kernels
from .dtypes import DType, check_dtype, lookup, on_register
from .reduce_op import BITWISE, ReduceOp

KIND_UFUNCS: dict[str, dict[ReduceOp, np.ufunc]] = {  # dtype category -> op -> its ufunc
    "b": {
        ReduceOp.SUM: np.logical_or,
        ReduceOp.PRODUCT: np.logical_and,
        ReduceOp.MIN: np.logical_and,
        ReduceOp.MAX: np.logical_or,
        ReduceOp.BAND: np.logical_and,
        ReduceOp.BOR: np.logical_or,
        ReduceOp.BXOR: np.logical_xor,
    },
    "i": {
        ReduceOp.SUM: np.add,
        ReduceOp.AVG: np.add,
        ReduceOp.PREMUL_SUM: np.add,
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.MIN: np.minimum,
        ReduceOp.MAX: np.maximum,
        ReduceOp.BAND: np.bitwise_and,
        ReduceOp.BOR: np.bitwise_or,
        ReduceOp.BXOR: np.bitwise_xor,
    },
}
KIND_UFUNCS["u"] = KIND_UFUNCS["i"]
KIND_UFUNCS["f"] = {op: u for op, u in KIND_UFUNCS["i"].items() if op not in BITWISE}
KIND_UFUNCS["c"] = {op: u for op, u in KIND_UFUNCS["f"].items() if op not in (ReduceOp.MIN, ReduceOp.MAX)}

# TABLE[op][dtype.num] -> kernel(dst, src, dst); ml_dtypes entries join when registered.
# The output is passed positionally: a ufunc parses `out=` more slowly (docs/design/reductions.md).
TABLE: list[dict[int, Any]] = [{} for _ in ReduceOp]
_TORCH_CODES = frozenset({9, 16})  # float16, bfloat16: torch's CPU kernels are much faster
_E8M0 = 21  # float8_e8m0fnu: powers of two as wide as float32's, and no zero


def _fill_table(entry: DType, num: int) -> None:
    if entry.arithmetic:
        for op, ufunc in KIND_UFUNCS[entry.category].items():
            kernel = _three_argument(ufunc, entry.category in "fc")
            TABLE[op][num] = _torch_capable(kernel, op) if entry.code in _TORCH_CODES else kernel
        if entry.code == _E8M0:
            TABLE[ReduceOp.PRODUCT][num] = _product_in_float64
        if entry.category == "c":
            TABLE[ReduceOp.PRODUCT][num] = _complex_product


def _complex_product(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """Complex products by one formula, (ar*br - ai*bi) + (ar*bi + ai*br)i, each step a single
    rounding: numpy's multiply fuses them differently in its vector and scalar loops (chosen by
    length and alignment), so a fold gave other bits on another rank or transport."""
    re = a.real * b.real
    re -= a.imag * b.imag
    im = a.real * b.imag
    im += a.imag * b.real
    out.real = re
    out.imag = im


def _product_in_float64(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """float8_e8m0fnu's product, exact in float64 and rounded once. ml_dtypes multiplies it in
    float32, where a product below 2**-149 becomes 0 and then NaN (no zero to round to), while
    the exact product converts to the smallest value as torch's kernels do."""
    with np.errstate(over="ignore", invalid="ignore"):  # past the range is NaN, as its multiply's
        np.copyto(out, np.multiply(a.astype(np.float64), b.astype(np.float64)), casting="unsafe")


def _three_argument(ufunc: np.ufunc, floating: bool) -> Callable[..., None]:
    """kernel(a, b, out): the ufunc itself where a positional output is allowed. numpy 2.4
    deprecates a third positional argument to minimum and maximum (they may become n-ary), so
    those two name their output. A floating kernel's inf and NaN are results, as in MPI and
    NCCL, whatever the caller's np.seterr: numpy raises its FloatingPointError (or a
    RuntimeWarning turned error) once the whole output is written, and the kernel lets it go."""
    if ufunc not in (np.minimum, np.maximum) and not floating:
        return ufunc
    named = ufunc in (np.minimum, np.maximum)

    def kernel(dst: np.ndarray, src: np.ndarray, out: np.ndarray) -> None:
        try:
            if named:
                ufunc(dst, src, out=out)
            else:
                ufunc(dst, src, out)
        except (FloatingPointError, RuntimeWarning):
            pass

    kernel.__name__ = ufunc.__name__
    kernel.ufunc = ufunc  # type: ignore[attr-defined]  # its reduce folds a grid (direct_plans.grid_folds)
    return kernel


def ufunc_of(kernel: Callable[..., None]) -> np.ufunc | None:
    """The numpy ufunc a table kernel runs, where it is one."""
    return kernel if type(kernel) is np.ufunc else getattr(kernel, "ufunc", None)


# numpy's warnings of inf and NaN in tensorwire's folds (under the default np.seterr) are not
# the caller's to act on: the same values in MPI or NCCL say nothing
warnings.filterwarnings("ignore", r"(overflow|invalid value|divide by zero|underflow) encountered in",
                        RuntimeWarning, r"tensorwire\.")


_IN_PLACE_ONLY: set[Callable[..., None]] = set()
"""Kernels whose torch path reduces into their first argument, ignoring `out` (see apply_to)."""


def _torch_capable(kernel: Callable[..., None], op: ReduceOp) -> Callable[..., None]:
    """The numpy kernel, but large buffers go through torch when the application has imported it."""

    def either(dst: np.ndarray, src: np.ndarray, out: np.ndarray) -> None:
        if dst.size < torch_kernels.TORCH_KERNEL_MIN_ELEMENTS or not torch_kernels.torch_reduce(dst, src, op):
            kernel(dst, src, out)

    either.__name__ = f"{kernel.__name__}_or_torch"
    _IN_PLACE_ONLY.add(either)
    return either


on_register(_fill_table)


def _resolve(op: ReduceOp, dtype: np.dtype) -> Any:
    """Slow path of `reduce_into`: first sight of an ml_dtypes type, or an invalid pair."""
    entry = lookup(dtype)
    if entry is None:
        check_dtype(dtype, collective="reduce_into")  # raises with the reason
        raise AssertionError("unreachable")
    ufunc = TABLE[op].get(dtype.num) if entry.carried is None else entry.carried.kernels.get(op)
    if ufunc is None:
        raise InvalidArgumentError(f"reduce_into: {op.name} is not defined for {entry.name}")
    return ufunc


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp) -> None:
    """`dst = dst (op) src` in place; same shape and dtype (the caller guarantees it).

    One table lookup and one ufunc call; AVG and PREMUL_SUM accumulate as SUM here and are
    completed by `finalize` once, after the last step.
    """
    reduction_kernel(op, dst.dtype)(dst, src, dst)


def reduce_to(out: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp) -> None:
    """`out = a (op) b` without first copying `a` into `out` (out-of-place collectives)."""
    apply_to(reduction_kernel(op, out.dtype), out, a, b)


def writes_where_told(kernel: Any) -> bool:
    """Whether kernel(a, b, out) leaves `a` alone and writes `out`, which may be `b`: not a
    kernel whose torch path reduces into its first argument (_IN_PLACE_ONLY)."""
    return kernel not in _IN_PLACE_ONLY


def apply_to(kernel: Any, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """reduce_to with the kernel looked up already (callers that reduce many times)."""
    if not writes_where_told(kernel):  # its torch path reduces in place: start from a copy
        np.copyto(out, a)
        a = out
    kernel(a, b, out)


def fold(views: tuple[np.ndarray, ...] | list[np.ndarray], out: np.ndarray, kernel: Any) -> None:
    """out = views[0] op views[1] op ... in order (over a segment's slots: rank order, so the
    same bits on every rank); `kernel` is the op's reduction_kernel."""
    apply_to(kernel, out, views[0], views[1])  # the first two in one call, no copy first
    if len(views) > 2:
        for v in views[2:]:
            kernel(out, v, out)


def reduction_kernel(op: ReduceOp, dtype: np.dtype) -> Any:
    """The kernel `reduce_into` applies, called as kernel(a, b, dst); it takes three distinct
    arrays unless it is in _IN_PLACE_ONLY (a torch path for float16/bfloat16)."""
    try:
        return TABLE[op][dtype.num]
    except KeyError:
        return _resolve(ReduceOp(op), dtype)
