"""The reductions users name: `ReduceOp`, `Reduction` (an op with its parameter), and
`as_reduction`, which accepts ours, a name, or torch's without importing torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, call_prefix


class ReduceOp(enum.IntEnum):
    """The reductions, numbered as torch.distributed's RedOpType so values can cross the API."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8


BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


@dataclass(frozen=True)
class Reduction:
    """An op plus its parameter: only PREMUL_SUM carries one (the factor applied to the sum).

    PREMUL_SUM is applied as `factor * sum(x_i)` after the reduction, which equals NCCL's
    `sum(factor * x_i)` only when every rank passes the same factor; the collective layer
    must therefore put the factor into the fingerprint it compares across ranks.
    """

    op: ReduceOp
    factor: float | None = None

    def __post_init__(self) -> None:
        try:
            op = ReduceOp(self.op)
        except ValueError:
            raise InvalidArgumentError(f"Reduction: unknown op {self.op!r}") from None
        object.__setattr__(self, "op", op)
        if op is ReduceOp.PREMUL_SUM:
            if self.factor is None:
                raise InvalidArgumentError(
                    "Reduction: PREMUL_SUM needs a factor (use tensorwire.ops.premul_sum(factor))"
                )
            object.__setattr__(self, "factor", _as_factor(self.factor))
        elif self.factor is not None:
            raise InvalidArgumentError(f"Reduction: {op.name} takes no factor (got {self.factor!r})")

    def __str__(self) -> str:
        return self.op.name if self.factor is None else f"{self.op.name}({self.factor!r})"


def _as_factor(factor: Any) -> float:
    """A real scalar (python/numpy number or a one-element tensor) as a python float."""
    if not isinstance(factor, (str, bytes, bool, np.bool_, complex, np.complexfloating)):
        try:
            return float(factor)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise InvalidArgumentError(
        f"Reduction: PREMUL_SUM factor must be a real number or a one-element tensor, "
        f"got {type(factor).__name__} {factor!r}"
    )


def premul_sum(factor: float) -> Reduction:
    """PREMUL_SUM with `factor` (torch's `_make_nccl_premul_sum`; e.g. 1/world_size for DDP):
    `factor * sum(x_r)`, so every rank passes the same factor (a CollectiveMismatchError
    otherwise). Through the torch backend each rank's input is scaled first, NCCL's
    `sum(factor_r * x_r)`, and the factors may differ."""
    return Reduction(ReduceOp.PREMUL_SUM, factor)


_NAMES: dict[str, ReduceOp] = {
    "sum": ReduceOp.SUM,
    "avg": ReduceOp.AVG,
    "prod": ReduceOp.PRODUCT,
    "product": ReduceOp.PRODUCT,
    "min": ReduceOp.MIN,
    "max": ReduceOp.MAX,
    "band": ReduceOp.BAND,
    "bor": ReduceOp.BOR,
    "bxor": ReduceOp.BXOR,
    "premul_sum": ReduceOp.PREMUL_SUM,
}
_PLAIN = {op: Reduction(op) for op in ReduceOp if op is not ReduceOp.PREMUL_SUM}


def as_reduction(op: Any, *, rank: int | None = None, collective: str | None = None) -> Reduction:
    """Normalise what users pass as `op` (ours, a string, or torch's ReduceOp) to a Reduction.

    torch is never imported: its RedOpType values are recognised by `.name`, and a
    `torch.distributed.ReduceOp` object by its `.op` (and `.factor` for PREMUL_SUM).
    """
    if isinstance(op, Reduction):
        return op
    if isinstance(op, ReduceOp):
        if op is ReduceOp.PREMUL_SUM:
            raise InvalidArgumentError(
                f"{call_prefix(rank, collective)}PREMUL_SUM needs a factor: pass "
                "tensorwire.ops.premul_sum(factor) (or torch.distributed._make_nccl_premul_sum(factor))"
            )
        return _PLAIN[op]
    if isinstance(op, str):
        found = _NAMES.get(op.strip().lower())
        if found is None:
            raise InvalidArgumentError(
                f"{call_prefix(rank, collective)}unknown reduce op {op!r} "
                f"(expected one of {', '.join(n for n in _NAMES if n != 'premul_sum')})"
            )
        return as_reduction(found, rank=rank, collective=collective)
    if isinstance(op, (int, np.integer)) and not isinstance(op, (bool, np.bool_)):
        try:
            return as_reduction(ReduceOp(int(op)), rank=rank, collective=collective)
        except ValueError:
            raise InvalidArgumentError(
                f"{call_prefix(rank, collective)}unknown reduce op number {op!r}") from None
    module = type(op).__module__ or ""
    if module.startswith("torch") or isinstance(op, enum.Enum):
        inner = getattr(op, "op", None)  # a torch.distributed.ReduceOp object wraps a RedOpType
        name = _enum_name(inner if inner is not None else op)
        red_op = ReduceOp.__members__.get(name or "")
        if red_op is ReduceOp.PREMUL_SUM:
            try:
                factor = op.factor
            except (AttributeError, RuntimeError):
                raise InvalidArgumentError(
                    f"{call_prefix(rank, collective)}torch PREMUL_SUM without a readable factor; "
                    "build it with torch.distributed._make_nccl_premul_sum(factor)"
                ) from None
            try:
                return Reduction(ReduceOp.PREMUL_SUM, _as_factor(factor))
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"{call_prefix(rank, collective)}{exc}") from None
        if red_op is not None:
            return _PLAIN[red_op]
    raise InvalidArgumentError(
        f"{call_prefix(rank, collective)}cannot use {type(op).__module__}.{type(op).__qualname__} {op!r} "
        "as a reduce op (pass tensorwire.ReduceOp, a name like 'sum', or torch.distributed.ReduceOp)"
    )


def _enum_name(value: Any) -> str | None:
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return name
    text = str(value)  # torch's RedOpType prints as 'RedOpType.SUM'
    return text.rsplit(".", 1)[-1] if "." in text else None
