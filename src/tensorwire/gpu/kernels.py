"""Reductions on the GPU with torch's kernels, with the semantics of the host ones (ops/):
bool SUM is any and PRODUCT all, integer AVG floor-divides, a PREMUL_SUM factor multiplies
the sum.

Folds run in a fixed order so every call on the same inputs gives the same bits, and, where
each rank folds for itself (the small path), every rank the same result.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError
from ..ops import ReduceOp, Reduction

_BINARY = {
    ReduceOp.SUM: "add", ReduceOp.AVG: "add", ReduceOp.PREMUL_SUM: "add", ReduceOp.PRODUCT: "mul",
    ReduceOp.MIN: "minimum", ReduceOp.MAX: "maximum", ReduceOp.BAND: "bitwise_and",
    ReduceOp.BOR: "bitwise_or", ReduceOp.BXOR: "bitwise_xor",
}
_WRAPPING = {ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
"""Ops whose result on unsigned integers is bit for bit the signed one (two's complement):
torch's CUDA kernels lack most uint16/32/64 loops, so these run on signed views."""
_SIGNED = {"uint16": "int16", "uint32": "int32", "uint64": "int64"}
_supported: dict[tuple[ReduceOp, Any], bool] = {}


def on_signed(t: Any, op: ReduceOp) -> Any:
    """`t` as `op` folds it: unsigned 16-64-bit integers as their signed views where the
    result is the same bits (see _WRAPPING)."""
    import torch

    name = _SIGNED.get(str(t.dtype).removeprefix("torch.")) if op in _WRAPPING else None
    return t if name is None else t.view(getattr(torch, name))


def binary(op: ReduceOp) -> Any:
    """torch's element-wise function of `op` (its `out=` form folds)."""
    import torch

    return getattr(torch, _BINARY[op])


def chain(out: Any, parts: list[Any], fn: Any) -> None:
    """out = parts[0] fn parts[1] fn ... in rank order (two or more parts; none of them `out`
    unless it is the first)."""
    fn(parts[0], parts[1], out=out)
    for p in parts[2:]:
        fn(out, p, out=out)


def runs_on_device(red: Reduction, dtype: Any, device: int) -> bool:
    """Can torch fold and finish this (op, dtype) on the GPU? Tried once on two elements and
    remembered; every rank of a job has the same torch, so every rank finds the same."""
    key = (red.op, dtype)
    known = _supported.get(key)
    if known is None:
        import torch

        try:
            a = torch.ones(2, dtype=dtype, device=device)
            fold(a, [a, a], red.op)
            finalize(a, Reduction(red.op, 1.0 if red.op is ReduceOp.PREMUL_SUM else None), 2)
            known = True
        except (RuntimeError, TypeError, NotImplementedError):
            known = False
        _supported[key] = known
    return known


def fold(out: Any, parts: list[Any], op: ReduceOp) -> None:
    """out = parts[0] op parts[1] op ... (element-wise). `out` may be one of `parts`: that one
    is folded first, so nothing is read after it was overwritten."""
    out, parts = on_signed(out, op), [on_signed(p, op) for p in parts]
    mine = next((i for i, p in enumerate(parts) if p.data_ptr() == out.data_ptr()), None)
    if mine is not None:
        parts = [parts[mine], *parts[:mine], *parts[mine + 1:]]
    if len(parts) == 1:
        if mine is None:
            out.copy_(parts[0])
        return
    chain(out, parts, binary(op))


def finalize(out: Any, red: Reduction, n: int) -> None:
    """AVG divides by the group size (floor division for integers), PREMUL_SUM multiplies by
    its factor (an integral factor exactly, any other through float64, truncated back)."""
    op = red.op
    if op is ReduceOp.AVG:
        if n == 1:
            return
        if out.is_floating_point() or out.is_complex():
            out.div_(n)
        else:
            out.copy_(out.div(n, rounding_mode="floor"))
    elif op is ReduceOp.PREMUL_SUM:
        factor = red.factor
        if factor is None:
            raise InvalidArgumentError("PREMUL_SUM without a factor")
        if out.is_floating_point() or out.is_complex():
            out.mul_(factor)
        elif float(factor).is_integer():
            out.mul_(int(factor))
        else:
            out.copy_(out.double().mul_(factor))
